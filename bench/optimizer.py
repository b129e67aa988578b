"""Optimizer-update benchmark on a BERT-base parameter tree (the thesis's Adan table).

    python bench/optimizer.py            # BERT-base: ~110M parameters, ~200 leaves
    python bench/optimizer.py --small    # hidden 256, 4 layers: a quick CPU run

    python bench/optimizer.py --block-rows 16,64,256 --num-warps 4,8 --num-stages 1,2
                                         # GPU kernel config sweep (one-pass kernel rows;
                                         # --steps 4,16: blocks per Mosaic GPU program)
    python bench/optimizer.py --only adan.xla,adan.mosaic_gpu,onepass   # some rows only

Per implementation: time per update (jitted, everything a training step needs from the gradients
to the new parameters inside the timed region: the optax rows include ``optax.apply_updates``,
so every layout copy counts; median of >= 20 after warm-up), kernels in the compiled update
(fusions + custom calls: the thesis's "kernel launches"), analytic bytes moved and the HBM
roofline fraction (bytes moved / time / the device's peak bandwidth from
``jaxaccel.devices``). Rows: optax.adamw, optax.adan and our Adan per leaf
(``impl="per_leaf"``, the kernel's reference applied leaf by leaf), xla (multi-tensor), pallas
(fused kernel on packed buffers), mosaic_gpu (its Mosaic GPU kernel, Hopper GPUs), and the
one-pass path of ``train.flat_params`` (``onepass.xla``, ``onepass.pallas``,
``onepass.mosaic_gpu``: parameters and state flat, the gradient arriving flat, one pass in
place). Pallas rows run on GPU/TPU, or with ``--interpret`` on CPU (a functional run, not a
timing); Mosaic GPU rows on a GPU where jax has Mosaic GPU.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (add_out_argument, count_kernels, device_kind,  # noqa: E402
                          markdown, time_fn, write_results)
from jaxaccel import devices  # noqa: E402
from jaxaccel.models import PRESETS, BertConfig, BertModel, ModelSpec  # noqa: E402
from jaxaccel.optim import decay_mask  # noqa: E402
from jaxaccel.optim.adan import adan, adan_onepass  # noqa: E402
from kernels_pallas import mgpu  # noqa: E402
from kernels_pallas.adan_reference import BlockSizes  # noqa: E402

# 4-byte words read + written per parameter by one update, at the least (analytic):
#   adamw: g, m, v, p read; m, v, update written                           -> 7
#   adan:  g, m, v, n, prev, p read; m, v, n, prev, update written         -> 11
#   optax contract: apply_updates reads p and the update, writes p         -> +3
#   flat multi-tensor impls also pack g and p and unpack the update        -> +6
#   one pass: g, p, m, v, n, prev read; p, m, v, n, prev written in place  -> 11
#   clipping (thesis setting, max_grad_norm=1) reads g once more           -> +1
WORDS = {"optax.adamw": 7 + 3 + 1, "optax.adan": 11 + 3 + 1, "adan.per_leaf": 11 + 3 + 1,
         "adan.xla": 11 + 6 + 3 + 1, "adan.pallas": 11 + 6 + 3 + 1,
         "adan.mosaic_gpu": 11 + 6 + 3 + 1, "onepass.xla": 11 + 1, "onepass.pallas": 11 + 1,
         "onepass.mosaic_gpu": 11 + 1}
HP = dict(weight_decay=0.01, max_grad_norm=1.0, mask=decay_mask)


def bert_params(config: BertConfig):
    from flax import nnx
    abstract = nnx.eval_shape(lambda: BertModel(ModelSpec(config, num_labels=2)))
    shapes = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    rng = np.random.default_rng(0)
    return jax.tree_util.tree_map(
        lambda s: jnp.asarray(rng.normal(size=s.shape).astype(np.float32) * 0.02), shapes)


def optimizers(interpret: bool):
    hp = HP
    txs = {
        "optax.adamw": optax.chain(optax.clip_by_global_norm(1.0),
                                   optax.adamw(1e-4, weight_decay=0.01, mask=decay_mask)),
        "optax.adan": optax.chain(optax.clip_by_global_norm(1.0),
                                  optax.adan(1e-4, weight_decay=0.01, mask=decay_mask)),
        "adan.per_leaf": adan(1e-4, impl="per_leaf", **hp),
        "adan.xla": adan(1e-4, impl="xla", **hp),
    }
    for impl in kernels(interpret):
        txs[f"adan.{impl}"] = adan(1e-4, impl=impl, **hp)
    return txs


def kernels(interpret: bool) -> tuple[str, ...]:
    """The kernel implementations to time here: the Pallas kernel on GPU/TPU (or interpreted
    on CPU), and the Mosaic GPU kernel on a GPU where jax has Mosaic GPU."""
    names = ("pallas",) if jax.default_backend() in ("gpu", "tpu") or interpret else ()
    return names + (("mosaic_gpu",) if jax.default_backend() == "gpu" and mgpu.available()
                    else ())


def onepass_rows(impls: tuple[str, ...], sweep: list) -> dict:
    """name -> the one-pass transform: xla, and each kernel at each swept kernel config."""
    txs = {"onepass.xla": adan_onepass(1e-4, impl="xla", **HP)}
    for impl in impls:
        for blocks in sweep:
            name = f"onepass.{impl}" if blocks is None else (
                f"onepass.{impl}[rows={blocks.rows},warps={blocks.num_warps},"
                f"stages={blocks.num_stages},steps={blocks.steps}]")
            txs[name] = adan_onepass(1e-4, impl=impl, block_sizes=blocks, **HP)
    return txs


def _ints(text: str | None) -> list:
    return [int(x) for x in text.split(",")] if text else []


def kernel_sweep(args) -> list:
    """BlockSizes to try (``None``: the backend's default only)."""
    rows, warps, stages = _ints(args.block_rows), _ints(args.num_warps), _ints(args.num_stages)
    steps = _ints(args.steps)
    if not (rows or warps or stages or steps):
        return [None]
    return [BlockSizes(r, num_warps=w, num_stages=s, steps=t) for r in rows or [16]
            for w in warps or [4] for s in stages or [1] for t in steps or [1]]


def measure(config: BertConfig, n: int = 20, interpret: bool = False, sweep=(None,),
            warmup: int = 3, only=("",), compiler_options: dict | None = None
            ) -> tuple[list[dict], dict]:
    """``(rows, about)``: one row per optimizer implementation updating the tree of
    ``config`` (``about``: parameters, leaves); ``only``: the prefixes of the rows' names to
    time; ``compiler_options``: XLA options the updates are compiled with."""
    params = bert_params(config)
    leaves = jax.tree_util.tree_leaves(params)
    num = sum(x.size for x in leaves)
    grads = jax.tree_util.tree_map(lambda x: x * 0.5 + 0.01, params)
    peak = devices.peak_bandwidth(device_kind())
    print(f"{device_kind()} ({jax.default_backend()}): {num / 1e6:.1f}M parameters in "
          f"{len(leaves)} leaves", flush=True)

    def record(name, fn, compiled, *fn_args):
        timing = time_fn(fn, *fn_args, n=n, warmup=warmup)
        moved = WORDS[name.split("[")[0]] * 4 * num
        gbps = moved / timing["median_s"]
        rows.append({"name": name, **timing, **count_kernels(compiled),
                     "bytes_moved": moved, "achieved_GBps": gbps / 1e9,
                     "roofline_fraction": gbps / peak if peak else None})
        print(f"  {name}: {timing['median_s'] * 1e3:.2f} ms", flush=True)

    rows = []
    for name, tx in optimizers(interpret).items():
        if not name.startswith(tuple(only)):
            continue

        def train_update(g, state, p, tx=tx):
            u, state = tx.update(g, state, p)
            return optax.apply_updates(p, u), state
        update = jax.jit(train_update, donate_argnums=(1, 2),
                         compiler_options=compiler_options)
        box = [tx.init(params), jax.tree_util.tree_map(jnp.copy, params)]
        compiled = update.lower(grads, *box).compile()

        def step(g, box=box, update=update):
            box[1], box[0] = update(g, box[0], box[1])
            return box[1]
        record(name, step, compiled, grads)

    for name, tx in onepass_rows(kernels(interpret), list(sweep)).items():
        if not name.startswith(tuple(only)):
            continue
        apply = jax.jit(tx.apply, donate_argnums=(1, 2), compiler_options=compiler_options)
        flat_params = tx.flatten(params)
        flat_grads = tx.flatten(grads).buffers     # in a training step the gradient is flat
        box = [tx.init(flat_params), flat_params]
        compiled = apply.lower(flat_grads, *box).compile()

        def step(g, box=box, apply=apply):
            box[1], box[0] = apply(g, box[0], box[1])
            return box[1]
        record(name, step, compiled, flat_grads)
    base = next((r["median_s"] for r in rows if r["name"] == "adan.per_leaf"), None)
    for r in rows:
        r["speedup_vs_per_leaf"] = base / r["median_s"] if base else None
    return rows, {"parameters": num, "leaves": len(leaves)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="hidden 256, 4 layers")
    ap.add_argument("--interpret", action="store_true", help="run pallas interpreted on CPU")
    ap.add_argument("-n", type=int, default=20, help="timed repetitions")
    ap.add_argument("--block-rows", help="one-pass kernel sweep: rows per block, e.g. 16,64")
    ap.add_argument("--num-warps", help="one-pass kernel sweep (GPU): e.g. 4,8")
    ap.add_argument("--num-stages", help="one-pass kernel sweep (GPU): e.g. 1,2")
    ap.add_argument("--steps", help="one-pass kernel sweep (Mosaic GPU): blocks per program")
    ap.add_argument("--only", help="time only the rows whose names start with one of these, "
                                   "e.g. adan.xla,adan.mosaic_gpu,onepass")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    config = PRESETS["bert-base"] if not args.small else BertConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
    rows, about = measure(config, args.n, args.interpret, kernel_sweep(args),
                          only=args.only.split(",") if args.only else ("",))
    path = write_results("optimizer", rows, {**about, "model": "bert-base" if not args.small
                                              else "bert-small(256x4)"}, out=args.out)
    print(markdown(rows, ["name", "median_s", "min_s", "max_s", "fusions_and_custom_calls",
                          "entry_ops", "achieved_GBps", "roofline_fraction",
                          "speedup_vs_per_leaf"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
