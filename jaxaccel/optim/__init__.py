"""Optimizers by name, as optax ``GradientTransformation``s, and learning-rate schedules.

``make_optimizer`` builds what the trainer uses: global-norm clipping, the optimizer with
decoupled weight decay masked off biases and LayerNorm parameters, a warm-up schedule, and
optionally layer-wise learning-rate decay (``jaxaccel.optim.layer_decay``).
Adan (``jaxaccel.optim.adan``) follows the official algorithm and has fused implementations;
``adan.adan_onepass`` is its one-pass form for parameters kept flat (``jaxaccel.forms.flat``;
the trainer's flat layout, ``jaxaccel.train.layout``). ``IMPLS``: what ``impl`` (config
``train.optimizer_impl``) takes.

The optimizers know pytrees only: their states mirror the parameters in whatever form the
caller holds them (``jaxaccel.forms``), and the caller places the states and converts them
for checkpoints.
"""
from __future__ import annotations

import jax
import optax

from jaxaccel.optim.clip import clip_by_global_norm, global_norm
from jaxaccel.optim.layer_decay import entry_name, scale_by_layer
from jaxaccel.optim.adan import IMPLS, adan

__all__ = ["IMPLS", "OPTIMIZERS", "SCHEDULES", "check_config", "decay_mask", "global_norm",
           "make_optimizer", "make_schedule", "scale_by_layer"]

OPTIMIZERS = ("adamw", "adan")


SCHEDULES = ("linear", "cosine", "constant")


def check_config(t) -> None:
    """The ``train`` config section's optimizer choices are names this package has."""
    choices = {"train.schedule": (t.schedule, SCHEDULES),
               "train.optimizer": (t.optimizer, OPTIMIZERS),
               "train.optimizer_impl": (t.optimizer_impl, IMPLS)}
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ValueError(f"{key}={value!r} is not one of {allowed}.")


def make_schedule(kind: str, learning_rate: float, total_steps: int, warmup_steps: int):
    """Linear warm-up from 0 to ``learning_rate``, then linear/cosine decay to 0 or constant."""
    total_steps, warmup_steps = max(total_steps, 1), min(warmup_steps, max(total_steps - 1, 0))
    decay_steps = max(total_steps - warmup_steps, 1)
    after = {
        "linear": optax.linear_schedule(learning_rate, 0.0, decay_steps),
        "cosine": optax.cosine_decay_schedule(learning_rate, decay_steps),
        "constant": optax.constant_schedule(learning_rate),
    }
    if kind not in after:
        raise ValueError(f"schedule {kind!r} is unknown; expected one of {SCHEDULES}.")
    if warmup_steps == 0:
        return after[kind]
    warm = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    return optax.join_schedules([warm, after[kind]], [warmup_steps])


def decay_mask(params):
    """True for parameters that get weight decay: everything but biases and LayerNorm scales."""
    def keep(path, _):
        return entry_name(path[-1]) not in ("bias", "scale")
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(name: str, learning_rate, *, weight_decay: float = 0.0,
                   max_grad_norm: float = 0.0, b1=None, b2=None, b3=None, eps=None,
                   impl: str = "auto", packer=None, layer_decay: float = 1.0,
                   embeddings: tuple[str, ...] = ()) -> optax.GradientTransformation:
    """The optimizer ``name`` with clipping and masked weight decay; ``None`` = its default.

    ``packer`` (a ``forms.packing.Packer``: the parameters' placement) matters to the
    multi-tensor Adan, whose flat state is packed per device. ``layer_decay`` < 1 scales each
    layer's updates
    (``scale_by_layer``; ``embeddings``: the model family's, ``models.spec.Family``)."""
    if name == "adamw":
        tx = optax.adamw(learning_rate, b1=0.9 if b1 is None else b1,
                         b2=0.999 if b2 is None else b2, eps=1e-8 if eps is None else eps,
                         weight_decay=weight_decay, mask=decay_mask)
        tx = optax.chain(clip_by_global_norm(max_grad_norm), tx) if max_grad_norm > 0 else tx
    elif name == "adan":
        tx = adan(learning_rate, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                  mask=decay_mask, impl=impl, packer=packer,
                  **_given(b1=b1, b2=b2, b3=b3, eps=eps))
    else:
        raise ValueError(f"optimizer {name!r} is unknown; expected one of {OPTIMIZERS}.")
    return optax.chain(tx, scale_by_layer(layer_decay, embeddings)) if layer_decay != 1.0 else tx


def _given(**kw) -> dict:
    return {k: v for k, v in kw.items() if v is not None}
