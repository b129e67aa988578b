"""The one attention entry point the models call: the kernel registry, run per shard.

``attention(q, k, v, attention_mask, impl=...)`` takes q/k/v as [batch, seq, heads, head_dim]
(the layout of ``jax.nn.dot_product_attention``) and a [batch, kv_seq] 0/1 padding mask, and
calls ``kernels_pallas.attention.attention`` with ``impl`` one of ``ATTENTION_IMPLS`` (that
kernel's registry: ``"auto"``, ``"xla"`` (the reference), ``"pallas"``, ``"cudnn"``) or a
tuple of them. One function, one semantics: switching implementations changes rounding only.

* The mask is read as key lengths (``attention_mask.sum(-1)``) by every implementation: exact
  for right-padded batches, which is what the BERT tokenizers produce. A row without any key
  (an all-padding row) gives zeros.
* Attention dropout exists in ``"xla"`` only. A model checks its ``impl`` against its dropout
  when it is built (``check_impl``); ``"auto"`` falls back to ``"xla"`` while dropout is on.
* Any implementation but the plain-XLA reference runs per shard (``sharding.per_shard``):
  batch and heads split as the logical-axis rules say, over the ambient mesh or the one q/k/v
  are placed on, so a Pallas kernel never runs on gathered operands. The reference (``"xla"``,
  or any impl while dropout is on) runs on the global arrays and XLA partitions it like the
  rest of the model; the dropout mask then does not depend on the mesh.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxaccel import sharding as shd
from kernels_pallas import attention as kernel
from kernels_pallas.attention import IMPLS as ATTENTION_IMPLS, check_impl

__all__ = ["ATTENTION_IMPLS", "attention", "check_impl"]

_QKV = shd.logical_to_mesh(("batch", None, "heads", None))
_ROWS = shd.logical_to_mesh(("batch",))


def attention(q, k, v, attention_mask=None, *, impl="xla", dropout_rate: float = 0.0,
              deterministic: bool = True, dropout_rng=None):
    """Multi-head attention over [batch, seq, heads, head_dim] inputs; returns q's layout and dtype."""
    lengths = None if attention_mask is None else attention_mask.astype(jnp.int32).sum(axis=-1)
    rate = 0.0 if deterministic else dropout_rate
    if impl == "xla" or rate > 0:
        return kernel.attention(q, k, v, key_lengths=lengths, dropout_rate=rate,
                                dropout_rng=dropout_rng, impl=impl)
    args, specs = (q, k, v), (_QKV, _QKV, _QKV)
    if lengths is not None:
        args, specs = args + (lengths,), specs + (_ROWS,)
    local = shd.per_shard(
        lambda q, k, v, n=None: kernel.attention(q, k, v, key_lengths=n, impl=impl),
        specs, _QKV)
    return local(*args)
