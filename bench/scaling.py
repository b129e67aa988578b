"""Scaling benchmark: step time and efficiency over 1..N devices per strategy, and the thesis's
backward-time estimator beside the measured backward time.

    python bench/scaling.py --model bert-base --per-device-batch 16 --seq 128    # GPU/TPU node
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/scaling.py   # CPU, functional
    python bench/scaling.py --set train.optimizer=adan --set train.optimizer_impl=pallas \
        --set model.attention_impl=pallas --set sharding.zero1=true   # the fused kernels

``--set key=value`` overrides any config key for every run (as on the ``jaxaccel`` CLI).

Weak scaling: the per-device batch is fixed, so efficiency = t(1 device) / t(n devices). On a CPU
with fake devices all "devices" share the same cores: the numbers show the machinery works,
not how a real interconnect scales.

Estimator (the thesis's per-layer model of data-parallel backward): for each encoder layer,
measure its backward compute time (VJP of one layer, one device) and the all-reduce time of its
gradient (psum of a buffer of the layer's size over n devices). Walking the layers from last
to first, layer l's all-reduce starts when its backward compute has finished *and* the channel
is free; the predicted backward time is when the last all-reduce ends. It is printed beside
the measured backward time (grad step minus forward, data parallel on n devices).
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import add_out_argument, markdown, time_fn, write_results  # noqa: E402
from jaxaccel import config as config_lib  # noqa: E402
from jaxaccel.models import PRESETS  # noqa: E402
from jaxaccel.models.bert import BertLayer  # noqa: E402
from jaxaccel.precision import get_policy  # noqa: E402
from jaxaccel.train import run as run_lib  # noqa: E402
from jaxaccel.train.step import forward  # noqa: E402

STRATEGIES = {"data": lambda n: (n, 1, 1), "fsdp": lambda n: (1, n, 1),
              "tensor": lambda n: (1, 1, n), "data+tensor": lambda n: (max(n // 2, 1), 1,
                                                                        min(n, 2))}


def build(args, mesh, n):
    d, f, t = mesh
    cfg = config_lib.build(sets=[
        f"model.name={args.model}", "data.name=synthetic", f"data.synthetic_seq_len={args.seq}",
        f"data.synthetic_examples={args.per_device_batch * n * 4}",
        f"train.batch_size={args.per_device_batch * n}", f"precision.policy={args.policy}",
        f"mesh.data={d}", f"mesh.fsdp={f}", f"mesh.tensor={t}", "model.hidden_dropout=0.0",
        "model.attention_dropout=0.0", "workdir=/tmp/jaxaccel_bench", *args.set])
    return run_lib.build(cfg, jax.devices()[:n])


def step_time(run, n_iter):
    """The trainer's own step (``Run.train_step``), state donated, on a fixed batch; under
    the run's mesh (set by the caller)."""
    batch = run.put_batch(next(run.train_data.batches(0)))
    box = [run.state]

    def go(b):
        box[0], m = run.train_step(box[0], b)
        return m
    return time_fn(go, batch, n=n_iter)


def measured_backward(run, n_iter):
    """Backward time on the run's mesh: (forward + backward) minus forward."""
    batch = run.put_batch(next(run.train_data.batches(0)))
    loss = lambda p, b: forward(run.graphdef, p, b, task=run.task, deterministic=True).sum()
    fwd = jax.jit(loss)
    grad = jax.jit(jax.grad(loss))
    return time_fn(grad, run.state.params, batch, n=n_iter)["median_s"] - \
        time_fn(fwd, run.state.params, batch, n=n_iter)["median_s"]


def per_layer_figures(args, n, n_iter):
    """(backward compute seconds of one layer, all-reduce seconds of its gradient) on n devices."""
    cfg = PRESETS[args.model]
    layer = BertLayer(cfg, get_policy(args.policy), "xla", nnx.Rngs(params=0))
    graphdef, params = nnx.split(layer, nnx.Param)
    x = jnp.ones((args.per_device_batch, args.seq, cfg.hidden_size), jnp.float32)

    def out(p, x):
        return nnx.merge(graphdef, p)(x, None, True, None)
    y, vjp = jax.vjp(out, params, x)
    backward = jax.jit(lambda ct: vjp(ct))
    compute = time_fn(backward, jnp.ones_like(y), n=n_iter)["median_s"]
    size = sum(v.size for v in jax.tree_util.tree_leaves(params))
    if n == 1:
        return compute, 0.0
    mesh = jax.make_mesh((n,), ("d",), devices=jax.devices()[:n])
    spec = jax.sharding.PartitionSpec("d")
    psum = jax.jit(jax.shard_map(lambda g: jax.lax.psum(g, "d"), mesh=mesh, in_specs=spec,
                                 out_specs=spec))
    grads = jax.device_put(jnp.ones((n * size,), jnp.float32),
                           jax.sharding.NamedSharding(mesh, spec))
    return compute, time_fn(psum, grads, n=n_iter)["median_s"]


def predict_backward(layers: int, compute: float, allreduce: float) -> float:
    """Event simulation: all-reduces queue on one channel, each after its layer's compute."""
    compute_done, channel_free = 0.0, 0.0
    for _ in range(layers):                 # last layer first; identical layers
        compute_done += compute
        channel_free = max(channel_free, compute_done) + allreduce
    return max(compute_done, channel_free)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--per-device-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--policy", default="fp32")
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every run, e.g. train.optimizer=adan")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    total = jax.device_count()
    counts = [c for c in (1, 2, 4, 8, 16, 32, 64) if c <= total]
    layers = PRESETS[args.model].num_hidden_layers
    rows, base = [], {}
    for name, shape in STRATEGIES.items():
        for n in counts:
            mesh = shape(n)
            if int(np.prod(mesh)) != n:
                continue
            try:
                run = build(args, mesh, n)
            except ValueError as e:          # e.g. tensor size not dividing the heads
                print(f"  skip {name} x{n}: {e}")
                continue
            r = {"name": f"{name}.x{n}", "strategy": name, "devices": n,
                 "mesh": "x".join(map(str, mesh))}
            if name == "data":              # before step_time, which donates the state
                compute, allreduce = per_layer_figures(args, n, args.n)
                r.update(layer_backward_s=compute, layer_allreduce_s=allreduce,
                         predicted_backward_s=predict_backward(layers, compute, allreduce))
            with jax.set_mesh(run.mesh):    # the Pallas kernels run per shard
                if name == "data":
                    r["measured_backward_s"] = measured_backward(run, args.n)
                r.update(step_time(run, args.n))
            base.setdefault(name, r["median_s"])
            r["scaling_efficiency"] = base[name] / r["median_s"]
            rows.append(r)
            print(f"  {r['name']}: {r['median_s'] * 1e3:.1f} ms", flush=True)
    note = ("CPU with fake devices: functional run, devices share the same cores"
            if jax.default_backend() == "cpu" else "")
    path = write_results("scaling", rows, {"model": args.model, "seq": args.seq,
                                           "per_device_batch": args.per_device_batch,
                                           "overrides": args.set, "note": note},
                         out=args.out)
    print(markdown(rows, ["name", "mesh", "median_s", "scaling_efficiency",
                          "predicted_backward_s", "measured_backward_s"]))
    if note:
        print(note)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
