"""Optimizer-update benchmark on a BERT-base parameter tree (the thesis's Adan table).

    python bench/optimizer.py            # BERT-base: ~110M parameters, ~200 leaves
    python bench/optimizer.py --small    # hidden 256, 4 layers: a quick CPU run

Per implementation: time per update (jitted, everything from gradients to updates inside the
timed region, so every layout copy counts; median of >= 20 after warm-up), kernels in the
compiled update (fusions + custom calls: the thesis's "kernel launches"), analytic bytes moved
and the achieved bandwidth against the device's peak. Rows: optax.adamw, optax.adan and our
Adan reference (per leaf), xla (multi-tensor) and pallas (fused kernel; GPU/TPU only, or
``--interpret`` on CPU for a functional run).
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

from bench.common import (PEAK_BANDWIDTH, count_kernels, device_kind, markdown,  # noqa: E402
                          time_fn, write_results)
from jaxaccel.models.bert import PRESETS, BertConfig, BertModel  # noqa: E402
from jaxaccel.optim import decay_mask  # noqa: E402
from jaxaccel.optim.adan import adan  # noqa: E402

# 4-byte words read + written per parameter by one update, at the least (analytic):
#   adamw: g, m, v, p read; m, v, update written                           -> 7
#   adan:  g, m, v, n, prev, p read; m, v, n, prev, update written         -> 11
#   flat multi-tensor impls also pack g and p and unpack the update        -> +6
#   clipping (thesis setting, max_grad_norm=1) reads g once more           -> +1
WORDS = {"optax.adamw": 7 + 1, "optax.adan": 11 + 1, "adan.reference": 11 + 1,
         "adan.xla": 11 + 6 + 1, "adan.pallas": 11 + 6 + 1}


def bert_params(config: BertConfig):
    from flax import nnx
    abstract = nnx.eval_shape(lambda: BertModel(config, num_labels=2))
    shapes = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    rng = np.random.default_rng(0)
    return jax.tree_util.tree_map(
        lambda s: jnp.asarray(rng.normal(size=s.shape).astype(np.float32) * 0.02), shapes)


def optimizers(interpret: bool):
    hp = dict(weight_decay=0.01, max_grad_norm=1.0, mask=decay_mask)
    txs = {
        "optax.adamw": optax.chain(optax.clip_by_global_norm(1.0),
                                   optax.adamw(1e-4, weight_decay=0.01, mask=decay_mask)),
        "optax.adan": optax.chain(optax.clip_by_global_norm(1.0),
                                  optax.adan(1e-4, weight_decay=0.01, mask=decay_mask)),
        "adan.reference": adan(1e-4, impl="reference", **hp),
        "adan.xla": adan(1e-4, impl="xla", **hp),
    }
    if jax.default_backend() in ("gpu", "tpu") or interpret:
        txs["adan.pallas"] = adan(1e-4, impl="pallas", **hp)
    return txs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="hidden 256, 4 layers")
    ap.add_argument("--interpret", action="store_true", help="run pallas interpreted on CPU")
    ap.add_argument("-n", type=int, default=20, help="timed repetitions")
    args = ap.parse_args(argv)

    config = PRESETS["bert-base"] if not args.small else BertConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
    params = bert_params(config)
    leaves = jax.tree_util.tree_leaves(params)
    num = sum(x.size for x in leaves)
    grads = jax.tree_util.tree_map(lambda x: x * 0.5 + 0.01, params)
    peak = PEAK_BANDWIDTH.get(device_kind())
    print(f"{device_kind()} ({jax.default_backend()}): {num / 1e6:.1f}M parameters in "
          f"{len(leaves)} leaves", flush=True)

    rows = []
    for name, tx in optimizers(args.interpret).items():
        state = tx.init(params)
        update = jax.jit(tx.update, donate_argnums=1)
        compiled = update.lower(grads, state, params).compile()
        _, state = update(grads, state, params)

        def step(g, p, _box=[state]):
            u, _box[0] = update(g, _box[0], p)
            return u
        timing = time_fn(step, grads, params, n=args.n)
        moved = WORDS[name] * 4 * num
        gbps = moved / timing["median_s"]
        rows.append({"name": name, **timing, **count_kernels(compiled),
                     "bytes_moved": moved, "achieved_GBps": gbps / 1e9,
                     "roofline_fraction": gbps / peak if peak else None})
        print(f"  {name}: {timing['median_s'] * 1e3:.2f} ms", flush=True)
    base = next(r["median_s"] for r in rows if r["name"] == "adan.reference")
    for r in rows:
        r["speedup_vs_reference"] = base / r["median_s"]
    path = write_results("optimizer", rows, {"parameters": num, "leaves": len(leaves),
                                              "model": "bert-base" if not args.small else
                                              "bert-small(256x4)"})
    print(markdown(rows, ["name", "median_s", "min_s", "max_s", "fusions_and_custom_calls",
                          "entry_ops", "achieved_GBps", "roofline_fraction",
                          "speedup_vs_reference"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
