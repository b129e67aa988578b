"""Fused multi-tensor Adan update: the Pallas kernel, and the registry of implementations.

The update of one element (official Adan, sail-sg/Adan; t is the step, g the clipped gradient):

    d    = g - prev                       (0 on the first step)
    m    = b1 m + (1 - b1) g
    v    = b2 v + (1 - b2) d
    n    = b3 n + (1 - b3) (g + b2 d)^2
    den  = sqrt(n) / sqrt(1 - b3^t) + eps
    step = lr / (1 - b1^t) m / den + lr b2 / (1 - b2^t) v / den
    no_prox:  p' = p (1 - lr wd) - step
    prox:     p' = (p - step) / (1 + lr wd)

The kernel works on flat, lane-dense buffers of shape [rows, 128] (many parameter tensors
packed into one: "multi-tensor apply"), one grid step per block of rows. It reads every buffer
once and writes every output once; math is float32 in registers whatever the storage dtype;
the hyperparameters arrive as a float32 vector at run time (``scalars``), so a new learning
rate never recompiles; the state outputs alias the state inputs (updated in place when the
caller donates them).

Implementations (``UPDATE`` and ``APPLY``, registries as in ``kernels_pallas.registry``):
``"xla"``, the reference (``adan_reference.adan_reference`` / ``adan_apply_reference``: the
math above as plain XLA, the base the kernels are tested against; that file also holds the
math the kernels share, the flat buffers' shape and block sizes); ``"pallas"``, the kernel here
(Mosaic on TPU, Triton on GPU, the interpreter on CPU); ``"mosaic_gpu"``, the kernel on Mosaic
GPU for Hopper (``adan_mgpu``, imported when it runs: TMA streams, in-place state; jax's Mosaic
GPU interpreter on CPU). ``"auto"``
(``DEFAULT_ORDER``): the Pallas kernel on TPU; XLA's multi-tensor path on GPU (measured faster
than the Triton kernel) and on CPU.

Two entry points share the math:

* ``adan_update`` returns the *update* ``p' - p`` (optax's contract) and the new state: it
  reads g, m, v, n, prev (and p with weight decay) and writes update, m, v, n, prev.
* ``adan_apply`` is the one-pass form for parameters that live in flat buffers themselves: it
  reads g, p, m, v, n, prev once and writes p', m, v, n, prev once, all five aliased to their
  inputs (11 words per element, the minimum for Adan with a stored previous gradient).

``scalars`` layout: see ``adan_reference.SCALARS`` (``make_scalars`` builds it).
"""
from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from kernels_pallas import registry
from kernels_pallas.adan_reference import (BLOCK_SIZES, LANES, SCALARS, BlockSizes,
                                           adan_apply_math, adan_apply_reference, adan_math,
                                           adan_reference)


def _apply_kernel(s_ref, g_ref, p_ref, m_ref, v_ref, n_ref, prev_ref, *outs, no_prox: bool):
    s = [s_ref[i] for i in range(len(SCALARS))]
    new = adan_apply_math(s, g_ref[...], p_ref[...], m_ref[...], v_ref[...], n_ref[...],
                          prev_ref[...], no_prox=no_prox)
    for ref, x in zip(outs, new):
        ref[...] = x.astype(ref.dtype)


def _kernel(s_ref, *refs, no_prox: bool, with_params: bool):
    if with_params:
        p_ref, g_ref, m_ref, v_ref, n_ref, prev_ref, u_out, m_out, v_out, n_out, prev_out = refs
        p = p_ref[...]
    else:
        g_ref, m_ref, v_ref, n_ref, prev_ref, u_out, m_out, v_out, n_out, prev_out = refs
        p = None
    s = [s_ref[i] for i in range(len(SCALARS))]
    update, m, v, n, prev = adan_math(s, g_ref[...], m_ref[...], v_ref[...], n_ref[...],
                                      prev_ref[...], p, no_prox=no_prox)
    u_out[...] = update.astype(u_out.dtype)
    m_out[...] = m.astype(m_out.dtype)
    v_out[...] = v.astype(v_out.dtype)
    n_out[...] = n.astype(n_out.dtype)
    prev_out[...] = prev.astype(prev_out.dtype)


def _pallas_call(kernel, name, scalars, tensors, outs, aliases, *, target, block_sizes):
    """``kernel`` over [rows, 128] ``tensors`` one block of rows per grid step; ``outs`` are
    the output buffers' shape/dtype templates, ``aliases`` maps tensor index -> output index."""
    rows = tensors[0].shape[0]
    for x in tensors:
        if x.ndim != 2 or x.shape != (rows, LANES) or rows % block_sizes.rows:
            raise ValueError(f"flat Adan buffers must all be [rows, {LANES}] with rows a "
                             f"multiple of {block_sizes.rows}; got {x.shape} (first "
                             f"{tensors[0].shape}).")
    block = pl.BlockSpec((block_sizes.rows, LANES), lambda i: (i, 0))
    if target == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        scalar_spec = pl.BlockSpec(memory_space=pltpu.SMEM)
        params = pltpu.CompilerParams(dimension_semantics=("parallel",))
    else:
        scalar_spec = pl.BlockSpec((len(SCALARS),), lambda i: (0,))
        params = None
        if target == "gpu":
            registry.check_triton()
            from jax.experimental.pallas import triton as pltr
            params = pltr.CompilerParams(num_warps=block_sizes.num_warps,
                                         num_stages=block_sizes.num_stages)
    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outs],
        grid=(rows // block_sizes.rows,),
        in_specs=[scalar_spec] + [block] * len(tensors),
        out_specs=[block] * len(outs),
        input_output_aliases={1 + t: o for t, o in aliases.items()},   # operand 0: scalars
        interpret=registry.interpret(target),
        compiler_params=params,
        name=name,
    )(scalars, *tensors)


