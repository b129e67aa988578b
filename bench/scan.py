"""Scanned against unscanned layers on a config's own run, in one process: what the job pays to
compile, and its train and eval steps, both sides on the same batches in interleaved rounds.

    python bench/scan.py --config configs/minilm_rt.py          # the main job
    python bench/scan.py --config configs/canterbury_lm.py      # the decoder job

The config's run is built twice, ``model.scan_layers=false`` and ``true`` (everything else
equal: the trainer's own ``Run.train_step`` and ``Run.eval_step``). Per side:

- ``compile_s``: the first call of the train step on each distinct batch shape among the
  first ``--batches`` batches (a job with length buckets compiles one program per shape),
  summed: compile time and one step each;
- ``eval_first_s`` / ``eval_s``: the first pass over the eval split (its programs compiled)
  and the median of the later passes;
- ``median_s`` (``min_s``, ``max_s``, ``cpu_median_s``): one train step, timed on the job's
  batches in order, the sides alternating (``bench.common.interleave``).

On a shared CPU the ratio of the two sides in one run is the result, not the seconds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (add_out_argument, interleave, markdown, step_row,  # noqa: E402
                          timed, write_results)
from jaxaccel import config as config_lib  # noqa: E402
from jaxaccel.train import run as run_lib  # noqa: E402

SIDES = {"unscanned": "model.scan_layers=false", "scanned": "model.scan_layers=true"}


def _side(cfg, batches):
    """``(run, step(i), compile_s)``: the run, its train step on batch ``i`` (the state kept
    between calls) and the first calls on each distinct shape, summed."""
    run = run_lib.build(cfg)
    state = [run.state]

    def step(i):
        with jax.set_mesh(run.mesh):
            state[0], metrics = run.train_step(state[0], run.put_batch(batches[i]))
        jax.block_until_ready(metrics)
    shapes, compile_s = set(), 0.0
    for i, batch in enumerate(batches):
        shape = tuple(v.shape for v in batch.values())
        if shape not in shapes:
            shapes.add(shape)
            t0 = time.perf_counter()
            step(i)
            compile_s += time.perf_counter() - t0
    return run, state, step, compile_s


def _eval(run, state, passes: int) -> tuple[float, float]:
    """(first pass seconds, median of the later passes)."""
    times = []
    with jax.set_mesh(run.mesh):
        for _ in range(passes):
            t0 = time.perf_counter()
            run.evaluate(state[0])
            times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[1:])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/minilm_rt.py")
    p.add_argument("--set", action="append", default=[], dest="sets")
    p.add_argument("--batches", type=int, default=60, help="train batches of the job, in order")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--eval-passes", type=int, default=3)
    add_out_argument(p)
    args = p.parse_args(argv)
    cfgs = {name: config_lib.load(args.config, [*args.sets, s]) for name, s in SIDES.items()}
    probe = run_lib.build(cfgs["unscanned"])
    batches = []
    for batch in probe.train_data.batches(0):
        batches.append(batch)
        if len(batches) == args.batches:
            break
    del probe
    sides = {name: _side(cfg, batches) for name, cfg in cfgs.items()}
    per_round = (len(batches) - 2) // args.rounds
    samples, first = interleave({name: timed(s[2]) for name, s in sides.items()},
                                args.rounds, per_round)
    tokens = statistics.median(b["input_ids"].size for b in batches)
    rows = []
    for name, (run, state, _, compile_s) in sides.items():
        eval_first, eval_s = _eval(run, state, args.eval_passes)
        rows.append({**step_row(name, samples[name], first[name], tokens,
                                {"config": args.config, "batches": len(batches)}),
                     "compile_s": compile_s, "shapes": len({tuple(b["input_ids"].shape)
                                                            for b in batches}),
                     "eval_first_s": eval_first, "eval_s": eval_s})
    base = rows[0]
    for r in rows:
        for key in ("median_s", "cpu_median_s", "compile_s", "eval_first_s", "eval_s"):
            r[f"{key}_ratio"] = r[key] / base[key]
    name = os.path.splitext(os.path.basename(args.config))[0]
    write_results("scan", rows, {"config": args.config}, stem=f"scan-{name}", out=args.out)
    print(markdown(rows, ["name", "median_s", "cpu_median_s", "compile_s", "shapes",
                          "eval_first_s", "eval_s", "median_s_ratio", "compile_s_ratio",
                          "eval_first_s_ratio"]))


if __name__ == "__main__":
    main()
