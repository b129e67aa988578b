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

Implementations (``impl``, ``IMPLS``), all computing the same numbers. The kernel's names
(``kernels_pallas.adan.IMPLS``: what the math runs as) and one choice of form:

* ``"per_leaf"``: the kernel's reference applied leaf by leaf (the unfused, single-tensor
  baseline; its state is the portable form checkpoints hold).
* ``"xla"``: multi-tensor: each moment is ``Packed`` in the flat form of
  ``jaxaccel.forms.flat`` (one [rows, 128] buffer per group, ``forms.packing``), each step
  packs the gradients (and the parameters, only when weight decay is on) and unpacks the
  updates; the kernel's reference does the math, fused by XLA.
* ``"pallas"``: the same flat buffers through the fused kernel in ``kernels_pallas/adan.py``
  (interpret mode on CPU).
* ``"mosaic_gpu"``: the same through its Mosaic GPU kernel (Hopper GPUs; jax's Mosaic GPU
  interpreter on CPU).
* ``"auto"``: the flat form and the kernel registry's default order for the platform
  (``kernels_pallas.adan.DEFAULT_ORDER``: the kernel on TPU, the reference on GPU and CPU).

``adan`` is a plain optax ``GradientTransformation``. ``adan_onepass`` is the trainer's faster
path outside optax's contract: the parameters live in the flat form too (``FlatParams``), the
gradient arrives flat, and one kernel pass reads g, p, m, v, n, prev and writes p, m, v, n,
prev in place: no packing, no updates tree, no separate ``apply_updates``.

