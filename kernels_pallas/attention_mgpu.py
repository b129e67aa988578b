"""Flash attention for Hopper GPUs on Mosaic GPU: forward, dQ and dK/dV kernels.

The semantics (masks, fully masked rows, grouped-query heads) and the base-2 online softmax are
``kernels_pallas.attention``'s, whose docstring has the math (the Pallas kernels for TPU and
Triton: ``attention_blocks``); this file holds Mosaic GPU kernels
that compute them, written for H100/H200 (sm_90a) after jax's FlashAttention-3 port
(``jax/experimental/pallas/ops/gpu/attention_mgpu.py``) and tokamax's sm90 kernels:

* a program is ``mgpu.COMPUTE_WGS`` (2) compute warpgroups, each owning ``block`` rows of the
  output, and one memory warpgroup that streams the other operand's blocks into shared memory
  by TMA (``mgpu.produce`` / ``mgpu.consume``: ``stages`` slots);
* every matmul is a warpgroup MMA with bf16/fp16 operands and float32 accumulation: from
  swizzled shared memory (Q K^T, dO V^T, K Q^T, V dO^T) and from registers into the running
  accumulators (P V, dS K, P^T dO, dS^T Q);
* loops visit only the blocks a program needs: key blocks below the key length (and, causal,
  up to the diagonal); for dK/dV, query blocks from the diagonal on. Tiles are masked only
  where they cross the key length or the diagonal (every tile with segment ids).

Inputs are padded here: sequences to whole program tiles (padded keys are past the key length;
padded queries are dropped), head_dim to a multiple of 64 (zero columns change no dot
product). float32 inputs are declined (``NotImplementedError``): a warpgroup MMA would take
them as TF32, far from the float32 reference; so is attention dropout (the registry falls
back). dK/dV are computed per query head and summed over each group in XLA.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import mgpu, registry
from kernels_pallas.attention_reference import LOG2E, MASK_VALUE

DTYPES = (jnp.bfloat16, jnp.float16)
WGS = mgpu.COMPUTE_WGS


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Rows per compute warpgroup (multiples of 64: one warpgroup MMA's M, and its K where the
    block is the contracted dimension) of each kernel's own tile (``block_q``, ``block_q_dq``,
    ``block_kv_dkv``) and of the streamed operand's blocks, and ``stages``: the shared-memory
    slots the memory warpgroup fills ahead."""

    block_q: int = 64
    block_kv: int = 128
    block_q_dq: int = 64
    block_kv_dq: int = 64
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    stages: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            b = getattr(self, f.name)
            if f.name != "stages" and (b <= 0 or b % 64):
                raise ValueError(f"BlockSizes.{f.name}={b} must be a positive multiple of 64.")
        if self.stages < 2:
            raise ValueError(f"BlockSizes.stages={self.stages} must be >= 2.")


def default_block_sizes(head_dim: int) -> BlockSizes:
    """128-key forward blocks up to D=64, 64 above: the scores, the running accumulators and
    the masks then fit a compute warpgroup's 232 registers per thread (ptxas reports no spills
    at D=64 and 128, but 44 bytes in dK/dV at D=128 with segment ids:
    tests/test_attention_mgpu.py). Not tuned on a GPU."""
    return BlockSizes() if head_dim <= 64 else BlockSizes(block_kv=64)


@dataclasses.dataclass(frozen=True)
class _Plan:
    causal: bool
    has_seg: bool
    scale: float
    groups: int
    blocks: BlockSizes
    interpret: bool


def _bcast(x, shape, dim):
    return lax.broadcast_in_dim(x, shape, [dim])


def _mask(s, q0, k0, kv_len, plan, transposed):
    """Base-2 logits of a tile whose first query / key are ``q0`` / ``k0`` (keys along the rows
    when ``transposed``), masked past the key length and (causal) above the diagonal."""
    qd, kd = (1, 0) if transposed else (0, 1)
    key = mgpu.iota(s.shape, kd, plan.interpret) + k0
    valid = key < kv_len
    if plan.causal:
        valid &= key <= mgpu.iota(s.shape, qd, plan.interpret) + q0
    return jnp.where(valid, s, MASK_VALUE)


