"""The flat multi-tensor layout: many parameter-shaped tensors packed into a few [rows, 128]
buffers, per device, and the mesh-independent form checkpoints hold.

A ``Layout`` says where every leaf of a parameter tree lives: float, non-empty leaves are
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

Two kinds of node keep buffers in a layout: optimizer states (``AdanState`` with a layout) and
``FlatParams`` (the parameters themselves, for the one-pass trainer). Both are ``FlatNode``s,
and this module's public interface works on any pytree containing them:

* ``portable(tree)``: every flat node in its per-parameter form (optimizer moments as trees
  like the parameters, flat parameters as the parameter tree), which no mesh, device count or
  implementation shapes: what checkpoints hold.
* ``restore(saved, like)``: the inverse, into the layouts of ``like`` (any mesh).
* ``portable_shardings(like, shardings)``: where the portable form of ``like`` lives (like the
  parameters), to restore a checkpoint straight onto the mesh.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxaccel.sharding import current_mesh, drop_trivial, entry_axes, per_shard
from kernels_pallas.adan import LANES, ROW_ALIGN


@dataclasses.dataclass(frozen=True)
class Group:
    decay: bool
    dtype: str             # the leaves' dtype (the flat parameter buffer's dtype)
    leaves: tuple          # leaf indices
    offsets: tuple         # start of each leaf in a device's flat buffer
    rows: int              # rows of one device's flat buffer (before a ZeRO-1 split)


@dataclasses.dataclass(frozen=True)
class Layout:
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
    axis_sizes: tuple = ()  # ((mesh axis, size), ...) of the mesh the layout is for
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
        """``mesh`` (a Mesh or AbstractMesh) must be the one this layout is for."""
        if mesh is None:
            raise ValueError(f"flat layout: split over {self.shard_axes + self.zero_axes} of "
                             f"a mesh {dict(self.axis_sizes)}, but no mesh is set and the "
                             "arrays are not placed on one; call inside jax.set_mesh(mesh) "
                             "or place the arrays on the mesh first.")
        got = tuple((a, mesh.shape.get(a)) for a, _ in self.axis_sizes)
        if got != self.axis_sizes:
            raise ValueError(f"flat layout: made for a mesh {dict(self.axis_sizes)}, used on "
                             f"{dict(mesh.shape)}; build the layout (optimizer) for this mesh.")

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
        arguments are placed on), or on the whole arrays if the layout is not sharded."""
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


def make_layout(leaves, treedef, decay_flags, dtype, shardings=None, zero_axes=()) -> Layout:
    """The flat layout of ``leaves`` with state dtype ``dtype``; per device when ``shardings``
    (a tree of ``NamedSharding`` like the parameters) is given."""
    shapes = tuple(tuple(int(d) for d in x.shape) for x in leaves)
    flags = tuple(is_float(x) for x in leaves)
    dtypes = tuple(jnp.dtype(x.dtype).name for x in leaves)
    dtype = jnp.dtype(dtype).name
    if shardings is None:
        if zero_axes:
            raise ValueError(f"flat layout: zero_axes={zero_axes} needs the parameters' "
                             "shardings.")
        return Layout(treedef, shapes, flags, _groups(shapes, dtypes, flags, decay_flags,
                                                      ROW_ALIGN), dtype,
                      tuple(P() for _ in shapes))
    given = treedef.flatten_up_to(shardings)
    bad = [s for s, f in zip(given, flags) if f and not isinstance(s, NamedSharding)]
    if bad:
        raise ValueError(f"flat layout: shardings must be NamedShardings like the parameters; "
                         f"got {bad[0]!r}.")
    meshes = {s.mesh for s, f in zip(given, flags) if f}
    if len(meshes) > 1:
        raise ValueError("flat layout: the parameters' shardings name different meshes; use "
                         "one.")
    if not meshes:
        return make_layout(leaves, treedef, decay_flags, dtype)
    mesh = meshes.pop()
    unknown = [a for a in zero_axes if a not in mesh.axis_names]
    if unknown:
        raise ValueError(f"flat layout: zero_axes {unknown} are not axes of the mesh "
                         f"{mesh.axis_names}.")
    specs = []
    for s, shape in zip(given, shapes):
        if not isinstance(s, NamedSharding):
            specs.append(P())
            continue
        entries = [drop_trivial(e, mesh) for e in s.spec]
        specs.append(P(*entries))
        for d, e in zip(shape, entries):
            k = math.prod(mesh.shape[a] for a in entry_axes(e))
            if d % k:
                raise ValueError(f"flat layout: a parameter of shape {shape} is sharded "
                                 f"{s.spec}, which splits its dimension {d} into {k} uneven "
                                 "parts; the multi-tensor impls need even shards "
                                 "(impl='reference' does not).")
    used = {a for spec in specs for e in spec for a in entry_axes(e)}
    shard_axes = tuple(a for a in mesh.axis_names if a in used)
    zero = tuple(a for a in mesh.axis_names
                 if a in zero_axes and a not in used and mesh.shape[a] > 1)
    layout = Layout(treedef, shapes, flags, (), dtype, tuple(specs), tuple(mesh.shape.items()),
                    shard_axes, zero)
    local = tuple(layout.local_shape(i) for i in range(len(shapes)))
    return dataclasses.replace(layout, groups=_groups(local, dtypes, flags, decay_flags,
                                                      ROW_ALIGN * layout.zero_size))


