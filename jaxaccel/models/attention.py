"""The one attention entry point the models call, with an ``attention_impl`` switch.

``attention(q, k, v, attention_mask, impl=...)`` takes q/k/v as [batch, seq, heads, head_dim]
(the layout of ``jax.nn.dot_product_attention``) and a [batch, kv_seq] 0/1 padding mask:

* ``"xla"``: plain einsums, softmax in float32, attention dropout supported; runs everywhere.
* ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (NVIDIA GPUs, fp16/bf16).
* ``"pallas"``: ``kernels_pallas.attention.flash_attention`` (Mosaic on TPU, Pallas on GPU,
  interpreter on CPU).

Under a mesh (``jax.set_mesh``) the Pallas kernel runs per shard (batch and heads split as the
sharding rules say) rather than on gathered operands. The fused implementations take padding as
key lengths (``attention_mask.sum(-1)``): that is
exact for right-padded batches, which is what the BERT tokenizers produce. They have no
attention dropout; asking for it is an error rather than a silent change of the model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

ATTENTION_IMPLS = ("xla", "cudnn", "pallas")


def check_impl(impl: str, dropout_rate: float, deterministic: bool) -> None:
    """Validate the implementation name and its compatibility with attention dropout."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r} is unknown; expected one of {ATTENTION_IMPLS}.")
    if impl != "xla" and dropout_rate > 0 and not deterministic:
        raise ValueError(
            f"attention_impl={impl!r} has no attention dropout, but the model asks for "
            f"attention_probs_dropout_prob={dropout_rate}. Either set the model's attention "
            "dropout to 0 (config: model.attention_dropout=0.0) or use attention_impl='xla'.")


@jax.custom_vjp
def _scores(q, k):
    """Unscaled scores q k^T: [b, q, h, d] x [b, k, h, d] -> [b, h, q, k], accumulated and
    returned in float32 (the softmax's input).

    Differentiated by hand so that the backward matmuls, like the forward ones, take their
    operands in the compute dtype: autodiff would multiply the float32 score cotangent with
    k and q upcast to float32 (float32/TF32 matmuls over [b, h, q, k] in a bf16 model). The
    cotangent dS is rounded to q's dtype first, as the fused kernels (Pallas, cuDNN) do."""
    return jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)


def _scores_fwd(q, k):
    return _scores(q, k), (q, k)


def _scores_bwd(res, ds):
    q, k = res
    ds = ds.astype(q.dtype)
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q, preferred_element_type=jnp.float32)
    return dq.astype(q.dtype), dk.astype(k.dtype)


_scores.defvjp(_scores_fwd, _scores_bwd)


def _xla_attention(q, k, v, attention_mask, dropout_rate, deterministic, dropout_rng):
    scores = _scores(q, k) * q.shape[-1] ** -0.5
    if attention_mask is not None:
        keep = attention_mask[:, None, None, :].astype(bool)
        scores = jnp.where(keep, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    if dropout_rate > 0 and not deterministic:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
        probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
    # probs @ v in v's dtype: the matmul accumulates in float32 and rounds once, and its
    # backward (dP = dO v^T, dV = P^T dO) multiplies compute-dtype operands.
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v).astype(q.dtype)


def attention(q, k, v, attention_mask=None, *, impl: str = "xla", dropout_rate: float = 0.0,
              deterministic: bool = True, dropout_rng=None):
    """Multi-head attention over [batch, seq, heads, head_dim] inputs; returns q's layout and dtype."""
    check_impl(impl, dropout_rate, deterministic)
    if impl == "xla":
        return _xla_attention(q, k, v, attention_mask, dropout_rate, deterministic, dropout_rng)
    lengths = None
    if attention_mask is not None:
        lengths = attention_mask.astype(jnp.int32).sum(axis=-1)
    if impl == "cudnn":
        if jax.default_backend() != "gpu":
            raise ValueError(f"attention_impl='cudnn' needs an NVIDIA GPU; this run's backend is "
                             f"{jax.default_backend()!r}. Use attention_impl='xla' or 'pallas'.")
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                            implementation="cudnn")
    from kernels_pallas.attention import flash_attention
    from jaxaccel.sharding import map_over_mesh
    qkv = ("batch", None, "heads", None)
    args, specs = (q, k, v), (qkv, qkv, qkv)
    if lengths is not None:
        args, specs = args + (lengths,), specs + (("batch",),)
    local = map_over_mesh(
        lambda q, k, v, n=None: flash_attention(q, k, v, key_lengths=n, backend="pallas"),
        specs, qkv)
    return local(*args)