def _masked(s, q0, k0, n_k, kv_len, seg, plan, transposed=False):
    """``s`` masked: by segment ids (``seg``: (query, key) vectors, or None) everywhere, by
    ``_mask`` only where a tile of ``n_k`` keys crosses the key length or (causal) reaches
    above the diagonal."""
    if seg is not None:
        qd, kd = (1, 0) if transposed else (0, 1)
        same = _bcast(seg[0], s.shape, qd) == _bcast(seg[1], s.shape, kd)
        s = jnp.where(same, s, MASK_VALUE)
    needed = k0 + n_k > kv_len
    if plan.causal:
        needed |= k0 + n_k > q0 + 1
    mask = functools.partial(_mask, q0=q0, k0=k0, kv_len=kv_len, plan=plan,
                             transposed=transposed)
    return lax.cond(needed, mask, lambda s: s, s)


def _key_blocks(plan, kv_len, tile, rows, block):
    """Key blocks a program of ``rows`` query rows at query tile ``tile`` visits: [0, ub)."""
    ub = lax.div(kv_len + block - 1, block)
    if plan.causal:
        ub = jnp.minimum(ub, lax.div((tile + 1) * rows + block - 1, block))
    return jnp.int32(0), ub


def _query_blocks(plan, kv_len, tile, bk, bq, n):
    """Query blocks (of ``bq`` rows, ``n`` in all) a dK/dV program at key tile ``tile`` (of
    ``WGS * bk`` keys) visits: [lb, ub), from the first that reaches its keys (causal), none
    when its keys lie past the key length."""
    lb = lax.div(tile * WGS * bk, jnp.int32(bq)) if plan.causal else jnp.int32(0)
    return lb, lb + (tile * WGS * bk < kv_len).astype(jnp.int32) * (n - lb)


def _stats(ref, interpret):
    return mgpu.load(ref, mgpu.ROW, interpret)


def _launch(plan, body, out, scratch, tiles, name, *args):
    b, hq = args[0].shape[0], args[0].shape[2]
    return mgpu.kernel(body, out, scratch, (b, hq, tiles), ("batch", "heads", "tile"), name,
                       plan.interpret)(*args)


def _ids():
    return tuple(lax.axis_index(n) for n in ("batch", "heads", "tile", "wg"))


def _stream_kv(plan, refs, smems, bars, free, bi, hi, lb, ub, bk):
    """The memory warpgroup of the forward and dQ kernels: key blocks ``lb``..``ub`` (of
    ``bk`` rows: each kernel's own block size) of the query head ``hi``'s K/V head streamed
    into the ``stages`` shared-memory slots."""
    hk = lax.div(hi, jnp.int32(plan.groups))
    blocks = lambda ref: lambda i: ref.at[bi, pl.ds(i * bk, bk), hk]
    mgpu.produce([(blocks(ref), smem) for ref, smem in zip(refs, smems)], bars, free, lb, ub,
                 plan.blocks.stages)


def _stream_q(plan, refs, smems, ready, free, bi, hi, lb, ub, bq):
    """The memory warpgroup of the dK/dV kernel: query blocks ``lb``..``ub`` (of ``bq`` rows)
    of q, dO (``refs[:2]``) and their statistics lse, delta (``refs[2:]``) streamed into the
    ``stages`` shared-memory slots."""
    rows = lambda ref: lambda i: ref.at[bi, pl.ds(i * bq, bq), hi]
    stats = lambda ref: lambda i: ref.at[bi, hi, pl.ds(i * bq, bq)]
    blocks = [rows(r) for r in refs[:2]] + [stats(r) for r in refs[2:]]
    mgpu.produce(list(zip(blocks, smems)), ready, free, lb, ub, plan.blocks.stages)


# ----------------------------------------------------------------------------- kernels


