"""BERT in Flax NNX: embeddings, post-LayerNorm encoder, pooler, classification and MLM heads.

Numerically the same model as Hugging Face's ``BertModel`` (exact-erf GELU, post-LN, pooler =
tanh(dense(first token))). Every parameter carries logical axis names (``vocab``, ``embed``,
``heads``, ``mlp``); ``jaxaccel.sharding`` maps them to mesh axes. Dtypes come from a
``jaxaccel.precision.Policy``: matmuls run in ``policy.compute_dtype``, parameters are stored in
``policy.param_dtype``, the hidden states (the layer norms' outputs) in
``policy.activation_dtype``; the embeddings' sum, the layer norms' statistics and softmax run in
float32. Under the fp8 policy the encoder's Dense layers (QKV, attention output, MLP in/out)
are ``fp8.Fp8Linear`` (``layers.dense``: same parameters plus non-trainable ``Fp8Meta``
scales); attention, pooler and heads stay bf16.

    model = BertModel(ModelSpec(architectures.PRESETS["tiny"], num_labels=2), policy="bf16")
    out = model(input_ids, attention_mask=mask)      # out.last_hidden_state, .pooler_output, .logits

What the model is comes from a ``spec.ModelSpec``; ``hf.from_pretrained`` loads a Hugging Face
checkpoint.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax import struct

from jaxaccel.flops import Shape
from jaxaccel.models.architectures import BertConfig
from jaxaccel.models.attention import ATTENTION_IMPLS, attention, check_impl
from jaxaccel.models.dropout import Dropout
from jaxaccel.models.family import FamilyModel
from jaxaccel.models.layers import ACTIVATIONS, dense, layer_norm, partitioned
from jaxaccel.models.remat import tag
from jaxaccel.models.spec import ModelSpec
from jaxaccel.models.stack import layers_key, sequential, token_rows
from jaxaccel.models.unpad import Unpadded
from jaxaccel.precision import Policy, get_policy
from jaxaccel.sharding import residual


@struct.dataclass
class BertOutput:
    last_hidden_state: jax.Array
    pooler_output: jax.Array | None = None
    logits: jax.Array | None = None


# fp8 layer groups: in-layer path of each encoder Dense -> group name (metrics).
FP8_GROUPS = {("attention", "query"): "qkv", ("attention", "key"): "qkv",
              ("attention", "value"): "qkv", ("attention", "output"): "attn_out",
              ("intermediate",): "mlp_in", ("output",): "mlp_out"}


def _dense(din, dout, axes, cfg: BertConfig, policy: Policy, rngs, encoder: bool = False):
    """A Dense layer (``layers.dense``); an encoder matmul (``encoder=True``) is fp8 under the
    fp8 policy."""
    return dense(din, dout, axes, cfg.initializer_range, policy, rngs, block=encoder)


def _layer_norm(cfg: BertConfig, policy: Policy, rngs):
    return layer_norm(cfg.hidden_size, cfg.layer_norm_eps, policy, rngs)


def _embed(n, cfg: BertConfig, policy: Policy, axes, rngs):
    return nnx.Embed(n, cfg.hidden_size, dtype=jnp.float32, param_dtype=policy.param_dtype,
                     embedding_init=partitioned(nnx.initializers.normal(cfg.initializer_range),
                                                axes), rngs=rngs)


class BertEmbeddings(nnx.Module):
    def __init__(self, cfg: BertConfig, policy: Policy, rngs: nnx.Rngs):
        self.word_embeddings = _embed(cfg.vocab_size, cfg, policy, ("vocab", "embed"), rngs)
        self.position_embeddings = _embed(cfg.max_position_embeddings, cfg, policy,
                                          (None, "embed"), rngs)
        self.token_type_embeddings = _embed(cfg.type_vocab_size, cfg, policy, (None, "embed"), rngs)
        self.layer_norm = _layer_norm(cfg, policy, rngs)
        self.dropout = Dropout(cfg.hidden_dropout_prob)

    def __call__(self, input_ids, token_type_ids, positions, deterministic, rngs, rows=None):
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(token_type_ids))
        return self.dropout(self.layer_norm(x), deterministic=deterministic, rngs=rngs,
                            rows=rows)


def _hidden_rows(x, tokens: Unpadded | None, rows):
    """The dropout row numbers of hidden states ``x``: the unpadded tokens' (``tokens``), a
    micro-batch's (``rows``, ``stack.token_rows``), or None (row-major: the whole batch)."""
    return tokens.rows() if tokens is not None else token_rows(rows, x.shape[1])


