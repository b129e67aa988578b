"""The train and eval steps of a task (``jaxaccel.train.tasks``: classification, causal LM) on a
parameter layout (``jaxaccel.train.layout``: a pytree under optax, or flat one-pass), written
once: the layout says what is differentiated and how an update is applied, and gradient
accumulation, loss scaling and fp8 are written here around it for both.

The loss is the task's weighted mean cross entropy (float32) over the global batch (for
classification over rows, ``weights`` 0 for padding rows; for a causal LM over next-token
targets, ``target_weights``); with gradient accumulation the batch is cut into micro-batches
and the weighted sums are accumulated, so the gradient equals the one-batch gradient (up to
summation order).

Precision policies add to the step (``jaxaccel.precision``):

* fp16 (``state.loss_scale``): the loss is multiplied by the scale ``S`` before
  differentiation and the gradients divided by ``S``; if any gradient is inf/NaN the step is
  skipped: ``params`` and ``opt_state`` (with the optimizer's own step count, hence the
  schedule position) come out bit-identical, only the loss scale and its counters change.
  ``state.step`` still advances: it is the data position, and the batch was consumed.
* fp8 (``state.fp8``): the model's delayed-scaling state is differentiated alongside the
  parameters; its "gradients" are the amaxes its matmuls saw, from which
  ``jaxaccel.models.fp8.advance`` makes the next state (histories and next scales, every layer
  at once). With gradient accumulation each micro-batch uses the state the previous one left.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxaccel.models.fp8 import advance as fp8_advance
from jaxaccel.models.fp8 import summary as fp8_summary
from jaxaccel.models.stack import merge
from jaxaccel.train.layout import Layout
from jaxaccel.train.state import TrainState
from jaxaccel.train.tasks import Task, weight_sum

# Metrics that are states, not per-step values: the loop logs their latest value.
STATE_METRICS = ("loss_scale", "skipped_steps", "consecutive_skips")


def is_state_metric(name: str) -> bool:
    return name in STATE_METRICS or name.startswith("fp8/")


def forward(graphdef, params, batch, *, task: Task, deterministic, rng=None, fp8=None,
            unpad=None):
    """The task's float32 logits of the model ``graphdef`` with ``params`` (a parameter tree,
    and the fp8 state ``fp8``) on ``batch``; dropout from ``rng`` unless ``deterministic``; the
    per-token layers on the real tokens only by the plan ``unpad`` (``models.unpad.Capacity``),
    if given. Parameters in the stacked form (a scan's, a pipeline's) run the layers as their
    stacking says (``models.stack.merge``). The one forward pass of training, evaluation and
    prediction."""
    kwargs = {} if unpad is None else {"unpad": unpad}
    model, stack = merge(graphdef, params, fp8)
    if stack is not None:
        kwargs["stack"] = stack
    rngs = None if deterministic else nnx.Rngs(dropout=rng)
    return task.logits(model, batch, deterministic, rngs, **kwargs)


def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree_util.tree_leaves(tree)]))


def make_train_step(graphdef, tx, layout: Layout, *, task: Task,
                    fp8_group: Callable[[tuple], str | None], grad_accum: int = 1, unpad=None):
    """``step(state, batch) -> (state, metrics)`` of ``task`` with the optimizer ``tx`` of
    ``layout``; jit it with the state donated. ``fp8_group`` names the metric group of an fp8
    layer path (the model class's ``FamilyModel.fp8_group``); ``unpad`` the run's unpadding
    plan (``grad_accum`` 1 only: the plan is made for whole batches)."""
    if unpad is not None and grad_accum != 1:
        raise ValueError(f"unpadding is planned for whole batches; grad_accum={grad_accum} "
                         "needs unpad=None (config: train.unpad=false).")

    def loss_fn(x, fp8, params, micro, rng, denom, scale):
        logits = forward(graphdef, layout.view_of(params, x), micro, task=task,
                         deterministic=False, rng=rng, fp8=fp8, unpad=unpad)
        ce_sum, correct, _ = task.sums(logits, micro)
        loss = ce_sum / denom
        return loss * scale, (loss, correct)

    # d/d(x): gradients of what the layout differentiates; d/d(fp8): the amaxes the fp8
    # matmuls saw, from which the fp8 state advances.
    differentiated = jax.grad(loss_fn, argnums=(0, 1), has_aux=True)

    def grad_fn(x, fp8, *args):
        (grads, amaxes), aux = differentiated(x, fp8, *args)
        return (grads, None if fp8 is None else fp8_advance(fp8, amaxes)), aux

    def step(state: TrainState, batch):
        rng = jax.random.fold_in(state.rng, state.step)
        denom = weight_sum(task, batch)
        scale = 1.0 if state.loss_scale is None else state.loss_scale.scale
        x = layout.differentiated(state.params)
        (grads, fp8), (loss, correct) = _accumulated(grad_fn, grad_accum, x, state.fp8,
                                                     state.params, batch, rng, denom, scale)
        metrics = {}
        if state.loss_scale is not None:
            grads = jax.tree_util.tree_map(lambda g: g / scale, grads)
            finite = _all_finite(grads)
            loss_scale = state.loss_scale.update(finite)
            metrics.update(loss_scale=scale, skipped_steps=loss_scale.skipped,
                           consecutive_skips=loss_scale.consecutive)
        grad_norm = layout.grad_norm(grads, state.params)  # the clipping's: XLA computes it once
        params, opt_state = layout.apply(tx, grads, state.opt_state, state.params)
        if state.loss_scale is not None:
            keep = lambda new, old: jax.tree_util.tree_map(
                lambda n, o: jnp.where(finite, n, o), new, old)
            params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
            state = state.replace(loss_scale=loss_scale)
        if fp8 is not None:
            metrics.update(fp8_summary(fp8, fp8_group))
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                                  fp8=fp8)
        metrics.update(loss=loss, grad_norm=grad_norm)
        if task.counts_correct:
            metrics["accuracy"] = correct / denom
        return new_state, metrics

    return step


def _accumulated(grad_fn, grad_accum: int, x, fp8, params, batch, rng, denom, scale):
    """``grad_fn``'s ``((grads, fp8), (loss, correct))`` of the whole batch, summed over
    ``grad_accum`` micro-batches run one after another (a scan: one micro-batch's activations
    live at a time). Strided micro-batches (rows i, i + k, i + 2k, ...): every device's
    contiguous block of the batch holds rows of each, so the split moves no data between them;
    each micro-batch's dropout key is ``rng`` folded with its index."""
    if grad_accum == 1:
        return grad_fn(x, fp8, params, batch, rng, denom, scale)
    micro = jax.tree_util.tree_map(
        lambda a: a.reshape(a.shape[0] // grad_accum, grad_accum, *a.shape[1:]).swapaxes(0, 1),
        batch)

    def body(carry, xs):
        i, mb = xs
        acc_g, fp8, acc_l, acc_c = carry
        (g, fp8), (l, c) = grad_fn(x, fp8, params, mb, jax.random.fold_in(rng, i), denom, scale)
        return (jax.tree_util.tree_map(jnp.add, acc_g, g), fp8, acc_l + l, acc_c + c), None

    zeros = jax.tree_util.tree_map(jnp.zeros_like, x)
    (grads, fp8, loss, correct), _ = jax.lax.scan(
        body, (zeros, fp8, 0.0, 0.0), (jnp.arange(grad_accum), micro))
    return (grads, fp8), (loss, correct)


def make_eval_step(graphdef, layout: Layout, *, task: Task, unpad=None):
    """``eval_step(params, batch, fp8=None) -> sums``: the task's {"loss_sum", "correct",
    "count"} of the batch and its ``tallies`` (classification: the confusion counts),
    ``params`` in ``layout``'s form; ``fp8`` is the train state's fp8 state under the fp8
    policy; ``unpad`` as ``make_train_step``'s."""

    def eval_step(params, batch, fp8=None):
        logits = forward(graphdef, layout.view(params), batch, task=task, deterministic=True,
                         fp8=fp8, unpad=unpad)
        sums = dict(zip(("loss_sum", "correct", "count"), task.sums(logits, batch)))
        return {**sums, **(task.tallies(logits, batch) if task.tallies else {})}

    return eval_step
