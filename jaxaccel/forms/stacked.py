"""The stacked form: a model's layers, each a tree of one structure, stacked into one tree of
arrays with leading dimensions, the rest of the model's tree as it is (``Stacked``).

A ``Stacking`` says how: the leading ``shape`` of every stacked array, the model layer each
place of it holds (``layer``), the mesh axes of the leading dimensions (``lead``) and how the
stacked layers run (``stack``). Two stackings exist: the pipeline's [stages, repeats, group]
(``train.pipeline.Stages``; places past the model's last layer hold padding layers) and the
scan's [layers] (``models.stack.Scan``). Whatever trees a train state holds of the
parameters' shape (the parameters, optax's moments, the gradients) are ``Stacked`` alike,
since optax maps over the pytree; their per-layer form (``portable``) is the model's tree
with ``layers[l]`` per layer, what checkpoints hold, so a run resumes on any stacking.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxaccel.forms import Form

LAYERS = "layers"


class Stacking:
    """How ``layers`` (L) model layers are stacked; subclasses are frozen dataclasses (static,
    hashable: they travel in the pytree structure) with ``layers`` among their fields."""

    layers: int

    @property
    def shape(self) -> tuple:
        """The leading dimensions of every stacked array."""
        raise NotImplementedError

    @property
    def lead(self) -> tuple:
        """The mesh axes (PartitionSpec entries) of the leading dimensions."""
        raise NotImplementedError

    def layer(self, *place) -> int:
        """The model layer held at ``place`` (an index into ``shape``); ``>= layers``: a
        padding layer."""
        raise NotImplementedError

    def stack(self, model, layers, fp8):
        """The model's ``stack(x, args, key, deterministic)`` (``models.stack``) running the
        stacked ``layers`` (one layer's tree of stacked arrays) with the stacked fp8 state
        ``fp8`` (None without the fp8 policy); ``model`` is the model merged with
        placeholder layers (``models.stack.merge``)."""
        raise NotImplementedError

    def places(self) -> list[tuple]:
        """Every place of ``shape``, in row-major order."""
        return list(itertools.product(*(range(n) for n in self.shape)))

    @property
    def padding(self) -> int:
        """Places holding padding layers (past the model's last)."""
        return math.prod(self.shape) - self.layers

    def numbers(self) -> np.ndarray:
        """The model layer of every place, an int array of ``shape``."""
        return np.array([self.layer(*p) for p in self.places()]).reshape(self.shape)


def _stack(stacking: Stacking, layers: dict, pad=None):
    """Per-layer trees ``{l: tree}`` -> one tree of [*shape, ...] arrays, ``pad`` (default
    zeros) where a place holds a padding layer."""
    if stacking.padding and pad is None:
        pad = jax.tree_util.tree_map(jnp.zeros_like, layers[0])
    order = [layers.get(stacking.layer(*place), pad) for place in stacking.places()]
    return jax.tree_util.tree_map(
        lambda *xs: jnp.stack(xs).reshape(*stacking.shape, *xs[0].shape), *order)


def _unstack(stacking: Stacking, stacked) -> dict:
    """Inverse of ``_stack`` (the padding layers dropped)."""
    return {stacking.layer(*place): jax.tree_util.tree_map(lambda a: a[place], stacked)
            for place in stacking.places() if stacking.layer(*place) < stacking.layers}


@dataclasses.dataclass(frozen=True, eq=False)
class Stacked(Form):
    """A model's tree with its layers stacked: ``layers`` one layer's tree of [*shape, ...]
    arrays, ``rest`` every other entry of the model's tree, ``stacking`` the ``Stacking``."""

    layers: dict
    rest: dict
    stacking: Stacking

    @classmethod
    def create(cls, stacking: Stacking, params: dict, pad=None) -> "Stacked":
        """``params`` (the model's tree) stacked; ``pad`` one layer's tree for the padding
        layers' places (default zeros)."""
        rest = {k: v for k, v in params.items() if k != LAYERS}
        return cls(_stack(stacking, params[LAYERS], pad), rest, stacking)

    def unstacked(self) -> dict:
        """The model's tree (``layers[l]`` per layer)."""
        return {**self.rest, LAYERS: _unstack(self.stacking, self.layers)}

    def portable(self):
        return _unstacked(self)

    def from_portable(self, saved):
        placed = [getattr(a, "sharding", None) for a in jax.tree_util.tree_leaves(self)]
        if None in placed:
            return _stacked(self.stacking, saved)
        shardings = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(self), placed)
        return jax.jit(Stacked.create, static_argnums=0,
                       out_shardings=shardings)(self.stacking, saved)

    def portable_shardings(self, shardings):
        lead = len(self.stacking.shape)
        one = jax.tree_util.tree_map(
            lambda s: NamedSharding(s.mesh, P(*tuple(s.spec)[lead:])), shardings.layers)
        return {**shardings.rest, LAYERS: {l: one for l in range(self.stacking.layers)}}


jax.tree_util.register_dataclass(Stacked, data_fields=["layers", "rest"],
                                 meta_fields=["stacking"])


@jax.jit
def _unstacked(params: Stacked) -> dict:
    return params.unstacked()


_stacked = jax.jit(Stacked.create, static_argnums=0)


def stacked_shardings(stacking: Stacking, shardings: dict) -> Stacked:
    """The shardings of ``Stacked.create(stacking, params)`` given the per-layer
    ``shardings`` of ``params``: a layer's placement with the leading dimensions in front,
    placed as ``stacking.lead`` says."""
    def stacked(s):
        return NamedSharding(s.mesh, P(*stacking.lead, *tuple(s.spec)))
    layers = jax.tree_util.tree_map(stacked, shardings[LAYERS][0])
    return Stacked(layers, {k: v for k, v in shardings.items() if k != LAYERS}, stacking)


__all__ = ["LAYERS", "Stacked", "Stacking", "stacked_shardings"]