def update_kernel(scalars, g, m, v, n, prev, p=None, *, no_prox: bool = False,
                  block_sizes: BlockSizes | None = None, target: str | None = None):
    """``adan_update`` by the Pallas kernel on ``target`` (interpret | tpu | gpu; None: where
    the buffers live, ``registry.pallas_target``), ``BLOCK_SIZES[target]`` by default."""
    target = registry.pallas_target(target, g, m, v, n, prev, p)
    with_params = p is not None
    tensors = ([p] if with_params else []) + [g, m, v, n, prev]
    first_state = len(tensors) - 4                 # m's index among the tensors
    return tuple(_pallas_call(
        functools.partial(_kernel, no_prox=no_prox, with_params=with_params), "adan_update",
        scalars, tensors, [g, m, v, n, prev], {first_state + k: 1 + k for k in range(4)},
        target=target, block_sizes=block_sizes or BLOCK_SIZES[target]))


def apply_kernel(scalars, g, p, m, v, n, prev, *, no_prox: bool = False,
                 block_sizes: BlockSizes | None = None, target: str | None = None):
    """``adan_apply`` by the Pallas kernel (``target`` as in ``update_kernel``)."""
    target = registry.pallas_target(target, g, p, m, v, n, prev)
    return tuple(_pallas_call(
        functools.partial(_apply_kernel, no_prox=no_prox), "adan_apply", scalars,
        [g, p, m, v, n, prev], [p, m, v, n, prev], {1 + k: k for k in range(5)},
        target=target, block_sizes=block_sizes or BLOCK_SIZES[target]))


def _mosaic_gpu(name):
    """``adan_mgpu``'s kernel ``name``, its module imported when it first runs."""
    def run(*args, **kwargs):
        from kernels_pallas import adan_mgpu     # slow to import: only to run
        return getattr(adan_mgpu, name)(*args, **kwargs)
    return run


def _reference_ignoring_blocks(reference):
    """The reference with the kernel's signature (``block_sizes`` means nothing to it)."""
    return lambda *args, block_sizes=None, **kw: reference(*args, **kw)


# On GPUs XLA's own fusion of the update is faster than the Triton kernel (H200, jax 0.11.2,
# BERT-base tree: multi-tensor 4.47 vs 4.98 ms, one pass 2.40 vs 3.75 ms;
# bench/results/evidence-nvidia_h200.json), so "auto" takes it there; impl="pallas" still runs
# the kernel, impl="mosaic_gpu" the Mosaic GPU one (not measured on a GPU yet).
DEFAULT_ORDER = {"cpu": ("xla",), "gpu": ("xla",), "tpu": ("pallas", "xla")}
UPDATE = registry.Registry("adan_update", {
    "xla": _reference_ignoring_blocks(adan_reference), "pallas": update_kernel,
    "mosaic_gpu": _mosaic_gpu("mgpu_update_kernel")}, DEFAULT_ORDER)
APPLY = registry.Registry("adan_apply", {
    "xla": _reference_ignoring_blocks(adan_apply_reference), "pallas": apply_kernel,
    "mosaic_gpu": _mosaic_gpu("mgpu_apply_kernel")}, DEFAULT_ORDER)
IMPLS = UPDATE.names


def adan_update(scalars, g, m, v, n, prev, p=None, *, no_prox: bool = False,
                impl="auto", block_sizes: BlockSizes | None = None):
    """Fused Adan over flat [rows, 128] buffers: ``(update, m, v, n, prev)``.

    ``g`` (and ``p``, needed only for weight decay) may be any float dtype; the state buffers
    keep their own dtypes; ``update`` has ``g``'s dtype. ``impl``: one of ``IMPLS``;
    ``block_sizes``: the kernel's (default per target)."""
    return UPDATE(scalars, g, m, v, n, prev, p, no_prox=no_prox, block_sizes=block_sizes,
                  impl=impl)


def adan_apply(scalars, g, p, m, v, n, prev, *, no_prox: bool = False, impl="auto",
               block_sizes: BlockSizes | None = None):
    """One-pass fused Adan over flat [rows, 128] buffers: ``(p', m, v, n, prev)``.

    Reads g, p, m, v, n, prev once, writes p', m, v, n, prev once; the kernel's outputs alias
    ``p`` and the state (in place when the caller donates them). Each keeps its dtype; math is
    float32. ``impl`` and ``block_sizes`` as in ``adan_update``."""
    return APPLY(scalars, g, p, m, v, n, prev, no_prox=no_prox, block_sizes=block_sizes,
                 impl=impl)
