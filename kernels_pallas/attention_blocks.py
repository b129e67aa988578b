"""The Pallas flash-attention kernels' bodies, one for every target (Mosaic TPU, Triton, the
interpreter), and their block sizes.

The kernels never build S for a whole row: the forward kernel (one program per query block)
walks the key blocks with an online softmax (running max ``m``, running sum ``l``, rescaled
accumulator), in base 2 (``exp2``, the scale premultiplied by log2 e) and fp32 whatever the
input dtype. The backward pass is two kernels: dQ (one program per query block, walking key
blocks) and dK/dV (one program per key block, walking query blocks); ``delta`` is one fused
XLA reduction. Key blocks past a row's key length, and blocks above the causal diagonal, are
skipped, not masked. A program holds the whole key (or query) sequence of one head in fast
memory and slices blocks from it, so the same kernel body runs on every target; the targets
differ only in array layout and block specs, each in its own file: ``attention_tpu.TpuLayout``
(Mosaic TPU) and ``attention_triton.SeqLayout`` (Triton and the interpreter). Where a body
still asks the target (``plan.target``) it is for the TPU's lane-major statistics and its
dK/dV sum over a group of query heads.

The math and the masks are ``kernels_pallas.attention``'s docstring; ``attention_pallas``
calls these kernels.
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import registry
from kernels_pallas.attention_reference import LOG2E, MASK_VALUE

TPU_LANES, TPU_SUBLANES = 128, 8
_NT = (((1,), (1,)), ((), ()))                         # x @ y^T


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Rows of queries / keys per block for each kernel (powers of two; shrunk to the sequence
    for short inputs). ``num_warps`` / ``num_stages`` are Triton launch parameters (GPU only)."""

    block_q: int
    block_k: int
    block_q_dkv: int
    block_k_dkv: int
    block_q_dq: int
    block_k_dq: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for f in ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq"):
            b = getattr(self, f)
            if b < 8 or b & (b - 1):
                raise ValueError(f"BlockSizes.{f}={b} must be a power of two >= 8.")


# Per target. TPU: 128-multiples for the MXU and the lane-major statistics (not tuned: no
# TPU was available). GPU: picked on an H100 from a sweep over BERT-base and the long causal
# shape (bench/attention.py shapes; 3 pipeline stages gave BERT-base fwd 147 vs 107 TFLOP/s,
# fwd+bwd 173 vs 158; 8 warps or 128-row backward blocks were slower). Interpret: large
# blocks, because the interpreter's cost grows with grid steps and loop iterations.
BLOCK_SIZES = {
    "tpu": BlockSizes(256, 512, 256, 256, 256, 512),
    "gpu": BlockSizes(128, 64, 64, 64, 64, 64, num_warps=4, num_stages=3),
    "interpret": BlockSizes(128, 128, 128, 128, 128, 128),
}
# float32 inputs, where they differ: Triton computes float32 dots at HIGHEST as IEEE FMA loops
# (no tensor cores), unrolled over the whole block, so the bf16 blocks above took 19-32 s to
# compile per shape for an H100 (forward + backward; compile-only devices, 2-core CPU); these
# blocks take ~10x less (measured interleaved under equal load; tests/test_attention.py bounds
# it). Not timed on a real GPU.
FP32_BLOCK_SIZES = {
    "gpu": BlockSizes(64, 32, 32, 32, 32, 32, num_warps=4, num_stages=2),
}


def default_block_sizes(target: str, dtype) -> BlockSizes:
    """The blocks ``flash_attention`` uses on ``target`` for inputs of ``dtype``."""
    if jnp.dtype(dtype) == jnp.float32 and target in FP32_BLOCK_SIZES:
        return FP32_BLOCK_SIZES[target]
    return BLOCK_SIZES[target]


# (q rows, k rows); TPU query blocks are lane-wide: the backward reads the statistics
# lane-major in blocks of query rows.
MIN_BLOCK = {"tpu": (TPU_LANES, TPU_LANES), "gpu": (16, 16), "interpret": (8, 8)}


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one call: Pallas target, padded shapes, blocks, mask kinds."""

    target: str            # interpret | tpu | gpu
    causal: bool
    scale: float
    has_len: bool          # some key index is >= its row's length (key_lengths or padding)
    has_seg: bool
    groups: int            # Hq // Hkv
    sq: int                # padded lengths
    sk: int
    blocks: BlockSizes     # fitted to the sequences
    precision: lax.Precision | None


def _widen(x, n):
    """Per-row statistics [rows, W] (W = 1, or 128 lane-replicated in a TPU kernel) ->
    broadcastable against [rows, n]."""
    w = x.shape[1]
    if w == 1:
        return x
    if n % w == 0:
        return jnp.tile(x, (1, n // w))
    return x[:, :n]


def _q_seg(ref, rows):
    return ref[rows][:, None] if ref.ndim == 1 else ref[rows, :]


def _kv_seg(ref, cols):
    return ref[cols][None, :] if ref.ndim == 1 else ref[:1, cols]


def _kv_len(ref, plan):
    """This batch row's key length: from the whole [B] vector (TPU SMEM) or a (1,) block."""
    return ref[pl.program_id(0)] if plan.target == "tpu" else ref[0]