def _forward(plan, q, k, v, kv_len, q_seg, kv_seg):
    """(out [B, Sq, Hq, D], lse [B, Hq, Sq] in base-2 units, +inf for rows without keys)."""
    b, sq, hq, d = q.shape
    bq, bk, stages = plan.blocks.block_q, plan.blocks.block_kv, plan.blocks.stages
    dt, it = q.dtype, plan.interpret

    def body(q_ref, k_ref, v_ref, len_ref, qseg_ref, kvseg_ref, o_ref, lse_ref, smem, bars,
             staging):
        (q_smem, k_smem, v_smem, lse_smem), (q_bar, (k_bar, v_bar), free) = smem, bars
        bi, hi, ti, wg = _ids()
        kv_len = len_ref[bi]
        lb, ub = _key_blocks(plan, kv_len, ti, WGS * bq, bk)

        pl.when(wg == WGS)(lambda: _stream_kv(plan, (k_ref, v_ref), (k_smem, v_smem),
                                              (k_bar, v_bar), free, bi, hi, lb, ub, bk))

        @pl.when(wg < WGS)
        def _compute():
            mgpu.plgpu.set_max_registers(232, action="increase")
            q0 = (ti * WGS + wg) * bq
            my_q, my_lse = q_smem.at[wg], lse_smem.at[wg]
            stage = None if staging is None else staging.at[wg]
            mgpu.plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(q0, bq), hi], my_q, q_bar.at[wg])
            q_seg = _stats(qseg_ref.at[bi, pl.ds(q0, bq)], it) if plan.has_seg else None
            mgpu.plgpu.barrier_wait(q_bar.at[wg])

            def step(i, slot, carry):
                acc, m, l = carry
                s = mgpu.scores(my_q, k_smem.at[slot], it) * (plan.scale * LOG2E)
                seg = (q_seg, mgpu.load(kvseg_ref.at[bi, pl.ds(i * bk, bk)], mgpu.COL, it)) \
                    if plan.has_seg else None
                s = _masked(s, q0, i * bk, bk, kv_len, seg, plan)
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - _bcast(m_new, s.shape, 0))
                acc = mgpu.mma_into(acc * _bcast(alpha, acc.shape, 0), p.astype(dt),
                                    v_smem.at[slot], it, stage)
                return acc, m_new, l * alpha + p.sum(axis=1)

            init = (mgpu.cast(jnp.zeros((bq, d), jnp.float32), mgpu.WGMMA, it),
                    mgpu.cast(jnp.full((bq,), MASK_VALUE, jnp.float32), mgpu.ROW, it),
                    mgpu.cast(jnp.zeros((bq,), jnp.float32), mgpu.ROW, it))
            acc, m, l = mgpu.consume(step, init, (k_bar, v_bar), free, lb, ub, stages)
            alive = m > 0.5 * MASK_VALUE          # the row saw at least one unmasked key
            l = jnp.where(alive, l, 1.0)
            my_q[...] = (acc * _bcast(jnp.where(alive, 1.0 / l, 0.0), acc.shape, 0)).astype(dt)
            my_lse[...] = jnp.where(alive, m + jnp.log(l) * LOG2E, jnp.inf)
            mgpu.plgpu.commit_smem()
            mgpu.plgpu.copy_smem_to_gmem(my_q, o_ref.at[bi, pl.ds(q0, bq), hi])
            mgpu.plgpu.copy_smem_to_gmem(my_lse, lse_ref.at[bi, hi, pl.ds(q0, bq)])
            mgpu.plgpu.wait_smem_to_gmem(0)

    scratch = [(mgpu.smem((WGS, bq, d), dt), mgpu.smem((stages, bk, d), dt),
                mgpu.smem((stages, bk, d), dt), mgpu.plgpu.SMEM((WGS, bq), jnp.float32)),
               (mgpu.plgpu.Barrier(num_barriers=WGS),) + mgpu.stream_barriers(2, stages),
               mgpu.stage(it, (bq, bk), dt)]
    out = [jax.ShapeDtypeStruct(q.shape, dt), jax.ShapeDtypeStruct((b, hq, sq), jnp.float32)]
    return _launch(plan, body, out, scratch, sq // (WGS * bq), "flash_attention_fwd_mgpu",
                   q, k, v, kv_len, q_seg, kv_seg)


