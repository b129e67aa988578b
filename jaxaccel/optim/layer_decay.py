"""Layer-wise learning-rate decay (LLRD), as an optax transform placed after the optimizer.

Fine-tuning recipes (ELECTRA, DeBERTa, BEiT) give the layers near the input a smaller step
than the layers near the head: with ``L`` layers, layer ``i`` (0-based) is scaled by
``decay ** (L - i)``, the embeddings by ``decay ** (L + 1)``, and everything else (the head:
classifier, pooler, final norm, LM head) by 1. Scaling an optimizer's update scales its
learning rate and its decoupled weight decay together, which is what a per-layer learning
rate means for AdamW and Adan alike; clipping before the optimizer still sees the whole
gradient.

The depth of a parameter comes from its path: ``layers[i]`` in every model family, and the
family's ``embeddings`` (``models.spec.Family``) for the collections below the first layer.
Parameters in the stacked form (``forms.stacked.Stacked``: a scan's [L, ...], a pipeline's
[S, R, G, ...]) have each stacked leaf scaled by a table of its layers' factors, one per place
(``Stacking.numbers``). The factors are constants fixed when the step is traced, so they cost
one multiply per update element that XLA fuses into the optimizer's last pass.
"""
from __future__ import annotations

import jax
import numpy as np
import optax

from jaxaccel.forms.stacked import LAYERS, Stacked


def entry_name(entry):
    """A tree path entry's key, attribute name or index (None for other entries)."""
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return None


def depths(tree, embeddings: tuple[str, ...]):
    """``(depth tree, number of layers)``: 0 for the embeddings, ``i + 1`` for ``layers[i]``,
    ``L + 1`` for the rest; stacked layers (``stacked_depths``) get arrays of depths that
    broadcast against them."""
    if isinstance(tree, Stacked):
        return stacked_depths(tree, embeddings)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = [[entry_name(e) for e in path] for path, _ in leaves]
    layer_ids = [n[1] for n in names if len(n) > 1 and n[0] == LAYERS]
    if not layer_ids:
        raise ValueError(f"layer-wise learning-rate decay needs the parameters' "
                         f"{LAYERS!r}[i] collections; the tree has only "
                         f"{sorted({str(n[0]) for n in names})}.")
    count = max(int(i) for i in layer_ids) + 1
    top = [0 if n[0] in embeddings else int(n[1]) + 1 if n[0] == LAYERS else count + 1
           for n in names]
    return jax.tree_util.tree_unflatten(treedef, top), count


def stacked_depths(tree: Stacked, embeddings: tuple[str, ...]):
    """``depths`` of the stacked form: its ``rest`` by name (the embeddings 0, the rest
    ``L + 1``) and each stacked layer leaf a [*shape, 1, ...] array of ``l + 1`` for the layer
    ``l`` each of its places holds (``Stacking.numbers``)."""
    stacking = tree.stacking
    number = stacking.numbers()

    def of_layer(leaf):
        return (number + 1).reshape(number.shape + (1,) * (np.ndim(leaf) - number.ndim))

    def of_rest(name, subtree):
        depth = 0 if name in embeddings else stacking.layers + 1
        return jax.tree_util.tree_map(lambda _: depth, subtree)
    rest = {k: of_rest(k, v) for k, v in tree.rest.items()}
    return (Stacked(jax.tree_util.tree_map(of_layer, tree.layers), rest, stacking),
            stacking.layers)


def scale_by_layer(decay: float, embeddings: tuple[str, ...]) -> optax.GradientTransformation:
    """Multiply each update by ``decay ** (L + 1 - depth)`` (``depths``); ``decay`` in (0, 1]."""
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"layer decay {decay} must be in (0, 1]; 1 is no decay.")

    def update(updates, state, params=None):
        del params
        depth, count = depths(updates, embeddings)

        def scale(u, d):
            factor = decay ** (count + 1 - np.asarray(d, np.float64))
            return u if np.all(factor == 1) else u * jax.numpy.asarray(factor, u.dtype)
        return jax.tree_util.tree_map(scale, updates, depth), state

    return optax.GradientTransformation(optax.init_empty_state, update)