def _dot(x, y, plan, dims=None):
    if dims is None:
        return lax.dot(x, y, precision=plan.precision, preferred_element_type=jnp.float32)
    return lax.dot_general(x, y, dims, precision=plan.precision,
                           preferred_element_type=jnp.float32)


def _logits(q, k, row0, col0, kv_len, q_seg, kv_seg, plan):
    """Masked logits in base-2 units, [rows, cols]; masked entries are MASK_VALUE."""
    s = _dot(q, k, plan, _NT) * (plan.scale * LOG2E)
    mask = None
    if plan.causal or plan.has_len:
        col = lax.broadcasted_iota(jnp.int32, s.shape, 1) + col0
        if plan.causal:
            mask = col <= lax.broadcasted_iota(jnp.int32, s.shape, 0) + row0
        if plan.has_len:
            in_len = col < kv_len
            mask = in_len if mask is None else mask & in_len
    if plan.has_seg:
        same = _widen(q_seg, s.shape[1]) == kv_seg
        mask = same if mask is None else mask & same
    return s if mask is None else jnp.where(mask, s, MASK_VALUE)


def _kv_blocks(q_block, rows, kv_len, block_k, plan):
    """Key blocks that query block ``q_block`` (of ``rows`` rows) must visit."""
    n = kv_len
    if plan.causal:
        n = jnp.minimum(n, (q_block + 1) * rows)
    return lax.div(n + block_k - 1, block_k)


def _split(refs, plan, n_out):
    segs = refs[:2] if plan.has_seg else (None, None)
    return segs, refs[-n_out:]


def fwd_kernel(kv_len_ref, q_ref, k_ref, v_ref, *refs, plan):
    (q_seg_ref, kv_seg_ref), (o_ref, lse_ref) = _split(refs, plan, 2)
    bq, bk = plan.blocks.block_q, plan.blocks.block_k
    i = pl.program_id(2)
    kv_len = _kv_len(kv_len_ref, plan)
    q = q_ref[...]
    q_seg = _q_seg(q_seg_ref, slice(None)) if plan.has_seg else None
    w = TPU_LANES if plan.target == "tpu" else 1     # m, l lane-replicated on TPU

    def body(j, carry):
        acc, m, l = carry
        cols = pl.ds(pl.multiple_of(j * bk, bk), bk)
        kv_seg = _kv_seg(kv_seg_ref, cols) if plan.has_seg else None
        s = _logits(q, k_ref[cols, :], i * bq, j * bk, kv_len, q_seg, kv_seg, plan)
        m_next = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp2(m - m_next)
        p = jnp.exp2(s - _widen(m_next, bk))
        l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[cols, :]
        acc = acc * _widen(alpha, acc.shape[1]) + _dot(p.astype(v.dtype), v, plan)
        return acc, m_next, l

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((bq, w), MASK_VALUE, jnp.float32),
            jnp.zeros((bq, w), jnp.float32))
    acc, m, l = lax.fori_loop(0, _kv_blocks(i, bq, kv_len, bk, plan), body, init)
    alive = m > 0.5 * MASK_VALUE          # the row saw at least one unmasked key
    l_safe = jnp.where(alive, l, 1.0)
    o_ref[...] = (acc * _widen(jnp.where(alive, 1.0 / l_safe, 0.0), acc.shape[1])
                  ).astype(o_ref.dtype)
    lse = jnp.where(alive, m + jnp.log(l_safe) * LOG2E, jnp.inf)
    lse_ref[...] = lse.T[:1] if plan.target == "tpu" else lse     # TPU: lane-major


def dq_kernel(kv_len_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, plan):
    (q_seg_ref, kv_seg_ref), (dq_ref,) = _split(refs, plan, 1)
    bq, bk = plan.blocks.block_q_dq, plan.blocks.block_k_dq
    i = pl.program_id(2)
    kv_len = _kv_len(kv_len_ref, plan)
    q, do = q_ref[...], do_ref[...]
    lse, delta = (_widen(_column(ref, plan), bk) for ref in (lse_ref, delta_ref))
    q_seg = _q_seg(q_seg_ref, slice(None)) if plan.has_seg else None

    def body(j, dq):
        cols = pl.ds(pl.multiple_of(j * bk, bk), bk)
        kv_seg = _kv_seg(kv_seg_ref, cols) if plan.has_seg else None
        k = k_ref[cols, :]
        p = jnp.exp2(_logits(q, k, i * bq, j * bk, kv_len, q_seg, kv_seg, plan) - lse)
        ds = p * (_dot(do, v_ref[cols, :], plan, _NT) - delta)
        return dq + _dot(ds.astype(k.dtype), k, plan)

    dq = lax.fori_loop(0, _kv_blocks(i, bq, kv_len, bk, plan), body,
                       jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)


