"""Does saving a checkpoint stall training? Step times around periodic saves, sync vs async.

    PYTHONPATH=. python bench/checkpoint_save.py [--steps 26] [--every 5] [--model minilm-l6]

Trains the same run twice through ``loop.train`` (synthetic tokens, so no dataset is needed),
saving every ``--every`` steps: once with the Orbax save waited for in place (what the trainer
did before) and once asynchronous (the trainer's default: ``save`` returns once the state is on
the host and the files are written in the background). The time of a step is the interval
between its metrics record and the previous one; the interval right after a save holds that
save's blocking part. Rows: median/min/max of those intervals (``after_save``) and of the
others (``plain``), the stall being their median difference, and of the time the trainer's
``Checkpointer.save`` call itself blocks (``save_call``). On a CPU-only machine the background
write competes with the steps for the same cores, so part of its cost still shows in the steps
after an asynchronous save; on an accelerator it does not.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from jaxaccel import config, storage  # noqa: E402
from jaxaccel.train import checkpoint, loop  # noqa: E402
from jaxaccel.train.metrics import read_metrics  # noqa: E402


def step_intervals(run_dir: str, every: int) -> dict[str, list[float]]:
    """Seconds between consecutive train metrics records, split by whether a save came between."""
    times = {r["step"]: r["time"] for r in read_metrics(run_dir) if "train/loss" in r}
    out = {"after_save": [], "plain": []}
    for s in sorted(times)[1:]:
        if s - 1 in times:
            out["after_save" if (s - 1) % every == 0 else "plain"].append(times[s] - times[s - 1])
    return out


def run(mode: str, args, workdir: str) -> list[dict]:
    cfg = config.build(sets=[
        f"workdir={workdir}", f"name={mode}", f"model.name={args.model}", "data.name=synthetic",
        "data.synthetic_examples=4096", "data.synthetic_seq_len=32", "train.batch_size=32",
        f"train.max_steps={args.steps}", f"train.checkpoint_every={args.every}",
        "train.log_every=1", "train.progress=false", "train.eval_every_epoch=false"])
    calls = []

    class Timed(checkpoint.Checkpointer):
        def save(self, *a, **k):
            t0 = time.perf_counter()
            super().save(*a, **k)
            calls.append(time.perf_counter() - t0)
    services = loop.Services(checkpointer=functools.partial(Timed, async_save=(mode == "async")))
    result = loop.train(cfg, services)
    state_bytes = storage.bytes_under(storage.join(result["checkpoint_dir"], str(args.steps)))
    rows = []
    intervals = step_intervals(result["run_dir"], args.every)
    for kind, xs in [*intervals.items(), ("save_call", calls[:-1])]:   # last: the final save
        rows.append({"name": f"{mode}/{kind}", "median_s": float(np.median(xs)),
                     "min_s": float(np.min(xs)), "max_s": float(np.max(xs)), "n": len(xs),
                     "checkpoint_mb": round(state_bytes / 2 ** 20, 1)})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=26)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--model", default="minilm-l6")
    common.add_out_argument(p)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        rows = run("sync", args, workdir) + run("async", args, workdir)
    med = {r["name"]: r["median_s"] for r in rows}
    for mode in ("sync", "async"):
        for r in rows:
            if r["name"].startswith(mode):
                r["stall_s"] = med[f"{mode}/after_save"] - med[f"{mode}/plain"]
    print(common.markdown(rows, ["name", "median_s", "min_s", "max_s", "n", "stall_s",
                                 "checkpoint_mb"]))
    print("wrote", common.write_results("checkpoint_save", rows,
                                        {"steps": args.steps, "every": args.every,
                                         "model": args.model}, out=args.out))


if __name__ == "__main__":
    main()
