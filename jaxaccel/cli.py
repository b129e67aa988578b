"""The ``jaxaccel`` command: train, eval, predict, generate, bench, compare, compile and data.

    jaxaccel train --config configs/minilm_rt.py [--set train.epochs=2 ...]
    jaxaccel eval --checkpoint runs/minilm_rt
    jaxaccel predict --checkpoint runs/minilm_rt "a gripping, beautifully shot film"
    jaxaccel predict --checkpoint runs/minilm_rt --input texts.txt   # one text a line; - = stdin
    jaxaccel generate --checkpoint runs/llama_cpu "Once upon a time" "The river" [--greedy]
    jaxaccel export --checkpoint runs/minilm_rt --out hf/minilm_rt --custom-code   # mean pooling
    jaxaccel bench train_step --small            # any suite's own flags follow its name
    jaxaccel compare bench/results/job-*.json [--prices FILE] [--weights balance] [--html]
    jaxaccel compile --config configs/bert_base_imdb.py --topology v5e-8 [--out bench/results]
    jaxaccel compile --config configs/bert_base_imdb.py --topology v5e-8,v6e-8,h100:1x8 [--fit]
    jaxaccel data prepare --config configs/files_lm.py     # tokenize into the cache ahead
    jaxaccel data show --config configs/files_lm.py -n 5   # the first rows, decoded

predict prints one JSON object a line, in input order: {"index", "text", "label",
"probability"} (probability null if not finite; with --top-k K also "top_k": the K likeliest
{"label", "probability"}, most likely first), or {"index", "error"} for an input that is not
valid UTF-8, or is empty or only whitespace; the others are still classified, and the exit
status is then 2. For an audio run each input is a file: {"index", "file", "label",
"probability", "seconds", "seconds_classified", "channels"} (what was read of it), or
{"index", "error"} for a file its dataset cannot make an input of (the audio rules of
docs/guides/audio-mae.md: not a WAV, truncated, no samples, NaN samples, another sample rate).
generate prints {"index", "prompt", "text"} a line (text: the continuation), or one error line
and nothing else when a prompt cannot be generated from (too long for the model, ...).

Exit statuses: 0 done; 2 a refused command, config or input (one ``error:`` line); 3 training
stopped by a non-finite loss (the last good checkpoint kept); 4 ``compile``: a step does not fit
in memory (with several targets: none fits; with ``--fit``: nothing tried fits); 75 training
stopped by SIGTERM or Ctrl-C after saving a checkpoint (the JSON's status "preempted"; the same
command resumes); 130 a second Ctrl-C (stopped without saving).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import traceback

from jaxaccel import console, storage

EXIT_ERROR, EXIT_NONFINITE, EXIT_DOES_NOT_FIT, EXIT_INTERRUPTED = 2, 3, 4, 130
# sysexits.h's EX_TEMPFAIL ("a temporary failure: the user is invited to retry"): a run stopped
# by SIGTERM or Ctrl-C after saving; the same command resumes it. Not 0, so that
# `jaxaccel train ... && jaxaccel eval ...` and job schedulers do not go on as if it had finished.
EXIT_PREEMPTED = 75
BENCH_SUITES = ("train_step", "attention", "optimizer", "job", "scaling", "hf_flax", "hf_llama",
                "pipeline", "backtest", "gpu_evidence", "data_prep", "scan", "bucket_io",
                "fp8_cost")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxaccel", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    _run_commands(sub)
    _tool_commands(sub)
    return p


def _run_commands(sub) -> None:
    """The commands of a run: train, eval, predict, generate, export."""
    t = sub.add_parser("train", help="fine-tune a model as a config file says")
    t.add_argument("--config", help="config file (configs/NAME.py, or NAME; or a .json); "
                   "default: the base config alone")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. train.epochs=3 (repeatable)")
    e = sub.add_parser("eval", help="evaluate a run's latest checkpoint on its eval split")
    e.add_argument("--checkpoint", required=True, help="run folder (or its checkpoints folder)")
    e.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    r = sub.add_parser("predict", help="classify texts (or, for an audio/image run, files) "
                                       "with a run's latest checkpoint")
    r.add_argument("--checkpoint", required=True, help="run folder (or its checkpoints folder)")
    r.add_argument("--input", metavar="FILE",
                   help="file with one text (or input file path) per line ('-' reads "
                        "standard input)")
    r.add_argument("--batch-size", type=int, default=64, help="inputs per forward pass")
    r.add_argument("--top-k", type=int, metavar="K", help="also give the K likeliest labels "
                   "with their probabilities (the record's top_k, most likely first)")
    r.add_argument("texts", nargs="*", help="texts to classify; for a run on arrays (e.g. "
                                            "bfsong), the files to classify (WAV recordings)")
    g = sub.add_parser("generate", help="continue texts with a causal LM run's latest "
                       "checkpoint (KV cache, batched)")
    g.add_argument("--checkpoint", required=True, help="run folder (or its checkpoints folder)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    g.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest "
                   "tokens; 0: all")
    g.add_argument("--greedy", action="store_true", help="temperature 0 (argmax)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("prompts", nargs="+", help="texts to continue")
    x = sub.add_parser("export", help="write a run's latest checkpoint, with its tokenizer, as "
                       "a Hugging Face checkpoint that transformers' from_pretrained loads")
    x.add_argument("--checkpoint", required=True, help="run folder (or its checkpoints folder)")
    x.add_argument("--out", required=True, metavar="DIR",
                   help="folder to write (made if missing; must be empty unless --overwrite)")
    x.add_argument("--overwrite", action="store_true", help="replace a non-empty DIR")
    x.add_argument("--custom-code", action="store_true",
                   help="write a classifier of mean pooling, of which transformers has no "
                   "class, with a class of its own (a modeling_*.py in DIR) that transformers "
                   "loads with trust_remote_code=True; without it such a run is refused")
    x.add_argument("--encoder", action="store_true",
                   help="write a ViT run's encoder alone as transformers' ViTModel (an MAE "
                   "pretraining run's, to fine-tune elsewhere)")


def _tool_commands(sub) -> None:
    """The commands around runs: bench, compare, data, compile."""
    b = sub.add_parser("bench", help="measure this machine's devices: one result file per suite",
                       description="Runs bench/<suite>.py (a source checkout) with the flags "
                       "that follow; `jaxaccel bench SUITE --help` lists them. The result goes "
                       "to --out DIR (default runs/bench/; the path is printed).")
    b.add_argument("suite", choices=BENCH_SUITES)
    b.add_argument("args", nargs=argparse.REMAINDER, help="the suite's own flags")
    c = sub.add_parser("compare", help="rank devices/configurations by time, cost, energy, "
                       "utilisation")
    c.add_argument("results", nargs="+", help="result files (bench/results/*.json)")
    c.add_argument("--prices", help="CSV device,usd_per_hour[,source,date] or JSON; "
                   "overrides the shipped on-demand list prices")
    c.add_argument("--weights", help="strategy to rank by (balance, time_cost_energy, ...) or "
                   "w1,w2,w3,w4 (default balance)")
    c.add_argument("--out", default="comparison", help="folder for CSV, JSON, plots")
    c.add_argument("--html", action="store_true", help="also write report.html with the plots")
    c.add_argument("--no-plots", action="store_true")
    c.add_argument("--mixed-versions", action="store_true",
                   help="join rows run with different jax versions or commits (noted)")
    d = sub.add_parser("data", help="prepare a run's data ahead of training, or show what the "
                       "model will read")
    dsub = d.add_subparsers(dest="data_command", required=True)
    dp = dsub.add_parser("prepare", help="tokenize the run's data into its cache (both splits) "
                         "and say what it holds")
    ds = dsub.add_parser("show", help="print the first training rows, decoded (segments and "
                         "targets, labels)")
    ds.add_argument("-n", type=int, default=5, help="rows to print")
    ds.add_argument("--split", default="train", choices=("train", "eval"))
    for sp in (dp, ds):
        sp.add_argument("--config", help="config file (configs/NAME.py, or NAME)")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    k = sub.add_parser("compile", help="compile the training and eval steps for a TPU slice, "
                       "GPU hosts or the local devices: memory per device, fits or not, "
                       "estimated step time and cost", description="Compiles the configured "
                       "steps for --topology from any machine (TPU: libtpu, GPU: the CUDA "
                       "plugin; pip install 'jaxaccel[aot]'). Exit status 4 when a step does "
                       "not fit in memory. Times and costs are estimates.")
    k.add_argument("--config", help="Python config file (configs/NAME.py)")
    k.add_argument("--topology", required=True,
                   help="v5e-8, v5e:2x4, v5p:2x2x1, v4-8, v6e-8, h100:1x8 (hosts x GPUs), "
                   "2xv5e-256 (2 slices), local, ...; several, comma-separated, are each "
                   "planned and ranked by time and cost")
    k.add_argument("--fit", nargs="?", type=int, const=12, default=0, metavar="N",
                   help="where the run does not fit, search by compiling (at most N, default "
                   "12) the mesh's data/FSDP split, remat and gradient accumulation for the "
                   "fastest configuration that fits")
    k.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    k.add_argument("--memory", type=float, metavar="GB", help="device memory to plan against, "
                   "per device, instead of the target's (a device shared with other work)")
    k.add_argument("--out", metavar="DIR", help="also write the plan as a result file "
                   "DIR/plan-<config name>-<topology>.json (e.g. bench/results)")


def _run_dir(path: str) -> str:
    from jaxaccel.train import rundir
    return rundir.run_folder(path)


def cmd_train(args) -> int:
    from jaxaccel import compilation_cache, config
    from jaxaccel.train.loop import train
    cfg = config.load(args.config, args.set)
    if args.config is None:
        logging.getLogger("jaxaccel").warning(
            "no --config: training the base config (jaxaccel/config.py BASE: model %s on %s, "
            "run folder %s) with the --set overrides; pass --config configs/NAME.py (or NAME) "
            "for another.", cfg.model.name, cfg.data.name, storage.join(cfg.workdir, cfg.name))
    compilation_cache.enable(cfg.compilation_cache)
    return train_outcome(train(cfg))


def train_outcome(result) -> int:
    """Print how a run ended (``train.outcome``: its JSON record, then on stderr what it means)
    and return the exit status: 0 completed, ``EXIT_PREEMPTED`` resumable, ``EXIT_NONFINITE``."""
    from jaxaccel.train.outcome import Diverged, Preempted
    print(json.dumps(result.record(), indent=2), file=console.result())
    if isinstance(result, Diverged):
        good = result.last_good_checkpoint
        where = (f"Last good checkpoint: step {good} in {result.checkpoint_dir}."
                 if good is not None else
                 "No good checkpoint was saved before the stop.")
        print(f"error: training stopped: {result.error.rstrip('.')}. {where} "
              f"{result.advice or ''}".rstrip(), file=sys.stderr)
        return EXIT_NONFINITE
    if isinstance(result, Preempted):
        print(f"{result.signal}: saved step {result.step} to {result.checkpoint_dir}; "
              f"run the same command again to resume (exit status {EXIT_PREEMPTED}: stopped, "
              "resumable).", file=sys.stderr)
        return EXIT_PREEMPTED
    print(f"{result.summary}\n"
          f"checkpoints: {result.checkpoint_dir}\nmetrics: {result.metrics_file}", file=sys.stderr)
    return 0


def cmd_eval(args) -> int:
    from jaxaccel.train import rundir
    from jaxaccel.train.inference import evaluate_run
    run_dir = _run_dir(args.checkpoint)
    with rundir.library_log(run_dir):
        print(json.dumps(evaluate_run(run_dir, args.set), indent=2), file=console.result())
    return 0


def _read_texts(args) -> list[str | ValueError]:
    """The texts to classify, in order; an input that cannot be classified is the reason why
    (``_refusal``)."""
    texts = [_refusal(t) or t for t in args.texts]
    if args.input:
        if args.input == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(args.input, "rb") as f:
                data = f.read()
        for line in data.splitlines():
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                text = e
            texts.append(_refusal(text) or text)
    if not texts:
        raise ValueError("predict got no texts: give them as arguments or with --input FILE "
                         "(one per line; - for standard input).")
    return texts


def _refusal(text: str | UnicodeError) -> ValueError | None:
    """Why ``text`` is not classified, or None: not valid UTF-8, or empty or only whitespace
    (no words: a label for it would be the model's bias, not a prediction)."""
    if isinstance(text, str):
        text = _not_utf8(text) or text
    if isinstance(text, UnicodeError):
        return ValueError(f"input is not valid UTF-8 ({text.reason} at byte {text.start})")
    if not text.strip():
        return ValueError(f"input {text!r} is empty or only whitespace: there is nothing to "
                          "classify")
    return None


def _not_utf8(text: str) -> UnicodeError | None:
    """The error of encoding ``text`` as UTF-8 (undecodable argv bytes arrive as surrogates),
    or None."""
    try:
        text.encode("utf-8")
    except UnicodeError as e:
        return e
    return None


def cmd_predict(args) -> int:
    from jaxaccel.train import rundir
    from jaxaccel.train.inference import Predictor, prediction_record
    texts = _read_texts(args)
    run_dir = _run_dir(args.checkpoint)
    with rundir.library_log(run_dir):
        predictor = Predictor(run_dir, batch_size=args.batch_size, top_k=args.top_k)
    good = [i for i, t in enumerate(texts) if isinstance(t, str)]
    results = dict(zip(good, predictor([texts[i] for i in good]))) if good else {}
    key = "file" if predictor.arrays else "text"
    refused = 0
    for i, text in enumerate(texts):
        result = results.get(i, text)
        if isinstance(result, ValueError):
            refused += 1
            record = {"index": i, "error": f"{result}; not classified"}
            print(f"error: input {i}: {record['error']}", file=sys.stderr)
        else:
            label, probability, facts = result
            record = {"index": i, **prediction_record(text, label, probability, key=key), **facts}
            if facts.get("seconds", 0) > facts.get("seconds_classified", 0):
                print(f"warning: input {i}: {text!r} is {facts['seconds']:.3f} s long; its label "
                      f"is that of its first {facts['seconds_classified']:.3f} s, all the model's "
                      "input holds (the record's seconds_classified).", file=sys.stderr)
        print(json.dumps(record, ensure_ascii=False), file=console.result())
    return EXIT_ERROR if refused else 0


def cmd_generate(args) -> int:
    from jaxaccel.models.generate import check_sampling
    from jaxaccel.train import rundir
    from jaxaccel.train.inference import Generator
    for i, prompt in enumerate(args.prompts):
        bad = _not_utf8(prompt)
        if bad:
            raise ValueError(f"prompt {i} is not valid UTF-8 ({bad.reason} at byte {bad.start}); "
                             "give prompts as UTF-8 text.")
    temperature = 0.0 if args.greedy else args.temperature
    # The temperature and the seed refused before the checkpoint is read (seconds); top_k's
    # bound is the model's vocabulary, checked by the sampler.
    check_sampling(temperature, 0, 0, args.seed)
    run_dir = _run_dir(args.checkpoint)
    with rundir.library_log(run_dir):
        generator = Generator(run_dir)
    texts = generator(args.prompts, args.max_new_tokens, temperature=temperature,
                      top_k=args.top_k, seed=args.seed)
    for i, (prompt, text) in enumerate(zip(args.prompts, texts)):
        print(json.dumps({"index": i, "prompt": prompt, "text": text}, ensure_ascii=False),
              file=console.result())
    return 0


def cmd_export(args) -> int:
    from jaxaccel.train import rundir
    from jaxaccel.train.export import export_run
    run_dir = _run_dir(args.checkpoint)
    with rundir.library_log(run_dir):
        print(json.dumps(export_run(run_dir, args.out, overwrite=args.overwrite,
                                    custom_code=args.custom_code, encoder=args.encoder),
                         indent=2), file=console.result())
    return 0


def cmd_bench(args) -> int:
    import importlib
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "bench", f"{args.suite}.py")
    if not os.path.isfile(script):
        raise FileNotFoundError(f"{script!r} not found: `jaxaccel bench` runs the bench/ "
                                "scripts of a source checkout; install with `pip install -e .` "
                                "from a clone of the repository.")
    sys.path.insert(0, root)
    # A suite's own lines (its table, the file it wrote) are its result.
    with contextlib.redirect_stdout(console.result()):
        status = importlib.import_module(f"bench.{args.suite}").main(args.args)
    return status if isinstance(status, int) else 0


