"""Checkpoints in a bucket against a local disk: save and restore MB/s, and the step's stall.

    PYTHONPATH=. python bench/bucket_io.py [--model bert-base] [--targets local,gs,s3]

Starts the local storage servers the tests use (``tests/storage_servers.py``: fake-gcs-server
for GCS, moto for S3; both hold objects in memory on this machine), then, in a child process per
target given that target's environment (as a VM's would be):

* the train state of ``--model`` (parameters and AdamW's two moments, fp32; the trainer's own
  ``Run``) saved by the trainer's ``Checkpointer`` and waited for, then restored onto the
  same shardings: MB/s each way, median of ``--repeats``;
* the stall: ``bench/checkpoint_save.py``'s measurement with the run folder on the target (a
  tiny run, a save every ``--every`` steps, asynchronous as the trainer saves): the step
  interval right after a save against the others.

The servers are local processes on the same 2 cores as the trainer, so the MB/s say what the
client side costs (TensorStore's drivers, Orbax's commit files, fsspec), not a cloud's network.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from bench import common  # noqa: E402


def _child(args) -> list[dict]:
    """The rows of one target (``args.target``: a local folder or a bucket URL)."""
    from jaxaccel.distributed import cpu_without_accelerator
    cpu_without_accelerator()
    import jax
    from jaxaccel import config, storage
    from jaxaccel.train.checkpoint import Checkpointer, on_disk, restore_state
    from jaxaccel.train.run import assemble, resolve
    from bench import checkpoint_save
    cfg = config.build(sets=[f"model.name={args.model}", "data.name=synthetic",
                             "train.max_steps=1", "mesh.data=1"])
    run = assemble(resolve(cfg, jax.devices()[:1], data=False), data=False)
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(on_disk(run.state)))
    rows, saves, restores = [], [], []
    for i in range(args.repeats):
        folder = storage.join(args.target, f"state-{i}")
        ckpt = Checkpointer(folder, keep=1, async_save=False)
        t0 = time.perf_counter()
        ckpt.save(1, on_disk(run.state), {"step": 1})
        ckpt.wait()
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        restored, _ = restore_state(ckpt, run.state, run.state_shardings)
        jax.block_until_ready(restored)
        restores.append(time.perf_counter() - t0)
        ckpt.close()
    where = args.label
    for kind, times in (("save", saves), ("restore", restores)):
        med = statistics.median(times)
        rows.append({"name": f"{where}/{kind}", "median_s": med, "min_s": min(times),
                     "max_s": max(times), "n": len(times), "state_mb": round(nbytes / 2**20, 1),
                     "mb_per_s": round(nbytes / 2**20 / med, 1)})
    stall = checkpoint_save.run("async", argparse.Namespace(
        steps=args.steps, every=args.every, model="tiny"), args.target)
    med = {r["name"]: r["median_s"] for r in stall}
    for r in stall:
        r["name"] = f"{where}/{r['name']}"
        r["stall_s"] = med["async/after_save"] - med["async/plain"]
    return rows + stall


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bert-base")
    p.add_argument("--targets", default="local,gs,s3")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=26)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--child", nargs=2, metavar=("LABEL", "TARGET"), help=argparse.SUPPRESS)
    common.add_out_argument(p)
    args = p.parse_args(argv)
    if args.child:
        args.label, args.target = args.child
        print(json.dumps(_child(args)))
        return 0
    import storage_servers
    starts = {"gs": storage_servers.start_gcs_emulator, "s3": storage_servers.start_moto_server}
    rows = []
    for label in args.targets.split(","):
        with tempfile.TemporaryDirectory() as local:
            if label == "local":
                rows += _spawn(args, argv, label, local, {})
                continue
            with starts[label]() as server:
                rows += _spawn(args, argv, label, f"{server.create_bucket()}/bench",
                               server.env)
    print(common.markdown(rows, ["name", "median_s", "min_s", "max_s", "n", "mb_per_s",
                                 "stall_s", "state_mb"]))
    print("wrote", common.write_results("bucket_io", rows, {"model": args.model,
                                                             "servers": "fake-gcs-server (gs), "
                                                             "moto (s3), local processes"},
                                        out=args.out))
    return 0


def _spawn(args, argv, label, target, env) -> list[dict]:
    """The child's rows for ``target`` under ``env`` (the server's endpoint and credentials)."""
    flags = [a for a in (argv if argv is not None else sys.argv[1:])]
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *flags,
                           "--child", label, target], env={**os.environ, **env},
                          capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"bucket_io {label}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
