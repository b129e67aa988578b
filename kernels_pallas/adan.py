"""Fused multi-tensor Adan update: reference math, the Pallas kernel, and their registry.

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
``"xla"``, the reference (``adan_reference`` / ``adan_apply_reference``: the math below as
plain XLA, the base the kernels are tested against); ``"pallas"``, the kernel (Mosaic on TPU,
Triton on GPU, the interpreter on CPU); ``"mosaic_gpu"``, the kernel on Mosaic GPU for Hopper
(TMA streams, in-place state; jax's Mosaic GPU interpreter on CPU). ``"auto"``
(``DEFAULT_ORDER``): the Pallas kernel on TPU; XLA's multi-tensor path on GPU (measured faster
than the Triton kernel) and on CPU.

Two entry points share the math:

* ``adan_update`` returns the *update* ``p' - p`` (optax's contract) and the new state: it
  reads g, m, v, n, prev (and p with weight decay) and writes update, m, v, n, prev.
* ``adan_apply`` is the one-pass form for parameters that live in flat buffers themselves: it
  reads g, p, m, v, n, prev once and writes p', m, v, n, prev once, all five aliased to their
  inputs (11 words per element, the minimum for Adan with a stored previous gradient).

``scalars`` layout: see ``SCALARS`` (``make_scalars`` builds it).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import mgpu, registry

LANES = 128
ROW_ALIGN = 1024   # flat buffers have a multiple of this many rows: every block size divides it
SCALARS = ("lr", "b1", "b2", "b3", "eps", "wd", "bc1", "bc2", "bc3_sqrt", "clip", "first")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """One kernel instance's work: ``rows`` of every [rows, 128] buffer. On GPU also the
    Triton program's ``num_warps`` and ``num_stages`` (ignored elsewhere); for the Mosaic GPU
    kernel ``rows`` is one TMA block, ``num_stages`` the blocks in flight and ``steps`` the
    blocks one program (a warpgroup) streams. Tune with ``bench/optimizer.py --block-rows ...
    --num-warps ... --num-stages ... --steps ...``."""

    rows: int
    num_warps: int = 4
    num_stages: int = 1
    steps: int = 1

    def __post_init__(self):
        if self.rows <= 0 or ROW_ALIGN % self.rows:
            raise ValueError(f"block rows {self.rows} must divide ROW_ALIGN={ROW_ALIGN}; pick "
                             "a power of two up to it.")
        if self.num_warps <= 0 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps={self.num_warps} must be a power of two (1..32).")
        if self.num_stages <= 0:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1.")
        if self.steps <= 0 or (ROW_ALIGN // self.rows) % self.steps:
            raise ValueError(f"steps={self.steps} must divide ROW_ALIGN / rows = "
                             f"{ROW_ALIGN // self.rows}.")


# Per target: TPU blocks fill VMEM tiles (11 buffers x 512 x 128 x 4 B = 2.9 MB, double
# buffered); GPU blocks keep each Triton program at 16 elements per thread and buffer (not yet
# tuned on a GPU: the sweep flags of bench/optimizer.py are there for that). The interpreter
# (CPU) takes the largest block: each of its grid steps copies every whole buffer, so its time
# grows with rows x grid steps (the tiny BERT's fused Adan step on 4 CPU devices: 0.74 s at 256
# rows, 0.23 s at 1024; compile 5.4 s -> 3.3 s).
# Mosaic GPU: 8-row blocks (4 KiB per float32 buffer), 3 in flight: 6 inputs x 3 + 5 outputs
# = 92 KiB of shared memory, two programs per H100 SM; not tuned on a GPU. Its interpreter
# (CPU) takes whole 1024-row groups in one step, as the Pallas interpreter does.
BLOCK_SIZES = {"tpu": BlockSizes(512), "gpu": BlockSizes(16, num_warps=4, num_stages=1),
               "interpret": BlockSizes(ROW_ALIGN),
               "mosaic_gpu": BlockSizes(8, num_stages=3, steps=16),
               "mosaic_gpu_interpret": BlockSizes(256, num_stages=2, steps=4)}


def make_scalars(*, lr, b1, b2, b3, eps, weight_decay, count, clip):
    """The float32 hyperparameter vector for step ``count + 1`` (``count`` steps done)."""
    t = jnp.asarray(count, jnp.float32) + 1.0
    f = lambda x: jnp.asarray(x, jnp.float32)
    values = dict(lr=f(lr), b1=f(b1), b2=f(b2), b3=f(b3), eps=f(eps), wd=f(weight_decay),
                  bc1=1.0 / (1.0 - f(b1) ** t), bc2=1.0 / (1.0 - f(b2) ** t),
                  bc3_sqrt=1.0 / jnp.sqrt(1.0 - f(b3) ** t), clip=f(clip),
                  first=(t == 1.0).astype(jnp.float32))
    return jnp.stack([values[k] for k in SCALARS])


def _moments(s, g, m, v, n, prev, sqrt=jnp.sqrt):
    """The new moments and the step ``lr (bc1 m + b2 bc2 v) / den``, float32."""
    lr, b1, b2, b3, eps, wd, bc1, bc2, bc3_sqrt, clip, first = (s[i] for i in range(len(SCALARS)))
    g = g.astype(jnp.float32) * clip
    d = (g - prev.astype(jnp.float32)) * (1.0 - first)
    m = b1 * m.astype(jnp.float32) + (1.0 - b1) * g
    v = b2 * v.astype(jnp.float32) + (1.0 - b2) * d
    u = g + b2 * d
    n = b3 * n.astype(jnp.float32) + (1.0 - b3) * u * u
    den = sqrt(n) * bc3_sqrt + eps
    step = (lr * bc1 * m + lr * b2 * bc2 * v) / den
    return step, m, v, n, g


def adan_math(s, g, m, v, n, prev, p=None, *, no_prox: bool, sqrt=jnp.sqrt):
    """One Adan step on arrays (any shape), float32 math. ``s`` indexes like ``SCALARS``.

    Returns ``(update, m, v, n, prev)`` in float32; ``p=None`` means weight decay is 0."""
    step, m, v, n, g = _moments(s, g, m, v, n, prev, sqrt)
    lr, wd = s[0], s[5]
    if p is None:
        update = -step
    else:
        p = p.astype(jnp.float32)
        update = -lr * wd * p - step if no_prox else (p - step) / (1.0 + lr * wd) - p
    return update, m, v, n, g


def adan_apply_math(s, g, p, m, v, n, prev, *, no_prox: bool, sqrt=jnp.sqrt):
    """One Adan step returning the new parameter ``p'`` itself (float32):
    ``p (1 - lr wd) - step`` (no_prox) or ``(p - step) / (1 + lr wd)``."""
    step, m, v, n, g = _moments(s, g, m, v, n, prev, sqrt)
    lr, wd = s[0], s[5]
    p = p.astype(jnp.float32)
    p = p * (1.0 - lr * wd) - step if no_prox else (p - step) / (1.0 + lr * wd)
    return p, m, v, n, g


def adan_apply_reference(scalars, g, p, m, v, n, prev, *, no_prox: bool):
    """The plain-XLA one-pass path: ``adan_apply_math`` cast back to the storage dtypes."""
    out = adan_apply_math(scalars, g, p, m, v, n, prev, no_prox=no_prox)
    return tuple(x.astype(like.dtype) for x, like in zip(out, (p, m, v, n, prev)))


def adan_reference(scalars, g, m, v, n, prev, p=None, *, no_prox: bool):
    """The plain-XLA path: ``adan_math`` cast back to the storage dtypes."""
    update, m2, v2, n2, prev2 = adan_math(scalars, g, m, v, n, prev, p, no_prox=no_prox)
    return (update.astype(g.dtype), m2.astype(m.dtype), v2.astype(v.dtype), n2.astype(n.dtype),
            prev2.astype(prev.dtype))


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


# ----------------------------------------------------------------------------- Mosaic GPU


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
    "mosaic_gpu": mgpu_update_kernel}, DEFAULT_ORDER)
APPLY = registry.Registry("adan_apply", {
    "xla": _reference_ignoring_blocks(adan_apply_reference), "pallas": apply_kernel,
    "mosaic_gpu": mgpu_apply_kernel}, DEFAULT_ORDER)
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
