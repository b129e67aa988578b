"""``flash_attention``: the Pallas flash-attention kernels (``attention_blocks``), forward and
backward, on Mosaic TPU (``attention_tpu``), on Triton or in the interpreter
(``attention_triton``).

Inputs are padded here: sequences to whole blocks (padded keys are past the key length, padded
queries are dropped), the head dim where a target needs it (Triton: a power of two of at least
16; TPU: a multiple of 128 above 128). The semantics are ``kernels_pallas.attention``'s.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import registry
from kernels_pallas.attention_blocks import (MIN_BLOCK, TPU_LANES, BlockSizes, Plan, call,
                                             default_block_sizes, dq_kernel, fwd_kernel,
                                             seg_inputs)
from kernels_pallas.attention_reference import check_inputs
from kernels_pallas.attention_tpu import TpuLayout
from kernels_pallas.attention_triton import SeqLayout


def _layout(plan, head_dim):
    return (TpuLayout if plan.target == "tpu" else SeqLayout)(plan, head_dim)


def _forward(plan, q, k, v, kv_len, segs):
    lay = _layout(plan, q.shape[-1])
    b, hq, sq = lay.heads_seq(q)
    bq = plan.blocks.block_q
    seg_args, seg_specs = seg_inputs(plan, lay, segs, lay.q_seg(bq, lambda n: n),
                                     lay.kv_seg(plan.sk, lambda n: 0))
    o, lse = call(
        fwd_kernel, plan, lay, (b, hq, sq // bq),
        [lay.kv_len(), lay.seq(bq, lambda n: n), lay.seq(plan.sk, lambda n: 0, kv=True),
         lay.seq(plan.sk, lambda n: 0, kv=True)] + seg_specs,
        [lay.seq(bq, lambda n: n), lay.stats(bq, lambda n: n)],
        [jax.ShapeDtypeStruct(q.shape, q.dtype),
         jax.ShapeDtypeStruct(lay.stats_shape(b, hq, sq), jnp.float32)],
        [kv_len, q, k, v] + seg_args, "flash_attention_fwd")
    return o, lse.reshape(b, hq, sq)


def _backward(plan, q, k, v, kv_len, segs, o, lse, do):
    """dq by query blocks, then dk, dv by key blocks (the layout's ``dkv``). The statistics
    (lse, delta: [B, H, Sq]) go to the kernels in free reshapes (the layout's ``stats``)."""
    lay = _layout(plan, q.shape[-1])
    b, hq, sq = lay.heads_seq(q)
    sk = lay.heads_seq(k)[2]
    delta = lay.by_head(jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1))
    bq = plan.blocks.block_q_dq
    seg_args, seg_specs = seg_inputs(plan, lay, segs, lay.q_seg(bq, lambda n: n),
                                     lay.kv_seg(plan.sk, lambda n: 0))
    stats = lay.stats(bq, lambda n: n)
    dq = call(
        dq_kernel, plan, lay, (b, hq, sq // bq),
        [lay.kv_len(), lay.seq(bq, lambda n: n), lay.seq(sk, lambda n: 0, kv=True),
         lay.seq(sk, lambda n: 0, kv=True), lay.seq(bq, lambda n: n), stats, stats] + seg_specs,
        lay.seq(bq, lambda n: n), jax.ShapeDtypeStruct(q.shape, q.dtype),
        [kv_len, q, k, v, do] + [x.reshape(lay.stats_shape(b, hq, sq)) for x in (lse, delta)]
        + seg_args, "flash_attention_dq")
    dk, dv = lay.dkv(q, k, v, kv_len, segs, do, lse, delta)
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


def _next_pow2(n):
    return 1 << max(0, int(n) - 1).bit_length()


def _round_up(n, m):
    return -(-n // m) * m


def _fit_blocks(bs, target, sq, sk):
    """``bs`` shrunk to short sequences (powers of two, not below the target's least)."""
    min_q, min_k = MIN_BLOCK[target]
    small = [f for f in ("block_q", "block_q_dkv", "block_q_dq") if getattr(bs, f) < min_q]
    if small:
        raise ValueError(f"block sizes {small} are below {min_q} query rows, the least the "
                         f"{target} kernels take.")
    fit_q = lambda x: min(x, max(min_q, _next_pow2(sq)))
    fit_k = lambda x: min(x, max(min_k, _next_pow2(sk)))
    return dataclasses.replace(
        bs, block_q=fit_q(bs.block_q), block_k=fit_k(bs.block_k),
        block_q_dkv=fit_q(bs.block_q_dkv), block_k_dkv=fit_k(bs.block_k_dkv),
        block_q_dq=fit_q(bs.block_q_dq), block_k_dq=fit_k(bs.block_k_dq))


def _head_dim(target, d):
    """The padded head dim: Triton blocks need a power of two; TPU blocks a multiple of 128
    above 128."""
    if target == "tpu":
        return d if d <= TPU_LANES else _round_up(d, TPU_LANES)
    return max(16, _next_pow2(d)) if target == "gpu" else d


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
    segs = check_inputs(q, k, v, key_lengths, segment_ids, scale)
    target = registry.pallas_target(target, q, k, v)
    if target == "gpu":
        registry.check_triton()
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    bs = _fit_blocks(block_sizes or default_block_sizes(target, q.dtype), target, sq, sk)
    sq_pad = _round_up(sq, max(bs.block_q, bs.block_q_dkv, bs.block_q_dq))
    sk_pad = _round_up(sk, max(bs.block_k, bs.block_k_dkv, bs.block_k_dq))
    d_pad = _head_dim(target, d)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    plan = Plan(target=target, causal=causal, scale=scale,
                has_len=key_lengths is not None or sk_pad != sk, has_seg=segs is not None,
                groups=hq // hkv, sq=sq_pad, sk=sk_pad, blocks=bs,
                precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)
    lay = _layout(plan, d_pad)
    pad = lambda x, s_pad: lay.arrange(
        jnp.pad(x, ((0, 0), (0, s_pad - x.shape[1]), (0, 0), (0, d_pad - d))))
    kv_len = (jnp.full((b,), sk, jnp.int32) if key_lengths is None
              else jnp.clip(jnp.asarray(key_lengths, jnp.int32), 0, sk))
    if segs is not None:
        segs = (jnp.pad(segs[0], ((0, 0), (0, sq_pad - sq))),
                jnp.pad(segs[1], ((0, 0), (0, sk_pad - sk))))
    o = _flash(plan, pad(q, sq_pad), pad(k, sk_pad), pad(v, sk_pad), kv_len, segs)
    return lay.arrange(o)[:, :sq, :, :d]
