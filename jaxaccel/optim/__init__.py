"""Optimizers by name, as optax ``GradientTransformation``s, and learning-rate schedules.

``make_optimizer`` builds what the trainer uses: global-norm clipping, the optimizer with
decoupled weight decay masked off biases and LayerNorm parameters, and a warm-up schedule.
Adan (``jaxaccel.optim.adan``) follows the official algorithm and has fused implementations.
"""
from __future__ import annotations

import jax
import optax

OPTIMIZERS = ("adamw", "adan")


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
        raise ValueError(f"schedule {kind!r} is unknown; expected one of {sorted(after)}.")
    if warmup_steps == 0:
        return after[kind]
    warm = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    return optax.join_schedules([warm, after[kind]], [warmup_steps])


def decay_mask(params):
    """True for parameters that get weight decay: everything but biases and LayerNorm scales."""
    def keep(path, _):
        name = getattr(path[-1], "key", getattr(path[-1], "name", None))
        return name not in ("bias", "scale")
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(name: str, learning_rate, *, weight_decay: float = 0.0,
                   max_grad_norm: float = 0.0, b1=None, b2=None, b3=None, eps=None,
                   impl: str = "auto") -> optax.GradientTransformation:
    """The optimizer ``name`` with clipping and masked weight decay; ``None`` = its default."""
    if name == "adamw":
        tx = optax.adamw(learning_rate, b1=0.9 if b1 is None else b1,
                         b2=0.999 if b2 is None else b2, eps=1e-8 if eps is None else eps,
                         weight_decay=weight_decay, mask=decay_mask)
        return optax.chain(optax.clip_by_global_norm(max_grad_norm), tx) if max_grad_norm > 0 else tx
    if name == "adan":
        from jaxaccel.optim.adan import adan
        kw = {k: v for k, v in dict(b1=b1, b2=b2, b3=b3, eps=eps).items() if v is not None}
        return adan(learning_rate, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                    mask=decay_mask, impl=impl, **kw)
    raise ValueError(f"optimizer {name!r} is unknown; expected one of {OPTIMIZERS}.")
