"""Job benchmark: one full training run of a config, as a user runs it (the study's unit of work).

    jaxaccel bench job                                        # configs/minilm_rt.py
    jaxaccel bench job --config configs/tiny_synthetic.py --set precision.policy=bf16
    jaxaccel bench job --compile-only          # only what the run compiles, and how long

Runs ``jaxaccel.train.loop.train`` in a fresh work folder (never resumes) and writes
``<--out>/job-<name>-<device>.json`` (default ``runs/bench/``), one row:

- ``time_s``: wall time of the whole run (build, compile, train, per-epoch and final eval);
- ``time_to_accuracy_s``: from the start to the first eval with accuracy >= ``--target``
  (None when never reached); ``final_accuracy`` on the eval split;
- ``tokens_per_s`` = tokens / time_s, where tokens = sum of every train batch's padded
  [batch, length] (what the device computes on; counted from the same data pipeline);
- ``mfu`` = model FLOPs / time_s / (peak FLOP/s of the policy's dtype x devices), FLOPs per
  batch by ``jaxaccel.flops.train_flops``: whole-job MFU, compile and eval included;
- energy over the run (NVML; elsewhere the labelled TDP estimate at utilisation = MFU);
- ``compile_s``: seconds in XLA compilation or, on a hit, reading the persistent compilation
  cache (``compilation_cache``, on by default as in the CLI; the cache folder of a first run
  should be empty or ``compilation_cache=off``), ``compile_share`` = compile_s / time_s,
  ``trace_lower_s`` (tracing and lowering to StableHLO: every run pays it), ``cache_hits``.

The work (joined by ``jaxaccel compare``) is the config's model, data, epochs / steps, batch and
seed; precision policy and optimizer name the row, so runs that differ only there compare.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (add_out_argument, device_kind, markdown,  # noqa: E402
                          write_results)
from jaxaccel import config as config_lib  # noqa: E402
from jaxaccel.flops import mfu_peak, model_shape, train_flops  # noqa: E402
from jaxaccel.compare import energy  # noqa: E402
from jaxaccel.precision import Policy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def padded_tokens_and_flops(cfg) -> tuple[int, float, Policy]:
    """Tokens and model FLOPs of every train batch the run takes (same pipeline, no steps),
    and the run's precision policy as resolved for this device (fp8 where no layer pays is
    bf16's: MFU's peak follows it, as the trainer's does)."""
    from jaxaccel.train.run import build
    run = build(cfg)
    tokens, flops, step, epoch = 0, 0.0, 0, 0
    while step < run.total_steps:
        for batch in run.train_data.batches(epoch):
            b, length = batch["input_ids"].shape
            b *= jax.process_count()
            tokens += b * length
            flops += train_flops(model_shape(run.spec), b, length)
            step += 1
            if step >= run.total_steps:
                break
        epoch += 1
    return tokens, flops, run.resolved.policy


def time_to_accuracy(metrics_file: str, start: float, target: float) -> float | None:
    """Seconds from ``start`` to the first eval record with accuracy >= target."""
    with open(metrics_file) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("eval/accuracy", -1.0) >= target:
                return rec["time"] - start
    return None


class CompileClock:
    """Sums JAX's compile-time events from its creation on (jax.monitoring listeners)."""

    EVENTS = {"/jax/core/compile/backend_compile_duration": "compile_s",
              "/jax/core/compile/jaxpr_trace_duration": "trace_lower_s",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "trace_lower_s"}

    def __init__(self):
        self.totals = {"compile_s": 0.0, "trace_lower_s": 0.0, "cache_hits": 0}
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)

    def _duration(self, event, seconds, **_):
        if event in self.EVENTS:
            self.totals[self.EVENTS[event]] += seconds

    def _event(self, event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            self.totals["cache_hits"] += 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "minilm_rt.py"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--target", type=float, default=0.8,
                    help="eval accuracy for time-to-accuracy (default 0.8)")
    ap.add_argument("--workdir", help="run folder root (default: a fresh temporary folder, "
                    "deleted afterwards)")
    add_out_argument(ap)
    ap.add_argument("--compile-only", action="store_true",
                    help="build the run and compile what it would compile (the loop's "
                    "compile_ahead), print the compile seconds and stop; no result file")
    args = ap.parse_args(argv)
    if args.workdir:
        job(args, args.workdir)
    else:                      # the temporary run folder goes, whether the run completed or not
        with tempfile.TemporaryDirectory(prefix="jaxaccel-job-") as workdir:
            job(args, workdir)


def job(args: argparse.Namespace, workdir: str) -> None:
    """Train ``args.config`` under ``workdir`` and write its result row (or, with
    ``--compile-only``, print the compile seconds)."""
    cfg = config_lib.load(args.config, args.set + [f"workdir={workdir!r}"])
    if os.path.exists(os.path.join(workdir, cfg.name)):
        raise FileExistsError(f"{os.path.join(workdir, cfg.name)!r} exists and would be "
                              "resumed; pass an empty --workdir.")
    from jaxaccel import compilation_cache
    from jaxaccel.train.loop import train
    compilation_cache.enable(cfg.compilation_cache)
    clock = CompileClock()
    if args.compile_only:
        from jaxaccel.train.loop import compile_ahead
        from jaxaccel.train.run import build
        run = build(cfg)
        start = time.perf_counter()
        with jax.set_mesh(run.mesh):
            programs = compile_ahead(run, run.state, 0)
        print(json.dumps({"programs": programs, "wall_s": time.perf_counter() - start,
                          "cache": jax.config.jax_compilation_cache_dir, **clock.totals}))
        return
    start = time.time()
    with energy.Meter(jax.default_backend(), jax.local_device_count()) as meter:
        result = train(cfg)
    if result["status"] != "completed":
        raise RuntimeError(f"the run did not complete: {result}")
    tta = time_to_accuracy(result["metrics_file"], start, args.target)
    tokens, flops, policy = padded_tokens_and_flops(cfg)
    seconds = meter.result["seconds"]
    peak = mfu_peak(device_kind(), policy)
    name = f"{cfg.name}.{cfg.precision.policy}.{cfg.train.optimizer}"
    row = {"name": name, "time_s": seconds, "n": 1, "steps": result["step"],
           "time_to_accuracy_s": tta, "target_accuracy": args.target,
           "final_accuracy": result["eval_accuracy"], "eval_examples": result["eval_examples"],
           "tokens": tokens, "tokens_per_s": tokens / seconds, "model_flops": flops,
           "model_tflops": flops / seconds / 1e12, **clock.totals,
           "compile_share": clock.totals["compile_s"] / seconds,
           "mfu": flops / seconds / (peak * jax.device_count()) if peak else None,
           **{k: v for k, v in meter.result.items() if k != "seconds"}}
    t = cfg.train
    work = {"config": os.path.basename(args.config), "model": cfg.model.name,
            "data": cfg.data.name, "epochs": t.epochs, "max_steps": t.max_steps,
            "batch_size": t.batch_size, "seed": cfg.seed}
    path = write_results("job", [row], {"config": os.path.relpath(args.config, ROOT),
                                        "sets": args.set, "work": work}, stem=f"job-{name}",
                         out=args.out)
    print(markdown([row], ["name", "time_s", "time_to_accuracy_s", "final_accuracy",
                           "tokens_per_s", "mfu", "compile_s", "compile_share", "energy_j",
                           "energy_source"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
