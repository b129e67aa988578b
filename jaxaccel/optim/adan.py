"""Adan (Xie et al., 2022) as an optax transform, following the official PyTorch code.

The rule (official sail-sg/Adan ``adan.py``; betas are the code's), per step t = 1, 2, ...:

    clip = min(max_grad_norm / (||grads||_2 + eps), 1) if max_grad_norm > 0 else 1
    g = clip * grad;  d = g - prev (0 at t = 1);  prev <- g
    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) d;  n = b3 n + (1 - b3) (g + b2 d)^2
    den  = sqrt(n) / sqrt(1 - b3^t) + eps
    step = lr / (1 - b1^t) m / den + lr b2 / (1 - b2^t) v / den
    no_prox: p <- p (1 - lr wd) - step;   else: p <- (p - step) / (1 + lr wd)

``optax.adan`` differs: it scales the gradient difference of the n-update by (1 - b2) where the
official code uses b2, so the two give different trajectories (tests/test_adan.py shows it).

Implementations (``impl``), all computing the same numbers:

* ``"reference"``: per-leaf jnp math (the unfused, single-tensor baseline).
* ``"xla"``: multi-tensor: every float leaf packed into one flat [rows, 128] buffer per group
  (decayed / not decayed), the update left to XLA to fuse.
* ``"pallas"``: the same flat buffers through the fused kernel in ``kernels_pallas/adan.py``
  (interpret mode on CPU).
* ``"auto"``: pallas on GPU/TPU, xla on CPU.

Layout: in the multi-tensor impls the optimizer state (m, v, n, prev) lives *flat*
permanently, so a step packs only the gradients (and the parameters, only when weight decay is
on) and unpacks the updates: 2 or 3 copies of the model's size per step, none of the state.

Sharded parameters (``shardings``): packing sharded leaves into one global buffer would make
XLA gather every parameter and gradient onto every device. Instead each device packs the
shards *it holds* into flat buffers of its own, and the update runs per device under
``shard_map``; nothing is gathered. The global state buffer of a group is the devices' buffers
side by side, split over the mesh axes the parameters use (FSDP: ``fsdp``, Megatron: ``tensor``).
``zero_axes`` (ZeRO-1) splits each device's buffer further over mesh axes the parameters are
replicated on (the batch axes): each device updates its slice of the rows and the updates are
all-gathered over those axes. The layout is static data of the state (``AdanState.layout``).
It depends on the mesh, so checkpoints hold the per-parameter form instead:
``portable_state`` converts to it and ``restore_layout`` back, onto any mesh.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxaccel.sharding import drop_trivial, entry_axes
from kernels_pallas import _backend
from kernels_pallas.adan import LANES, ROW_ALIGN, adan_reference, adan_update, make_scalars

IMPLS = ("auto", "reference", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class _Group:
    decay: bool
    leaves: tuple          # leaf indices
    offsets: tuple         # start of each leaf in a device's flat buffer
    rows: int              # rows of one device's flat buffer (before a ZeRO-1 split)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each parameter's state lives in the flat buffers. Static (hashable) data of the
    state's pytree structure: jit specialises on it, and it travels with the state."""

    treedef: Any
    shapes: tuple          # global shape of every leaf
    is_float: tuple        # which leaves have state
    groups: tuple          # _Group, decayed first
    dtype: str             # state dtype
    specs: tuple           # every leaf's PartitionSpec (size-1 mesh axes dropped)
    mesh: Mesh | None = None
    shard_axes: tuple = ()  # mesh axes the parameters are split over
    zero_axes: tuple = ()   # mesh axes each device's rows are split over (ZeRO-1)

    @property
    def sharded(self) -> bool:
        return bool(self.shard_axes or self.zero_axes)

    @property
    def packed(self) -> list:
        """Indices of the leaves in the buffers, in buffer order."""
        return [i for g in self.groups for i in g.leaves]

    @property
    def zero_size(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.zero_axes) if self.zero_axes else 1

    def local_shape(self, i: int) -> tuple:
        if self.mesh is None:
            return self.shapes[i]
        spec = tuple(self.specs[i]) + (None,) * (len(self.shapes[i]) - len(self.specs[i]))
        return tuple(d // math.prod(self.mesh.shape[a] for a in entry_axes(e))
                     for d, e in zip(self.shapes[i], spec))

    @property
    def buffer_axes(self) -> tuple:
        return tuple(a for a in self.mesh.axis_names if a in self.shard_axes + self.zero_axes)

    @property
    def buffer_spec(self) -> P:
        return P(self.buffer_axes) if self.sharded else P()

    @property
    def buffer_sharding(self) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, self.buffer_spec)

    def global_rows(self, group: _Group) -> int:
        """Rows of the global buffer: one block of ``rows / zero split`` per device block."""
        if not self.sharded:
            return group.rows
        blocks = math.prod(self.mesh.shape[a] for a in self.buffer_axes)
        return blocks * group.rows // self.zero_size

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
        """``fn`` on each device's shards (``shard_map``), or on the whole arrays if unsharded."""
        if not self.sharded:
            return fn
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)

    def leaf_specs(self, indices) -> dict:
        return {i: self.specs[i] for i in indices}

    @property
    def buffer_specs(self) -> tuple:
        return tuple(self.buffer_spec for _ in self.groups)