class BertAttention(nnx.Module):
    """Self-attention plus its output projection, residual and post-LayerNorm."""

    def __init__(self, cfg: BertConfig, policy: Policy, attention_impl: str, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.cfg, self.attention_impl = cfg, attention_impl
        self.query = _dense(h, h, ("embed", "heads"), cfg, policy, rngs, True)
        self.key = _dense(h, h, ("embed", "heads"), cfg, policy, rngs, True)
        self.value = _dense(h, h, ("embed", "heads"), cfg, policy, rngs, True)
        self.output = _dense(h, h, ("heads", "embed"), cfg, policy, rngs, True)
        self.layer_norm = _layer_norm(cfg, policy, rngs)
        self.dropout = Dropout(cfg.hidden_dropout_prob)

    def __call__(self, x, attention_mask, deterministic, rngs, tokens: Unpadded | None = None,
                 rows=None):
        """``x`` [B, S, H], or [G, C, H] the real tokens of ``tokens`` (attention alone runs
        on [B, S]: Q, K, V scattered there, its output gathered back); ``rows`` numbers x's
        rows in the whole batch (``models.stack``)."""
        heads, d = self.cfg.num_attention_heads, self.cfg.head_dim

        def split(t):                  # [B, S, H] (the real tokens put back) -> [B, S, heads, d]
            t = t if tokens is None else tokens.scatter(t)
            return t.reshape(*t.shape[:2], heads, d)

        dropout_rng = None
        if not deterministic and self.cfg.attention_probs_dropout_prob > 0:
            dropout_rng = rngs.dropout()
        ctx = attention(split(tag(self.query(x), "query_proj")),
                        split(tag(self.key(x), "key_proj")),
                        split(tag(self.value(x), "value_proj")),
                        attention_mask, impl=self.attention_impl,
                        dropout_rate=self.cfg.attention_probs_dropout_prob,
                        deterministic=deterministic, dropout_rng=dropout_rng, dropout_rows=rows)
        ctx = ctx.reshape(*ctx.shape[:2], heads * d)
        ctx = ctx if tokens is None else tokens.gather(ctx)
        y = self.dropout(tag(self.output(ctx), "out_proj"), deterministic=deterministic,
                         rngs=rngs, rows=_hidden_rows(x, tokens, rows))
        return self.layer_norm(y + x)


class BertLayer(nnx.Module):
    def __init__(self, cfg: BertConfig, policy: Policy, attention_impl: str, rngs: nnx.Rngs):
        self.attention = BertAttention(cfg, policy, attention_impl, rngs)
        self.intermediate = _dense(cfg.hidden_size, cfg.intermediate_size, ("embed", "mlp"),
                                   cfg, policy, rngs, True)
        self.output = _dense(cfg.intermediate_size, cfg.hidden_size, ("mlp", "embed"),
                             cfg, policy, rngs, True)
        self.layer_norm = _layer_norm(cfg, policy, rngs)
        self.dropout = Dropout(cfg.hidden_dropout_prob)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x, attention_mask, deterministic, rngs, tokens: Unpadded | None = None,
                 rows=None):
        x = self.attention(x, attention_mask, deterministic, rngs, tokens, rows)
        y = tag(self.output(self.act(self.intermediate(x))), "mlpwo")
        y = self.dropout(y, deterministic=deterministic, rngs=rngs,
                         rows=_hidden_rows(x, tokens, rows))
        return self.layer_norm(y + x)


class BertMLMHead(nnx.Module):
    """Masked-LM head: dense + GELU + LayerNorm, then logits tied to the word embeddings."""

    def __init__(self, cfg: BertConfig, policy: Policy, rngs: nnx.Rngs):
        self.dense = _dense(cfg.hidden_size, cfg.hidden_size, ("embed", None), cfg, policy, rngs)
        self.layer_norm = _layer_norm(cfg, policy, rngs)
        self.bias = nnx.Param(jnp.zeros((cfg.vocab_size,), policy.param_dtype),
                              out_sharding=("vocab",), eager_sharding=False)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.policy = policy

    def __call__(self, x, word_embeddings):
        x = self.layer_norm(self.act(self.dense(x)))
        emb = word_embeddings.astype(self.policy.compute_dtype)
        logits = jnp.einsum("bsh,vh->bsv", x.astype(self.policy.compute_dtype), emb,
                            preferred_element_type=jnp.float32)
        return logits + self.bias[...].astype(jnp.float32)


def _masked_mean(x, attention_mask):
    x = x.astype(jnp.float32)
    if attention_mask is None:
        return x.mean(axis=1)
    w = attention_mask.astype(jnp.float32)[..., None]
    return (x * w).sum(axis=1) / jnp.maximum(w.sum(axis=1), 1.0)