def cmd_data(args) -> int:
    from jaxaccel import config
    from jaxaccel.train import datacmd
    cfg = config.load(args.config, args.set)
    if args.data_command == "prepare":
        lines = datacmd.prepare(cfg)
    else:
        lines = datacmd.show(cfg, args.n, args.split)
    print("\n".join(lines), file=console.result())
    return 0


def cmd_compare(args) -> int:
    from jaxaccel import compare
    report = compare.compare(args.results, args.prices, args.weights, args.mixed_versions)
    compare.check_comparable(report)
    print(compare.markdown(report), file=console.result())
    written = compare.write(report, args.out, plots=not args.no_plots, html_page=args.html)
    print(f"\nwrote {len(written)} files to {args.out}/", file=console.result())
    return 0


def cmd_compile(args) -> int:
    import jax
    if args.out:
        storage.check_out_dir(args.out)
    if args.memory is not None and not (math.isfinite(args.memory) and args.memory > 0):
        raise ValueError(f"--memory {args.memory}: the memory per device to plan against, in GB, "
                         "must be a finite number > 0 (e.g. --memory 16).")
    names = [n.strip() for n in args.topology.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--topology {args.topology!r} names no target.")
    if "local" not in names:           # compile-only devices: no accelerator is used
        jax.config.update("jax_platforms", "cpu")
    from jaxaccel.plan import rank
    entries = rank.plan_targets(args.config, args.set, names,
                                memory=None if args.memory is None else args.memory * 1e9,
                                fit=args.fit, out=args.out, error_text=error_message)
    if any(e.fits for e in entries):
        return 0
    return EXIT_ERROR if all(e.refused for e in entries) else EXIT_DOES_NOT_FIT


def error_message(e: Exception) -> str:
    """What the catch-all prints for ``e``: its own sentence (jaxaccel's ``KeyError``s are
    sentences too), or, for a lookup that failed inside the code (a ``KeyError`` of a bare key)
    or an exception without a message, what failed and where, never one bare word."""
    text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    if isinstance(text, str) and " " in text.strip():
        return text
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return (f"{type(e).__name__} {text!r} at {os.path.basename(frame.filename)}:{frame.lineno} "
            f"({frame.name}): jaxaccel should have refused this command with a sentence; "
            "please report it with the command line.")


def _not_the_torch_notice(record: logging.LogRecord) -> bool:
    """False for transformers' "PyTorch was not found. Models won't be available ..." (logged
    when it is imported without torch): jaxaccel takes only tokenizers and configuration from
    transformers, so a user without torch needs no such line."""
    return not record.getMessage().startswith("PyTorch was not found.")


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # The console carries jaxaccel's own lines; the kernel registry's "impl='auto' runs ..."
    # (INFO, for library users) stays out of it, its warnings do not.
    for noisy in ("absl", "orbax", "jax._src", "tensorflow_datasets", "kernels_pallas",
                  "google"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # The bucket clients' errors (gcsfs: each request out of retries, with its traceback) reach
    # the console as jaxaccel's one line of what failed; a run's library.log keeps them.
    for client in ("aiobotocore", "botocore", "s3fs", "gcsfs", "fsspec"):
        logging.getLogger(client).setLevel(logging.CRITICAL)
    logging.getLogger("transformers").addFilter(_not_the_torch_notice)
    args = _parser().parse_args(argv)
    with console.results_only():
        return _run(args)


def _run(args) -> int:
    """``args``' command, its errors as one line on stderr and an exit status."""
    try:
        from jaxaccel import distributed
        distributed.start()
        return {"train": cmd_train, "eval": cmd_eval, "predict": cmd_predict,
                "generate": cmd_generate, "bench": cmd_bench, "compare": cmd_compare,
                "compile": cmd_compile, "export": cmd_export,
                "data": cmd_data}[args.command](args)
    except (ValueError, KeyError, OSError) as e:
        print(f"error: {error_message(e)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted: stopped without saving.", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
