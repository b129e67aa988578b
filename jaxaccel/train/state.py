"""The train state: one pytree holding everything a resumed run needs from the device."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxaccel.precision import LossScale


class TrainState(struct.PyTreeNode):
    """``params`` is a plain nested dict (the model's ``nnx.Param`` state as a pure dict), so
    optax masks, sharding rules and orbax see ordinary paths. ``rng`` is the base dropout key;
    step ``s`` uses ``fold_in(rng, s)``, so a resumed run draws the same dropout masks.
    ``step`` counts the batches consumed (skipped fp16 steps included: it is the data position).

    Per policy: ``loss_scale`` is the fp16 dynamic loss scale (a ``LossScale``), ``fp8`` the
    fp8 delayed-scaling state (the model's ``Fp8Meta`` variables as a pure dict, never seen by
    the optimizer); both are None otherwise, and both are replicated and checkpointed."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    loss_scale: LossScale | None = None
    fp8: Any = None

    @classmethod
    def create(cls, params, tx: optax.GradientTransformation, seed: int,
               loss_scale: LossScale | None = None, fp8=None) -> "TrainState":
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                   rng=jax.random.PRNGKey(seed), loss_scale=loss_scale, fp8=fp8)