@dataclasses.dataclass(frozen=True, eq=False)
class AdanState:
    """``count``: steps done. ``m, v, n, prev``: per-leaf trees ("reference", and the portable
    form) or tuples of flat [rows, 128] buffers, one per group, described by ``layout``."""

    count: jax.Array
    m: Any
    v: Any
    n: Any
    prev: Any
    layout: Layout | None = None

    def replace(self, **kw) -> "AdanState":
        return dataclasses.replace(self, **kw)


jax.tree_util.register_dataclass(AdanState, data_fields=["count", "m", "v", "n", "prev"],
                                 meta_fields=["layout"])


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype,
                          jnp.floating)


def _mask_leaves(mask, params, treedef, num_leaves):
    if mask is None:
        return [True] * num_leaves
    if callable(mask):
        if params is None:
            raise ValueError("adan: a callable weight-decay mask needs params in update().")
        mask = mask(params)
    return treedef.flatten_up_to(mask)


def _groups(shapes, is_float, decay_flags, align_rows: int) -> tuple[_Group, ...]:
    """Float, non-empty leaves, grouped by whether they get weight decay."""
    groups = []
    for decay in (True, False):
        idx = [i for i, shape in enumerate(shapes)
               if is_float[i] and math.prod(shape) > 0 and bool(decay_flags[i]) == decay]
        if not idx:
            continue
        sizes = [math.prod(shapes[i]) for i in idx]
        offsets = tuple(int(o) for o in np.cumsum([0] + sizes[:-1]))
        chunk = align_rows * LANES
        rows = -(-sum(sizes) // chunk) * align_rows
        groups.append(_Group(decay, tuple(idx), offsets, rows))
    return tuple(groups)


def make_layout(leaves, treedef, decay_flags, dtype, shardings=None, zero_axes=()) -> Layout:
    """The flat layout of ``leaves``; per device when ``shardings`` (a tree of
    ``NamedSharding`` like the parameters) is given."""
    shapes = tuple(tuple(int(d) for d in x.shape) for x in leaves)
    is_float = tuple(_is_float(x) for x in leaves)
    dtype = jnp.dtype(dtype).name
    if shardings is None:
        if zero_axes:
            raise ValueError(f"adan: zero_axes={zero_axes} needs the parameters' shardings.")
        return Layout(treedef, shapes, is_float, _groups(shapes, is_float, decay_flags,
                                                         ROW_ALIGN), dtype,
                      tuple(P() for _ in shapes))
    given = treedef.flatten_up_to(shardings)
    bad = [s for s, f in zip(given, is_float) if f and not isinstance(s, NamedSharding)]
    if bad:
        raise ValueError(f"adan: shardings must be NamedShardings like the parameters; got "
                         f"{bad[0]!r}.")
    meshes = {s.mesh for s, f in zip(given, is_float) if f}
    if len(meshes) > 1:
        raise ValueError("adan: the parameters' shardings name different meshes; use one.")
    if not meshes:
        return make_layout(leaves, treedef, decay_flags, dtype)
    mesh = meshes.pop()
    unknown = [a for a in zero_axes if a not in mesh.axis_names]
    if unknown:
        raise ValueError(f"adan: zero_axes {unknown} are not axes of the mesh "
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
                raise ValueError(f"adan: a parameter of shape {shape} is sharded {s.spec}, which "
                                 f"splits its dimension {d} into {k} uneven parts; the "
                                 "multi-tensor impls need even shards (impl='reference' "
                                 "does not).")
    used = {a for spec in specs for e in spec for a in entry_axes(e)}
    shard_axes = tuple(a for a in mesh.axis_names if a in used)
    zero = tuple(a for a in mesh.axis_names
                 if a in zero_axes and a not in used and mesh.shape[a] > 1)
    layout = Layout(treedef, shapes, is_float, (), dtype, tuple(specs), mesh, shard_axes, zero)
    local = tuple(layout.local_shape(i) for i in range(len(shapes)))
    return dataclasses.replace(layout, groups=_groups(local, is_float, decay_flags,
                                                      ROW_ALIGN * layout.zero_size))


def _pack(leaves, group: _Group, dtype):
    flat = jnp.concatenate([leaves[i].reshape(-1).astype(dtype) for i in group.leaves])
    return jnp.pad(flat, (0, group.rows * LANES - flat.shape[0])).reshape(group.rows, LANES)


def _unpack(flat, group: _Group, layout: Layout) -> dict:
    flat = flat.reshape(-1)
    out = {}
    for i, off in zip(group.leaves, group.offsets):
        shape = layout.local_shape(i)
        out[i] = flat[off:off + math.prod(shape)].reshape(shape)
    return out


def _common_dtype(leaves, group: _Group):
    dtypes = {jnp.dtype(leaves[i].dtype) for i in group.leaves}
    return dtypes.pop() if len(dtypes) == 1 else jnp.dtype(jnp.float32)


def adan(learning_rate: float | Callable = 1e-3, b1: float = 0.98, b2: float = 0.92,
         b3: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0, no_prox: bool = False,
         max_grad_norm: float = 0.0, mask: Any = None, state_dtype: Any = None,
         impl: str = "auto", shardings: Any = None,
         zero_axes: tuple[str, ...] = ()) -> optax.GradientTransformation:
    """Adan following the official code (see module docstring).

    Args:
      learning_rate: a float, a scalar array (e.g. injected by ``optax.inject_hyperparams``) or
        a schedule ``count -> lr``.
      b1, b2, b3, eps: the official code's coefficients.
      weight_decay: decoupled weight decay; ``mask`` (a pytree of bools or a callable
        ``params -> bools``, like ``optax.adamw``) selects the leaves it applies to.
      no_prox: the official ``no_prox`` switch (multiplicative decay instead of proximal).
      max_grad_norm: global-norm clipping inside the optimizer, as the official code; 0 = off.
      state_dtype: dtype of m, v, n, prev (default float32); math is float32 regardless.
      impl: reference | xla | pallas | auto.
      shardings: the parameters' ``NamedSharding``s (a tree like the parameters). The
        multi-tensor impls then update each device's own shards (see module docstring); the
        per-leaf "reference" impl needs nothing (XLA partitions it like the parameters).
      zero_axes: ZeRO-1: mesh axes over which each device's state is split further (the
        parameters replicated over them), e.g. the batch axes ``("data", "fsdp")``.
    """
    if impl not in IMPLS:
        raise ValueError(f"adan impl={impl!r} is not one of {IMPLS}.")
    state_dtype = jnp.dtype(state_dtype or jnp.float32)
    needs_params = not (isinstance(weight_decay, (int, float)) and weight_decay == 0)

    def decay_flags(params, treedef, num_leaves):
        """Which leaves get weight decay (all of them when there is no decay: one group)."""
        if not needs_params:
            return [True] * num_leaves
        return _mask_leaves(mask, params, treedef, num_leaves)

    def resolved_impl():
        if impl != "auto":
            return impl
        return "pallas" if _backend.resolve("auto") in ("tpu", "gpu") else "xla"

    def init_fn(params):
        leaves, treedef = jax.tree_util.tree_flatten(params)
        count = jnp.zeros((), jnp.int32)
        if resolved_impl() == "reference":
            zeros = lambda: jax.tree_util.tree_map(
                lambda x: jnp.zeros(x.shape if _is_float(x) else (), state_dtype), params)
            return AdanState(count, zeros(), zeros(), zeros(), zeros())
        layout = make_layout(leaves, treedef, decay_flags(params, treedef, len(leaves)),
                             state_dtype, shardings, zero_axes)
        return AdanState(count, *(_zero_buffers(layout) for _ in range(4)), layout=layout)

    def update_fn(updates, state: AdanState, params=None):
        if needs_params and params is None:
            raise ValueError("adan with weight_decay != 0 needs params: "
                             "tx.update(grads, state, params).")
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        if not leaves:
            return updates, state.replace(count=state.count + 1)
        float_leaves = [x for x in leaves if _is_float(x)]
        clip = jnp.float32(1.0)
        if not (isinstance(max_grad_norm, (int, float)) and max_grad_norm <= 0):
            norm = jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                                for x in float_leaves))
            clip = jnp.where(max_grad_norm > 0,
                             jnp.minimum(max_grad_norm / (norm + eps), 1.0), 1.0)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        scalars = {d: make_scalars(lr=lr, b1=b1, b2=b2, b3=b3, eps=eps,
                                   weight_decay=weight_decay if d else 0.0,
                                   count=state.count, clip=clip) for d in (True, False)}
        p_leaves = treedef.flatten_up_to(params) if needs_params else None
        if state.layout is None:
            decay = decay_flags(params, treedef, len(leaves))
            out = _update_per_leaf(leaves, treedef, state, p_leaves, decay, scalars)
        else:
            if state.layout.treedef != treedef:
                raise ValueError("adan: the state was initialised for another parameter tree "
                                 f"({state.layout.treedef}); the updates are {treedef}.")
            backend = "xla" if resolved_impl() == "xla" else "pallas"
            out = _update_flat(state.layout, leaves, state, p_leaves, scalars, backend)
        new_updates, m, v, n, prev = out
        return new_updates, AdanState(state.count + 1, m, v, n, prev, state.layout)

    def _update_per_leaf(leaves, treedef, state, p_leaves, decay, scalars):
        states = [treedef.flatten_up_to(x) for x in (state.m, state.v, state.n, state.prev)]
        outs = []
        for i, g in enumerate(leaves):
            if not _is_float(g) or g.size == 0:
                outs.append((jnp.zeros_like(g),) + tuple(s[i] for s in states))
                continue
            p = p_leaves[i] if (p_leaves is not None and decay[i]) else None
            outs.append(adan_reference(scalars[bool(decay[i])], g, *(s[i] for s in states), p,
                                       no_prox=no_prox))
        cols = list(zip(*outs))
        return tuple(treedef.unflatten(c) for c in cols)

    def _update_flat(layout, leaves, state, p_leaves, scalars, backend):
        """The multi-tensor update, per device when the layout is sharded: pack the local
        gradient (and parameter) shards, update this device's rows, unpack local updates."""
        grad_idx = layout.packed
        param_idx = [i for g in layout.groups if g.decay for i in g.leaves] \
            if p_leaves is not None else []
        both = jnp.stack([scalars[False], scalars[True]])

        def local(both, g, p, m, v, n, prev):
            u_leaves, new = {}, ([], [], [], [])
            for k, group in enumerate(layout.groups):
                dtype = _common_dtype(g, group)
                gk = layout.own_rows(_pack(g, group, dtype))
                pk = layout.own_rows(_pack(p, group, dtype)) if p and group.decay else None
                u, *st = adan_update(both[int(group.decay)], gk, m[k], v[k], n[k], prev[k], pk,
                                     no_prox=no_prox, backend=backend)
                for buf, s in zip(new, st):
                    buf.append(s)
                for i, x in _unpack(layout.all_rows(u), group, layout).items():
                    u_leaves[i] = x.astype(g[i].dtype)
            return u_leaves, tuple(tuple(b) for b in new)

        bufs = layout.buffer_specs
        local = layout.per_device(
            local, in_specs=(P(), layout.leaf_specs(grad_idx), layout.leaf_specs(param_idx),
                             bufs, bufs, bufs, bufs),
            out_specs=(layout.leaf_specs(grad_idx), (bufs,) * 4))
        u, new_state = local(both, {i: leaves[i] for i in grad_idx},
                             {i: p_leaves[i] for i in param_idx}, state.m, state.v, state.n,
                             state.prev)
        new_leaves = [u[i] if i in u else jnp.zeros_like(x) for i, x in enumerate(leaves)]
        return (layout.treedef.unflatten(new_leaves),) + new_state

    return optax.GradientTransformation(init_fn, update_fn)


