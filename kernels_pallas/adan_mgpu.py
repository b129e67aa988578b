"""Fused Adan on Mosaic GPU for Hopper (TMA streams, state updated in place; jax's Mosaic GPU
interpreter on CPU): ``kernels_pallas.adan``'s ``"mosaic_gpu"`` implementation, with the math
of ``adan_reference``. Imported only when it runs: jax's Mosaic GPU modules take a second or
more to import.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import mgpu, registry
from kernels_pallas.adan_reference import (BLOCK_SIZES, LANES, SCALARS, BlockSizes,
                                           adan_apply_math, adan_math)


def _rsqrt_sqrt(x):
    """sqrt(x) for x >= 0 as ``x rsqrt(x)``: jax 0.10's Mosaic GPU lowers rsqrt, not sqrt."""
    return jnp.where(x > 0, x * lax.rsqrt(x), 0.0)


def _mgpu_stream(name, scalars, fixed, shared, writes, math, bs, interpret):
    """One pass of ``writes = math(s, *fixed, *shared)`` over [rows, 128] buffers by Mosaic
    GPU: ``fixed`` arrays only read, ``shared`` GMEM refs read and (in ``writes``) written in
    place, block i stored after it is read. Each program (one warpgroup) streams ``bs.steps``
    blocks of ``bs.rows`` rows: TMA loads ``bs.num_stages`` blocks ahead into shared memory,
    the math in registers, TMA stores from shared memory."""
    plgpu, reads = mgpu.plgpu, list(fixed) + list(shared)
    rows = reads[0].shape[0]
    r, steps = bs.rows, bs.steps
    stages = min(bs.num_stages, steps)
    for x in reads + writes:
        if x.shape != (rows, LANES) or rows % (r * steps):
            raise ValueError(f"flat Adan buffers must all be [rows, {LANES}] with rows a "
                             f"multiple of {r * steps}; got {x.shape} (first {reads[0].shape}).")

    def body(s_ref, *refs):
        in_smem, out_smem, ready = refs[-3:]
        reads = list(refs[:len(fixed)]) + shared
        base = lax.axis_index("blocks") * steps
        block = lambda ref, i: ref.at[pl.ds((base + i) * r, r)]

        def issue(i):
            slot = lax.rem(i, jnp.int32(stages))
            for ref, buf, bar in zip(reads, in_smem, ready):
                plgpu.copy_gmem_to_smem(block(ref, i), buf.at[slot], bar.at[slot])

        for i in range(stages):
            issue(jnp.int32(i))
        s = [s_ref[k] for k in range(len(SCALARS))]

        @pl.loop(0, steps)
        def _(i):
            slot = lax.rem(i, jnp.int32(stages))
            for bar in ready:
                plgpu.barrier_wait(bar.at[slot])
            new = math(s, *(buf.at[slot][...] for buf in in_smem))
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # the last block's stores
            for buf, x in zip(out_smem, new):
                buf[...] = x.astype(buf.dtype)
            plgpu.commit_smem()            # outputs visible to TMA; the slot is read
            pl.when(i + stages < steps)(lambda: issue(i + stages))
            for ref, buf in zip(writes, out_smem):
                plgpu.copy_smem_to_gmem(buf, block(ref, i))
        plgpu.wait_smem_to_gmem(0)

    scratch = ([plgpu.SMEM((stages, r, LANES), x.dtype) for x in reads],
               [plgpu.SMEM((r, LANES), x.dtype) for x in writes],
               [plgpu.Barrier(num_barriers=stages) for _ in reads])
    mesh = plgpu.Mesh(grid=(rows // (r * steps),), grid_names=("blocks",))
    pl.kernel(lambda *ins: pl.run_scoped(functools.partial(body, *ins), *scratch), out_type=(),
              mesh=mesh, name=name, interpret=mgpu.interpret_params() if interpret else False)(
                  scalars, *fixed)


def _mgpu_setup(operands, block_sizes):
    if not mgpu.available():
        raise NotImplementedError(f"jax {jax.__version__} has no Mosaic GPU Pallas backend; "
                                  "use optimizer impl 'pallas' or 'xla'.")
    interpret = registry.platform(*operands) != "gpu"
    if not interpret:
        mgpu.check_device()
    return interpret, block_sizes or BLOCK_SIZES[
        "mosaic_gpu_interpret" if interpret else "mosaic_gpu"]


def _refs(*xs):
    return [jax.new_ref(x, memory_space=mgpu.plgpu.GMEM) for x in xs]


# jitted: the GMEM refs that alias the state exist only inside jit.
@functools.partial(jax.jit, static_argnames=("no_prox", "block_sizes"))
def mgpu_update_kernel(scalars, g, m, v, n, prev, p=None, *, no_prox: bool = False,
                       block_sizes: BlockSizes | None = None):
    """``adan_update`` by the Mosaic GPU kernel (Hopper; jax's Mosaic GPU interpreter where
    the buffers are not on a GPU). m, v, n, prev are updated in place (aliased)."""
    interpret, bs = _mgpu_setup((g, m, v, n, prev, p), block_sizes)
    state = _refs(m, v, n, prev)
    u_ref = jax.empty_ref(jax.ShapeDtypeStruct(g.shape, g.dtype), memory_space=mgpu.plgpu.GMEM)

    def math(s, *x):
        pv = x[0] if p is not None else None
        return adan_math(s, *x[-5:], pv, no_prox=no_prox, sqrt=_rsqrt_sqrt)

    fixed = ([] if p is None else [p]) + [g]
    _mgpu_stream("adan_update_mgpu", scalars, fixed, state, [u_ref] + state, math, bs,
                 interpret)
    return tuple(x[...] for x in [u_ref] + state)


@functools.partial(jax.jit, static_argnames=("no_prox", "block_sizes"))
def mgpu_apply_kernel(scalars, g, p, m, v, n, prev, *, no_prox: bool = False,
                      block_sizes: BlockSizes | None = None):
    """``adan_apply`` by the Mosaic GPU kernel: p, m, v, n, prev updated in place."""
    interpret, bs = _mgpu_setup((g, p, m, v, n, prev), block_sizes)
    state = _refs(p, m, v, n, prev)
    math = lambda s, *x: adan_apply_math(s, *x, no_prox=no_prox, sqrt=_rsqrt_sqrt)
    _mgpu_stream("adan_apply_mgpu", scalars, [g], state, state, math, bs, interpret)
    return tuple(x[...] for x in state)
