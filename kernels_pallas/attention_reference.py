"""Attention's semantics in plain XLA: the inputs every implementation takes, checked once
(``check_inputs``), and ``attention_reference``, the base every kernel is tested against.

The math, the masks and what a query without keys gets are in ``kernels_pallas.attention``'s
docstring. ``MASK_VALUE`` and ``LOG2E`` are the kernels' too (``attention_blocks``,
``attention_mgpu``).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.dropout import keep_mask

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)   # finite: exp2(MASK - MASK) is not NaN
LOG2E = math.log2(math.e)


def segments(segment_ids, sq, sk):
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


def check_inputs(q, k, v, key_lengths, segment_ids, scale):
    """ValueError unless the arguments are what every implementation takes; the segment ids
    as ``segments`` gives them."""
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
    segs = segments(segment_ids, sq, k.shape[1])
    if segs is not None and (segs[0].shape != (b, sq) or segs[1].shape != (b, k.shape[1])):
        raise ValueError(f"segment ids must be [B, Sq]=({b}, {sq}) and [B, Sk]=({b}, "
                         f"{k.shape[1]}); got {segs[0].shape} and {segs[1].shape}.")
    if scale is not None and not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a Python number (it is compiled in); got {scale!r}.")
    return segs


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
    segs = segments(segment_ids, sq, sk)
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
