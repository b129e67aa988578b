"""The one-pass Adan trainer path (``train.flat_params=true``): parameters and Adan's state
live permanently in the flat multi-tensor layout, one [rows, 128] buffer per (weight decay,
dtype) group and device (``jaxaccel.optim.flat``).

Per step, inside one jitted function:

    params = flat.view()                      slices + reshapes of the buffers (no copy)
    loss, dL/d buffers = value_and_grad(...)  the gradient arrives flat: no packing
    buffers, m, v, n, prev = adan_apply(...)  one pass, in place (the state is donated)

against the optax path's pack grads -> update -> unpack 201 updates -> ``apply_updates``.
Same numbers as ``train.optimizer=adan`` with the same ``optimizer_impl`` (tested), same
checkpoints (``on_disk`` holds the per-parameter form, so either path resumes the other's).
The state is the ordinary ``TrainState`` with ``params`` a ``FlatParams``; only the step
builders differ, picked by ``loop.Run.train_step`` and ``eval_step``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxaccel.optim import OnePass, state_shardings
from jaxaccel.train import step as step_lib
from jaxaccel.train.state import TrainState
from jaxaccel.train.tasks import Task, weight_sum


def state_init(tx: OnePass, params, seed: int, mesh):
    """``(create, shardings)``: ``create(params) -> TrainState`` flattens a parameter tree
    (placed like the shardings ``tx`` was built with; abstract is fine) and zeroes the Adan
    state, and ``shardings`` lays the state out on ``mesh``."""
    create = lambda p: TrainState.create(tx.flatten(p), tx, seed)
    abstract = jax.eval_shape(create, params)
    param_shardings = abstract.params.layout.treedef.unflatten(
        abstract.params.layout.leaf_shardings(mesh))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shardings = jax.tree_util.tree_map(lambda _: replicated, abstract).replace(
        params=abstract.params.shardings(mesh),
        opt_state=state_shardings(abstract.opt_state, param_shardings, mesh))
    return create, shardings


def make_train_step(graphdef, tx: OnePass, grad_accum: int = 1,
                    task: Task = step_lib.CLASSIFICATION, fp8_group=None, unpad=None):
    """``step(state, batch) -> (state, metrics)`` as ``step.make_train_step``'s, with the
    gradient taken w.r.t. the flat buffers; jit it with the state donated. (No fp8 state on
    this path: ``fp8_group`` is unused.)"""
    if grad_accum != 1:
        raise ValueError(f"train.grad_accum={grad_accum}: the flat-parameter path has no "
                         "gradient accumulation yet; set train.flat_params=false to "
                         "accumulate.")

    def loss_fn(buffers, params, batch, rng, denom):
        view = dataclasses.replace(params, buffers=buffers).view()
        logits = step_lib.forward(graphdef, view, batch, deterministic=False, rng=rng,
                                  task=task, unpad=unpad)
        ce_sum, correct, _ = task.sums(logits, batch)
        return ce_sum / denom, correct

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state: TrainState, batch):
        rng = jax.random.fold_in(state.rng, state.step)
        denom = weight_sum(task, batch)
        (loss, correct), grads = grad_fn(state.params.buffers, state.params, batch, rng, denom)
        grad_norm = jnp.sqrt(sum(jnp.vdot(g, g) for g in grads))
        params, opt_state = tx.apply(grads, state.opt_state, state.params)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, {"loss": loss, "accuracy": correct / denom, "grad_norm": grad_norm}

    return step


def make_eval_step(graphdef, task: Task = step_lib.CLASSIFICATION, unpad=None):
    """``step.make_eval_step``'s on the view of flat parameters."""
    inner = step_lib.make_eval_step(graphdef, task, unpad)
    return lambda params, batch, fp8=None: inner(params.view(), batch, fp8)