def pack(leaves, group: Group, dtype):
    """Leaves (indexable by leaf index) of ``group`` into one [rows, 128] buffer."""
    flat = jnp.concatenate([leaves[i].reshape(-1).astype(dtype) for i in group.leaves])
    return jnp.pad(flat, (0, group.rows * LANES - flat.shape[0])).reshape(group.rows, LANES)


def unpack(flat, group: Group, layout: Layout) -> dict:
    """Inverse of ``pack``: leaf index -> this device's tensor (slices and reshapes).

    Each leaf is cut from its own rows of the [rows, 128] buffer before any reshape: cut from
    the buffer flattened whole, XLA folds the slice into a reshape of the *whole* buffer to the
    leaf's minor dimension (e.g. [6881280, 2] for a (768, 2) classifier), which the TPU lays out
    padded to 128 lanes (64x the buffer: 3.5 GB per chip of temporaries for BERT-base)."""
    out = {}
    for i, off in zip(group.leaves, group.offsets):
        shape = layout.local_shape(i)
        n = math.prod(shape)
        first, end = off // LANES, -(-(off + n) // LANES)
        rows = flat[first:end].reshape(-1)
        start = off - first * LANES
        out[i] = rows[start:start + n].reshape(shape)
    return out


def zero_buffers(layout: Layout) -> tuple:
    """Zeroed state buffers, one per group (placed by the caller: ``buffer_spec``)."""
    return tuple(jnp.zeros((layout.global_rows(g), LANES), layout.dtype) for g in layout.groups)


def _unpack_all(layout: Layout, buffers, *, state: bool) -> dict:
    """Leaf index -> tensor (sharded like the parameter) for every packed leaf. ``state``: the
    buffers are state buffers (ZeRO-1 split, dtype ``layout.dtype``), else parameter buffers."""
    def local(buffers):
        out = {}
        for k, group in enumerate(layout.groups):
            out.update(unpack(layout.all_rows(buffers[k]) if state else buffers[k], group,
                              layout))
        return out
    return layout.per_device(local, in_specs=(layout.buffer_specs if state else
                                              layout.param_specs,),
                             out_specs=layout.leaf_specs(layout.packed))(buffers)


def _pack_all(layout: Layout, leaves: dict, *, state: bool) -> tuple:
    """Inverse of ``_unpack_all``: the packed leaves (index -> tensor) into flat buffers."""
    def local(d):
        if state:
            return tuple(layout.own_rows(pack(d, g, layout.dtype)) for g in layout.groups)
        return tuple(pack(d, g, g.dtype) for g in layout.groups)
    return layout.per_device(local, in_specs=(layout.leaf_specs(layout.packed),),
                             out_specs=layout.buffer_specs if state else layout.param_specs)(
        {i: leaves[i] for i in layout.packed})


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _param_leaves(layout: Layout, buffers) -> dict:
    """``_unpack_all`` of parameter buffers, differentiable: the gradient w.r.t. the buffers
    is the leaves' gradients packed per device (each device's copy of a leaf replicated over
    its axes gets the whole gradient; autodiff through ``shard_map`` would split it)."""
    return _unpack_all(layout, buffers, state=False)


def _param_leaves_fwd(layout, buffers):
    return _unpack_all(layout, buffers, state=False), None


def _param_leaves_bwd(layout, _, cts):
    return (_pack_all(layout, cts, state=False),)


_param_leaves.defvjp(_param_leaves_fwd, _param_leaves_bwd)


def to_per_leaf(layout: Layout, buffers):
    """One state's flat buffers as a tree like the parameters (sharded like them); leaves not
    packed (not float) come back as zeros."""
    got = _unpack_all(layout, buffers, state=True)
    leaves = [got[i] if i in got else
              jnp.zeros(layout.shapes[i] if layout.is_float[i] else (), layout.dtype)
              for i in range(len(layout.shapes))]
    return layout.treedef.unflatten(leaves)