def _dq(plan, q, k, v, do, lse, delta, kv_len, q_seg, kv_seg):
    """dQ [B, Sq, Hq, D]: per query block, walking the key blocks."""
    sq, d = q.shape[1], q.shape[3]
    bq, bk, stages = plan.blocks.block_q_dq, plan.blocks.block_kv_dq, plan.blocks.stages
    dt, it = q.dtype, plan.interpret

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, len_ref, qseg_ref, kvseg_ref,
             dq_ref, smem, bars, staging):
        (q_smem, do_smem, k_smem, v_smem), (q_bar, do_bar, (k_bar, v_bar), free) = smem, bars
        bi, hi, ti, wg = _ids()
        kv_len = len_ref[bi]
        lb, ub = _key_blocks(plan, kv_len, ti, WGS * bq, bk)

        pl.when(wg == WGS)(lambda: _stream_kv(plan, (k_ref, v_ref), (k_smem, v_smem),
                                              (k_bar, v_bar), free, bi, hi, lb, ub, bk))

        @pl.when(wg < WGS)
        def _compute():
            mgpu.plgpu.set_max_registers(232, action="increase")
            q0 = (ti * WGS + wg) * bq
            rows = pl.ds(q0, bq)
            my_q, my_do = q_smem.at[wg], do_smem.at[wg]
            stage = None if staging is None else staging.at[wg]
            mgpu.plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, hi], my_q, q_bar.at[wg])
            mgpu.plgpu.copy_gmem_to_smem(do_ref.at[bi, rows, hi], my_do, do_bar.at[wg])
            lse = _stats(lse_ref.at[bi, hi, rows], it)
            delta = _stats(delta_ref.at[bi, hi, rows], it)
            q_seg = _stats(qseg_ref.at[bi, rows], it) if plan.has_seg else None
            mgpu.plgpu.barrier_wait(q_bar.at[wg])
            mgpu.plgpu.barrier_wait(do_bar.at[wg])

            def step(i, slot, dq):
                s = mgpu.scores(my_q, k_smem.at[slot], it) * (plan.scale * LOG2E)
                seg = (q_seg, mgpu.load(kvseg_ref.at[bi, pl.ds(i * bk, bk)], mgpu.COL, it)) \
                    if plan.has_seg else None
                s = _masked(s, q0, i * bk, bk, kv_len, seg, plan)
                p = jnp.exp2(s - _bcast(lse, s.shape, 0))
                dp = mgpu.scores(my_do, v_smem.at[slot], it)
                ds = p * (dp - _bcast(delta, s.shape, 0))
                return mgpu.mma_into(dq, ds.astype(dt), k_smem.at[slot], it, stage)

            dq = mgpu.consume(step, mgpu.cast(jnp.zeros((bq, d), jnp.float32), mgpu.WGMMA, it),
                              (k_bar, v_bar), free, lb, ub, stages)
            my_q[...] = (dq * plan.scale).astype(dt)
            mgpu.plgpu.commit_smem()
            mgpu.plgpu.copy_smem_to_gmem(my_q, dq_ref.at[bi, rows, hi])
            mgpu.plgpu.wait_smem_to_gmem(0)

    scratch = [(mgpu.smem((WGS, bq, d), dt), mgpu.smem((WGS, bq, d), dt),
                mgpu.smem((stages, bk, d), dt), mgpu.smem((stages, bk, d), dt)),
               (mgpu.plgpu.Barrier(num_barriers=WGS), mgpu.plgpu.Barrier(num_barriers=WGS))
               + mgpu.stream_barriers(2, stages),
               mgpu.stage(it, (bq, bk), dt)]
    return _launch(plan, body, jax.ShapeDtypeStruct(q.shape, dt), scratch, sq // (WGS * bq),
                   "flash_attention_dq_mgpu", q, k, v, do, lse, delta, kv_len, q_seg, kv_seg)


