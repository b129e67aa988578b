"""Mosaic GPU building blocks of the Hopper kernels (``attention_mgpu.py``, ``adan_mgpu.py``).

* ``available()``: whether the installed jax can build Mosaic GPU kernels at all;
* the kernel launch (``kernel``): warp-specialised programs of ``COMPUTE_WGS`` compute
  warpgroups and one memory warpgroup, compiled for the GPU or run by jax's Mosaic GPU
  interpreter (``InterpretGPUParams``: GPU shared memory, warpgroups, barriers and TMA
  simulated on the CPU);
* the memory warpgroup's stream of blocks into shared-memory slots (``produce``) and the
  compute warpgroups' loop over them (``consume``);
* warpgroup MMAs with float32 accumulators (``scores``: a @ b^T from shared memory;
  ``mma_regs``: registers @ shared memory; ``mma_into``: the same added to a running
  accumulator).

What the interpreters lack, and what is done instead (nothing else differs from the compiled
kernels; ``interpret`` in each helper):

* jax >= 0.11.2 (``plgpu.InterpretGPUParams`` public) runs warpgroup MMAs from shared memory
  only: a register operand is staged through a shared-memory buffer first (``mma_regs``).
  Neither it nor jax 0.10's runs ``pl.run_state`` or stores into an accumulator: where the
  compiled kernels accumulate into a running accumulator (``mma_into``), the interpreted ones
  accumulate into a fresh one and add it (the same sums).
* jax 0.10's interpreter (private, ``jax._src``) also runs no layout hints (``layout_cast``,
  ``plgpu.load`` with a layout, a laid-out ``broadcasted_iota``) and no transposed MMA
  operand: there the hints are dropped (``load``, ``cast``, ``iota``) and the MMAs run as
  plain dots of the same shared-memory tiles. Its callbacks also dispatch jax computations
  (``jnp.array``), which deadlock against a computation the caller dispatched meanwhile on
  the same CPU device (seen: optax.apply_updates after an interpreted update): block on an
  interpreted kernel's results before dispatching anything else.
"""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:                                     # a jax without Mosaic GPU
    plgpu = None

COMPUTE_WGS = 2


def available() -> bool:
    """Whether this jax has the Mosaic GPU Pallas backend these kernels are written for."""
    return plgpu is not None and all(hasattr(plgpu, n) for n in (
        "kernel", "wgmma", "copy_gmem_to_smem", "Barrier", "set_max_registers"))


if available():
    WGMMA = plgpu.Layout.WGMMA
    ROW = plgpu.Layout.WGMMA.reduce(1)        # one value per row of a [rows, cols] WGMMA tile
    COL = plgpu.Layout.WGMMA.reduce(0)        # one value per column
    # jax 0.10's plgpu.load needs an index (0.11 deprecates it, 0.12 takes none): the ref is
    # indexed before, and the index passed empty where it is required.
    _idx = inspect.signature(plgpu.load).parameters.get("idx")
    _LOAD_INDEXED = _idx is not None and _idx.default is inspect.Parameter.empty
# The interpreter made public in jax 0.11.2 runs warpgroup MMAs (see the docstring).
INTERPRETER_MMA = available() and hasattr(plgpu, "InterpretGPUParams")


def check_device():
    """NotImplementedError where the default backend is a GPU that is not a Hopper (sm_90): the
    kernels are written for its warpgroup MMAs and TMA. (Compile-only targets are not checked:
    the compile itself says so.)"""
    if jax.default_backend() != "gpu":
        return
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if capability is not None and not str(capability).startswith("9"):
        raise NotImplementedError(f"the Mosaic GPU kernels are written for Hopper GPUs (sm_90: "
                                  f"H100/H200); this is {device.device_kind} (compute "
                                  f"capability {capability}).")


def interpret_params():
    """jax's Mosaic GPU interpreter parameters (public from jax 0.11.2, private in 0.10)."""
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params()


def kernel(body, out_type, scratch, grid, grid_names, name, interpret):
    """``body`` as a Mosaic GPU kernel: ``COMPUTE_WGS`` + 1 warpgroups (axis "wg") per
    program."""
    return plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=grid_names,
        num_threads=COMPUTE_WGS + 1, thread_name="wg", kernel_name=name,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params() if interpret else None)