Sharded parameters (FSDP, tensor parallel, ZeRO-1) are updated per device on the shards each
device holds, packed as the caller's ``packer`` (a ``forms.packing.Packer``) says; this module
knows pytrees only. Checkpoints hold the per-layer form (``forms.portable`` /
``forms.restore``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxaccel.forms.flat import FlatParams, Packed
from jaxaccel.forms.packing import Packer, Packing, is_float, pack, unpack
from jaxaccel.optim.clip import global_norm
from kernels_pallas import adan as kernel
from kernels_pallas.adan import adan_apply, adan_update
from kernels_pallas.adan_reference import adan_reference, make_scalars

PER_LEAF = "per_leaf"
IMPLS = kernel.IMPLS + (PER_LEAF,)


@dataclasses.dataclass(frozen=True)
class AdanState:
    """``count``: steps done. ``m, v, n, prev``: trees like the parameters ("per_leaf", and
    the per-layer form), or each ``Packed`` in the flat form (the multi-tensor impls)."""

    count: jax.Array
    m: Any
    v: Any
    n: Any
    prev: Any

    def replace(self, **kw) -> "AdanState":
        return dataclasses.replace(self, **kw)


jax.tree_util.register_dataclass(AdanState, data_fields=["count", "m", "v", "n", "prev"],
                                 meta_fields=[])


def _mask_leaves(mask, params, treedef, num_leaves):
    if mask is None:
        return [True] * num_leaves
    if callable(mask):
        if params is None:
            raise ValueError("adan: a callable weight-decay mask needs params in update().")
        mask = mask(params)
    return treedef.flatten_up_to(mask)


def _common_dtype(leaves, group):
    dtypes = {jnp.dtype(leaves[i].dtype) for i in group.leaves}
    return dtypes.pop() if len(dtypes) == 1 else jnp.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Rule:
    """The hyperparameters, and what both transforms derive from them."""

    learning_rate: Any
    b1: float
    b2: float
    b3: float
    eps: float
    weight_decay: float
    no_prox: bool
    max_grad_norm: float
    mask: Any
    state_dtype: Any

    @property
    def needs_params(self) -> bool:
        return not (isinstance(self.weight_decay, (int, float)) and self.weight_decay == 0)

    def decay_flags(self, params, treedef, num_leaves):
        """Which leaves get weight decay (all of them when there is no decay: one group)."""
        if not self.needs_params:
            return [True] * num_leaves
        return _mask_leaves(self.mask, params, treedef, num_leaves)

    def packing(self, params, packer: Packer) -> Packing:
        leaves, treedef = jax.tree_util.tree_flatten(params)
        return packer.packing(params, self.decay_flags(params, treedef, len(leaves)),
                            self.state_dtype)

    def scalars(self, count, norm):
        """The kernel's scalar vectors for (no decay, decay), stacked, at step ``count + 1``;
        ``norm()`` is the gradients' global norm, called only where the rule clips."""
        clip = jnp.float32(1.0)
        if not (isinstance(self.max_grad_norm, (int, float)) and self.max_grad_norm <= 0):
            norm = norm()
            clip = jnp.where(self.max_grad_norm > 0,
                             jnp.minimum(self.max_grad_norm / (norm + self.eps), 1.0), 1.0)
        lr = self.learning_rate(count) if callable(self.learning_rate) else self.learning_rate
        return jnp.stack([make_scalars(lr=lr, b1=self.b1, b2=self.b2, b3=self.b3, eps=self.eps,
                                       weight_decay=self.weight_decay if d else 0.0,
                                       count=count, clip=clip) for d in (False, True)])


def _update_per_leaf(leaves, treedef, state, p_leaves, decay, scalars, no_prox):
    """The single-tensor update: the kernel's reference on each float leaf, in the tree form."""
    states = [treedef.flatten_up_to(x) for x in (state.m, state.v, state.n, state.prev)]
    outs = []
    for i, g in enumerate(leaves):
        if not is_float(g) or g.size == 0:
            outs.append((jnp.zeros_like(g),) + tuple(s[i] for s in states))
            continue
        p = p_leaves[i] if (p_leaves is not None and decay[i]) else None
        outs.append(adan_reference(scalars[int(bool(decay[i]))], g,
                                   *(s[i] for s in states), p, no_prox=no_prox))
    cols = list(zip(*outs))
    return tuple(treedef.unflatten(c) for c in cols)


def _update_flat(packing, leaves, state, p_leaves, scalars, no_prox, impl):
    """The multi-tensor update, per device when the packing is sharded: pack the local
    gradient (and parameter) shards, update this device's rows, unpack local updates."""
    grad_idx = packing.packed
    param_idx = [i for g in packing.groups if g.decay for i in g.leaves] \
        if p_leaves is not None else []

    def local(scalars, g, p, m, v, n, prev):
        u_leaves, new = {}, ([], [], [], [])
        for k, group in enumerate(packing.groups):
            dtype = _common_dtype(g, group)
            gk = packing.own_rows(pack(g, group, dtype))
            pk = packing.own_rows(pack(p, group, dtype)) if p and group.decay else None
            u, *st = adan_update(scalars[int(group.decay)], gk, m[k], v[k], n[k], prev[k],
                                 pk, no_prox=no_prox, impl=impl)
            for buf, s in zip(new, st):
                buf.append(s)
            for i, x in unpack(packing.all_rows(u), group, packing).items():
                u_leaves[i] = x.astype(g[i].dtype)
        return u_leaves, tuple(tuple(b) for b in new)

    bufs = packing.buffer_specs
    local = packing.per_device(
        local, in_specs=(P(), packing.leaf_specs(grad_idx), packing.leaf_specs(param_idx),
                         bufs, bufs, bufs, bufs),
        out_specs=(packing.leaf_specs(grad_idx), (bufs,) * 4))
    u, new_state = local(scalars, {i: leaves[i] for i in grad_idx},
                         {i: p_leaves[i] for i in param_idx},
                         *(x.buffers for x in (state.m, state.v, state.n, state.prev)))
    new_leaves = [u[i] if i in u else jnp.zeros_like(x) for i, x in enumerate(leaves)]
    return (packing.treedef.unflatten(new_leaves),
            *(Packed(b, packing) for b in new_state))


def adan(learning_rate: float | Callable = 1e-3, b1: float = 0.98, b2: float = 0.92,
         b3: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0, no_prox: bool = False,
         max_grad_norm: float = 0.0, mask: Any = None, state_dtype: Any = None,
         impl: str = "auto", packer: Packer | None = None) -> optax.GradientTransformation:
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
      impl: one of ``IMPLS``: auto | xla | pallas | mosaic_gpu (the flat form, the kernel
        registry's implementation) or per_leaf.
      packer: how the multi-tensor impls pack the parameters (``forms.packing.Packer``: per
        device for sharded parameters, ZeRO-1; default: unsharded); the "per_leaf" impl
        needs nothing (XLA partitions it like the parameters).
    """
    if impl not in IMPLS:
        raise ValueError(f"adan impl={impl!r} is not one of {IMPLS}.")
    rule = _Rule(learning_rate, b1, b2, b3, eps, weight_decay, no_prox, max_grad_norm, mask,
                 jnp.dtype(state_dtype or jnp.float32))

    def init_fn(params):
        count = jnp.zeros((), jnp.int32)
        if impl == PER_LEAF:
            zeros = lambda: jax.tree_util.tree_map(
                lambda x: jnp.zeros(x.shape if is_float(x) else (), rule.state_dtype), params)
            return AdanState(count, zeros(), zeros(), zeros(), zeros())
        packing = rule.packing(params, packer or Packer())
        return AdanState(count, *(Packed.zeros(packing) for _ in range(4)))

    def update_fn(updates, state: AdanState, params=None):
        if rule.needs_params and params is None:
            raise ValueError("adan with weight_decay != 0 needs params: "
                             "tx.update(grads, state, params).")
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        if not leaves:
            return updates, state.replace(count=state.count + 1)
        scalars = rule.scalars(state.count,
                               lambda: global_norm([x for x in leaves if is_float(x)]))
        p_leaves = treedef.flatten_up_to(params) if rule.needs_params else None
        if not isinstance(state.m, Packed):
            decay = rule.decay_flags(params, treedef, len(leaves))
            out = _update_per_leaf(leaves, treedef, state, p_leaves, decay, scalars, no_prox)
        else:
            if state.m.packing.treedef != treedef:
                raise ValueError("adan: the state was initialised for another parameter tree "
                                 f"({state.m.packing.treedef}); the updates are {treedef}.")
            out = _update_flat(state.m.packing, leaves, state, p_leaves, scalars, no_prox, impl)
        new_updates, m, v, n, prev = out
        return new_updates, AdanState(state.count + 1, m, v, n, prev)

    return optax.GradientTransformation(init_fn, update_fn)


class OnePass(NamedTuple):
    """Adan outside optax's contract, on parameters that live in the flat form.

    ``flatten(params) -> FlatParams``; ``init(flat_params) -> AdanState``;
    ``apply(grads, state, flat_params) -> (flat_params, state)`` with ``grads`` the gradient
    w.r.t. ``flat_params.buffers`` (a tuple of flat buffers, as ``jax.grad`` gives it)."""

    flatten: Callable
    init: Callable
    apply: Callable


def adan_onepass(learning_rate: float | Callable = 1e-3, b1: float = 0.98, b2: float = 0.92,
                 b3: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0,
                 no_prox: bool = False, max_grad_norm: float = 0.0, mask: Any = None,
                 state_dtype: Any = None, impl: str = "auto", packer: Packer | None = None,
                 block_sizes=None) -> OnePass:
    """The one-pass Adan: same arguments and numbers as ``adan`` (``impl`` one of the kernel's
    ``kernels_pallas.adan.IMPLS``; ``block_sizes`` the kernel's, default per target). Per group
    and device, one ``adan_apply``:

        reads  g, p, m, v, n, prev    (6 words per parameter)
        writes p, m, v, n, prev       (5 words, aliased in place)

    plus one read of g for the clipping norm when ``max_grad_norm > 0``. With ZeRO-1 (the
    ``packer``'s zero axes) each device updates its rows of the parameters and gathers the
    others."""
    kernel.APPLY.candidates(impl)                  # a known name, before anything is built
    rule = _Rule(learning_rate, b1, b2, b3, eps, weight_decay, no_prox, max_grad_norm, mask,
                 jnp.dtype(state_dtype or jnp.float32))

    def flatten(params) -> FlatParams:
        return FlatParams.create(rule.packing(params, packer or Packer()), params)

    def init(params: FlatParams) -> AdanState:
        return AdanState(jnp.zeros((), jnp.int32),
                         *(Packed.zeros(params.packing) for _ in range(4)))

    def apply(grads, state: AdanState, params: FlatParams):
        packing = params.packing
        if state.m.packing != packing:
            raise ValueError("adan_onepass: the state's packing is not the parameters'; build "
                             "it with init(flat_params).")
        if len(grads) != len(packing.groups):
            raise ValueError(f"adan_onepass: {len(grads)} gradient buffers for "
                             f"{len(packing.groups)} groups; pass the gradient w.r.t. "
                             "flat_params.buffers.")
        scalars = rule.scalars(state.count, lambda: packing.global_norm(grads))

        def local(scalars, g, p, m, v, n, prev):
            out = ([], [], [], [], [])
            for k, group in enumerate(packing.groups):
                new = adan_apply(scalars[int(group.decay)], packing.own_rows(g[k]),
                                 packing.own_rows(p[k]), m[k], v[k], n[k], prev[k],
                                 no_prox=no_prox, impl=impl, block_sizes=block_sizes)
                for buf, x in zip(out, (packing.all_rows(new[0]),) + new[1:]):
                    buf.append(x)
            return tuple(out[0]), tuple(tuple(b) for b in out[1:])

        bufs, pbufs = packing.buffer_specs, packing.param_specs
        local = packing.per_device(local, in_specs=(P(), pbufs, pbufs, bufs, bufs, bufs, bufs),
                                  out_specs=(pbufs, (bufs,) * 4))
        p, new = local(scalars, tuple(grads), params.buffers,
                       *(x.buffers for x in (state.m, state.v, state.n, state.prev)))
        return (dataclasses.replace(params, buffers=p),
                AdanState(state.count + 1, *(Packed(b, packing) for b in new)))

    return OnePass(flatten, init, apply)


def _is_state(x) -> bool:
    return isinstance(x, AdanState)


def restart(state):
    """The official ``restart_opt``: step counter to 0, m, v and n zeroed (works on an
    ``AdanState`` or an optax chain/inject_hyperparams state containing one)."""
    def fix(node):
        if _is_state(node):
            z = lambda t: jax.tree_util.tree_map(jnp.zeros_like, t)
            return node.replace(count=jnp.zeros_like(node.count), m=z(node.m), v=z(node.v),
                                n=z(node.n))
        return node
    return jax.tree_util.tree_map(fix, state, is_leaf=_is_state)