def _dkv(plan, q, k, v, do, lse, delta, kv_len, q_seg, kv_seg):
    """dK, dV per query head, [B, Sk, Hq, D]: per key block, walking the query blocks."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    bq, bk, stages = plan.blocks.block_q_dkv, plan.blocks.block_kv_dkv, plan.blocks.stages
    dt, it = q.dtype, plan.interpret

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, len_ref, qseg_ref, kvseg_ref,
             dk_ref, dv_ref, smem, bars, staging):
        (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem), \
            (k_bar, v_bar, ready, free) = smem, bars
        bi, hi, ti, wg = _ids()
        kv_len = len_ref[bi]
        lb, ub = _query_blocks(plan, kv_len, ti, bk, bq, sq // bq)

        pl.when(wg == WGS)(lambda: _stream_q(
            plan, (q_ref, do_ref, lse_ref, delta_ref), (q_smem, do_smem, lse_smem, delta_smem),
            ready, free, bi, hi, lb, ub, bq))

        @pl.when(wg < WGS)
        def _compute():
            mgpu.plgpu.set_max_registers(232, action="increase")
            k0 = (ti * WGS + wg) * bk
            keys, hk = pl.ds(k0, bk), lax.div(hi, jnp.int32(plan.groups))
            my_k, my_v = k_smem.at[wg], v_smem.at[wg]
            stage = None if staging is None else staging.at[wg]
            mgpu.plgpu.copy_gmem_to_smem(k_ref.at[bi, keys, hk], my_k, k_bar.at[wg])
            mgpu.plgpu.copy_gmem_to_smem(v_ref.at[bi, keys, hk], my_v, v_bar.at[wg])
            kv_seg = _stats(kvseg_ref.at[bi, keys], it) if plan.has_seg else None
            mgpu.plgpu.barrier_wait(k_bar.at[wg])
            mgpu.plgpu.barrier_wait(v_bar.at[wg])

            def step(i, slot, carry):
                dk, dv = carry
                q_s, do_s = q_smem.at[slot], do_smem.at[slot]
                st = mgpu.scores(my_k, q_s, it) * (plan.scale * LOG2E)     # [keys, queries]
                seg = (mgpu.load(qseg_ref.at[bi, pl.ds(i * bq, bq)], mgpu.COL, it), kv_seg) \
                    if plan.has_seg else None
                st = _masked(st, i * bq, k0, bk, kv_len, seg, plan, transposed=True)
                pt = jnp.exp2(st - _bcast(mgpu.load(lse_smem.at[slot], mgpu.COL, it),
                                          st.shape, 1))
                dv = mgpu.mma_into(dv, pt.astype(dt), do_s, it, stage)
                dpt = mgpu.scores(my_v, do_s, it)
                dst = pt * (dpt - _bcast(mgpu.load(delta_smem.at[slot], mgpu.COL, it),
                                         st.shape, 1))
                return mgpu.mma_into(dk, dst.astype(dt), q_s, it, stage), dv

            zeros = mgpu.cast(jnp.zeros((bk, d), jnp.float32), mgpu.WGMMA, it)
            dk, dv = mgpu.consume(step, (zeros, zeros), ready, free, lb, ub, stages)
            my_k[...] = (dk * plan.scale).astype(dt)
            my_v[...] = dv.astype(dt)
            mgpu.plgpu.commit_smem()
            mgpu.plgpu.copy_smem_to_gmem(my_k, dk_ref.at[bi, keys, hi])
            mgpu.plgpu.copy_smem_to_gmem(my_v, dv_ref.at[bi, keys, hi])
            mgpu.plgpu.wait_smem_to_gmem(0)

    out = [jax.ShapeDtypeStruct((b, sk, hq, d), dt)] * 2
    return _launch(plan, body, out, _dkv_scratch(plan, bq, bk, d, dt), sk // (WGS * bk),
                   "flash_attention_dkv_mgpu",
                   q, k, v, do, lse, delta, kv_len, q_seg, kv_seg)


def _dkv_scratch(plan, bq, bk, d, dt):
    """The dK/dV kernel's shared memory: each compute warpgroup's K and V tiles, the streamed
    q, dO, lse and delta slots; their barriers; the MMA staging buffer (interpreter)."""
    stages = plan.blocks.stages
    stats = mgpu.plgpu.SMEM((stages, bq), jnp.float32)
    return [(mgpu.smem((WGS, bk, d), dt), mgpu.smem((WGS, bk, d), dt),
             mgpu.smem((stages, bq, d), dt), mgpu.smem((stages, bq, d), dt), stats, stats),
            (mgpu.plgpu.Barrier(num_barriers=WGS), mgpu.plgpu.Barrier(num_barriers=WGS))
            + mgpu.stream_barriers(4, stages),
            mgpu.stage(plan.interpret, (bk, bq), dt)]


# ----------------------------------------------------------------------------- public


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan, q, k, v, kv_len, q_seg, kv_seg):
    return _forward(plan, q, k, v, kv_len, q_seg, kv_seg)[0]


def _flash_fwd(plan, q, k, v, kv_len, q_seg, kv_seg):
    o, lse = _forward(plan, q, k, v, kv_len, q_seg, kv_seg)
    return o, (q, k, v, kv_len, q_seg, kv_seg, o, lse)


def _flash_bwd(plan, res, do):
    q, k, v, kv_len, q_seg, kv_seg, o, lse = res
    delta = jnp.einsum("bqhd,bqhd->bhq", o.astype(jnp.float32), do.astype(jnp.float32))
    args = (q, k, v, do, lse, delta, kv_len, q_seg, kv_seg)
    dq = _dq(plan, *args)
    dk, dv = _dkv(plan, *args)
    if plan.groups > 1:      # per query head -> per key/value head
        b, sk, hkv, d = k.shape
        dk, dv = (x.reshape(b, sk, hkv, plan.groups, d).astype(jnp.float32).sum(3)
                  .astype(k.dtype) for x in (dk, dv))
    return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _round_up(n, m):
    return -(-n // m) * m


def _check(q, k, v):
    if not mgpu.available():
        raise NotImplementedError(f"jax {jax.__version__} has no Mosaic GPU Pallas backend; "
                                  "use attention impl 'pallas', 'cudnn' or 'xla'.")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise NotImplementedError(
            f"mosaic_gpu attention takes bfloat16/float16 q, k, v of one dtype (Hopper "
            f"warpgroup MMAs; float32 would run as TF32); got {q.dtype}, {k.dtype}, {v.dtype}. "
            "Use a bf16/fp16 precision policy, or impl 'pallas' / 'xla' for float32.")


def mgpu_flash_attention(q, k, v, *, key_lengths=None, segment_ids=None, causal: bool = False,
                         scale: float | None = None, block_sizes: BlockSizes | None = None,
                         interpret: bool | None = None):
    """``attention_pallas.flash_attention``'s contract on Mosaic GPU (bf16/fp16 only).

    ``segment_ids``: None or a (q [B, Sq], kv [B, Sk]) int32 pair
    (``attention_reference.segments``); ``interpret``: run jax's Mosaic GPU interpreter; None: unless q, k, v live on a GPU."""
    _check(q, k, v)
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if interpret is None:
        interpret = registry.platform(q, k, v) != "gpu"
    if not interpret:
        mgpu.check_device()
    d_pad = _round_up(d, 64)
    bs = block_sizes or default_block_sizes(d_pad)
    sq_pad = _round_up(sq, math.lcm(WGS * bs.block_q, WGS * bs.block_q_dq, bs.block_q_dkv))
    sk_pad = _round_up(sk, math.lcm(bs.block_kv, bs.block_kv_dq, WGS * bs.block_kv_dkv))
    plan = _Plan(causal=causal, has_seg=segment_ids is not None, scale=scale,
                 groups=hq // hkv, blocks=bs, interpret=interpret)
    pad = lambda x, s: jnp.pad(x, ((0, 0), (0, s - x.shape[1]), (0, 0), (0, d_pad - d)))
    kv_len = (jnp.full((b,), sk, jnp.int32) if key_lengths is None
              else jnp.clip(jnp.asarray(key_lengths, jnp.int32), 0, sk))
    q_seg = kv_seg = None
    if segment_ids is not None:
        q_seg = jnp.pad(segment_ids[0], ((0, 0), (0, sq_pad - sq)))
        kv_seg = jnp.pad(segment_ids[1], ((0, 0), (0, sk_pad - sk)))
    o = _flash(plan, pad(q, sq_pad), pad(k, sk_pad), pad(v, sk_pad), kv_len, q_seg, kv_seg)
    return o[:, :sq, :, :d]
