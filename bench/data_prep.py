"""The data side on a CPU: preparing a corpus against Hugging Face's run_clm recipe, the loader
against the step, and the trainer's memory as the corpus grows.

    python bench/data_prep.py --corpus-mb 200 --sizes-mb 10,100,1000 --out bench/results

* prepare: the same JSONL corpus (``--corpus-mb`` of documents made deterministically from the
  Canterbury corpus's paragraphs: each document 1-8 paragraphs drawn with a fixed seed) made
  into training rows (a) by ``jaxaccel data prepare``'s token cache (``tokencache.tokens``,
  two worker processes) and (b) by ``run_clm``'s recipe: ``datasets.load_dataset("json")``,
  batched ``map`` tokenization and ``group_texts`` into rows of 128, ``num_proc=2``, its Arrow
  cache in a fresh folder. Both with the same fast tokenizer (the Canterbury LM job's BPE of
  2,048 tokens), each in a fresh process; wall time and the peak resident memory of the
  process and its children (sampled every 50 ms), side by side in one run.
* loader vs step: rows of configs/files_lm.py's batches (16 x 128) streamed from that cache
  (tokens/s, this process's batches, no device), against the tokens/s the CPU LM job's train
  step takes (llama-cpu, the same batches, 20 steps after warm-up).
* memory: ``jaxaccel train`` (configs/files_lm.py, 100 steps) on corpora of ``--sizes-mb``
  prepared beforehand, each in a fresh process: its peak resident memory while it trains.

Needs the ``hf`` extra (the datasets library) for the run_clm side. Writes
``data_prep-cpu.json`` to ``--out`` and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import (add_out_argument, markdown, seconds_per_step,  # noqa: E402
                          write_results)

BLOCK = 128


def make_corpus(path: str, megabytes: float, seed: int = 0) -> dict:
    """Write ``megabytes`` of JSONL documents made of Canterbury paragraphs (module doc), or
    count those of the file written so before."""
    if os.path.exists(path):
        with open(path, "rb") as f:
            return {"documents": sum(1 for _ in f), "bytes": os.path.getsize(path)}
    from jaxaccel.data import load_corpus
    paragraphs = load_corpus("canterbury", splits=("train",))["train"]
    rng, target, docs, size = np.random.default_rng(seed), megabytes * 1e6, 0, 0
    with open(path, "w") as f:
        while size < target:
            picks = rng.integers(0, len(paragraphs), rng.integers(1, 9))
            line = json.dumps({"text": "\n\n".join(paragraphs[i] for i in picks)}) + "\n"
            f.write(line)
            size, docs = size + len(line.encode()), docs + 1
    return {"documents": docs, "bytes": size}


def peak_rss(cmd: list[str], env: dict) -> tuple[float, float, str]:
    """``(wall seconds, peak RSS bytes of the process and its children, stdout)``."""
    import psutil
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    parent, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [parent, *parent.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return time.perf_counter() - t0, peak, out


def _sets(work: str, corpus: str, tokenizer: str) -> list[str]:
    return [f"data.train_files={corpus}", f"data.cache_dir={work}/cache",
            f"model.tokenizer={tokenizer}", f"workdir={work}/runs", "train.progress=false",
            "data.holdout=0", f"data.eval_files={work}/eval.jsonl", "data.workers=2"]


def child_ours(work: str, corpus: str, tokenizer: str) -> dict:
    from jaxaccel import config
    from jaxaccel.data import load_tokenizer, tokencache
    from jaxaccel.train.run import resolve
    data = resolve(config.load(os.path.join(ROOT, "configs", "files_lm.py"),
                               _sets(work, corpus, tokenizer))).data
    cache = tokencache.tokens(data, "train", load_tokenizer(tokenizer), workers=2)
    return {"documents": len(cache), "tokens": cache.tokens, "rows": cache.tokens // BLOCK}


def child_hf(work: str, corpus: str, tokenizer: str) -> dict:
    """run_clm.py's data preparation (transformers examples/pytorch/language-modeling)."""
    import datasets
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(tokenizer, "tokenizer.json"))
    raw = datasets.load_dataset("json", data_files={"train": corpus},
                                cache_dir=os.path.join(work, "hf_cache"))

    def tokenize_function(examples):
        return tok(examples["text"])

    def group_texts(examples):
        concatenated = {k: list(itertools.chain(*examples[k])) for k in examples.keys()}
        total = len(concatenated["input_ids"]) // BLOCK * BLOCK
        return {k: [t[i:i + BLOCK] for i in range(0, total, BLOCK)]
                for k, t in concatenated.items()}
    tokenized = raw.map(tokenize_function, batched=True, num_proc=2, remove_columns=["text"])
    rows = tokenized.map(group_texts, batched=True, num_proc=2)
    return {"documents": raw["train"].num_rows, "rows": rows["train"].num_rows}


def child_speed(work: str, corpus: str, tokenizer: str) -> dict:
    """Tokens/s of the loader alone, and of the LM job's train step, on the same batches."""
    from jaxaccel import config
    from jaxaccel.train.run import assemble, resolve
    cfg = config.load(os.path.join(ROOT, "configs", "files_lm.py"),
                      _sets(work, corpus, tokenizer) + ["train.max_steps=1000"])
    run = assemble(resolve(cfg))
    data, n = run.train_data, 400
    tokens = data.global_batch_size * data.seq_len
    t0 = time.perf_counter()
    for i, _ in zip(range(n), data.batches(0)):
        pass
    loader = n * tokens / (time.perf_counter() - t0)
    batches = [run.put_batch(b) for _, b in zip(range(25), data.batches(1))]
    step = tokens / seconds_per_step(run, batches)
    return {"loader_tokens_per_s": loader, "step_tokens_per_s": step}


