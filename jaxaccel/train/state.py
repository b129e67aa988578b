"""The train state: one pytree holding everything a resumed run needs from the device."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct


class TrainState(struct.PyTreeNode):
    """``params`` is a plain nested dict (the model's ``nnx.Param`` state as a pure dict), so
    optax masks, sharding rules and orbax see ordinary paths. ``rng`` is the base dropout key;
    step ``s`` uses ``fold_in(rng, s)``, so a resumed run draws the same dropout masks."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array

    @classmethod
    def create(cls, params, tx: optax.GradientTransformation, seed: int) -> "TrainState":
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                   rng=jax.random.PRNGKey(seed))
