"""Fused (flash) attention, forward and backward: reference math, Pallas kernels, a dispatch.

For one batch row and query head (``P`` the attention weights, ``M`` the mask)::

    S   = scale * Q K^T                     masked entries of S are -inf
    P   = softmax(S) row-wise               a row with no unmasked key gives P = 0, O = 0
    O   = P V
    lse = logsumexp(S) row-wise             (the only residual besides O and the inputs)
    dV  = P^T dO
    dP  = dO V^T
    dS  = P * (dP - delta),  delta = rowsum(dO * O)
    dQ  = scale * dS K,      dK = scale * dS^T Q

The mask ``M[i, j]`` is the conjunction of: ``j < key_lengths[b]`` (padding), ``q_seg[i] ==
kv_seg[j]`` (packed sequences) and ``j <= i`` (causal, aligned at the start).

The kernels never build S for a whole row: the forward kernel (one program per query block)
walks the key blocks with an online softmax (running max ``m``, running sum ``l``, rescaled
accumulator), in base 2 (``exp2``, the scale premultiplied by log2 e) and fp32 whatever the
input dtype. The backward pass is two kernels: dQ (one program per query block, walking key
blocks) and dK/dV (one program per key block, walking query blocks); ``delta`` is one fused
XLA reduction. Key blocks past a row's key length, and blocks above the causal diagonal, are
skipped, not masked. A program holds the whole key (or query) sequence of one head in fast
memory and slices blocks from it, so the same kernel body runs on every target; the targets
differ only in array layout and block specs (``_Layout``):

* GPU (Triton) and interpret: [B, S, H, D] as given; per-row statistics as [rows, 1];
* TPU (Mosaic): [B, H, S, D] (the last two block dims must tile (8, 128)); query blocks of at
  least 128 rows; per-row statistics lane-major in HBM ([B, H, 1, S], as splash attention's
  backward reads them; lane-replicated in the kernels' registers), query segment ids
  replicated over 128 lanes, key segment ids over 8 sublanes, as in
  ``jax.experimental.pallas.ops.tpu.flash_attention``.

Grouped-query attention (Hq = G * Hkv): query head h reads key/value head h // G. On TPU a
dK/dV program runs the G query heads of its key/value head one after another (the grid's last
axis) and sums their gradients in float32 scratch; elsewhere dK/dV are computed per query head
and summed over each group in XLA.

Implementations (``REGISTRY``, see ``kernels_pallas.registry``), all with the semantics above;
``attention(..., impl=...)`` dispatches:

* ``"xla"``: ``attention_reference``, plain XLA, the base the others are tested against; the
  only one with attention dropout (``dropout_rate``, ``dropout_rng``: inverted dropout on P);
* ``"pallas"``: ``flash_attention``, the kernels here (Mosaic on TPU, Triton on GPU, the
  interpreter on CPU);
* ``"mosaic_gpu"``: ``attention_mgpu.mgpu_flash_attention``, the same kernels written for Hopper
  GPUs on Mosaic GPU (bf16/fp16; jax's Mosaic GPU interpreter on CPU);
* ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (NVIDIA GPUs,
  fp16/bf16, no segment ids).

``"auto"`` tries, per platform, ``DEFAULT_ORDER``: on GPU, best first as measured on an H100
(``bench/results/attention-nvidia_h100_80gb_hbm3.json``, jax 0.11.2: the Triton kernel faster
than cuDNN on BERT-base shapes), the Triton kernel where this jax does not deprecate it
(``registry.gpu_order``: jax 0.10), then cuDNN, then XLA; on TPU the Pallas kernel; on CPU the
reference. The Mosaic GPU kernel is not in the GPU order until it is measured on a GPU
(``bench/attention.py``); ``model.attention_impl=mosaic_gpu`` runs it.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import registry
from kernels_pallas.attention_mgpu import mgpu_flash_attention
from kernels_pallas.dropout import keep_mask

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)   # finite: exp2(MASK - MASK) is not NaN
LOG2E = math.log2(math.e)
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
_MIN_BLOCK = {"tpu": (TPU_LANES, TPU_LANES), "gpu": (16, 16), "interpret": (8, 8)}


# ----------------------------------------------------------------------------- reference


def _segments(segment_ids, sq, sk):
    """(q_seg [B, Sq], kv_seg [B, Sk]) or None, from an array (Sq == Sk) or a pair."""
    if segment_ids is None:
        return None
    if isinstance(segment_ids, (tuple, list)):
        q_seg, kv_seg = segment_ids
    else:
        if sq != sk:
            raise ValueError(f"segment_ids as one [B, S] array needs Sq == Sk; got Sq={sq}, "
                             f"Sk={sk}. Pass a (q_segment_ids, kv_segment_ids) pair.")
        q_seg = kv_seg = segment_ids
    return jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32)


@jax.custom_vjp
def _scores(q, k):
    """Unscaled grouped scores [b, hkv, g, q, d] x [b, k, hkv, d] -> [b, hkv, g, q, k],
    accumulated and returned in float32 (the softmax's input).

    Differentiated by hand so that the backward matmuls, like the forward ones, take their
    operands in the input dtype: autodiff would multiply the float32 score cotangent with k and
    q upcast to float32 (float32/TF32 matmuls over [b, h, q, k] in a bf16 model). The cotangent
    dS is rounded to q's dtype first, as the fused kernels (Pallas, cuDNN) do.

    q comes with its group axis before its sequence axis, as in the scores: with q as
    [b, q, hkv, g, d], XLA:CPU computed the grouped scores as [b, hkv, q, k, g] and copied
    them (and dS in the backward) transposed, a pass over every score per layer."""
    return jnp.einsum("bhgqd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32)


def _scores_fwd(q, k):
    return _scores(q, k), (q, k)


def _scores_bwd(res, ds):
    q, k = res
    ds = ds.astype(q.dtype)
    dq = jnp.einsum("bhgqk,bkhd->bhgqd", ds, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bhgqk,bhgqd->bkhd", ds, q, preferred_element_type=jnp.float32)
    return dq.astype(q.dtype), dk.astype(k.dtype)


_scores.defvjp(_scores_fwd, _scores_bwd)


def attention_reference(q, k, v, *, key_lengths=None, segment_ids=None, causal=False,
                        scale=None, dropout_rate: float = 0.0, dropout_rng=None,
                        dropout_rows=None):
    """Plain-XLA attention with the kernels' semantics (fully masked rows give zeros).

    Score matmuls take the input dtype with fp32 accumulation, softmax is fp32, P is rounded
    to v's dtype for P V. ``dropout_rate > 0`` drops entries of P with that probability
    (``dropout_rng``) and scales the rest by ``1 / (1 - dropout_rate)``; ``dropout_rows``
    (int [B]) numbers q's rows within a larger batch: row ``r`` then draws the mask row
    ``dropout_rows[r]`` of that batch draws (a micro-batch of a pipeline draws its rows' part
    of the whole batch's masks)."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g = hq // hkv
    # Scores [B, Hkv, G, Sq, Sk] are handled as [B, Hq, Sq, Sk] (query head h = (h // G, h % G),
    # a free reshape): XLA:CPU reduced the 5-D form's softmax rows about 4x slower. q and the
    # output are transposed to [B, Hkv, G, Sq, D] (query-sized copies) so that no score-sized
    # array is (``_scores``).
    qt = q.reshape(b, sq, hkv, g, d).transpose(0, 2, 3, 1, 4)
    s = _scores(qt, k).reshape(b, hq, sq, sk) * scale
    mask = jnp.ones((b, 1, sq, sk), bool)
    if key_lengths is not None:
        lengths = jnp.asarray(key_lengths, jnp.int32)
        mask &= (jnp.arange(sk)[None, :] < lengths[:, None])[:, None, None, :]
    segs = _segments(segment_ids, sq, sk)
    if segs is not None:
        mask &= (segs[0][:, :, None] == segs[1][:, None, :])[:, None]
    if causal:
        mask &= jnp.arange(sq)[:, None] >= jnp.arange(sk)[None, :]
    # jax.nn.softmax: exp(s - max) / sum, as written out, but with the one-reduction backward
    # P * (dP - rowsum(P * dP)) (its custom JVP); differentiating the written-out division
    # costs a second reduction per layer (bench/README.md). Masked scores are finite
    # (MASK_VALUE), so exp underflows to exactly 0 in every row that has a key; a row with
    # none (all MASK_VALUE, a uniform softmax) is zeroed.
    p = jax.nn.softmax(jnp.where(mask, s, MASK_VALUE), axis=-1)
    # Causal self-attention within one segment array keeps every query's own key (i == j, the
    # same segment): no row is empty, and the zeroing pass is skipped.
    diagonal_kept = causal and sq == sk and key_lengths is None and (
        segs is None or segs[0] is segs[1])
    if (key_lengths is not None or segs is not None) and not diagonal_kept:
        p = jnp.where(jnp.any(mask, axis=-1, keepdims=True), p, 0.0)
    if dropout_rate > 0:
        if dropout_rng is None:
            raise ValueError(f"dropout_rate={dropout_rate} needs dropout_rng (a PRNG key).")
        # Drawn per query head, [B, Hq, Sq, Sk], whatever the grouping (keep_mask: both
        # words of every Threefry hash, the mask independent of the mesh).
        rows = None
        if dropout_rows is not None:          # row-major numbers of (row, head, query)
            rows = ((jnp.asarray(dropout_rows, jnp.int32)[:, None, None] * hq
                     + jnp.arange(hq, dtype=jnp.int32)[None, :, None]) * sq
                    + jnp.arange(sq, dtype=jnp.int32)[None, None, :])
        keep = keep_mask(dropout_rng, 1.0 - dropout_rate, (b, hq, sq, sk), rows)
        p = jnp.where(keep, p / (1.0 - dropout_rate), 0.0)
    # P V in v's dtype: the matmul accumulates in float32 and rounds once, and its backward
    # (dP = dO V^T, dV = P^T dO) multiplies input-dtype operands; computed as [B, Hkv, G, Sq,
    # D] and transposed after (dO transposed before the backward's score-sized matmuls).
    o = jnp.einsum("bhgqk,bkhd->bhgqd", p.reshape(b, hkv, g, sq, sk).astype(v.dtype), v)
    return o.transpose(0, 3, 1, 2, 4).reshape(b, sq, hq, d).astype(q.dtype)


# ----------------------------------------------------------------------------- kernels


@dataclasses.dataclass(frozen=True)
class _Plan:
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


def _fwd_kernel(kv_len_ref, q_ref, k_ref, v_ref, *refs, plan):
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


def _dq_kernel(kv_len_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, plan):
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


def _dkv_kernel(kv_len_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, plan):
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


# ----------------------------------------------------------------------------- layouts


class _Layout:
    """Block specs for one target; the grid is always (batch, query head, sequence block)."""

    def __init__(self, plan: _Plan, head_dim: int):
        self.plan, self.d = plan, head_dim
        self.tpu = plan.target == "tpu"

    def seq(self, rows, block_index, kv=False):
        """A [rows, D] window of a [B, S, H, D] (or TPU [B, H, S, D]) tensor."""
        g = self.plan.groups if kv else 1
        head = (lambda h: lax.div(h, g)) if g > 1 else (lambda h: h)   # `//` lowers via sign
        if self.tpu:
            return pl.BlockSpec((None, None, rows, self.d),
                                lambda b, h, n: (b, head(h), block_index(n), 0))
        return pl.BlockSpec((None, rows, None, self.d),
                            lambda b, h, n: (b, block_index(n), head(h), 0))

    def stats(self, rows, block_index):
        """A block of ``rows`` per-row statistics (lse, delta) of a ``stats_shape`` array:
        on TPU lane-major [1, rows] (the rows along the lanes), elsewhere [rows, 1]."""
        if self.tpu:
            return pl.BlockSpec((None, None, 1, rows), lambda b, h, n: (b, h, 0, block_index(n)))
        return pl.BlockSpec((None, None, rows, 1), lambda b, h, n: (b, h, block_index(n), 0))

    def stats_shape(self, b, h, s):
        """The shape the kernels hold [B, H, S] statistics in (a free reshape)."""
        return (b, h, 1, s) if self.tpu else (b, h, s, 1)

    def q_seg(self, rows, block_index):
        if self.tpu:
            return pl.BlockSpec((None, rows, TPU_LANES), lambda b, h, n: (b, block_index(n), 0))
        return pl.BlockSpec((None, rows), lambda b, h, n: (b, block_index(n)))

    def kv_seg(self, cols, block_index):
        if self.tpu:
            return pl.BlockSpec((None, TPU_SUBLANES, cols),
                                lambda b, h, n: (b, 0, block_index(n)))
        return pl.BlockSpec((None, cols), lambda b, h, n: (b, block_index(n)))

    def kv_len(self):
        if self.tpu:
            from jax.experimental.pallas import tpu as pltpu
            return pl.BlockSpec(memory_space=pltpu.SMEM)
        return pl.BlockSpec((1,), lambda b, h, n: (b,))

    def segments(self, q_seg, kv_seg):
        """Segment-id arrays in this layout's shapes."""
        if not self.tpu:
            return q_seg, kv_seg
        b, sq = q_seg.shape
        sk = kv_seg.shape[1]
        return (jnp.broadcast_to(q_seg[:, :, None], (b, sq, TPU_LANES)),
                jnp.broadcast_to(kv_seg[:, None, :], (b, TPU_SUBLANES, sk)))

    def compiler_params(self, axes: int = 3):
        """A TPU grid's axes past the third accumulate (``_dkv_kernel``'s query-head group)."""
        if self.plan.target == "tpu":
            from jax.experimental.pallas import tpu as pltpu
            return pltpu.CompilerParams(
                dimension_semantics=("parallel",) * 3 + ("arbitrary",) * (axes - 3))
        if self.plan.target == "gpu":
            from jax.experimental.pallas import triton as plgpu
            return plgpu.CompilerParams(num_warps=self.plan.blocks.num_warps,
                                        num_stages=self.plan.blocks.num_stages)
        return None


def _seg_inputs(plan, lay, segs, q_spec, kv_spec):
    if not plan.has_seg:
        return [], []
    return list(lay.segments(*segs)), [q_spec, kv_spec]


def _vmem_f32(shape):
    """A float32 TPU scratch buffer of ``shape``."""
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.VMEM(shape, jnp.float32)


def _call(kernel, plan, lay, grid, in_specs, out_specs, out_shape, args, name, scratch=()):
    return pl.pallas_call(
        functools.partial(kernel, plan=plan), grid=grid, in_specs=in_specs,
        out_specs=out_specs, out_shape=out_shape, scratch_shapes=scratch,
        compiler_params=lay.compiler_params(len(grid)),
        interpret=registry.interpret(plan.target), name=name)(*args)


def _heads_seq(plan, x):
    """(batch, heads, seq) of a tensor in the plan's layout."""
    return (x.shape[0], x.shape[1], x.shape[2]) if plan.target == "tpu" else \
        (x.shape[0], x.shape[2], x.shape[1])


def _forward(plan, q, k, v, kv_len, segs):
    lay = _Layout(plan, q.shape[-1])
    b, hq, sq = _heads_seq(plan, q)
    bq = plan.blocks.block_q
    seg_args, seg_specs = _seg_inputs(plan, lay, segs, lay.q_seg(bq, lambda n: n),
                                      lay.kv_seg(plan.sk, lambda n: 0))
    o, lse = _call(
        _fwd_kernel, plan, lay, (b, hq, sq // bq),
        [lay.kv_len(), lay.seq(bq, lambda n: n), lay.seq(plan.sk, lambda n: 0, kv=True),
         lay.seq(plan.sk, lambda n: 0, kv=True)] + seg_specs,
        [lay.seq(bq, lambda n: n), lay.stats(bq, lambda n: n)],
        [jax.ShapeDtypeStruct(q.shape, q.dtype),
         jax.ShapeDtypeStruct(lay.stats_shape(b, hq, sq), jnp.float32)],
        [kv_len, q, k, v] + seg_args, "flash_attention_fwd")
    return o, lse.reshape(b, hq, sq)


def _backward(plan, q, k, v, kv_len, segs, o, lse, do):
    """dq by query blocks, then dk, dv by key blocks. The statistics (lse, delta: [B, H, Sq])
    go to the kernels in free reshapes (``_Layout.stats``): on TPU lane-major, as splash
    attention's backward takes them (lane-replicated copies cost a float32 [B, H, Sq, 128]
    write and two reads each); a TPU dk/dv program sums its key/value head's group of query
    heads itself, elsewhere per-query-head dk/dv are summed after."""
    lay = _Layout(plan, q.shape[-1])
    b, hq, sq = _heads_seq(plan, q)
    _, hkv, sk = _heads_seq(plan, k)
    tpu, g = plan.target == "tpu", plan.groups
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    if not tpu:
        delta = delta.transpose(0, 2, 1)                       # [B, H, Sq]
    bs = plan.blocks

    bq = bs.block_q_dq
    seg_args, seg_specs = _seg_inputs(plan, lay, segs, lay.q_seg(bq, lambda n: n),
                                      lay.kv_seg(plan.sk, lambda n: 0))
    stats = lay.stats(bq, lambda n: n)
    dq = _call(
        _dq_kernel, plan, lay, (b, hq, sq // bq),
        [lay.kv_len(), lay.seq(bq, lambda n: n), lay.seq(sk, lambda n: 0, kv=True),
         lay.seq(sk, lambda n: 0, kv=True), lay.seq(bq, lambda n: n), stats, stats] + seg_specs,
        lay.seq(bq, lambda n: n), jax.ShapeDtypeStruct(q.shape, q.dtype),
        [kv_len, q, k, v, do] + [x.reshape(lay.stats_shape(b, hq, sq)) for x in (lse, delta)]
        + seg_args, "flash_attention_dq")

    bq, bk = bs.block_q_dkv, bs.block_k_dkv
    seg_args, seg_specs = _seg_inputs(plan, lay, segs, lay.q_seg(sq, lambda n: 0),
                                      lay.kv_seg(bk, lambda n: n))
    if tpu:       # grid (batch, key/value head, key block, query head of its group)
        d = q.shape[-1]
        head = lambda spec, h_of: pl.BlockSpec(
            spec.block_shape, lambda b, h, n, i: spec.index_map(b, h_of(h, i), n))
        in_q = lambda h, i: h * g + i
        rows = head(lay.seq(sq, lambda n: 0), in_q)
        stats = pl.BlockSpec((None, None, sq // bq, bq), lambda b, h, n, i: (b, in_q(h, i), 0, 0))
        kv_spec = head(lay.seq(bk, lambda n: n), lambda h, i: h)
        seg_specs = [head(x, lambda h, i: h) for x in seg_specs]
        lse, delta = (x.reshape(b, hq, sq // bq, bq) for x in (lse, delta))
        grid, kv_shape, kv_dtype = (b, hkv, sk // bk, g), k.shape, k.dtype
        out_spec, scratch = kv_spec, [_vmem_f32((bk, d))] * 2
    else:         # grid over query heads; a group's dk/dv summed below
        kv_shape, kv_dtype = (b, sk, hq, q.shape[-1]), (k.dtype if g == 1 else jnp.float32)
        rows, stats = lay.seq(sq, lambda n: 0), lay.stats(sq, lambda n: 0)
        lse, delta = (x.reshape(lay.stats_shape(b, hq, sq)) for x in (lse, delta))
        kv_spec, out_spec = lay.seq(bk, lambda n: n, kv=True), lay.seq(bk, lambda n: n)
        grid, scratch = (b, hq, sk // bk), ()
    dk, dv = _call(
        _dkv_kernel, plan, lay, grid,
        [lay.kv_len(), rows, kv_spec, kv_spec, rows, stats, stats] + seg_specs,
        [out_spec] * 2, [jax.ShapeDtypeStruct(kv_shape, kv_dtype)] * 2,
        [kv_len, q, k, v, do, lse, delta] + seg_args, "flash_attention_dkv", scratch)
    if not tpu and g > 1:
        split = kv_shape[:2] + (hkv, g) + kv_shape[3:]
        dk, dv = (x.reshape(split).sum(3).astype(k.dtype) for x in (dk, dv))
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan, q, k, v, kv_len, segs):
    return _forward(plan, q, k, v, kv_len, segs)[0]


def _flash_fwd(plan, q, k, v, kv_len, segs):
    o, lse = _forward(plan, q, k, v, kv_len, segs)
    return o, (q, k, v, kv_len, segs, o, lse)


def _flash_bwd(plan, res, do):
    q, k, v, kv_len, segs, o, lse = res
    dq, dk, dv = _backward(plan, q, k, v, kv_len, segs, o, lse, do)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------- public


def _next_pow2(n):
    return 1 << max(0, int(n) - 1).bit_length()


def _fit(block, n, minimum):
    return min(block, max(minimum, _next_pow2(n)))


def _round_up(n, m):
    return -(-n // m) * m


def _check(q, k, v, key_lengths, segment_ids, scale):
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"flash_attention expects q [B, Sq, Hq, D] and k, v [B, Sk, Hkv, D] of "
                         f"one shape; got q {q.shape}, k {k.shape}, v {v.shape}.")
    b, sq, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"q {q.shape} and k {k.shape} must share batch and head_dim.")
    if hq % k.shape[2]:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads "
                         f"({k.shape[2]}) for grouped-query attention.")
    if not all(jnp.issubdtype(x.dtype, jnp.floating) for x in (q, k, v)):
        raise ValueError(f"q, k, v must be floating point; got {q.dtype}, {k.dtype}, {v.dtype}.")
    if key_lengths is not None and jnp.shape(key_lengths) != (b,):
        raise ValueError(f"key_lengths must have shape [B]=({b},); got {jnp.shape(key_lengths)}.")
    segs = _segments(segment_ids, sq, k.shape[1])
    if segs is not None and (segs[0].shape != (b, sq) or segs[1].shape != (b, k.shape[1])):
        raise ValueError(f"segment ids must be [B, Sq]=({b}, {sq}) and [B, Sk]=({b}, "
                         f"{k.shape[1]}); got {segs[0].shape} and {segs[1].shape}.")
    if scale is not None and not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a Python number (it is compiled in); got {scale!r}.")
    return segs


def flash_attention(q, k, v, *, key_lengths=None, segment_ids=None, causal: bool = False,
                    scale: float | None = None, block_sizes: BlockSizes | None = None,
                    target: str | None = None):
    """Fused multi-head attention by the Pallas kernels, differentiable (Pallas backward).

    Args:
      q: [B, Sq, Hq, D]; k, v: [B, Sk, Hkv, D] with Hkv dividing Hq (grouped-query
        attention). Any float dtype; math is fp32. Any sequence lengths (padded internally).
      key_lengths: optional [B] ints; key j of row b is masked when j >= key_lengths[b].
      segment_ids: optional [B, S] ints (Sq == Sk) or a (q [B, Sq], kv [B, Sk]) pair; a query
        attends only to keys of its own segment (packed sequences).
      causal: query i attends only to keys j <= i (aligned at the start).
      scale: logits multiplier, default 1/sqrt(D).
      block_sizes: override ``default_block_sizes(target, q.dtype)``.
      target: interpret | tpu | gpu; None: where q, k, v live (``registry.pallas_target``).

    Returns:
      [B, Sq, Hq, D] in q's dtype. A query with no unmasked key gets zeros (and no gradient).
    """
    segs = _check(q, k, v, key_lengths, segment_ids, scale)
    target = registry.pallas_target(target, q, k, v)
    if target == "gpu":
        registry.check_triton()
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    bs = block_sizes or default_block_sizes(target, q.dtype)
    min_q, min_k = _MIN_BLOCK[target]
    small = [f for f in ("block_q", "block_q_dkv", "block_q_dq") if getattr(bs, f) < min_q]
    if small:
        raise ValueError(f"block sizes {small} are below {min_q} query rows, the least the "
                         f"{target} kernels take.")
    fit_q = lambda x: _fit(x, sq, min_q)
    fit_k = lambda x: _fit(x, sk, min_k)
    bs = dataclasses.replace(bs, block_q=fit_q(bs.block_q), block_k=fit_k(bs.block_k),
                             block_q_dkv=fit_q(bs.block_q_dkv), block_k_dkv=fit_k(bs.block_k_dkv),
                             block_q_dq=fit_q(bs.block_q_dq), block_k_dq=fit_k(bs.block_k_dq))
    sq_pad = _round_up(sq, max(bs.block_q, bs.block_q_dkv, bs.block_q_dq))
    sk_pad = _round_up(sk, max(bs.block_k, bs.block_k_dkv, bs.block_k_dq))
    # Head dim: Triton blocks need a power of two; TPU blocks a multiple of 128 above 128.
    if target == "tpu":
        d_pad = d if d <= TPU_LANES else _round_up(d, TPU_LANES)
    else:
        d_pad = max(16, _next_pow2(d)) if target == "gpu" else d
    plan = _Plan(target=target, causal=causal, scale=scale,
                 has_len=key_lengths is not None or sk_pad != sk, has_seg=segs is not None,
                 groups=hq // hkv, sq=sq_pad, sk=sk_pad, blocks=bs,
                 precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)

    def prep(x, s_pad):
        x = jnp.pad(x, ((0, 0), (0, s_pad - x.shape[1]), (0, 0), (0, d_pad - d)))
        return x.transpose(0, 2, 1, 3) if target == "tpu" else x

    kv_len = (jnp.full((b,), sk, jnp.int32) if key_lengths is None
              else jnp.clip(jnp.asarray(key_lengths, jnp.int32), 0, sk))
    if segs is not None:
        segs = (jnp.pad(segs[0], ((0, 0), (0, sq_pad - sq))),
                jnp.pad(segs[1], ((0, 0), (0, sk_pad - sk))))
    o = _flash(plan, prep(q, sq_pad), prep(k, sk_pad), prep(v, sk_pad), kv_len, segs)
    if target == "tpu":
        o = o.transpose(0, 2, 1, 3)
    return o[:, :sq, :, :d]


def cudnn_attention(q, k, v, *, key_lengths=None, segment_ids=None, causal: bool = False,
                    scale: float | None = None):
    """``jax.nn.dot_product_attention(implementation="cudnn")`` with this file's arguments."""
    here = registry.platform(q, k, v)
    if here != "gpu":
        raise NotImplementedError(f"cudnn attention needs an NVIDIA GPU; q, k, v live on "
                                  f"{here!r}. Use impl 'xla' or 'pallas'.")
    if q.dtype not in (jnp.float16, jnp.bfloat16):
        raise NotImplementedError(f"cudnn attention takes float16/bfloat16 inputs, not "
                                  f"{q.dtype}; use a bf16/fp16 precision policy or impl "
                                  "'xla'/'pallas'.")
    if segment_ids is not None:
        raise NotImplementedError("cudnn attention here takes no segment ids; use impl "
                                  "'xla' or 'pallas'.")
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                        key_value_seq_lengths=key_lengths,
                                        implementation="cudnn")


def _no_dropout(name, dropout_rate):
    if dropout_rate > 0:
        raise NotImplementedError(f"attention impl {name!r} has no attention dropout "
                                  f"(dropout_rate={dropout_rate}); use impl 'xla' or set the "
                                  "attention dropout to 0.")


def _xla(q, k, v, *, dropout_rate=0.0, dropout_rng=None, dropout_rows=None, **mask):
    return attention_reference(q, k, v, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                               dropout_rows=dropout_rows, **mask)


def _pallas(q, k, v, *, dropout_rate=0.0, dropout_rng=None, dropout_rows=None, **mask):
    _no_dropout("pallas", dropout_rate)
    return flash_attention(q, k, v, **mask)


def _cudnn(q, k, v, *, dropout_rate=0.0, dropout_rng=None, dropout_rows=None, **mask):
    _no_dropout("cudnn", dropout_rate)
    return cudnn_attention(q, k, v, **mask)


def _mosaic_gpu(q, k, v, *, dropout_rate=0.0, dropout_rng=None, dropout_rows=None, **mask):
    _no_dropout("mosaic_gpu", dropout_rate)
    return mgpu_flash_attention(q, k, v, **mask)


# GPU: best first as measured on an H100 (module docstring); registry.gpu_order drops the Triton
# kernel where jax deprecates it.
MEASURED_GPU_ORDER = ("pallas", "cudnn", "xla")
DEFAULT_ORDER = {"cpu": ("xla",), "gpu": registry.gpu_order(MEASURED_GPU_ORDER),
                 "tpu": ("pallas", "xla")}
REGISTRY = registry.Registry("attention", {"xla": _xla, "pallas": _pallas, "cudnn": _cudnn,
                                           "mosaic_gpu": _mosaic_gpu}, DEFAULT_ORDER)
IMPLS = REGISTRY.names
WITH_DROPOUT = ("xla",)
# Platforms an implementation runs on (default: all); Mosaic GPU's CPU is its interpreter.
ONLY_ON = {"cudnn": ("gpu",), "mosaic_gpu": ("gpu", "cpu")}


def check_impl(impl, dropout_rate: float = 0.0) -> None:
    """Validate ``impl`` before anything is built: a known name, one that runs on this
    platform (``registry.platform()``: the ambient mesh's, else the default device's), and one
    with attention dropout when ``dropout_rate > 0`` ("auto" always has one: the reference)."""
    names = REGISTRY.candidates(impl)
    here = registry.platform()
    if all(here not in ONLY_ON.get(n, (here,)) for n in names):
        raise ValueError(f"attention_impl={impl!r} runs on {ONLY_ON[names[0]]} only; the "
                         f"platform here (ambient mesh, else default device) is {here!r}. Use "
                         "attention_impl='auto', 'xla' or 'pallas'.")
    if dropout_rate > 0 and not set(names) & set(WITH_DROPOUT):
        raise ValueError(
            f"attention_impl={impl!r} has no attention dropout, but the model asks for "
            f"attention dropout {dropout_rate}. Either set the model's attention dropout to 0 "
            "(config: model.attention_dropout=0.0) or use attention_impl='xla' (or 'auto', "
            "which falls back to it while dropout is active).")


def attention(q, k, v, *, key_lengths=None, segment_ids=None, causal: bool = False,
              scale: float | None = None, dropout_rate: float = 0.0, dropout_rng=None,
              dropout_rows=None, impl="auto"):
    """Multi-head attention by ``impl`` (``IMPLS``, or a tuple of names tried in order).

    Arguments as ``flash_attention``'s, plus attention dropout (``"xla"`` only; its arguments
    as ``attention_reference``'s). Returns
    [B, Sq, Hq, D] in q's dtype; a query with no unmasked key gets zeros."""
    segs = _check(q, k, v, key_lengths, segment_ids, scale)
    return REGISTRY(q, k, v, key_lengths=key_lengths, segment_ids=segs, causal=causal,
                    scale=scale, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                    dropout_rows=dropout_rows, impl=impl)
