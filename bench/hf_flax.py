"""The stock Hugging Face Flax classification loop beside ours, at the same shapes, in one run.

    python bench/hf_flax.py                  # train-step medians at batch 16 x 64 (a few minutes)
    python bench/hf_flax.py --job            # also both whole jobs, one after the other
    jaxaccel bench hf_flax [flags]           # the same

The baseline is transformers 4.57.6's ``FlaxBertForSequenceClassification`` (the last
transformers with Flax models) on the packaged MiniLM-L6 checkpoint, trained as its example
``examples/flax/text-classification/run_flax_glue.py`` does: inputs padded to 64 tokens,
AdamW (eps 1e-6, weight decay 0.01 masked off biases and LayerNorm), no clipping, a dropout
key split per step, the state donated, jitted on one device; the CLS pooler head; warm-up
then cosine decay (``HF_SCHEDULE``). The script makes its own virtual environment for it on
first use (``$XDG_CACHE_HOME/jaxaccel`` or ``~/.cache/jaxaccel``, folder
``hf-flax-transformers-<version>``): pip installs transformers and its pins there, every other
package comes from this interpreter's site-packages through a ``.pth``; the script then runs
itself again in it.

* Step (always): our jitted train step (``data.bucket=False data.max_len=64
  data.pad_multiple=64``, the main job's config otherwise) and HF's on the same batches of the
  training split, interleaved (``--rounds`` rounds of ``--steps`` steps each, the order
  alternating), timed one step at a time after compilation: rows ``jaxaccel step`` and
  ``hf_flax step`` with per-step median/min/max wall seconds and the median process CPU
  seconds (``cpu_median_s``: the work done, less sensitive to other processes on a shared
  CPU than wall time); ``speedup`` = HF median / ours, ``cpu_speedup`` the same in CPU time.
* Job (``--job``): the whole HF loop (tokenize, load, compile, train, evaluate on the test
  split) and our main job (``jaxaccel.train.loop.train`` of ``--config``) at the same batch and
  steps: rows ``jaxaccel job`` and ``hf_flax job`` with ``time_s`` and ``final_accuracy``; once
  per seed of ``--seeds`` (both sides take the seed), for the ``--sides`` asked for.

Writes ``bench/results/hf_flax-<device>.json`` with the host load average before and after
(on a shared CPU only the ratio of one run is a result). Each row's ``work`` joins it with its
counterpart in ``jaxaccel compare``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import ensure_venv, interleave, step_row, timed  # noqa: E402

HF_VERSION = "4.57.6"
HF_SCHEDULE = "cosine"
FIXED_LEN = 64
IN_VENV = "JAXACCEL_HF_FLAX_VENV"


# ----------------------------------------------------------------------------- the HF loop


def hf_model_and_state(total_steps: int, warmup_steps: int, learning_rate: float, seed: int):
    """``(model, state, schedule)``: the packaged MiniLM as FlaxBertForSequenceClassification
    and its train state with run_flax_glue's optimizer."""
    import optax
    from flax.training import train_state
    from transformers import FlaxBertForSequenceClassification

    from jaxaccel.models import packaged_minilm_dir

    model = FlaxBertForSequenceClassification.from_pretrained(
        packaged_minilm_dir(), num_labels=2, from_pt=True, seed=seed)
    schedule = hf_schedule(learning_rate, total_steps, warmup_steps)
    tx = optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01,
                     mask=decay_mask(("layernorm",)))
    state = train_state.TrainState.create(apply_fn=model.__call__, params=model.params, tx=tx)
    return model, state, schedule


def hf_schedule(learning_rate: float, total_steps: int, warmup_steps: int,
                kind: str = HF_SCHEDULE):
    """The examples' schedule: linear warm-up from 0, then ``kind`` decay to 0 (default
    ``HF_SCHEDULE``, our configs' ``cosine``; the examples' own is ``linear``)."""
    import optax
    return optax.join_schedules(
        [optax.linear_schedule(0.0, learning_rate, warmup_steps),
         {"cosine": optax.cosine_decay_schedule(learning_rate, total_steps - warmup_steps),
          "linear": optax.linear_schedule(learning_rate, 0.0, total_steps - warmup_steps)}
         [kind]], [warmup_steps])


def decay_mask(norm_names: tuple[str, ...]):
    """The examples' ``decay_mask_fn``: weight decay on every parameter but biases and the
    last two path entries of any path whose joined, lower-cased names contain one of
    ``norm_names`` (run_flax_glue: "layernorm"; run_clm_flax: also "layer_norm", "ln")."""
    from flax import traverse_util

    def mask(params):
        flat = traverse_util.flatten_dict(params)
        norms = {p[-2:] for p in flat for n in norm_names if n in "".join(p).lower()}
        return traverse_util.unflatten_dict(
            {p: p[-1] != "bias" and p[-2:] not in norms for p in flat})
    return mask