CHILDREN = {"ours": child_ours, "hf": child_hf, "speed": child_speed}


def _env() -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false",
                HF_DATASETS_OFFLINE="1", PYTHONPATH=os.pathsep.join(
                    [ROOT, os.environ.get("PYTHONPATH", "")]))


def _child(kind: str, work: str, corpus: str, tokenizer: str) -> tuple[float, float, dict]:
    wall, peak, out = peak_rss([sys.executable, os.path.abspath(__file__), "--child", kind,
                                "--work", work, "--corpus", corpus, "--tokenizer", tokenizer],
                               _env())
    return wall, peak, json.loads(out.strip().splitlines()[-1])


def _tokenizer() -> str:
    """The Canterbury LM job's BPE (trained once on the corpus's training split)."""
    from jaxaccel import config
    from jaxaccel.data import run_tokenizer
    from jaxaccel.train.run import resolve
    cfg = config.load(os.path.join(ROOT, "configs", "canterbury_lm.py"), [])
    return run_tokenizer.tokenizer_dir(resolve(cfg).data)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus-mb", type=float, default=200)
    p.add_argument("--sizes-mb", default="10,100,1000", help="corpora the trainer's memory is "
                   "measured on ('' skips it)")
    p.add_argument("--steps", type=int, default=100, help="train steps of each memory run")
    p.add_argument("--work", help="scratch folder (default: a temporary one)")
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    add_out_argument(p)
    args = p.parse_args(argv)
    from jaxaccel.distributed import cpu_without_accelerator
    cpu_without_accelerator()
    if args.child:
        print(json.dumps(CHILDREN[args.child](args.work, args.corpus, args.tokenizer)))
        return
    work = args.work or tempfile.mkdtemp(prefix="jaxaccel-data-bench-")
    os.makedirs(work, exist_ok=True)
    for stale in ("cache", "hf_cache", "runs"):          # every side starts cold
        shutil.rmtree(os.path.join(work, stale), ignore_errors=True)
    tokenizer = _tokenizer()
    make_corpus(os.path.join(work, "eval.jsonl"), 0.2, seed=1)
    corpus = os.path.join(work, f"corpus-{args.corpus_mb:g}mb.jsonl")
    made = make_corpus(corpus, args.corpus_mb)
    rows, extra = [], {"corpus": made, "load_average_at_start": os.getloadavg(),
                       "cpus": os.cpu_count()}

    def record(row: dict) -> None:
        """Add a row and rewrite the result file (a long run leaves what it measured)."""
        rows.append(row)
        extra["load_average_now"] = os.getloadavg()
        path = write_results("data_prep", rows, extra, out=args.out)
        print(f"{row['name']}: {json.dumps(row)} (load {os.getloadavg()}; {path})", flush=True)

    prep = {}
    for side in ("ours", "hf"):
        prep[side] = _child(side, work, corpus, tokenizer)
    (ours_s, ours_rss, _), (hf_s, hf_rss, _) = prep["ours"], prep["hf"]
    for side, (wall, peak, got) in prep.items():
        row = {"name": f"prepare {args.corpus_mb:g} MB: "
                       f"{'jaxaccel token cache' if side == 'ours' else 'run_clm (datasets)'}",
               "median_s": wall, "min_s": wall, "max_s": wall, "n": 1,
               "peak_rss_mb": peak / 1e6, "mb_per_s": made["bytes"] / 1e6 / wall,
               "disk_mb": _size(os.path.join(work, "cache" if side == "ours" else "hf_cache")),
               **got}
        if side == "ours":
            row.update(speedup=hf_s / ours_s, memory_ratio=ours_rss / hf_rss)
        record(row)
    wall, _, speed = _child("speed", work, corpus, tokenizer)
    record({"name": "loader vs the LM job's step (16 x 128)", "median_s": wall, "min_s": wall,
            "max_s": wall, "n": 1, **speed,
            "loader_over_step": speed["loader_tokens_per_s"] / speed["step_tokens_per_s"]})
    for mb in (float(s) for s in args.sizes_mb.split(",") if s):
        path = os.path.join(work, f"corpus-{mb:g}mb.jsonl")
        make_corpus(path, mb)
        sets = _sets(work, path, tokenizer) + [f"train.max_steps={args.steps}", f"name=m{mb:g}"]
        cli = [sys.executable, "-m", "jaxaccel.cli"]
        config = ["--config", os.path.join(ROOT, "configs", "files_lm.py"),
                  *(f"--set={s}" for s in sets)]
        prepare_s, _, _ = peak_rss(cli + ["data", "prepare", *config], _env())
        wall, peak, _ = peak_rss(cli + ["train", *config], _env())
        record({"name": f"train {args.steps} steps on {mb:g} MB", "median_s": wall,
                "min_s": wall, "max_s": wall, "n": 1, "peak_rss_mb": peak / 1e6,
                "corpus_mb": os.path.getsize(path) / 1e6, "prepare_s": prepare_s})
    print(markdown(rows, ["name", "median_s", "peak_rss_mb", "mb_per_s", "disk_mb", "speedup",
                          "memory_ratio", "loader_tokens_per_s", "step_tokens_per_s",
                          "loader_over_step"]))


def _size(folder: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder)
               for f in fs) / 1e6


if __name__ == "__main__":
    main()
