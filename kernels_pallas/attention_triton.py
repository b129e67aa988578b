"""The Pallas flash-attention kernels' layout on GPU (Triton) and in the interpreter (CPU):
arrays, block specs and grids.

* q, k, v and the outputs as given, [B, S, H, D]; per-row statistics (lse, delta) as
  [B, H, S, 1], a [rows, 1] block per program;
* segment ids and key lengths as given, a block per program;
* dK/dV: a program per key block of a query head; for grouped-query attention the per-query-
  head gradients (float32) are summed over each group in XLA;
* on GPU the Triton launch takes ``BlockSizes.num_warps`` / ``num_stages``.

The kernel bodies are ``attention_blocks``'; ``attention_pallas`` calls them in this layout.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.attention_blocks import Plan, call, dkv_kernel, kv_head, seg_inputs


class SeqLayout:
    """Block specs for [B, S, H, D] tensors; the grid is (batch, query head, sequence block)."""

    def __init__(self, plan: Plan, head_dim: int):
        self.plan, self.d = plan, head_dim

    @staticmethod
    def arrange(x):
        """The caller's [B, S, H, D] is this layout."""
        return x

    @staticmethod
    def heads_seq(x):
        """(batch, heads, seq) of a tensor in this layout."""
        return x.shape[0], x.shape[2], x.shape[1]

    @staticmethod
    def by_head(x):
        """A per-row statistic reduced over D in this layout, [B, S, H], as [B, H, S]."""
        return x.transpose(0, 2, 1)

    def seq(self, rows, block_index, kv=False):
        """A [rows, D] window of a [B, S, H, D] tensor."""
        head = kv_head(self.plan, kv)
        return pl.BlockSpec((None, rows, None, self.d),
                            lambda b, h, n: (b, block_index(n), head(h), 0))

    def stats(self, rows, block_index):
        """A [rows, 1] block of ``stats_shape``."""
        return pl.BlockSpec((None, None, rows, 1), lambda b, h, n: (b, h, block_index(n), 0))

    def stats_shape(self, b, h, s):
        """The shape the kernels hold [B, H, S] statistics in (a free reshape)."""
        return (b, h, s, 1)

    def q_seg(self, rows, block_index):
        return pl.BlockSpec((None, rows), lambda b, h, n: (b, block_index(n)))

    def kv_seg(self, cols, block_index):
        return pl.BlockSpec((None, cols), lambda b, h, n: (b, block_index(n)))

    def kv_len(self):
        return pl.BlockSpec((1,), lambda b, h, n: (b,))

    def segments(self, q_seg, kv_seg):
        """Segment-id arrays in this layout's shapes: as given."""
        return q_seg, kv_seg

    def compiler_params(self, axes: int = 3):
        """Triton's launch parameters on GPU; none for the interpreter."""
        if self.plan.target != "gpu":
            return None
        from jax.experimental.pallas import triton as pltr
        return pltr.CompilerParams(num_warps=self.plan.blocks.num_warps,
                                   num_stages=self.plan.blocks.num_stages)

    def dkv(self, q, k, v, kv_len, segs, do, lse, delta):
        """dK, dV by key blocks, per query head; a group's summed after."""
        plan, g = self.plan, self.plan.groups
        b, hq, sq = self.heads_seq(q)
        _, hkv, sk = self.heads_seq(k)
        bk = plan.blocks.block_k_dkv
        seg_args, seg_specs = seg_inputs(plan, self, segs, self.q_seg(sq, lambda n: 0),
                                         self.kv_seg(bk, lambda n: n))
        kv_shape, kv_dtype = (b, sk, hq, self.d), (k.dtype if g == 1 else jnp.float32)
        rows, stats = self.seq(sq, lambda n: 0), self.stats(sq, lambda n: 0)
        lse, delta = (x.reshape(self.stats_shape(b, hq, sq)) for x in (lse, delta))
        kv_spec, out_spec = self.seq(bk, lambda n: n, kv=True), self.seq(bk, lambda n: n)
        dk, dv = call(
            dkv_kernel, plan, self, (b, hq, sk // bk),
            [self.kv_len(), rows, kv_spec, kv_spec, rows, stats, stats] + seg_specs,
            [out_spec] * 2, [jax.ShapeDtypeStruct(kv_shape, kv_dtype)] * 2,
            [kv_len, q, k, v, do, lse, delta] + seg_args, "flash_attention_dkv")
        if g > 1:
            dk, dv = (x.reshape(b, sk, hkv, g, self.d).sum(3).astype(k.dtype) for x in (dk, dv))
        return dk, dv