def _zero_buffers(layout: Layout) -> tuple:
    out = []
    for g in layout.groups:
        z = jnp.zeros((layout.global_rows(g), LANES), layout.dtype)
        out.append(z if layout.mesh is None
                   else jax.lax.with_sharding_constraint(z, layout.buffer_sharding))
    return tuple(out)


def _to_per_leaf(layout: Layout, buffers):
    """One moment's flat buffers as a tree like the parameters (sharded like them)."""
    def local(buffers):
        out = {}
        for k, group in enumerate(layout.groups):
            out.update(_unpack(layout.all_rows(buffers[k]), group, layout))
        return out
    got = layout.per_device(local, in_specs=(layout.buffer_specs,),
                            out_specs=layout.leaf_specs(layout.packed))(buffers)
    leaves = [got[i] if i in got else
              jnp.zeros(layout.shapes[i] if layout.is_float[i] else (), layout.dtype)
              for i in range(len(layout.shapes))]
    return layout.treedef.unflatten(leaves)


def _from_per_leaf(layout: Layout, tree):
    """Inverse of ``_to_per_leaf``: a per-parameter tree into ``layout``'s flat buffers."""
    leaves = layout.treedef.flatten_up_to(tree)

    def local(d):
        return tuple(layout.own_rows(_pack(d, g, layout.dtype)) for g in layout.groups)
    return layout.per_device(local, in_specs=(layout.leaf_specs(layout.packed),),
                             out_specs=layout.buffer_specs)({i: leaves[i] for i in layout.packed})