def from_per_leaf(layout: Layout, tree) -> tuple:
    """Inverse of ``to_per_leaf``: a parameter-like tree into the layout's state buffers."""
    return _pack_all(layout, dict(enumerate(layout.treedef.flatten_up_to(tree))), state=True)


class FlatNode:
    """A pytree node some fields of which are flat buffers in ``self.layout`` (``None``: in
    the per-parameter form already). Subclasses say how to convert."""

    layout: Layout | None

    def portable(self):
        """This node in its per-parameter form."""
        raise NotImplementedError

    def from_portable(self, saved):
        """``saved`` (this node's per-parameter form) in ``self.layout``."""
        raise NotImplementedError

    def portable_shardings(self, shardings):
        """The shardings of ``self.portable()``, given this node's own ``shardings``."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, eq=False)
class FlatParams(FlatNode):
    """Parameters living permanently in flat buffers: ``buffers`` (one per group, the group's
    dtype, split over ``layout.param_spec``) and ``rest`` (the leaves not packed, in index
    order). ``view()`` is the parameter tree the model reads: slices and reshapes of the
    buffers, which XLA turns into bitcasts and slices inside a jitted step; a gradient taken
    w.r.t. ``buffers`` through it arrives flat."""

    buffers: tuple
    rest: tuple
    layout: Layout | None = None

    @classmethod
    def create(cls, layout: Layout, params) -> "FlatParams":
        leaves = dict(enumerate(layout.treedef.flatten_up_to(params)))
        packed = set(layout.packed)
        return cls(_pack_all(layout, leaves, state=False),
                   tuple(x for i, x in leaves.items() if i not in packed), layout)

    def view(self):
        got = _param_leaves(self.layout, self.buffers)
        rest = iter(self.rest)
        return self.layout.treedef.unflatten(
            [got[i] if i in got else next(rest) for i in range(len(self.layout.shapes))])

    def portable(self):
        return _view(self)

    def from_portable(self, saved):
        return _flat_params(self.layout, restore_leaves(self.layout, saved))

    def portable_shardings(self, shardings):
        packed = set(self.layout.packed)
        rest = iter(shardings.rest)
        mesh = jax.tree_util.tree_leaves(shardings)[0].mesh
        return self.layout.treedef.unflatten(
            [s if i in packed else next(rest)
             for i, s in enumerate(self.layout.leaf_shardings(mesh))])

    def shardings(self, mesh) -> "FlatParams":
        """Where the buffers live on ``mesh`` (and the unpacked leaves: like the parameters)."""
        packed = set(self.layout.packed)
        return FlatParams(tuple(NamedSharding(mesh, self.layout.param_spec)
                                for _ in self.layout.groups),
                          tuple(s for i, s in enumerate(self.layout.leaf_shardings(mesh))
                                if i not in packed), self.layout)


jax.tree_util.register_dataclass(FlatParams, data_fields=["buffers", "rest"],
                                 meta_fields=["layout"])


@jax.jit
def _view(params: FlatParams):
    return params.view()


@functools.partial(jax.jit, static_argnums=0)
def _flat_params(layout: Layout, tree) -> FlatParams:
    return FlatParams.create(layout, tree)


def is_flat(x) -> bool:
    return isinstance(x, FlatNode) and x.layout is not None


def portable(tree):
    """``tree`` with every flat node in it in its per-parameter form (anything else as it is,
    without a copy). A node's form may hold flat nodes of another kind (flat buffers of a
    pipeline's staged parameters): those are converted in turn."""
    return jax.tree_util.tree_map(lambda x: portable(x.portable()) if is_flat(x) else x, tree,
                                  is_leaf=is_flat)


def restore(saved, like):
    """Inverse of ``portable``: ``saved`` with the flat nodes of ``like`` (a tree of the same
    kind, or its ``jax.eval_shape``) restored into their layouts, which may be on another mesh
    than the one ``saved`` came from."""
    return jax.tree_util.tree_map(lambda t, s: t.from_portable(s) if is_flat(t) else s,
                                  like, saved, is_leaf=is_flat)


def restore_leaves(layout: Layout, saved):
    """``saved``, the portable form of a tree of ``layout``'s structure, in that structure:
    the flat nodes its treedef holds (a pipeline's ``StagedParams``) restored in turn."""
    return restore(saved, layout.treedef.unflatten([0] * len(layout.shapes)))


def portable_shardings(like, shardings):
    """The shardings of ``portable(like)``, given ``like``'s own ``shardings``: the flat
    nodes' per-parameter forms sharded like the parameters, the rest as given."""
    def one(node, given):
        if not is_flat(node):
            return given
        inner = node.portable_shardings(given)
        return portable_shardings(inner, inner)
    return jax.tree_util.tree_map(one, like, shardings, is_leaf=is_flat)
