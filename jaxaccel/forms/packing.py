"""The flat packing: many parameter-shaped tensors laid into a few [rows, 128] buffers per
device (the multi-tensor arrangement of the fused Adan kernel; the flat forms of
``jaxaccel.forms.flat`` hold such buffers).

A ``Packing`` says where every leaf of a parameter tree lives: float, non-empty leaves are
grouped by (weight decay or not, dtype) and each group is laid end to end in one flat buffer of
``rows x 128`` elements (``rows`` a multiple of ``ROW_ALIGN``; the tail is zero padding), like
``optax.flatten`` but with one buffer per group, lane-dense for the fused kernel.

Sharded parameters: packing sharded leaves into one global buffer would make XLA gather every
parameter onto every device. Instead each device packs the shards *it holds* into buffers of
its own and everything runs per device under ``shard_map``. The global buffer of a group is the
devices' buffers side by side, split over the mesh axes the parameters use (``shard_axes``;
FSDP: ``fsdp``, Megatron: ``tensor``). ``zero_axes`` (ZeRO-1) splits the *state* buffers of
each device further over mesh axes the parameters are replicated on (the batch axes): a device
keeps ``rows / zero`` rows of each (``own_rows``) and gathers the others back (``all_rows``).
Where the parameters live is the caller's to say (``Packer``: their shardings and the ZeRO-1
axes); an optimizer that keeps its state flat is handed a ``Packer`` and asks it for the
``Packing`` of its tree.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxaccel.sharding import current_mesh, drop_trivial, entry_axes, per_shard, width_shards
from kernels_pallas.adan_reference import LANES, ROW_ALIGN


@dataclasses.dataclass(frozen=True)
class Group:
    decay: bool
    dtype: str             # the leaves' dtype (the flat parameter buffer's dtype)
    leaves: tuple          # leaf indices
    offsets: tuple         # start of each leaf in a device's flat buffer
    rows: int              # rows of one device's flat buffer (before a ZeRO-1 split)


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where each leaf lives in the flat buffers. Static (hashable) data of the pytree
    structure of the nodes holding the buffers: jit specialises on it, it travels with them.

    It holds no mesh, only the axis sizes it was laid out for (``axis_sizes``); the per-device
    code runs over the mesh the buffers are placed on (``sharding.per_shard``), and anything
    that places buffers is given the mesh."""

    treedef: Any
    shapes: tuple          # global shape of every leaf
    is_float: tuple        # which leaves are packed (float; empty ones have no rows)
    groups: tuple          # Group, decayed first
    dtype: str             # state dtype
    specs: tuple           # every leaf's PartitionSpec (size-1 mesh axes dropped)
    axis_sizes: tuple = ()  # ((mesh axis, size), ...) of the mesh the packing is for
    shard_axes: tuple = ()  # mesh axes the parameters are split over
    zero_axes: tuple = ()   # mesh axes each device's state rows are split over (ZeRO-1)

    @property
    def sharded(self) -> bool:
        return bool(self.shard_axes or self.zero_axes)

    @property
    def packed(self) -> list:
        """Indices of the leaves in the buffers, in buffer order."""
        return [i for g in self.groups for i in g.leaves]

    def _size(self, axes) -> int:
        sizes = dict(self.axis_sizes)
        return math.prod(sizes[a] for a in axes)

    @property
    def zero_size(self) -> int:
        return self._size(self.zero_axes)

    def local_shape(self, i: int) -> tuple:
        spec = tuple(self.specs[i]) + (None,) * (len(self.shapes[i]) - len(self.specs[i]))
        return tuple(d // self._size(entry_axes(e)) for d, e in zip(self.shapes[i], spec))

    def _axes(self, names) -> tuple:
        return tuple(a for a, _ in self.axis_sizes if a in names)

    @property
    def buffer_spec(self) -> P:
        """State buffers: split over the parameters' axes and the ZeRO-1 axes."""
        axes = self._axes(self.shard_axes + self.zero_axes)
        return P(axes) if axes else P()

    @property
    def param_spec(self) -> P:
        """Flat parameter buffers: split over the parameters' axes only."""
        axes = self._axes(self.shard_axes)
        return P(axes) if axes else P()

    def _blocks(self, spec: P) -> int:
        return self._size(entry_axes(spec[0])) if spec else 1

    def global_rows(self, group: Group) -> int:
        """Rows of a global state buffer: one ``rows / zero`` block per device block."""
        return self._blocks(self.buffer_spec) * group.rows // self.zero_size

    def param_rows(self, group: Group) -> int:
        return self._blocks(self.param_spec) * group.rows

    def check_mesh(self, mesh) -> None:
        """``mesh`` (a Mesh or AbstractMesh) must be the one this packing is for."""
        if mesh is None:
            raise ValueError(f"flat packing: split over {self.shard_axes + self.zero_axes} of "
                             f"a mesh {dict(self.axis_sizes)}, but no mesh is set and the "
                             "arrays are not placed on one; call inside jax.set_mesh(mesh) "
                             "or place the arrays on the mesh first.")
        got = tuple((a, mesh.shape.get(a)) for a, _ in self.axis_sizes)
        if got != self.axis_sizes:
            raise ValueError(f"flat packing: made for a mesh {dict(self.axis_sizes)}, used on "
                             f"{dict(mesh.shape)}; build the packing (optimizer) for this mesh.")

    def leaf_shardings(self, mesh) -> tuple:
        """Every leaf's ``NamedSharding`` on ``mesh`` (the parameters' own)."""
        if self.axis_sizes:
            self.check_mesh(mesh)
        return tuple(NamedSharding(mesh, s) for s in self.specs)

    def own_rows(self, flat):
        """A device's slice of its full [rows, 128] buffer (all of it without ZeRO-1)."""
        if not self.zero_axes:
            return flat
        n = flat.shape[0] // self.zero_size
        return jax.lax.dynamic_slice_in_dim(flat, jax.lax.axis_index(self.zero_axes) * n, n)

    def all_rows(self, block):
        """Inverse of ``own_rows``: the full buffer from every device's slice."""
        if not self.zero_axes:
            return block
        return jax.lax.all_gather(block, self.zero_axes, axis=0, tiled=True)

    def per_device(self, fn, in_specs, out_specs):
        """``fn`` on each device's shards (``sharding.per_shard`` over the mesh set or the
        arguments are placed on), or on the whole arrays if the packing is not sharded."""
        if not self.sharded:
            return fn

        def call(*args):
            mesh = current_mesh(*args)
            self.check_mesh(mesh)
            return per_shard(fn, in_specs, out_specs, mesh=mesh)(*args)
        return call

    def copies(self, i: int) -> int:
        """How many devices of the shard axes hold the same copy of leaf ``i`` (1 for a leaf
        split over all of them)."""
        used = {a for e in self.specs[i] for a in entry_axes(e)}
        return self._size(tuple(a for a in self.shard_axes if a not in used))

    def global_norm(self, buffers) -> jax.Array:
        """The float32 global norm of the parameter-shaped flat ``buffers`` (a gradient, placed
        as ``param_spec``): ``optim.clip.global_norm`` of the tree they hold. Each device's
        buffer holds its shard of every leaf, and a whole copy of a leaf replicated over some
        shard axes (a bias FSDP keeps whole, a pipeline's embeddings on every stage), so the
        devices' sums of squares are added up with each such copy weighted 1 / copies."""
        copies = {i: self.copies(i) for g in self.groups for i in g.leaves}

        def local(bufs):
            total = jnp.float32(0.0)
            for k, group in enumerate(self.groups):
                g = bufs[k].astype(jnp.float32)
                total += jnp.sum(jnp.square(g))
                if any(copies[i] > 1 for i in group.leaves):
                    for i, leaf in unpack(g, group, self).items():
                        if copies[i] > 1:
                            total -= (1 - 1 / copies[i]) * jnp.sum(jnp.square(leaf))
            return jax.lax.psum(total, self.shard_axes) if self.shard_axes else total
        return jnp.sqrt(self.per_device(local, in_specs=(self.param_specs,),
                                        out_specs=P())(tuple(buffers)))

    def leaf_specs(self, indices) -> dict:
        return {i: self.specs[i] for i in indices}

    @property
    def buffer_specs(self) -> tuple:
        return tuple(self.buffer_spec for _ in self.groups)

    @property
    def param_specs(self) -> tuple:
        return tuple(self.param_spec for _ in self.groups)


def is_float(x) -> bool:
    return jnp.issubdtype(x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype,
                          jnp.floating)


def _groups(shapes, dtypes, flags, decay_flags, align_rows: int) -> tuple[Group, ...]:
    """Float, non-empty leaves, grouped by (weight decay, dtype), decayed first."""
    keys = sorted({(bool(decay_flags[i]), dtypes[i]) for i, f in enumerate(flags)
                   if f and math.prod(shapes[i]) > 0}, key=lambda k: (not k[0], k[1]))
    groups = []
    for decay, dtype in keys:
        idx = [i for i, shape in enumerate(shapes) if flags[i] and math.prod(shape) > 0
               and bool(decay_flags[i]) == decay and dtypes[i] == dtype]
        sizes = [math.prod(shapes[i]) for i in idx]
        offsets = tuple(int(o) for o in np.cumsum([0] + sizes[:-1]))
        chunk = align_rows * LANES
        groups.append(Group(decay, dtype, tuple(idx), offsets,
                            -(-sum(sizes) // chunk) * align_rows))
    return tuple(groups)


@dataclasses.dataclass(frozen=True, eq=False)
class Packer:
    """How the leaves of a parameter tree are packed per device: ``shardings``, the
    parameters' ``NamedSharding``s (a tree like them; None: unsharded, one buffer set for the
    whole tree), and ``zero_axes`` (ZeRO-1: mesh axes each device's state rows are split
    over, the parameters replicated over them, e.g. the batch axes ``("data", "fsdp")``)."""

    shardings: Any = None
    zero_axes: tuple = ()

    def __post_init__(self):
        if self.shardings is None and self.zero_axes:
            raise ValueError(f"flat packing: zero_axes={self.zero_axes} needs the parameters' "
                             "shardings.")

    def packing(self, tree, decay_flags, dtype) -> Packing:
        """The packing of ``tree``'s leaves (``decay_flags`` one bool per leaf) with state
        dtype ``dtype``."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        shapes = tuple(tuple(int(d) for d in x.shape) for x in leaves)
        flags = tuple(is_float(x) for x in leaves)
        dtypes = tuple(jnp.dtype(x.dtype).name for x in leaves)
        dtype = jnp.dtype(dtype).name
        unsharded = Packing(treedef, shapes, flags, _groups(shapes, dtypes, flags, decay_flags,
                                                            ROW_ALIGN), dtype,
                            tuple(P() for _ in shapes))
        if self.shardings is None:
            return unsharded
        given = treedef.flatten_up_to(self.shardings)
        bad = [s for s, f in zip(given, flags) if f and not isinstance(s, NamedSharding)]
        if bad:
            raise ValueError(f"flat packing: shardings must be NamedShardings like the "
                             f"parameters; got {bad[0]!r}.")
        meshes = {s.mesh for s, f in zip(given, flags) if f}
        if len(meshes) > 1:
            raise ValueError("flat packing: the parameters' shardings name different meshes; "
                             "use one.")
        if not meshes:
            return unsharded
        mesh = meshes.pop()
        specs = _specs(given, shapes, mesh, self.zero_axes)
        used = {a for spec in specs for e in spec for a in entry_axes(e)}
        zero = tuple(a for a in mesh.axis_names
                     if a in self.zero_axes and a not in used and mesh.shape[a] > 1)
        packing = Packing(treedef, shapes, flags, (), dtype, specs, tuple(mesh.shape.items()),
                          tuple(a for a in mesh.axis_names if a in used), zero)
        local = tuple(packing.local_shape(i) for i in range(len(shapes)))
        return dataclasses.replace(packing, groups=_groups(local, dtypes, flags, decay_flags,
                                                           ROW_ALIGN * packing.zero_size))


def _specs(given, shapes, mesh, zero_axes) -> tuple:
    """Every leaf's PartitionSpec on ``mesh`` (size-1 axes dropped), checked: the leaves split
    evenly, the ZeRO-1 axes are the mesh's."""
    unknown = [a for a in zero_axes if a not in mesh.axis_names]
    if unknown:
        raise ValueError(f"flat packing: zero_axes {unknown} are not axes of the mesh "
                         f"{mesh.axis_names}.")
    specs = []
    for s, shape in zip(given, shapes):
        if not isinstance(s, NamedSharding):
            specs.append(P())
            continue
        entries = [drop_trivial(e, mesh) for e in s.spec]
        specs.append(P(*entries))
        for d, e in zip(shape, entries):
            k = width_shards(mesh, e)
            if d % k:
                raise ValueError(f"flat packing: a parameter of shape {shape} is sharded "
                                 f"{s.spec}, which splits its dimension {d} into {k} uneven "
                                 "parts; the multi-tensor impls need even shards "
                                 "(impl='per_leaf' does not).")
    return tuple(specs)


def pack(leaves, group: Group, dtype):
    """Leaves (indexable by leaf index) of ``group`` into one [rows, 128] buffer."""
    flat = jnp.concatenate([leaves[i].reshape(-1).astype(dtype) for i in group.leaves])
    return jnp.pad(flat, (0, group.rows * LANES - flat.shape[0])).reshape(group.rows, LANES)


def unpack(flat, group: Group, packing: Packing) -> dict:
    """Inverse of ``pack``: leaf index -> this device's tensor (slices and reshapes).

    Each leaf is cut from its own rows of the [rows, 128] buffer before any reshape: cut from
    the buffer flattened whole, XLA folds the slice into a reshape of the *whole* buffer to the
    leaf's minor dimension (e.g. [6881280, 2] for a (768, 2) classifier), which the TPU lays out
    padded to 128 lanes (64x the buffer: 3.5 GB per chip of temporaries for BERT-base)."""
    out = {}
    for i, off in zip(group.leaves, group.offsets):
        shape = packing.local_shape(i)
        n = math.prod(shape)
        first, end = off // LANES, -(-(off + n) // LANES)
        rows = flat[first:end].reshape(-1)
        start = off - first * LANES
        out[i] = rows[start:start + n].reshape(shape)
    return out


def unpack_all(packing: Packing, buffers, *, state: bool) -> dict:
    """Leaf index -> tensor (sharded like the parameter) for every packed leaf. ``state``: the
    buffers are state buffers (ZeRO-1 split, dtype ``packing.dtype``), else parameter buffers."""
    def local(buffers):
        out = {}
        for k, group in enumerate(packing.groups):
            out.update(unpack(packing.all_rows(buffers[k]) if state else buffers[k], group,
                              packing))
        return out
    return packing.per_device(local, in_specs=(packing.buffer_specs if state else
                                              packing.param_specs,),
                             out_specs=packing.leaf_specs(packing.packed))(buffers)


def pack_all(packing: Packing, leaves: dict, *, state: bool) -> tuple:
    """Inverse of ``unpack_all``: the packed leaves (index -> tensor) into flat buffers."""
    def local(d):
        if state:
            return tuple(packing.own_rows(pack(d, g, packing.dtype)) for g in packing.groups)
        return tuple(pack(d, g, g.dtype) for g in packing.groups)
    return packing.per_device(local, in_specs=(packing.leaf_specs(packing.packed),),
                             out_specs=packing.buffer_specs if state else packing.param_specs)(
        {i: leaves[i] for i in packing.packed})


__all__ = ["Group", "Packer", "Packing", "is_float", "pack", "pack_all", "unpack", "unpack_all"]