def _is_state(x) -> bool:
    return isinstance(x, AdanState)


@jax.jit
def _per_leaf_state(state: AdanState) -> AdanState:
    """A flat state in the per-parameter form (compiled once per layout: it is in the treedef)."""
    m, v, n, prev = (_to_per_leaf(state.layout, b) for b in (state.m, state.v, state.n,
                                                             state.prev))
    return AdanState(state.count, m, v, n, prev)


@functools.partial(jax.jit, static_argnums=0)
def _flat_state(layout: Layout, state: AdanState) -> AdanState:
    m, v, n, prev = (_from_per_leaf(layout, t) for t in (state.m, state.v, state.n, state.prev))
    return AdanState(state.count, m, v, n, prev, layout)


def portable_state(opt_state):
    """``opt_state`` with every flat ``AdanState`` in it turned into the per-parameter form
    (that of ``impl="reference"``, sharded like the parameters): independent of the mesh and
    the impl, what checkpoints hold. Anything else in the state is returned as it is."""
    return jax.tree_util.tree_map(
        lambda s: _per_leaf_state(s) if _is_state(s) and s.layout is not None else s,
        opt_state, is_leaf=_is_state)


def restore_layout(portable, like):
    """Inverse of ``portable_state``: the per-parameter ``AdanState``s of ``portable`` in the
    flat layouts of ``like`` (the target optimizer's state or its ``jax.eval_shape``), which
    may be on another mesh than the one ``portable`` was saved from."""
    def one(target, saved):
        if _is_state(target) and target.layout is not None:
            return _flat_state(target.layout, saved)
        return saved
    return jax.tree_util.tree_map(one, like, portable, is_leaf=_is_state)


def restart(state):
    """The official ``restart_opt``: step counter to 0, m, v and n zeroed (works on an
    ``AdanState`` or an optax chain/inject_hyperparams state containing one)."""
    def fix(node):
        if _is_state(node):
            z = lambda t: jax.tree_util.tree_map(jnp.zeros_like, t)
            return node.replace(count=jnp.zeros_like(node.count), m=z(node.m), v=z(node.v),
                                n=z(node.n))
        return node
    return jax.tree_util.tree_map(fix, state, is_leaf=_is_state)