def _column(ref, plan, index=None):
    """Per-row statistics as a [rows, 1] (GPU, interpreter: [rows, W]) column: on TPU from a
    lane-major block (rows along the lanes; ``index`` picks the block's row of them),
    elsewhere ``ref[index]`` (default all) of a [rows, W] block."""
    if plan.target == "tpu":
        return jnp.expand_dims(ref[0 if index is None else index], -1)
    return ref[...] if index is None else ref[index, :]


def dkv_kernel(kv_len_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, plan):
    """dK, dV of one key block for one query head. On TPU the grid's last axis runs over the
    key/value head's group of query heads (statistics [Sq / bq, bq] lane-major), whose
    gradients are summed in float32 scratch and written after the last; elsewhere a program
    per query head writes its own (summed over the group outside)."""
    tpu = plan.target == "tpu"
    if tpu:
        (q_seg_ref, kv_seg_ref), (dk_ref, dv_ref, dk_sum, dv_sum) = _split(refs, plan, 4)
    else:
        (q_seg_ref, kv_seg_ref), (dk_ref, dv_ref) = _split(refs, plan, 2)
    bq, bk = plan.blocks.block_q_dkv, plan.blocks.block_k_dkv
    j = pl.program_id(2)
    kv_len = _kv_len(kv_len_ref, plan)
    k, v = k_ref[...], v_ref[...]
    kv_seg = _kv_seg(kv_seg_ref, slice(None)) if plan.has_seg else None

    def body(i, carry):
        dk, dv = carry
        rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
        q, do = q_ref[rows, :], do_ref[rows, :]
        lse, delta = (_column(r, plan, i if tpu else rows) for r in (lse_ref, delta_ref))
        q_seg = _q_seg(q_seg_ref, rows) if plan.has_seg else None
        s = _logits(q, k, i * bq, j * bk, kv_len, q_seg, kv_seg, plan)
        p = jnp.exp2(s - _widen(lse, bk))
        dv = dv + _dot(p.astype(do.dtype).T, do, plan)
        ds = p * (_dot(do, v, plan, _NT) - _widen(delta, bk))
        dk = dk + _dot(ds.astype(q.dtype).T, q, plan)
        return dk, dv

    first = lax.div(j * bk, bq) if plan.causal else 0
    # A key block past the length visits no query block. (Integer arithmetic, not a select:
    # Pallas Triton lowers a select of two constants to an i1 loop bound.)
    active = (j * bk < kv_len).astype(jnp.int32)
    last = first + active * (plan.sq // bq - first)
    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(first, last, body, (zeros, zeros))
    if not tpu:
        dk_ref[...] = (dk * plan.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv.astype(dv_ref.dtype)
        return
    g = pl.program_id(3)

    @pl.when(g == 0)
    def _():
        dk_sum[...], dv_sum[...] = zeros, zeros

    dk_sum[...] += dk
    dv_sum[...] += dv

    @pl.when(g == plan.groups - 1)
    def _():
        dk_ref[...] = (dk_sum[...] * plan.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sum[...].astype(dv_ref.dtype)


def kv_head(plan, kv):
    """A block index map's head: query head h itself, or (``kv``) its key/value head."""
    g = plan.groups if kv else 1
    return (lambda h: lax.div(h, g)) if g > 1 else (lambda h: h)   # `//` lowers via sign


def seg_inputs(plan, lay, segs, q_spec, kv_spec):
    """The segment-id operands in layout ``lay`` and their block specs (none without)."""
    if not plan.has_seg:
        return [], []
    return list(lay.segments(*segs)), [q_spec, kv_spec]


def call(kernel, plan, lay, grid, in_specs, out_specs, out_shape, args, name, scratch=()):
    """One of the kernels above as a ``pallas_call`` on ``plan``'s target, in layout ``lay``."""
    return pl.pallas_call(
        functools.partial(kernel, plan=plan), grid=grid, in_specs=in_specs,
        out_specs=out_specs, out_shape=out_shape, scratch_shapes=scratch,
        compiler_params=lay.compiler_params(len(grid)),
        interpret=registry.interpret(plan.target), name=name)(*args)
