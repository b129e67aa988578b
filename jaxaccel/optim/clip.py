"""Global-norm clipping: the norm the step reports and the clipping transform share one formula.

``global_norm(tree)`` is sqrt(sum over leaves of sum(g^2)) in float32. Written once, the train
step's ``grad_norm`` metric and the clipping norm are the same expression of the same
gradients, so XLA computes it once (common subexpressions are merged).

``clip_by_global_norm(c)`` is optax's ``clip_by_global_norm``: ``g`` unchanged when
``norm < c``, else scaled by ``c / norm``, but as one scalar factor multiplied into each leaf,
``g * (c / norm)`` for optax's ``(g / norm) * c`` (the same value up to one rounding). XLA
fuses a multiply by a scalar into the optimizer's moment updates; the divide it left as a pass
of its own over every gradient (on the CPU the embedding table's gradient, 11.7M floats,
was 4% of the MiniLM step; bench/README.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def global_norm(tree) -> jax.Array:
    """sqrt(sum of squares) of every leaf of ``tree``, in float32."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                        for x in jax.tree_util.tree_leaves(tree)))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Scale the updates by ``min(1, max_norm / global_norm)`` (1 exactly below the norm)."""

    def update(updates, state, params=None):
        del params
        norm = global_norm(updates)
        factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree_util.tree_map(lambda g: g * factor.astype(g.dtype), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)