class BertModel(FamilyModel):
    """BERT encoder with pooler and the heads ``spec`` asks for.

    Args:
      spec: the architecture and options (``spec.ModelSpec``).
      policy: precision policy name or object (default fp32).
      rngs: parameter initialisation RNGs (default ``nnx.Rngs(params=0)``).
    """

    FP8_GROUPS = FP8_GROUPS
    input_keys = ("input_ids", "attention_mask", "token_type_ids")   # the batch keys it reads

    @staticmethod
    def layer_call(layer, x, args, deterministic, rngs, rows=None):
        """One layer on ``x`` with ``args`` = (attention mask, unpadding plan) (``stack``)."""
        attention_mask, tokens = args
        return layer(x, attention_mask, deterministic, rngs, tokens, rows)

    @staticmethod
    def flops_shape(spec: ModelSpec) -> Shape:
        """A BERT encoder (bidirectional, GELU MLP, post-norm layers) with its classification
        or masked-LM head."""
        a = spec.architecture
        h = a.hidden_size
        head = h * a.vocab_size + h * h if spec.mlm_head else h * h + h * (spec.num_labels or 0)
        return Shape(hidden=h, layers=a.num_hidden_layers, heads=a.num_attention_heads,
                     kv_heads=a.num_attention_heads, head_dim=a.head_dim,
                     intermediate=a.intermediate_size, mlp_matrices=2, head_weights=head,
                     causal=spec.family.causal, pre_norm=spec.family.pre_norm)

    def __init__(self, spec: ModelSpec, policy: str | Policy | None = None,
                 rngs: nnx.Rngs | None = None):
        if not isinstance(spec, ModelSpec):
            raise TypeError(f"BertModel takes a ModelSpec, got {type(spec).__name__}; e.g. "
                            "BertModel(ModelSpec(PRESETS['tiny'], num_labels=2)).")
        check_impl(spec.attention_impl, spec.architecture.attention_probs_dropout_prob)
        rngs = rngs if rngs is not None else nnx.Rngs(params=0)
        policy = get_policy(policy)
        config = spec.architecture
        self.spec, self.config, self.policy = spec, config, policy
        self.embeddings = BertEmbeddings(config, policy, rngs)
        self.layers = nnx.List([BertLayer(config, policy, spec.attention_impl, rngs)
                                for _ in range(config.num_hidden_layers)])
        self.pooler = _dense(config.hidden_size, config.hidden_size, ("embed", None), config,
                             policy, rngs)
        self.classifier_dropout = Dropout(config.hidden_dropout_prob)
        self.classifier = nnx.data(None if spec.num_labels is None else _dense(
            config.hidden_size, spec.num_labels, ("embed", None), config, policy, rngs))
        self.mlm = nnx.data(BertMLMHead(config, policy, rngs) if spec.mlm_head else None)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, *,
                 deterministic: bool = True, rngs: nnx.Rngs | None = None,
                 tokens: Unpadded | None = None, stack=None) -> BertOutput:
        """Run the model; ``rngs`` (an ``nnx.Rngs`` with a ``dropout`` stream) when not
        deterministic. With ``tokens`` (``unpad.Unpadded`` of ``attention_mask``) the
        per-token layers run on the real tokens only; ``last_hidden_state`` is then 0 at
        padding positions (every other output is the padded model's). ``stack`` runs the
        layers instead of this model's own loop (``models.stack``: a pipeline's)."""
        seq = input_ids.shape[1]
        if seq > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {seq} exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}; truncate the inputs.")
        if not deterministic and rngs is None:
            raise ValueError("deterministic=False needs rngs=nnx.Rngs(dropout=key).")
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        if tokens is None:
            positions, rows = jnp.arange(seq)[None, :], None
        else:
            input_ids, token_type_ids = tokens.gather(input_ids), tokens.gather(token_type_ids)
            positions, rows = tokens.positions(), tokens.rows()
        x = residual(self.embeddings(input_ids, token_type_ids, positions, deterministic, rngs,
                                     rows))
        stack = stack or sequential(self.layers, self.layer_call, remat=self.spec.remat)
        x = stack(x, (attention_mask, tokens), layers_key(rngs, deterministic), deterministic)
        x = x if tokens is None else tokens.scatter(x)
        pooled = jnp.tanh(self.pooler(x[:, 0]).astype(jnp.float32))
        logits = None
        if self.classifier is not None:
            h = pooled if self.spec.pooling == "cls" else _masked_mean(x, attention_mask)
            h = self.classifier_dropout(h, deterministic=deterministic, rngs=rngs)
            logits = self.policy.cast_to_output(self.classifier(h))
        elif self.mlm is not None:
            logits = self.mlm(x, self.embeddings.word_embeddings.embedding[...])
        return BertOutput(last_hidden_state=self.policy.cast_to_output(x),
                          pooler_output=self.policy.cast_to_output(pooled), logits=logits)


__all__ = ["ATTENTION_IMPLS", "BertModel", "BertOutput"]
