"""Job benchmark: one full training run of a config, as a user runs it (the study's unit of work).

    jaxaccel bench job                                        # configs/minilm_rt.py
    jaxaccel bench job --config configs/tiny_synthetic.py --set precision.policy=bf16

Runs ``jaxaccel.train.loop.train`` in a fresh work folder (never resumes) and writes
``bench/results/job-<name>-<device>.json``, one row:

- ``time_s``: wall time of the whole run (build, compile, train, per-epoch and final eval);
- ``time_to_accuracy_s``: from the start to the first eval with accuracy >= ``--target``
  (None when never reached); ``final_accuracy`` on the eval split;
- ``tokens_per_s`` = tokens / time_s, where tokens = sum of every train batch's padded
  [batch, length] (what the device computes on; counted from the same data pipeline);
- ``mfu`` = model FLOPs / time_s / (peak bf16 FLOP/s x devices), FLOPs per batch by the
  analytic count of bench/train_step.py: whole-job MFU, compile and eval included;
- energy over the run (NVML; elsewhere the labelled TDP estimate at utilisation = MFU).

The work (joined by ``jaxaccel compare``) is the config's model, data, epochs / steps, batch and
seed; precision policy and optimizer name the row, so runs that differ only there compare.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import device_kind, markdown, write_results  # noqa: E402
from jaxaccel import config as config_lib  # noqa: E402
from jaxaccel import devices, energy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def padded_tokens_and_flops(cfg) -> tuple[int, float]:
    """Tokens and model FLOPs of every train batch the run takes (same pipeline, no steps)."""
    from jaxaccel.train.loop import build
    run = build(cfg)
    tokens, flops, step, epoch = 0, 0.0, 0, 0
    while step < run.total_steps:
        for batch in run.train_data.batches(epoch):
            b, length = batch["input_ids"].shape
            b *= jax.process_count()
            tokens += b * length
            flops += run.spec.architecture.train_flops(b, length, cfg.model.num_labels)
            step += 1
            if step >= run.total_steps:
                break
        epoch += 1
    return tokens, flops


def time_to_accuracy(metrics_file: str, start: float, target: float) -> float | None:
    """Seconds from ``start`` to the first eval record with accuracy >= target."""
    with open(metrics_file) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("eval/accuracy", -1.0) >= target:
                return rec["time"] - start
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "minilm_rt.py"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--target", type=float, default=0.8,
                    help="eval accuracy for time-to-accuracy (default 0.8)")
    ap.add_argument("--workdir", help="run folder root (default: a fresh temporary folder, "
                    "deleted afterwards)")
    args = ap.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="jaxaccel-job-")
    cfg = config_lib.load(args.config, args.set + [f"workdir={workdir!r}"])
    if os.path.exists(os.path.join(workdir, cfg.name)):
        raise FileExistsError(f"{os.path.join(workdir, cfg.name)!r} exists and would be "
                              "resumed; pass an empty --workdir.")
    from jaxaccel.train.loop import train
    start = time.time()
    with energy.Meter(jax.default_backend(), jax.local_device_count()) as meter:
        result = train(cfg)
    if result["status"] != "completed":
        raise RuntimeError(f"the run did not complete: {result}")
    tta = time_to_accuracy(result["metrics_file"], start, args.target)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    tokens, flops = padded_tokens_and_flops(cfg)
    seconds = meter.result["seconds"]
    peak = devices.peak_bf16(device_kind())
    name = f"{cfg.name}.{cfg.precision.policy}.{cfg.train.optimizer}"
    row = {"name": name, "time_s": seconds, "n": 1, "steps": result["step"],
           "time_to_accuracy_s": tta, "target_accuracy": args.target,
           "final_accuracy": result["eval_accuracy"], "eval_examples": result["eval_examples"],
           "tokens": tokens, "tokens_per_s": tokens / seconds, "model_flops": flops,
           "model_tflops": flops / seconds / 1e12,
           "mfu": flops / seconds / (peak * jax.device_count()) if peak else None,
           **{k: v for k, v in meter.result.items() if k != "seconds"}}
    t = cfg.train
    work = {"config": os.path.basename(args.config), "model": cfg.model.name,
            "data": cfg.data.name, "epochs": t.epochs, "max_steps": t.max_steps,
            "batch_size": t.batch_size, "seed": cfg.seed}
    path = write_results("job", [row], {"config": os.path.relpath(args.config, ROOT),
                                        "sets": args.set, "work": work}, stem=f"job-{name}")
    print(markdown([row], ["name", "time_s", "time_to_accuracy_s", "final_accuracy",
                           "tokens_per_s", "mfu", "energy_j", "energy_source"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
