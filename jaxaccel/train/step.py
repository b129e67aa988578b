"""Jitted train and eval steps for sequence classification.

The loss is the weighted mean cross entropy (float32) over the rows of the global batch
(``weights`` is 0 for padding rows); with gradient accumulation the batch is cut into
micro-batches and the per-row sums are accumulated, so the gradient equals the one-batch
gradient (up to summation order).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxaccel.train.state import TrainState

INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def _forward(graphdef, params, batch, *, deterministic, rng=None):
    model = nnx.merge(graphdef, params)
    rngs = None if deterministic else nnx.Rngs(dropout=rng)
    out = model(*(batch[k] for k in INPUTS), deterministic=deterministic, rngs=rngs)
    return out.logits.astype(jnp.float32)


def _sums(logits, batch):
    """Per-batch sums: weighted cross entropy, weighted correct count, total weight."""
    w = batch["weights"].astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    correct = (jnp.argmax(logits, -1) == batch["labels"]).astype(jnp.float32)
    return jnp.sum(ce * w), jnp.sum(correct * w), jnp.sum(w)


def make_train_step(graphdef, tx: optax.GradientTransformation, grad_accum: int = 1):
    """``step(state, batch) -> (state, metrics)``; jit it with the state donated."""

    def loss_fn(params, micro, rng, denom):
        logits = _forward(graphdef, params, micro, deterministic=False, rng=rng)
        ce_sum, correct, _ = _sums(logits, micro)
        return ce_sum / denom, correct

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state: TrainState, batch):
        rng = jax.random.fold_in(state.rng, state.step)
        denom = jnp.maximum(jnp.sum(batch["weights"].astype(jnp.float32)), 1.0)
        if grad_accum == 1:
            (loss, correct), grads = grad_fn(state.params, batch, rng, denom)
        else:
            # Strided micro-batches (rows i, i + k, i + 2k, ...): every device's contiguous
            # block of the batch holds rows of each, so the split moves no data between them.
            micro = jax.tree_util.tree_map(
                lambda x: x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:])
                .swapaxes(0, 1), batch)

            def body(carry, xs):
                i, mb = xs
                (l, c), g = grad_fn(state.params, mb, jax.random.fold_in(rng, i), denom)
                acc_g, acc_l, acc_c = carry
                return (jax.tree_util.tree_map(jnp.add, acc_g, g), acc_l + l, acc_c + c), None

            zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
            (grads, loss, correct), _ = jax.lax.scan(
                body, (zeros, 0.0, 0.0), (jnp.arange(grad_accum), micro))
        grad_norm = jnp.sqrt(sum(jnp.vdot(g, g) for g in jax.tree_util.tree_leaves(grads)))
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, {"loss": loss, "accuracy": correct / denom, "grad_norm": grad_norm}

    return step


def make_eval_step(graphdef):
    """``eval_step(params, batch) -> (sums dict, probabilities)``."""

    def eval_step(params, batch):
        logits = _forward(graphdef, params, batch, deterministic=True)
        ce_sum, correct, weight = _sums(logits, batch)
        return {"loss_sum": ce_sum, "correct": correct, "count": weight}, jax.nn.softmax(logits)

    return eval_step
