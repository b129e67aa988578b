"""The flat forms: parameter-shaped trees held in the [rows, 128] buffers of a
``forms.packing.Packing``, one per (weight decay, dtype) group and device.

``Packed`` is one parameter-shaped tree such as an optimizer moment (the state dtype, ZeRO-1
split); ``FlatParams`` are the parameters themselves (the one-pass trainer's, the flat layout
of ``train.layout``). Both are ``jaxaccel.forms.Form``s: they convert to the per-layer form
checkpoints hold and back.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxaccel.forms import Form, restore
from jaxaccel.forms.packing import Packing, pack_all, unpack_all
from kernels_pallas.adan_reference import LANES


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _param_leaves(packing: Packing, buffers) -> dict:
    """``unpack_all`` of parameter buffers, differentiable: the gradient w.r.t. the buffers
    is the leaves' gradients packed per device (each device's copy of a leaf replicated over
    its axes gets the whole gradient; autodiff through ``shard_map`` would split it)."""
    return unpack_all(packing, buffers, state=False)


def _param_leaves_fwd(packing, buffers):
    return unpack_all(packing, buffers, state=False), None


def _param_leaves_bwd(packing, _, cts):
    return (pack_all(packing, cts, state=False),)


_param_leaves.defvjp(_param_leaves_fwd, _param_leaves_bwd)


def restore_leaves(packing: Packing, saved):
    """``saved``, the per-layer form of a tree of ``packing``'s structure, in that structure:
    the forms its treedef holds (stacked layers) restored in turn."""
    return restore(saved, packing.treedef.unflatten([0] * len(packing.shapes)))


@dataclasses.dataclass(frozen=True, eq=False)
class Packed(Form):
    """A parameter-shaped tree (an optimizer moment) in ``packing``'s state buffers: one
    [rows, 128] buffer of the state dtype per group, split over ``packing.buffer_spec``
    (ZeRO-1 included). Its per-layer form is the tree, sharded like the parameters; leaves
    not packed (not float) come back as zeros."""

    buffers: tuple
    packing: Packing

    @classmethod
    def zeros(cls, packing: Packing) -> "Packed":
        return cls(tuple(jnp.zeros((packing.global_rows(g), LANES), packing.dtype)
                         for g in packing.groups), packing)

    def portable(self):
        return _unpacked(self)

    def from_portable(self, saved):
        return _packed(self.packing, restore_leaves(self.packing, saved))

    def portable_shardings(self, shardings):
        packing, mesh = self.packing, jax.tree_util.tree_leaves(shardings)[0].mesh
        packed = set(packing.packed)
        return packing.treedef.unflatten([s if i in packed else NamedSharding(mesh, P())
                                          for i, s in enumerate(packing.leaf_shardings(mesh))])

    def shardings(self, given, mesh):
        return Packed(tuple(NamedSharding(mesh, self.packing.buffer_spec)
                            for _ in self.packing.groups), self.packing)


jax.tree_util.register_dataclass(Packed, data_fields=["buffers"], meta_fields=["packing"])


@jax.jit
def _unpacked(state: Packed):
    """The per-layer form (compiled once per packing: it is in the treedef)."""
    packing = state.packing
    got = unpack_all(packing, state.buffers, state=True)
    return packing.treedef.unflatten(
        [got[i] if i in got else
         jnp.zeros(packing.shapes[i] if packing.is_float[i] else (), packing.dtype)
         for i in range(len(packing.shapes))])


@functools.partial(jax.jit, static_argnums=0)
def _packed(packing: Packing, tree) -> Packed:
    return Packed(pack_all(packing, dict(enumerate(packing.treedef.flatten_up_to(tree))),
                            state=True), packing)


@dataclasses.dataclass(frozen=True, eq=False)
class FlatParams(Form):
    """Parameters living permanently in flat buffers: ``buffers`` (one per group, the group's
    dtype, split over ``packing.param_spec``) and ``rest`` (the leaves not packed, in index
    order). ``view()`` is the parameter tree the model reads: slices and reshapes of the
    buffers, which XLA turns into bitcasts and slices inside a jitted step; a gradient taken
    w.r.t. ``buffers`` through it arrives flat."""

    buffers: tuple
    rest: tuple
    packing: Packing

    @classmethod
    def create(cls, packing: Packing, params) -> "FlatParams":
        leaves = dict(enumerate(packing.treedef.flatten_up_to(params)))
        packed = set(packing.packed)
        return cls(pack_all(packing, leaves, state=False),
                   tuple(x for i, x in leaves.items() if i not in packed), packing)

    def view(self):
        got = _param_leaves(self.packing, self.buffers)
        rest = iter(self.rest)
        return self.packing.treedef.unflatten(
            [got[i] if i in got else next(rest) for i in range(len(self.packing.shapes))])

    def portable(self):
        return _view(self)

    def from_portable(self, saved):
        return _flat_params(self.packing, restore_leaves(self.packing, saved))

    def portable_shardings(self, shardings):
        packed = set(self.packing.packed)
        rest = iter(shardings.rest)
        mesh = jax.tree_util.tree_leaves(shardings)[0].mesh
        return self.packing.treedef.unflatten(
            [s if i in packed else next(rest)
             for i, s in enumerate(self.packing.leaf_shardings(mesh))])

    def shardings(self, given, mesh) -> "FlatParams":
        """The buffers over ``packing.param_spec``, the unpacked leaves like the parameters."""
        packed = set(self.packing.packed)
        return FlatParams(tuple(NamedSharding(mesh, self.packing.param_spec)
                                for _ in self.packing.groups),
                          tuple(s for i, s in enumerate(self.packing.leaf_shardings(mesh))
                                if i not in packed), self.packing)


jax.tree_util.register_dataclass(FlatParams, data_fields=["buffers", "rest"],
                                 meta_fields=["packing"])


@jax.jit
def _view(params: FlatParams):
    return params.view()


@functools.partial(jax.jit, static_argnums=0)
def _flat_params(packing: Packing, tree) -> FlatParams:
    return FlatParams.create(packing, tree)


__all__ = ["FlatParams", "Packed"]
