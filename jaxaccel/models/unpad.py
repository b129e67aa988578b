"""Unpadded tokens: the per-token layers of an encoder run on the real tokens of a padded batch
only, as "remove padding" in FasterTransformer / MosaicML's BERT does.

A classification batch [B, S] padded to a fixed length holds many padding positions (the RT
snippets padded to 64: 42% of the positions are real tokens). Everything but attention works
on one token at a time (embeddings, Q/K/V and output projections, MLP, LayerNorm, dropout), so
those layers can work on a compact [G, C] array of the real tokens instead: G groups of
contiguous rows (one per shard of the batch, so the compaction never moves a token between
devices) of C slots each. Attention scatters Q, K, V back to [B, S] and gathers its output.

The numbers are those of the padded model at every real token (a padded position never reaches
a real one: attention masks it as a key, pooling skips it); only summation orders change. C is
static (a compiled shape): a data pipeline that knows its batches gives the largest group of
real tokens any batch of a length has (``data.pipeline.BatchIterator.token_capacity``); a batch
with more real tokens than that is refused before it reaches the step
(``Capacity.check``), never truncated.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from jaxaccel.sharding import batch_split, entry_axes

# Unpadding is skipped for a length whose capacity is above this share of its positions: the
# scatters and gathers around attention then cost about what the padding saved.
MAX_SHARE = 0.9


@struct.dataclass
class Unpadded:
    """Where the real tokens of a [batch, seq] batch sit: ``index`` [G, C] int32, each slot's
    position among its group's ``batch // G * seq`` positions (ascending); an empty slot holds
    an out-of-range position (gathers read zeros there, scatters drop it)."""

    index: jax.Array
    batch: int = struct.field(pytree_node=False)
    seq: int = struct.field(pytree_node=False)

    @classmethod
    def of(cls, attention_mask: jax.Array, groups: int, capacity: int) -> "Unpadded":
        b, s = attention_mask.shape
        n = b // groups * s
        real = attention_mask.reshape(groups, n) != 0
        slots = jnp.arange(capacity, dtype=jnp.int32)

        def one(row):
            idx = jnp.flatnonzero(row, size=capacity, fill_value=0).astype(jnp.int32)
            return jnp.where(slots < jnp.sum(row), idx, n + slots)   # distinct, ascending

        return cls(jax.vmap(one)(real), b, s)

    @property
    def groups(self) -> int:
        return self.index.shape[0]

    @property
    def per_group(self) -> int:
        """Positions in one group: its rows times the sequence length."""
        return self.batch // self.groups * self.seq

    def gather(self, x: jax.Array) -> jax.Array:
        """[B, S, ...] -> [G, C, ...]: the real tokens (zeros in empty slots)."""
        flat = x.reshape(self.groups, -1, *x.shape[2:])
        take = lambda a, i: a.at[i].get(mode="fill", fill_value=0, indices_are_sorted=True,
                                        unique_indices=True)
        return _per_group(jax.vmap(take), flat, self.index)

    def scatter(self, y: jax.Array) -> jax.Array:
        """[G, C, ...] -> [B, S, ...]: the tokens back in place, zeros at padding."""
        put = lambda a, i: jnp.zeros((self.per_group, *a.shape[1:]), a.dtype).at[i].set(
            a, mode="drop", indices_are_sorted=True, unique_indices=True)
        out = _per_group(jax.vmap(put), y, self.index)
        return out.reshape(self.batch, self.seq, *y.shape[2:])

    def rows(self) -> jax.Array:
        """[G, C] int32: each slot's token's row-major number among the batch's B * S
        positions (what the dropout masks number rows by: a token drops the same features
        whether the batch is unpadded or not, and however it is grouped)."""
        return self.index + self.per_group * jnp.arange(self.groups, dtype=jnp.int32)[:, None]

    def positions(self) -> jax.Array:
        """[G, C] int32: each slot's position within its row (0 in empty slots)."""
        return jnp.where(self.index < self.per_group, self.index % self.seq, 0)


def _per_group(fn, x: jax.Array, index: jax.Array) -> jax.Array:
    """``fn(x, index)`` over [G, ...] arrays, each device on its own groups: manual over the
    mesh's batch axes (``jax.shard_map``), the other axes left to XLA (a tensor-parallel
    feature dimension stays split). XLA's partitioner cannot see that a group's indices point
    into its own rows: left to it, the batched gathers and scatters moved whole activations
    between devices (MiniLM-L6 at 64 x 128 on a 1x2x4 CPU mesh: 254 MB of all-to-alls per
    device and step, 0.60 GB of collectives in all; now 8 MB and 0.21 GB)."""
    mesh, axes = batch_split(x)
    if axes is None:
        return fn(x, index)
    spec = P(axes)
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec), out_specs=spec,
                         axis_names=set(entry_axes(axes)), check_vma=False)(x, index)


@dataclasses.dataclass(frozen=True)
class Capacity:
    """The unpadding plan of a run's batches: ``groups`` (shards of the batch rows) and, per
    global batch shape (rows, padded length), ``slots`` per group: at least the real tokens of
    any group of any batch of that shape. A shape absent from ``slots`` runs padded."""

    groups: int
    slots: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, groups: int, largest: dict) -> "Capacity":
        """From ``largest`` ((rows, length) -> the most real tokens in one group of a batch of
        that shape): slots rounded up to a multiple of 8; shapes where that would still fill
        more than ``MAX_SHARE`` of the group's positions are left to run padded."""
        slots = {}
        for (rows, length), most in largest.items():
            c = -(-max(int(most), 1) // 8) * 8
            if c <= MAX_SHARE * (rows // groups) * length:
                slots[(int(rows), int(length))] = c
        return cls(groups, slots)

    def tokens(self, attention_mask: jax.Array) -> Unpadded | None:
        """The ``Unpadded`` of a global batch (traced), or None where its shape runs padded."""
        c = self.slots.get(tuple(attention_mask.shape))
        return None if c is None else Unpadded.of(attention_mask, self.groups, c)

    def check(self, attention_mask: np.ndarray, processes: int = 1) -> None:
        """Refuse a batch (this process's rows, numpy) with more real tokens in a group than
        its shape's slots: the step would otherwise lose tokens."""
        b, s = attention_mask.shape
        c = self.slots.get((b * processes, s))
        if c is None:
            return
        local_groups = max(self.groups // processes, 1)
        most = int((np.asarray(attention_mask) != 0).reshape(local_groups, -1).sum(1).max())
        if most > c:
            raise ValueError(
                f"a batch of {b * processes} x {s} has {most} real tokens in one of its "
                f"{self.groups} row groups, more than the {c} slots planned for that shape; "
                "the run's unpadding plan was made for other batches (rebuild the run from "
                "its data, or set train.unpad=false).")


__all__ = ["Capacity", "MAX_SHARE", "Unpadded"]
