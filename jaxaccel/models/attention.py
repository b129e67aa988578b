"""The one attention entry point the models call: the kernel registry, run per shard.

``attention(q, k, v, attention_mask, impl=...)`` takes q as [batch, seq, heads, head_dim]
and k/v as [batch, kv_seq, kv_heads, head_dim] (the layout of ``jax.nn.dot_product_attention``;
kv_heads < heads is grouped-query attention), a [batch, kv_seq] 0/1 padding mask, and for
decoders ``segment_ids`` (packed documents: [batch, seq], or a (q, kv) pair when the query is
a suffix of the keys, as in cached decoding) and ``causal``. It calls
``kernels_pallas.attention.attention`` with ``impl`` one of ``ATTENTION_IMPLS`` (that
kernel's registry: ``"auto"``, ``"xla"`` (the reference), ``"pallas"``, ``"cudnn"``,
``"mosaic_gpu"``) or a tuple of them. One function, one semantics: switching implementations changes rounding only.

* The mask is read as key lengths (``attention_mask.sum(-1)``) by every implementation: exact
  for right-padded batches, which is what the BERT tokenizers produce. A row without any key
  (an all-padding row) gives zeros.
* Attention dropout exists in ``"xla"`` only. A model checks its ``impl`` against its dropout
  when it is built (``check_impl``); ``"auto"`` falls back to ``"xla"`` while dropout is on.
* Any implementation but the plain-XLA reference runs per shard (``sharding.per_shard``):
  batch and (query and key/value) heads split as the logical-axis rules say, over the ambient mesh or the one q/k/v
  are placed on, so a Pallas kernel never runs on gathered operands. The reference (``"xla"``,
  or any impl while dropout is on) runs on the global arrays and XLA partitions it like the
  rest of the model; the dropout mask then does not depend on the mesh.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxaccel import sharding as shd
from kernels_pallas import attention as kernel
from kernels_pallas.attention import IMPLS as ATTENTION_IMPLS, check_impl

__all__ = ["ATTENTION_IMPLS", "attention", "check_config", "check_impl", "check_target"]


def check_config(impl: str, policy) -> None:
    """``model.attention_impl`` is a name of the kernel's registry and works under ``policy``
    (a ``precision.Policy``)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"model.attention_impl={impl!r} is not one of {ATTENTION_IMPLS}.")
    half_only = {"cudnn": "cuDNN flash attention", "mosaic_gpu": "the Mosaic GPU flash "
                 "attention (Hopper warpgroup MMAs)"}
    if impl in half_only and policy.name == "fp32":
        raise ValueError(f"model.attention_impl={impl!r} with precision.policy='fp32': "
                         f"{half_only[impl]} takes fp16/bf16 inputs only. Use precision.policy="
                         "bf16, fp16 or fp8 (attention runs in bf16 under fp8), or "
                         "model.attention_impl='xla' or 'pallas'.")


def check_target(impl: str, platform: str, target: str) -> None:
    """``model.attention_impl`` runs on the devices of a planned ``target`` (jax's
    ``platform`` name): ``jaxaccel compile`` checks it before the run is resolved, so that a
    kernel the target cannot run is named before advice about other settings (the policy
    cuDNN needs) that would not make it run."""
    only = kernel.ONLY_ON.get(impl)
    if only and platform not in only:
        raise ValueError(f"model.attention_impl={impl!r} runs on {'/'.join(only).upper()}s "
                         f"only, and the devices of the target {target} are "
                         f"{platform.upper()}s: use model.attention_impl='auto' (the best "
                         "kernel the target has), 'pallas' or 'xla'.")


_Q = shd.logical_to_mesh(("batch", None, "heads", None))
_KV = shd.logical_to_mesh(("batch", None, "kv_heads", None))
_ROWS = shd.logical_to_mesh(("batch",))
_SEQ = shd.logical_to_mesh(("batch", None))


def attention(q, k, v, attention_mask=None, *, segment_ids=None, causal: bool = False,
              impl="xla", dropout_rate: float = 0.0, deterministic: bool = True,
              dropout_rng=None, dropout_rows=None):
    """Multi-head attention over [batch, seq, heads, head_dim] inputs; returns q's layout and
    dtype. ``segment_ids``: [batch, seq] ints or a (q [batch, seq], kv [batch, kv_seq]) pair; a
    query attends only to keys of its segment. ``causal``: query i attends keys j <= i.
    ``dropout_rows`` (int [batch]): each row's number in the whole batch, for a micro-batch
    (``models.stack``): its dropout masks are then that batch's rows'."""
    lengths = None if attention_mask is None else attention_mask.astype(jnp.int32).sum(axis=-1)
    rate = 0.0 if deterministic else dropout_rate
    masks = {k: v for k, v in (("key_lengths", lengths), ("segment_ids", segment_ids))
             if v is not None}
    if impl == "xla" or rate > 0:
        return kernel.attention(q, k, v, **masks, causal=causal, dropout_rate=rate,
                                dropout_rng=dropout_rng, dropout_rows=dropout_rows, impl=impl)
    mask_specs = {"key_lengths": _ROWS, "segment_ids": (_SEQ, _SEQ)
                  if isinstance(segment_ids, (tuple, list)) else _SEQ}
    local = shd.per_shard(
        lambda q, k, v, m: kernel.attention(q, k, v, **m, causal=causal, impl=impl),
        (_Q, _KV, _KV, {name: mask_specs[name] for name in masks}), _Q)
    return local(q, k, v, masks)
