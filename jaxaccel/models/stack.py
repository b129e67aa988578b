"""A model's layer stack: the one way every family calls its layers, and the hook through which
a schedule that runs them otherwise (the pipeline, ``jaxaccel.train.pipeline``) takes over.

Every family's forward is embeddings -> layers -> head, and its ``__call__`` runs the layers as
``stack(x, args, key, deterministic)`` (default: ``sequential`` over its own layers), where

* ``x`` [batch, seq, hidden] are the hidden states and ``args`` a tuple of what the layers read
  besides (per-row arrays with the batch leading, or None; BERT: the attention mask and the
  unpadding plan, Llama: positions and segment ids);
* ``key`` is the layers' dropout key, one draw from the model's ``dropout`` stream (None when
  deterministic). Layer ``i`` draws from its own stream ``fold_in(key, i)`` (``layer_rngs``):
  its masks depend on its index alone, not on the draws of the layers before it, so a schedule
  that runs layer groups on different devices draws the masks the plain loop draws;
* a family's model class has ``layer_call(layer, x, args, deterministic, rngs, rows) -> x``,
  where ``rows`` (int [batch], or None for the whole batch) numbers the rows of ``x`` within
  the whole batch: a micro-batch given its rows' numbers draws exactly its rows' part of the
  whole batch's dropout masks (``kernels_pallas.dropout.keep_mask``), so a pipelined step
  equals the plain one with dropout on.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxaccel.sharding import by_batch


def layers_key(rngs: nnx.Rngs | None, deterministic: bool):
    """The layers' dropout key: one draw from ``rngs``' dropout stream (None if deterministic)."""
    return None if deterministic or rngs is None else rngs.dropout()


def layer_rngs(key, index) -> nnx.Rngs | None:
    """Layer ``index``'s dropout stream: ``nnx.Rngs(dropout=fold_in(key, index))``."""
    return None if key is None else nnx.Rngs(dropout=jax.random.fold_in(key, index))


def token_rows(rows, seq: int):
    """[batch, seq] row-major numbers of the (row, position) pairs of rows ``rows`` [batch] of
    a batch of ``seq``-token rows (what a [batch, seq, features] dropout numbers its rows by);
    None for the whole batch."""
    if rows is None:
        return None
    return jnp.asarray(rows, jnp.int32)[:, None] * seq + jnp.arange(seq, dtype=jnp.int32)


def _call(layer_call, layer, x, args, rngs, deterministic):
    return layer_call(layer, x, args, deterministic, rngs, None)


_remat_call = nnx.remat(_call, static_argnums=(0, 5))


def sequential(layers, layer_call, *, remat: bool = False):
    """``stack(x, args, key, deterministic)``: ``layers`` one after another on the whole batch
    (``layer_call`` the family's), each rematerialised in the backward pass if ``remat``, the
    hidden states kept split over the batch axes between layers."""
    def stack(x, args, key, deterministic):
        for i, layer in enumerate(layers):
            call = _remat_call if remat else _call
            x = by_batch(call(layer_call, layer, x, args, layer_rngs(key, i), deterministic))
        return x
    return stack


__all__ = ["layer_rngs", "layers_key", "sequential", "token_rows"]
