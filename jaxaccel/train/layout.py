"""Parameter layouts: how a train state holds the parameters and the optimizer state, what the
train step differentiates and how it applies an update. One rule (``choose``) picks the layout
of a run; the train step (``jaxaccel.train.step``) is written once around either.

* ``TREE`` (default): the parameters are a pytree (the model's tree, or its stacked form:
  ``jaxaccel.forms.stacked``), the optimizer is an optax ``GradientTransformation`` (any of
  ``optim.OPTIMIZERS``, any ``optimizer_impl``): ``grads -> tx.update -> optax.apply_updates``.
* ``FLAT`` (``train.flat_params=true``): the parameters and Adan's state live permanently in
  the flat form, one [rows, 128] buffer per (weight decay, dtype) group and device
  (``jaxaccel.forms.flat.FlatParams``), and the optimizer is the one-pass Adan
  (``optim.adan.adan_onepass``). The step differentiates the buffers themselves, so the
  gradient arrives flat, and one kernel pass reads g, p, m, v, n, prev and writes p, m, v, n,
  prev in place (the state is donated): no packing, no updates tree, no ``apply_updates``.
  Same numbers as ``train.optimizer=adan`` with the same ``optimizer_impl`` (tested).

Both layouts checkpoint the per-layer form (``forms.portable``), so a run resumes on the other
layout, and evaluation reads either through ``Layout.view``. The layout also places the
optimizer state (``state_shardings``): the optimizers know pytrees only.
"""
from __future__ import annotations

import dataclasses

import jax
import optax

from jaxaccel import forms
from jaxaccel import sharding as shd
from jaxaccel.forms.packing import Packer
from jaxaccel.optim import decay_mask, global_norm, make_optimizer
from jaxaccel.optim.adan import adan_onepass
from jaxaccel.train.state import TrainState
from kernels_pallas.adan import IMPLS as ONEPASS_IMPLS


def _replicated_rest(abstract: TrainState, mesh) -> TrainState:
    return jax.tree_util.tree_map(lambda _: shd.replicated(mesh), abstract)


def _hyper(t) -> dict:
    """The optimizer hyper-parameters of the ``train`` section (None: the optimizer's default)."""
    given = dict(b1=t.b1, b2=t.b2, b3=t.b3, eps=t.eps)
    return dict(weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
                **{k: v for k, v in given.items() if v is not None})


@dataclasses.dataclass(frozen=True)
class Layout:
    """A parameter layout; ``name`` is what plans and logs call it. This class is the tree
    layout (``TREE``): parameters as a pytree, an optax optimizer; the flat layout overrides
    each method."""

    name: str

    def make_optimizer(self, t, schedule, spec, packer: Packer):
        """The optimizer of the ``train`` config section ``t`` on this layout, over
        ``schedule``; ``spec`` names the model family's embeddings (layer decay), ``packer``
        the parameters' placement (a multi-tensor state is packed per device)."""
        return make_optimizer(t.optimizer, schedule, impl=t.optimizer_impl, packer=packer,
                              layer_decay=t.layer_decay, embeddings=spec.family.embeddings,
                              **_hyper(t))

    def flatten(self, tx, params):
        """A parameter tree (the model's) in this layout's form."""
        return params

    def view(self, params):
        """The parameter tree the model reads, from this layout's form."""
        return params

    def differentiated(self, params):
        """What the step differentiates: the leaves the gradient is taken with respect to."""
        return params

    def view_of(self, params, x):
        """``view`` of ``params`` with its differentiated part replaced by ``x``."""
        return x

    def grad_norm(self, grads, params):
        """The global norm of ``grads`` (``differentiated(params)``-shaped): the one the
        optimizer clips by and the step reports."""
        return global_norm(grads)

    def apply(self, tx, grads, opt_state, params):
        """``(params, opt_state)`` after one update by ``grads`` (``differentiated``-shaped)."""
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def state_shardings(self, abstract: TrainState, param_shardings, mesh, zero1: bool):
        """Where each leaf of the train state ``abstract`` (an ``eval_shape``) lives on
        ``mesh``: parameters as ``param_shardings`` say (their form in this layout), the
        optimizer state like them (ZeRO-1: split further), everything else replicated."""
        return _replicated_rest(abstract, mesh).replace(
            params=param_shardings,
            opt_state=state_shardings(abstract.opt_state, param_shardings, mesh, zero1=zero1))


def state_shardings(opt_state, param_shardings, mesh, *, zero1: bool = False):
    """Where an optimizer state (or its ``jax.eval_shape``) lives on ``mesh``: per-parameter
    leaves like their parameter (ZeRO-1: also split over the batch axes), forms by their own
    placement (a multi-tensor Adan's packed moments), anything else replicated."""
    base = shd.opt_state_shardings(opt_state, param_shardings, mesh)
    if zero1:
        base = shd.zero1_shardings(opt_state, base, mesh)
    return forms.shardings(opt_state, base, mesh)


class _Flat(Layout):
    def make_optimizer(self, t, schedule, spec, packer):
        return adan_onepass(schedule, mask=decay_mask, impl=t.optimizer_impl, packer=packer,
                            **_hyper(t))

    def flatten(self, tx, params):
        return tx.flatten(params)

    def view(self, params):
        return params.view()

    def differentiated(self, params):
        return params.buffers

    def view_of(self, params, x):
        return dataclasses.replace(params, buffers=x).view()

    def grad_norm(self, grads, params):
        return params.packing.global_norm(grads)

    def apply(self, tx, grads, opt_state, params):
        return tx.apply(grads, opt_state, params)

    def state_shardings(self, abstract, param_shardings, mesh, zero1):
        packing = abstract.params.packing
        leaves = packing.treedef.unflatten(packing.leaf_shardings(mesh))
        # zero1 is already in the packing (its zero_axes): the buffers' placement says it.
        return _replicated_rest(abstract, mesh).replace(
            params=abstract.params.shardings(None, mesh),
            opt_state=state_shardings(abstract.opt_state, leaves, mesh))


TREE = Layout("tree")
FLAT = _Flat("flat")


def choose(t) -> Layout:
    """The layout of a run with the ``train`` config section ``t``: ``FLAT`` when
    ``train.flat_params`` asks for it and the run can have it, ``TREE`` otherwise.
    ``ValueError`` naming every setting that keeps a run off the flat layout, and the fix."""
    if not t.flat_params:
        return TREE
    problems = []
    if t.optimizer != "adan":
        problems.append(f"train.optimizer=adan (got {t.optimizer!r}: only Adan has a one-pass "
                        "form)")
    if t.optimizer_impl not in ONEPASS_IMPLS:
        problems.append(f"train.optimizer_impl in {ONEPASS_IMPLS} (got {t.optimizer_impl!r}: "
                        "the kernel that updates the flat buffers)")
    if t.layer_decay != 1:
        problems.append(f"train.layer_decay=1 (got {t.layer_decay}: the one-pass Adan has one "
                        "learning rate for all parameters)")
    if problems:
        raise ValueError("train.flat_params=true needs " + "; ".join(problems) +
                         ". Set those, or train.flat_params=false.")
    return FLAT


__all__ = ["FLAT", "Layout", "ONEPASS_IMPLS", "TREE", "choose", "state_shardings"]