def smem(shape, dtype):
    """Shared memory for [..., rows, cols] MMA operands, tiled and swizzled as wgmma reads it."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(shape[-1] * bits)
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, 8 * swizzle // bits)), plgpu.SwizzleTransform(swizzle)))


def stage(interpret, shape, dtype):
    """The interpreter's staging buffers for ``mma_regs`` (one per compute warpgroup), or
    None where none is needed."""
    return smem((COMPUTE_WGS,) + shape, dtype) if interpret and INTERPRETER_MMA else None


def load(ref, layout, interpret):
    """A small vector from shared or global memory, in ``layout``."""
    if interpret:
        return ref[...]
    return plgpu.load(ref, (), layout=layout, optimized=False) if _LOAD_INDEXED else \
        plgpu.load(ref, layout=layout, optimized=False)


def cast(x, layout, interpret):
    return x if interpret else plgpu.layout_cast(x, layout)


def iota(shape, dim, interpret):
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WGMMA)


def _acc(a, b, shape):
    def run(acc):
        plgpu.wgmma(acc, a, b)
        return acc[...]
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _dot(a, b, contract):
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def scores(a, b, interpret):
    """``a @ b^T`` of two [rows, D] shared-memory tiles, float32."""
    if interpret and not INTERPRETER_MMA:
        return _dot(a[...], b[...], ((1,), (1,)))
    return _acc(a, b.T, (a.shape[0], b.shape[0]))


def mma_regs(a, b, interpret, staging):
    """``a @ b`` of registers ``a`` and a shared-memory tile ``b``, float32 (``staging``: this
    warpgroup's buffer from ``stage``)."""
    if not interpret:
        return _acc(a, b, (a.shape[0], b.shape[1]))
    if not INTERPRETER_MMA:
        return _dot(a, b[...], ((1,), (0,)))
    staging[...] = a
    return _acc(staging, b, (a.shape[0], b.shape[1]))


def mma_into(acc, a, b, interpret, staging):
    """``acc + a @ b`` (``mma_regs``' operands). Compiled, the MMA accumulates into ``acc``
    itself (``pl.run_state`` on an initialised accumulator, FlashAttention-3's form: no second
    accumulator's registers); interpreted, into a fresh one then added (the interpreters run
    no ``run_state``)."""
    if interpret:
        return acc + mma_regs(a, b, interpret, staging)
    return pl.run_state(lambda ref: plgpu.wgmma(ref, a, b))(plgpu.ACC.init(acc))


def _slot(i, stages):
    return lax.rem(i, jnp.asarray(stages, i.dtype))


def produce(copies, ready, free, lb, ub, stages):
    """The memory warpgroup: blocks ``lb .. ub-1`` of every operand into slot ``i % stages``
    (``copies``: ``(block index -> GMEM ref, SMEM slots)`` per operand; ``ready``: their
    barriers), each slot refilled once every compute warpgroup has freed it. It then waits for
    the last blocks to be freed too, so that it sees every phase of the free barriers (jax
    0.10's interpreter requires it)."""
    def issue(i):
        slot = _slot(i, stages)
        for (src, dst), bar in zip(copies, ready):
            plgpu.copy_gmem_to_smem(src(i), dst.at[slot], bar.at[slot])

    plgpu.set_max_registers(40, action="decrease")
    for s in range(stages):
        pl.when(lb + s < ub)(functools.partial(issue, lb + s))

    @pl.loop(lb, ub - stages)
    def _(i):
        plgpu.barrier_wait(free.at[_slot(i, stages)])
        issue(i + stages)

    @pl.loop(jnp.maximum(lb, ub - stages), ub)
    def _(i):
        plgpu.barrier_wait(free.at[_slot(i, stages)])


def consume(step, carry, ready, free, lb, ub, stages):
    """A compute warpgroup's loop over the streamed blocks: ``step(i, slot, carry)`` once every
    operand of block ``i`` has landed, then the slot is freed."""
    def body(i, carry):
        slot = _slot(i, stages)
        for bar in ready:
            plgpu.barrier_wait(bar.at[slot])
        carry = step(i, slot, carry)
        plgpu.barrier_arrive(free.at[slot])
        return carry
    return lax.fori_loop(lb, ub, body, carry)


def stream_barriers(operands, stages):
    """A ready barrier per streamed operand, and the slots' free barrier."""
    return (tuple(plgpu.Barrier(num_barriers=stages) for _ in range(operands)),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages))
