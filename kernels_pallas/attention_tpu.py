"""The Pallas flash-attention kernels' layout on TPU (Mosaic): arrays, block specs and grids.

* q, k, v and the outputs as [B, H, S, D] (the last two block dims must tile (8, 128)); query
  blocks of at least 128 rows (``attention_blocks.MIN_BLOCK``);
* per-row statistics (lse, delta) lane-major in HBM ([B, H, 1, S], as splash attention's
  backward reads them; lane-replicated in the kernels' registers: a lane-replicated copy
  would cost a float32 [B, H, S, 128] write and two reads each);
* query segment ids replicated over 128 lanes, key segment ids over 8 sublanes, as in
  ``jax.experimental.pallas.ops.tpu.flash_attention``; the key lengths in SMEM;
* dK/dV: a program per key block of a key/value head runs the G query heads of its group
  one after another (the grid's last axis, "arbitrary") and sums their gradients in float32
  VMEM scratch.

The kernel bodies are ``attention_blocks``'; ``attention_pallas`` calls them in this layout.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.attention_blocks import (TPU_LANES, TPU_SUBLANES, Plan, call, dkv_kernel,
                                             kv_head, seg_inputs)


def _pltpu():
    """jax's Pallas TPU module, imported when a TPU kernel is built (a third of a second)."""
    from jax.experimental.pallas import tpu as pltpu
    return pltpu


class TpuLayout:
    """Block specs on TPU; the grid is (batch, query head, sequence block), and for dK/dV
    (batch, key/value head, key block, query head of its group)."""

    def __init__(self, plan: Plan, head_dim: int):
        self.plan, self.d = plan, head_dim

    @staticmethod
    def arrange(x):
        """[B, S, H, D] <-> [B, H, S, D] (its own inverse)."""
        return x.transpose(0, 2, 1, 3)

    @staticmethod
    def heads_seq(x):
        """(batch, heads, seq) of a tensor in this layout."""
        return x.shape[0], x.shape[1], x.shape[2]

    @staticmethod
    def by_head(x):
        """A per-row statistic reduced over D in this layout, as [B, H, S]."""
        return x

    def seq(self, rows, block_index, kv=False):
        """A [rows, D] window of a [B, H, S, D] tensor."""
        head = kv_head(self.plan, kv)
        return pl.BlockSpec((None, None, rows, self.d),
                            lambda b, h, n: (b, head(h), block_index(n), 0))

    def stats(self, rows, block_index):
        """A lane-major [1, rows] block (the rows along the lanes) of ``stats_shape``."""
        return pl.BlockSpec((None, None, 1, rows), lambda b, h, n: (b, h, 0, block_index(n)))

    def stats_shape(self, b, h, s):
        """The shape the kernels hold [B, H, S] statistics in (a free reshape)."""
        return (b, h, 1, s)

    def q_seg(self, rows, block_index):
        return pl.BlockSpec((None, rows, TPU_LANES), lambda b, h, n: (b, block_index(n), 0))

    def kv_seg(self, cols, block_index):
        return pl.BlockSpec((None, TPU_SUBLANES, cols), lambda b, h, n: (b, 0, block_index(n)))

    def kv_len(self):
        return pl.BlockSpec(memory_space=_pltpu().SMEM)

    def segments(self, q_seg, kv_seg):
        """Segment-id arrays in this layout's shapes."""
        b, sq = q_seg.shape
        sk = kv_seg.shape[1]
        return (jnp.broadcast_to(q_seg[:, :, None], (b, sq, TPU_LANES)),
                jnp.broadcast_to(kv_seg[:, None, :], (b, TPU_SUBLANES, sk)))

    def compiler_params(self, axes: int = 3):
        """A grid's axes past the third accumulate (``dkv_kernel``'s query-head group)."""
        return _pltpu().CompilerParams(
            dimension_semantics=("parallel",) * 3 + ("arbitrary",) * (axes - 3))

    def dkv(self, q, k, v, kv_len, segs, do, lse, delta):
        """dK, dV by key blocks: a program sums its key/value head's group of query heads."""
        plan, g = self.plan, self.plan.groups
        b, hq, sq = self.heads_seq(q)
        _, hkv, sk = self.heads_seq(k)
        bq, bk = plan.blocks.block_q_dkv, plan.blocks.block_k_dkv
        seg_args, seg_specs = seg_inputs(plan, self, segs, self.q_seg(sq, lambda n: 0),
                                         self.kv_seg(bk, lambda n: n))
        head = lambda spec, h_of: pl.BlockSpec(
            spec.block_shape, lambda b, h, n, i: spec.index_map(b, h_of(h, i), n))
        in_q = lambda h, i: h * g + i
        rows = head(self.seq(sq, lambda n: 0), in_q)
        stats = pl.BlockSpec((None, None, sq // bq, bq), lambda b, h, n, i: (b, in_q(h, i), 0, 0))
        kv_spec = head(self.seq(bk, lambda n: n), lambda h, i: h)
        seg_specs = [head(x, lambda h, i: h) for x in seg_specs]
        lse, delta = (x.reshape(b, hq, sq // bq, bq) for x in (lse, delta))
        return call(
            dkv_kernel, plan, self, (b, hkv, sk // bk, g),
            [self.kv_len(), rows, kv_spec, kv_spec, rows, stats, stats] + seg_specs,
            [kv_spec] * 2, [jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2,
            [kv_len, q, k, v, do, lse, delta] + seg_args, "flash_attention_dkv",
            [_pltpu().VMEM((bk, self.d), jnp.float32)] * 2)