def hf_train_step(state, batch, dropout_rng):
    """run_flax_glue's train_step on one device (no pmean): loss, grads, AdamW update."""
    import jax
    import optax
    dropout_rng, new_rng = jax.random.split(dropout_rng)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}

    def loss_fn(params):
        logits = state.apply_fn(**inputs, params=params, dropout_rng=dropout_rng, train=True)[0]
        return optax.softmax_cross_entropy(logits, jax.nn.one_hot(batch["labels"], 2)).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}, new_rng


def hf_job(batch_size: int, steps: int, learning_rate: float, seed: int) -> dict:
    """The whole stock loop: tokenize (padding to 64), load, train ``steps`` steps over
    shuffled epochs (whole batches), evaluate on the test split. Returns time and accuracy."""
    import jax
    import numpy as np
    from transformers import AutoTokenizer

    from jaxaccel.data import load_text_dataset
    from jaxaccel.models import packaged_minilm_dir

    start = time.perf_counter()
    ds = load_text_dataset("rt_snippets", splits=("train", "test"))
    tok = AutoTokenizer.from_pretrained(packaged_minilm_dir())
    enc = {s: dict(tok(ds[s][0], padding="max_length", max_length=FIXED_LEN, truncation=True,
                       return_tensors="np"), labels=np.asarray(ds[s][1])) for s in ds.splits}
    model, state, _ = hf_model_and_state(steps, int(0.1 * steps), learning_rate, seed)
    step = jax.jit(hf_train_step, donate_argnums=(0,))
    rng = jax.random.PRNGKey(seed)
    rng, dropout_rng = jax.random.split(rng)
    n = len(enc["train"]["labels"])
    done, epoch = 0, 0
    while done < steps:
        rng, perm_rng = jax.random.split(rng)
        perm = np.asarray(jax.random.permutation(perm_rng, n))[: n // batch_size * batch_size]
        for idx in perm.reshape(-1, batch_size):
            batch = {k: v[idx] for k, v in enc["train"].items()}
            state, metrics, dropout_rng = step(state, batch, dropout_rng)
            done += 1
            if done == steps:
                break
        epoch += 1
    eval_step = jax.jit(lambda params, batch: model(
        **{k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")},
        params=params, train=False)[0].argmax(-1))
    test, correct = enc["test"], 0
    for i in range(0, len(test["labels"]), 128):
        batch = {k: v[i:i + 128] for k, v in test.items()}
        correct += int((np.asarray(eval_step(state.params, batch)) == batch["labels"]).sum())
    return {"time_s": time.perf_counter() - start, "steps": done,
            "final_accuracy": correct / len(test["labels"])}


# ----------------------------------------------------------------------------- measurements


def fixed_shape_sets(workdir: str) -> list[str]:
    return ["data.bucket=False", f"data.max_len={FIXED_LEN}", f"data.pad_multiple={FIXED_LEN}",
            f"workdir={workdir!r}"]


def time_steps(config: str, sets: list[str], rounds: int, steps: int) -> tuple[dict, dict]:
    """Per-step seconds of ours and HF's train step on the same batches, interleaved."""
    import jax

    from jaxaccel import config as config_lib
    from jaxaccel.train.run import build

    cfg = config_lib.load(config, sets)
    run = build(cfg)
    t = cfg.train
    _, hf_state, _ = hf_model_and_state(t.max_steps, int(t.warmup_ratio * t.max_steps),
                                        t.learning_rate, cfg.seed)
    hf_step = jax.jit(hf_train_step, donate_argnums=(0,))
    batches = [b for _, b in zip(range(rounds * steps + 2), run.train_data.batches(0))]
    with jax.set_mesh(run.mesh):
        state = run.state
        hf = {"state": hf_state, "rng": jax.random.PRNGKey(cfg.seed)}

        def ours_step(i):
            nonlocal state
            state, _ = run.train_step(state, run.put_batch(batches[i]))
            jax.block_until_ready(state)

        def theirs_step(i):
            hf["state"], _, hf["rng"] = hf_step(hf["state"], batches[i], hf["rng"])
            jax.block_until_ready(hf["state"])

        samples, first = interleave({"jaxaccel": timed(ours_step),
                                     "hf_flax": timed(theirs_step)}, rounds, steps)
    work = {"what": "train step", "model": cfg.model.name, "batch": cfg.train.batch_size,
            "seq": FIXED_LEN}
    rows = {name: step_row(f"{name} step", samples[name], first[name],
                           cfg.train.batch_size * FIXED_LEN, work) for name in samples}
    return rows, {"speedup": rows["hf_flax"]["median_s"] / rows["jaxaccel"]["median_s"],
                  "cpu_speedup": rows["hf_flax"]["cpu_median_s"]
                  / rows["jaxaccel"]["cpu_median_s"],
                  "config_sets": sets}


def our_job(config: str, sets: list[str], metrics: tuple[str, ...] = ("accuracy",)) -> dict:
    """Our whole job (``jaxaccel.train.loop.train`` of ``config`` in a temporary workdir):
    ``{"time_s", "steps", "final_<metric>"}`` of the final evaluation's ``metrics``; and the
    config."""
    from jaxaccel import config as config_lib
    from jaxaccel.train.loop import train
    with tempfile.TemporaryDirectory(prefix="jaxaccel-hf-bench-") as workdir:
        cfg = config_lib.load(config, sets + [f"workdir={workdir!r}", "train.progress=False"])
        start = time.perf_counter()
        result = train(cfg)
        seconds = time.perf_counter() - start
    if result["status"] != "completed":
        raise RuntimeError(f"our job did not complete: {result}")
    return {"time_s": seconds, "steps": result["step"],
            **{f"final_{m}": result[f"eval_{m}"] for m in metrics}}, cfg


def jobs(config: str, sets: list[str], seeds: str | None, sides: list[str],
         extra: dict) -> list[dict]:
    """Rows ``jaxaccel job`` / ``hf_flax job`` of each seed (``sides``: ``ours``, ``hf``),
    given the same batch, steps and learning rate (our config's); ``extra["job_speedup"]``
    for the first seed where both ran."""
    from jaxaccel import config as config_lib
    if set(sides) - {"ours", "hf"} or not sides:
        raise SystemExit(f"--sides {','.join(sides)}: expected ours, hf or ours,hf.")
    base = config_lib.load(config, sets)
    rows = []
    for seed in ([base.seed] if seeds is None else [int(s) for s in seeds.split(",")]):
        t = base.train
        steps = t.max_steps if t.max_steps > 0 else None
        work = {"what": "job", "model": base.model.name, "data": base.data.name,
                "batch": t.batch_size, "seed": seed}
        ours = theirs = None
        if "ours" in sides:
            ours, _ = our_job(config, sets + [f"seed={seed}"])
            steps = ours["steps"]
            rows.append({"name": "jaxaccel job", "n": 1, **ours, "work": {**work, "steps": steps}})
        if "hf" in sides:
            if steps is None:
                raise SystemExit("--sides hf needs train.max_steps in the config (the steps "
                                 "our job would take).")
            theirs = hf_job(t.batch_size, steps, t.learning_rate, seed)
            rows.append({"name": "hf_flax job", "n": 1, **theirs,
                         "work": {**work, "steps": steps}})
        print(f"seed {seed}: " + ", ".join(f"{name} {r['final_accuracy']:.4f} in "
                                          f"{r['time_s']:.1f} s" for name, r in
                                          (("ours", ours), ("hf", theirs)) if r), flush=True)
        if ours and theirs and "job_speedup" not in extra:
            extra["job_speedup"] = theirs["time_s"] / ours["time_s"]
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "minilm_rt.py"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override our config (both sides keep batch, steps, lr, seed)")
    ap.add_argument("--rounds", type=int, default=6,
                    help="interleaved rounds of the step timing (default 6; 0: no step timing)")
    ap.add_argument("--steps", type=int, default=5, help="steps per side per round")
    ap.add_argument("--job", action="store_true", help="also time both whole jobs")
    ap.add_argument("--seeds", default=None, metavar="S[,S...]",
                    help="--job: run the jobs once per seed (default: the config's seed)")
    ap.add_argument("--sides", default="ours,hf", metavar="ours,hf",
                    help="--job: whose jobs to run (default both)")
    from bench.common import add_out_argument
    add_out_argument(ap)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if os.environ.get(IN_VENV) != "1":
        python = ensure_venv(HF_VERSION)
        env = {**os.environ, IN_VENV: "1",
               "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
        os.execve(python, [python, os.path.abspath(__file__), *argv], env)

    import jax

    from bench.common import markdown, write_results

    load_before = os.getloadavg()
    rows, extra = [], {}
    if args.rounds > 0:
        with tempfile.TemporaryDirectory() as tmp:
            step_rows, extra = time_steps(args.config, args.set + fixed_shape_sets(tmp),
                                          args.rounds, args.steps)
        rows = [step_rows["jaxaccel"], step_rows["hf_flax"]]
    if args.job:
        rows += jobs(args.config, args.set, args.seeds, args.sides.split(","), extra)
    extra.update(transformers=HF_VERSION, hf_schedule=HF_SCHEDULE,
                 load_average_before=load_before, load_average_after=os.getloadavg(),
                 jax_devices=str(jax.devices()))
    path = write_results("hf_flax", rows, extra, out=args.out)
    print(markdown(rows, ["name", "median_s", "min_s", "max_s", "n", "time_s",
                          "final_accuracy"]))
    if "speedup" in extra:
        print(f"speedup (HF step median / ours): {extra['speedup']:.3f} wall, "
              f"{extra['cpu_speedup']:.3f} process CPU time")
    if "job_speedup" in extra:
        print(f"job speedup (HF job time / ours): {extra['job_speedup']:.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
