"""Inverted dropout with ``kernels_pallas.dropout.keep_mask``'s masks (both words of every
Threefry hash used; see there), as a function and as an ``nnx.Dropout`` stand-in."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from kernels_pallas.dropout import keep_mask


def dropout(x: jax.Array, rate: float, key, rows=None) -> jax.Array:
    """Inverted dropout: elements of ``x`` zeroed with probability ``rate``, the rest scaled
    by ``1 / (1 - rate)``; ``rows`` numbers the rows of ``x`` (``keep_mask``)."""
    if rate == 0.0:
        return x
    if rate == 1.0:
        return jnp.zeros_like(x)
    keep = 1.0 - rate
    return lax.select(keep_mask(key, keep, x.shape, rows), x / keep, jnp.zeros_like(x))


class Dropout(nnx.Module):
    """``nnx.Dropout``'s interface (``rate``; ``deterministic`` and ``rngs`` per call, the key
    from the ``dropout`` stream) with masks from ``keep_mask``."""

    def __init__(self, rate: float):
        self.rate = rate

    def __call__(self, x, *, deterministic: bool, rngs: nnx.Rngs | None = None, rows=None):
        if deterministic or self.rate == 0.0:
            return x
        if rngs is None:
            raise ValueError("dropout with deterministic=False needs rngs (a 'dropout' stream).")
        return dropout(x, self.rate, rngs.dropout(), rows)
