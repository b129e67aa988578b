"""Attention benchmark: TFLOP/s of every implementation in the attention kernel's registry.

    python bench/attention.py            # BERT-base (B=32, S=512, H=12, D=64, padded keys)
                                         # and long causal (B=2, S=4096, H=16, D=128), bf16
    python bench/attention.py --small    # small shapes: a one-minute CPU run (XLA rows only)
    python bench/attention.py --only pallas,mosaic_gpu,cudnn   # some implementations only

Rows per shape and implementation (``kernels_pallas.attention.REGISTRY``: the XLA reference, our
Pallas flash attention (Triton on GPU), its Mosaic GPU version for Hopper (``mosaic_gpu``),
cuDNN; one that declines the inputs on this device is skipped): forward,
and forward + backward (one jitted vjp, the forward inside the timed region). FLOPs are the
dense count: 4 B H Sq Sk D forward, 2.5x that for the backward, halved when causal; padded keys
count (the kernels skip them, XLA does not). ``rel_err`` is ||out - ref|| / ||ref|| of the
forward output against the XLA reference in fp32.
On CPU only XLA is timed: the Pallas interpreter is a functional check, not a speed.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (add_out_argument, device_kind, markdown,  # noqa: E402
                          time_fn, write_results)
from jaxaccel.flops import mfu_peak  # noqa: E402
from kernels_pallas import registry  # noqa: E402
from kernels_pallas.attention import REGISTRY, attention  # noqa: E402
from kernels_pallas.attention_reference import attention_reference  # noqa: E402

SHAPES = {  # name: (B, S, H, D, causal, padded)
    "bert_base": (32, 512, 12, 64, False, True),
    "long_causal": (2, 4096, 16, 128, True, False),
}
SMALL_SHAPES = {
    "bert_base_small": (4, 128, 4, 64, False, True),
    "long_causal_small": (1, 1024, 4, 128, True, False),
}


def make_inputs(b, s, h, d, padded, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q, k, v, do = (jax.random.normal(key, (b, s, h, d), dtype) for key in ks[:4])
    # BERT-like padding: key lengths uniform in [S/4, S].
    lengths = jax.random.randint(ks[4], (b,), s // 4, s + 1) if padded else None
    return q, k, v, do, lengths


def implementations(platform, only=None):
    """The registry's implementations to time (those in ``only`` if given): all on GPU/TPU,
    the reference alone on CPU (Pallas there is the interpreter)."""
    names = tuple(REGISTRY.impls) if platform in ("gpu", "tpu") else ("xla",)
    return {name: functools.partial(attention, impl=name) for name in names
            if only is None or name in only}


def measure(shapes: dict, n: int = 20, warmup: int = 3, only=None,
            compiler_options: dict | None = None) -> list[dict]:
    """One row per shape, implementation and mode (fwd, fwd+bwd) of ``shapes`` (name ->
    ``(B, S, H, D, causal, padded)``), bf16 inputs, every implementation this platform times
    (or those in ``only``), compiled with the XLA options ``compiler_options``."""
    platform = registry.platform()
    peak = mfu_peak(device_kind(), "bf16")
    rows = []
    for shape_name, (b, s, h, d, causal, padded) in shapes.items():
        q, k, v, do, lengths = make_inputs(b, s, h, d, padded, jnp.bfloat16)
        ref = attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)),
                                  key_lengths=lengths, causal=causal)
        flops_fwd = 4 * b * h * s * s * d / (2 if causal else 1)
        for impl_name, impl in implementations(platform, only).items():
            attn = functools.partial(impl, key_lengths=lengths, causal=causal)
            fwd = jax.jit(attn, compiler_options=compiler_options)
            fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do),
                              compiler_options=compiler_options)
            try:
                out = fwd(q, k, v).astype(jnp.float32)
            except NotImplementedError as e:
                print(f"{shape_name}/{impl_name}: skipped ({e})", flush=True)
                continue
            rel_err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            for mode, fn, fn_args, flops in (("fwd", fwd, (q, k, v), flops_fwd),
                                             ("fwd+bwd", fwd_bwd, (q, k, v, do), 3.5 * flops_fwd)):
                t = time_fn(fn, *fn_args, n=n, warmup=warmup)
                tflops = flops / t["median_s"] / 1e12
                rows.append({"name": f"{shape_name}/{impl_name}/{mode}", "shape": shape_name,
                             "impl": impl_name, "mode": mode, **t, "tflops": tflops,
                             "mfu": tflops * 1e12 / peak if peak else None, "rel_err": rel_err,
                             "B": b, "S": s, "H": h, "D": d, "causal": causal,
                             "dtype": "bfloat16"})
                print(rows[-1]["name"], f"{t['median_s'] * 1e3:.3f} ms", f"{tflops:.2f} TFLOP/s",
                      flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="small shapes for a CPU run")
    ap.add_argument("-n", type=int, default=20, help="timed repetitions")
    ap.add_argument("--only", help="comma-separated implementation names to time")
    add_out_argument(ap)
    args = ap.parse_args(argv)

    platform = registry.platform()
    rows = measure(SMALL_SHAPES if args.small else SHAPES, args.n,
                   only=args.only.split(",") if args.only else None)
    note = ("CPU run: only the XLA reference is timed (Pallas interpret mode is not a speed); "
            "absolute CPU times are not results." if platform == "cpu" else None)
    extra = {"small": args.small, "note": note}
    if os.environ.get("JAXACCEL_SHA"):   # a copy of the tree without .git (a device machine)
        extra["jaxaccel"] = os.environ["JAXACCEL_SHA"]
    path = write_results("attention", rows, extra, out=args.out)
    print(markdown(rows, ["name", "median_s", "min_s", "max_s", "n", "tflops", "mfu",
                          "rel_err"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
