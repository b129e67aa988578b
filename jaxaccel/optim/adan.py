"""Adan (Xie et al., 2022) as an optax transform, following the official PyTorch code.

The rule (official sail-sg/Adan ``adan.py``; betas are the code's), per step t = 1, 2, ...:

    clip = min(max_grad_norm / (||grads||_2 + eps), 1) if max_grad_norm > 0 else 1
    g = clip * grad;  d = g - prev (0 at t = 1);  prev <- g
    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) d;  n = b3 n + (1 - b3) (g + b2 d)^2
    den  = sqrt(n) / sqrt(1 - b3^t) + eps
    step = lr / (1 - b1^t) m / den + lr b2 / (1 - b2^t) v / den
    no_prox: p <- p (1 - lr wd) - step;   else: p <- (p - step) / (1 + lr wd)

``optax.adan`` differs: it scales the gradient difference of the n-update by (1 - b2) where the
official code uses b2, so the two give different trajectories (tests/test_adan.py shows it).

Implementations (``impl``), all computing the same numbers:

* ``"reference"``: per-leaf jnp math (the unfused, single-tensor baseline).
* ``"xla"``: multi-tensor: every float leaf packed into one flat [rows, 128] buffer per group
  (decayed / not decayed), the update left to XLA to fuse.
* ``"pallas"``: the same flat buffers through the fused kernel in ``kernels_pallas/adan.py``
  (interpret mode on CPU).
* ``"auto"``: pallas on GPU/TPU, xla on CPU.

Layout: in the multi-tensor impls the optimizer state (m, v, n, prev) lives *flat*
permanently, so a step packs only the gradients (and the parameters, only when weight decay is
on) and unpacks the updates: 2 or 3 copies of the model's size per step, none of the state.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kernels_pallas import _backend
from kernels_pallas.adan import LANES, ROW_ALIGN, adan_reference, adan_update, make_scalars

IMPLS = ("auto", "reference", "xla", "pallas")


class AdanState(NamedTuple):
    """``count``: steps done. ``m, v, n, prev``: per-leaf trees ("reference") or tuples of flat
    [rows, 128] buffers, one per group ("xla", "pallas")."""

    count: jax.Array
    m: Any
    v: Any
    n: Any
    prev: Any


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype,
                          jnp.floating)


def _mask_leaves(mask, params, treedef, num_leaves):
    if mask is None:
        return [True] * num_leaves
    if callable(mask):
        if params is None:
            raise ValueError("adan: a callable weight-decay mask needs params in update().")
        mask = mask(params)
    return treedef.flatten_up_to(mask)


class _Group(NamedTuple):
    decay: bool
    leaves: tuple          # leaf indices
    offsets: tuple         # start of each leaf in the flat buffer
    rows: int


def _layout(leaves, decay_flags) -> tuple[_Group, ...]:
    """Float, non-empty leaves, grouped by whether they get weight decay."""
    groups = []
    for decay in (True, False):
        idx = [i for i, x in enumerate(leaves)
               if _is_float(x) and np.prod(x.shape) > 0 and bool(decay_flags[i]) == decay]
        if not idx:
            continue
        sizes = [int(np.prod(leaves[i].shape)) for i in idx]
        offsets = tuple(int(o) for o in np.cumsum([0] + sizes[:-1]))
        chunk = ROW_ALIGN * LANES
        rows = -(-sum(sizes) // chunk) * ROW_ALIGN
        groups.append(_Group(decay, tuple(idx), offsets, rows))
    return tuple(groups)


def _pack(leaves, group: _Group, dtype):
    flat = jnp.concatenate([leaves[i].reshape(-1).astype(dtype) for i in group.leaves])
    return jnp.pad(flat, (0, group.rows * LANES - flat.shape[0])).reshape(group.rows, LANES)


def _common_dtype(leaves, group: _Group):
    dtypes = {jnp.dtype(leaves[i].dtype) for i in group.leaves}
    return dtypes.pop() if len(dtypes) == 1 else jnp.dtype(jnp.float32)


def adan(learning_rate: float | Callable = 1e-3, b1: float = 0.98, b2: float = 0.92,
         b3: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0, no_prox: bool = False,
         max_grad_norm: float = 0.0, mask: Any = None, state_dtype: Any = None,
         impl: str = "auto") -> optax.GradientTransformation:
    """Adan following the official code (see module docstring).

    Args:
      learning_rate: a float, a scalar array (e.g. injected by ``optax.inject_hyperparams``) or
        a schedule ``count -> lr``.
      b1, b2, b3, eps: the official code's coefficients.
      weight_decay: decoupled weight decay; ``mask`` (a pytree of bools or a callable
        ``params -> bools``, like ``optax.adamw``) selects the leaves it applies to.
      no_prox: the official ``no_prox`` switch (multiplicative decay instead of proximal).
      max_grad_norm: global-norm clipping inside the optimizer, as the official code; 0 = off.
      state_dtype: dtype of m, v, n, prev (default float32); math is float32 regardless.
      impl: reference | xla | pallas | auto.
    """
    if impl not in IMPLS:
        raise ValueError(f"adan impl={impl!r} is not one of {IMPLS}.")
    state_dtype = jnp.dtype(state_dtype or jnp.float32)
    needs_params = not (isinstance(weight_decay, (int, float)) and weight_decay == 0)

    def decay_flags(params, treedef, num_leaves):
        """Which leaves get weight decay (all of them when there is no decay: one group)."""
        if not needs_params:
            return [True] * num_leaves
        return _mask_leaves(mask, params, treedef, num_leaves)

    def resolved_impl():
        if impl != "auto":
            return impl
        return "pallas" if _backend.resolve("auto") in ("tpu", "gpu") else "xla"

    def init_fn(params):
        leaves, treedef = jax.tree_util.tree_flatten(params)
        count = jnp.zeros((), jnp.int32)
        if resolved_impl() == "reference":
            zeros = lambda: jax.tree_util.tree_map(
                lambda x: jnp.zeros(x.shape if _is_float(x) else (), state_dtype), params)
            return AdanState(count, zeros(), zeros(), zeros(), zeros())
        groups = _layout(leaves, decay_flags(params, treedef, len(leaves)))
        zeros = lambda: tuple(jnp.zeros((g.rows, LANES), state_dtype) for g in groups)
        return AdanState(count, zeros(), zeros(), zeros(), zeros())

    def update_fn(updates, state: AdanState, params=None):
        if needs_params and params is None:
            raise ValueError("adan with weight_decay != 0 needs params: "
                             "tx.update(grads, state, params).")
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        if not leaves:
            return updates, state._replace(count=state.count + 1)
        float_leaves = [x for x in leaves if _is_float(x)]
        clip = jnp.float32(1.0)
        if not (isinstance(max_grad_norm, (int, float)) and max_grad_norm <= 0):
            norm = jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                                for x in float_leaves))
            clip = jnp.where(max_grad_norm > 0,
                             jnp.minimum(max_grad_norm / (norm + eps), 1.0), 1.0)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        decay = decay_flags(params, treedef, len(leaves))
        scalars = {d: make_scalars(lr=lr, b1=b1, b2=b2, b3=b3, eps=eps,
                                   weight_decay=weight_decay if d else 0.0,
                                   count=state.count, clip=clip) for d in (True, False)}
        p_leaves = treedef.flatten_up_to(params) if needs_params else None
        which = resolved_impl()
        if which == "reference":
            out = _update_per_leaf(leaves, treedef, state, p_leaves, decay, scalars)
        else:
            out = _update_flat(leaves, treedef, state, p_leaves, decay, scalars,
                               "xla" if which == "xla" else
                               ("interpret" if _backend.platform() == "cpu" else "auto"))
        new_updates, m, v, n, prev = out
        return new_updates, AdanState(state.count + 1, m, v, n, prev)

    def _update_per_leaf(leaves, treedef, state, p_leaves, decay, scalars):
        states = [treedef.flatten_up_to(x) for x in (state.m, state.v, state.n, state.prev)]
        outs = []
        for i, g in enumerate(leaves):
            if not _is_float(g) or g.size == 0:
                outs.append((jnp.zeros_like(g),) + tuple(s[i] for s in states))
                continue
            p = p_leaves[i] if (p_leaves is not None and decay[i]) else None
            outs.append(adan_reference(scalars[bool(decay[i])], g, *(s[i] for s in states), p,
                                       no_prox=no_prox))
        cols = list(zip(*outs))
        return tuple(treedef.unflatten(c) for c in cols)

    def _update_flat(leaves, treedef, state, p_leaves, decay, scalars, backend):
        groups = _layout(leaves, decay)
        new_leaves = [jnp.zeros_like(x) for x in leaves]
        new_state = ([], [], [], [])
        for k, group in enumerate(groups):
            dtype = _common_dtype(leaves, group)
            g = _pack(leaves, group, dtype)
            p = _pack(p_leaves, group, dtype) if (p_leaves is not None and group.decay) else None
            u, *st = adan_update(scalars[group.decay], g, state.m[k], state.v[k], state.n[k],
                                 state.prev[k], p, no_prox=no_prox, backend=backend)
            for buf, s in zip(new_state, st):
                buf.append(s)
            flat = u.reshape(-1)
            for i, off in zip(group.leaves, group.offsets):
                x = leaves[i]
                new_leaves[i] = flat[off:off + x.size].reshape(x.shape).astype(x.dtype)
        return (treedef.unflatten(new_leaves),) + tuple(tuple(s) for s in new_state)

    return optax.GradientTransformation(init_fn, update_fn)


def restart(state):
    """The official ``restart_opt``: step counter to 0, m, v and n zeroed (works on an
    ``AdanState`` or an optax chain/inject_hyperparams state containing one)."""
    def fix(node):
        if isinstance(node, AdanState):
            z = lambda t: jax.tree_util.tree_map(jnp.zeros_like, t)
            return node._replace(count=jnp.zeros_like(node.count), m=z(node.m), v=z(node.v),
                                 n=z(node.n))
        return node
    return jax.tree_util.tree_map(fix, state, is_leaf=lambda x: isinstance(x, AdanState))
