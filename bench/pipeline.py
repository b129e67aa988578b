"""Pipeline benchmark: step time and memory per device of a pipelined train step against the
micro-batches M and the repeats R for a fixed stage count S, with the bubble measured beside
the schedule's formula (S-1)/(R*M+S-1).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/pipeline.py   # CPU
    python bench/pipeline.py --stages 4 --model llama-125m --batch 64 --seq 512     # a GPU node

Every row is the trainer's own jitted step (``Run.train_step``, ``jaxaccel.train.run``) on the
decoder with ``--layers`` layers, the global batch fixed, on a (stage=S, data=N/S) mesh; the
unpipelined step on (data=N) is the baseline row. Memory is the compiled step's temporaries per
device (XLA ``memory_analysis``), parameters and optimizer state per device.

Measured bubble: with the batch fixed, each of the T = R M + S - 1 schedule steps processes
B/M rows on every stage, so t(M, R) = t0 + a T + c (1 + (S-1)/(R M)): a fixed cost t0, a cost a
per schedule step whatever its size (launches, the stage permute, small matmuls) and the
layers' work c on the whole batch, of which c (S-1)/(R M) is spent in the idle schedule
steps. The least-squares fit of the measured medians gives t0, a and c; the measured bubble of
a row is c (S-1)/(R M) / t(M, R), the share of its step time the idle steps' work takes
(None where the fit's c is not positive: the work term is not resolved). On a CPU with fake
devices every device shares the same cores, so idle stages' work (they compute on
placeholders) costs what real work costs and the per-step cost is large: the numbers check the
machinery, not a real interconnect.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import add_out_argument, markdown, time_fn, write_results  # noqa: E402
from jaxaccel import config as config_lib  # noqa: E402
from jaxaccel.models import model_spec  # noqa: E402
from jaxaccel.plan import shard_bytes  # noqa: E402
from jaxaccel.train import run as run_lib  # noqa: E402


def build(args, mesh: dict, *extra):
    cfg = config_lib.build(sets=[
        f"model.name={args.model}", "data.name=canterbury", "model.tokenizer=unused",
        f"data.max_len={args.seq}", f"train.batch_size={args.batch}",
        f"train.eval_batch_size={args.batch}", "train.max_steps=100",
        f"precision.policy={args.policy}", "workdir=/tmp/jaxaccel_bench",
        *(f"mesh.{k}={v}" for k, v in mesh.items()), *extra, *args.set])
    spec = model_spec(cfg.model)
    spec = dataclasses.replace(spec, architecture=dataclasses.replace(
        spec.architecture, num_hidden_layers=args.layers))
    return run_lib.assemble(run_lib.resolve(cfg, spec=spec), data=False)


def measure(run, args) -> dict:
    vocab = run.spec.architecture.vocab_size
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocab, (args.batch, args.seq), dtype=np.int32)
    batch = {"input_ids": ids, "positions": np.tile(np.arange(args.seq, dtype=np.int32),
                                                     (args.batch, 1)),
             "segment_ids": np.ones_like(ids), "targets": np.roll(ids, -1, axis=1),
             "target_weights": np.ones(ids.shape, np.float32)}
    with jax.set_mesh(run.mesh):
        batch = run.put_batch(batch)
        compiled = run.train_step.lower(run.state, batch).compile()
        box = [run.state]

        def go(b):
            box[0], m = run.train_step(box[0], b)
            return m
        timing = time_fn(go, batch, warmup=2, n=args.iters)
    return {**timing, "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "params_bytes": shard_bytes(run.state.params),
            "opt_state_bytes": shard_bytes(run.state.opt_state)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-cpu")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", default="4,8,16", help="M values (each >= stages)")
    p.add_argument("--repeats", default="1,2")
    # 64 x 256: enough work per micro-batch that the bubble shows over the per-step costs of
    # 8 fake CPU devices (at 32 x 64 it did not: docs/reports/scale-out.md)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--policy", default="fp32")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    add_out_argument(p)
    args = p.parse_args(argv)
    n, s = jax.device_count(), args.stages
    rows = [{"name": f"plain.data{n}", "stages": 1, "microbatches": None, "repeats": None,
             **measure(build(args, {"data": n}), args)}]
    print(rows[-1]["name"], f"{rows[-1]['median_s'] * 1e3:.1f} ms", flush=True)
    for r in map(int, args.repeats.split(",")):
        for m in map(int, args.microbatches.split(",")):
            run = build(args, {"stage": s, "data": n // s}, f"train.microbatches={m}",
                        f"model.pipeline_repeats={r}")
            rows.append({"name": f"pipeline.S{s}.M{m}.R{r}", "stages": s, "microbatches": m,
                         "repeats": r, "bubble_formula": run.resolved.stages.bubble,
                         **measure(run, args)})
            print(rows[-1]["name"], f"{rows[-1]['median_s'] * 1e3:.1f} ms", flush=True)
    piped = [row for row in rows if row["stages"] > 1]
    fit = _fit(piped, s)
    for row in piped:
        x = (s - 1) / (row["repeats"] * row["microbatches"])
        row["bubble_measured"] = fit["work_s"] * x / row["median_s"] \
            if fit["work_s"] > 0 else None
        row["vs_plain"] = row["median_s"] / rows[0]["median_s"]
    path = write_results("pipeline", rows, {"model": args.model, "layers": args.layers,
                                            "batch": args.batch, "seq": args.seq,
                                            "devices": n, "fit": fit}, out=args.out)
    print("fit: t = %(fixed_s).4g + %(per_step_s).4g T + %(work_s).4g (1 + (S-1)/(R M)) s"
          % fit)
    for row in rows:
        row["ms"] = row["median_s"] * 1e3
        row["temp MB"] = row["temp_bytes"] / 1e6
        row["params+opt MB"] = (row["params_bytes"] + row["opt_state_bytes"]) / 1e6
    print(markdown(rows, ["name", "microbatches", "repeats", "ms", "vs_plain", "bubble_formula",
                          "bubble_measured", "temp MB", "params+opt MB"]))
    _plot(piped, s, os.path.join(os.path.dirname(path), "pipeline-cpu.png"))
    print(path)


def _fit(rows, stages) -> dict:
    """Least squares of t(M, R) = t0 + a T + c (1 + (S-1)/(R M)) over the pipelined rows."""
    rm = np.array([row["repeats"] * row["microbatches"] for row in rows], float)
    a = np.stack([np.ones_like(rm), rm + stages - 1, 1 + (stages - 1) / rm], axis=1)
    coef = np.linalg.lstsq(a, np.array([row["median_s"] for row in rows]), rcond=None)[0]
    return dict(zip(("fixed_s", "per_step_s", "work_s"), map(float, coef)))


def _plot(rows, stages, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for r in sorted({row["repeats"] for row in rows}):
        mine = [row for row in rows if row["repeats"] == r]
        m = [row["microbatches"] for row in mine]
        a.plot(m, [row["ms"] for row in mine], "o-", label=f"R={r}")
        measured = [(row["microbatches"], row["bubble_measured"]) for row in mine
                    if row["bubble_measured"] is not None]
        if measured:
            b.plot(*zip(*measured), "o-", label=f"measured, R={r}")
        b.plot(m, [row["bubble_formula"] for row in mine], "k--", alpha=0.5,
               label=f"(S-1)/(RM+S-1), R={r}")
    a.set(xlabel="micro-batches M", ylabel="step time (ms, CPU)", title=f"S={stages}")
    b.set(xlabel="micro-batches M", ylabel="bubble fraction", title="bubble")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
