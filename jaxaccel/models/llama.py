"""A Llama-style decoder-only causal LM in Flax NNX: token embeddings, pre-RMSNorm blocks of
rotary grouped-query causal attention and a SwiGLU MLP, a final RMSNorm and an LM head
(optionally tied to the embeddings).

Numerically the model of transformers' ``LlamaForCausalLM`` (parameter paths mirror its
tensor names: ``embed_tokens``, ``layers/i/self_attn/q_proj``, ..., ``norm``, ``lm_head``).
For hidden states ``x`` [batch, seq, hidden] and each layer::

    h  = x + o_proj(attn(rope(q_proj(rms(x))), rope(k_proj(rms(x))), v_proj(rms(x))))
    x' = h + down_proj(silu(gate_proj(rms(h))) * up_proj(rms(h)))
    rms(x) = w * x / sqrt(mean(x**2) + eps)                       (float32)
    logits = rms(x_L) W_head        (W_head = W_embed^T when tie_word_embeddings)

* RoPE: position ``p`` rotates each pair (x_i, x_{i + d/2}) of a head by ``p * theta_i``,
  ``theta_i = rope_theta ** (-2i / d)``, i < d/2 (transformers' ``rotate_half`` layout; Llama
  3's ``rope_scaling`` rescales the low frequencies, ``rope_frequencies``). The
  positions are an input: in a packed row they restart at 0 for every document, so a
  document's logits do not depend on where in the row it sits.
* Attention: causal, and only within a document (``segment_ids``: 1, 2, ... per document of
  a row, 0 = padding), through the attention registry (``models.attention``: xla / pallas /
  cudnn, ``auto``); ``num_key_value_heads`` < ``num_attention_heads`` is grouped-query
  attention, the key/value heads never repeated in memory.
* Precision (``precision.Policy``): parameters in ``param_dtype``, matmuls in
  ``compute_dtype``, the residual stream in ``activation_dtype`` (bfloat16 under bf16 and
  fp8); RMSNorm's statistics, RoPE, softmax and the logits in float32.
  Under fp8 the block Dense layers (q/k/v/o, gate/up/down) are ``fp8.Fp8Linear``; the
  embeddings and the LM head stay bf16.
* Logical axes: ``vocab``, ``embed``, ``heads`` (query heads x head_dim), ``kv_heads``
  (key/value heads x head_dim), ``mlp``.

Decoding: ``model(ids, positions, segment_ids, cache=model.init_cache(batch, length))``
returns the logits and the cache holding the keys and values of every position seen so far
(``KVCache``); a call either fills an empty cache with a whole prompt (causal, as without a
cache) or appends one token, which attends to every filled slot of its row's segment
(``jaxaccel.models.generate``).

    model = LlamaForCausalLM(ModelSpec(LLAMA_PRESETS["llama-tiny"]), policy="bf16")
    logits = model(input_ids, positions=positions, segment_ids=segment_ids).logits
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax import struct

from jaxaccel.flops import Shape
from jaxaccel.models.architectures import LlamaConfig
from jaxaccel.models.attention import attention, check_impl
from jaxaccel.models.family import FamilyModel
from jaxaccel.models.layers import dense, partitioned, rms_norm
from jaxaccel.models.remat import tag
from jaxaccel.models.spec import ModelSpec
from jaxaccel.models.stack import layer_rngs, layers_key, sequential
from jaxaccel.precision import Policy, get_policy
from jaxaccel.sharding import residual

# fp8 layer groups: in-layer path of each block Dense -> group name (metrics).
FP8_GROUPS = {("self_attn", "q_proj"): "qkv", ("self_attn", "k_proj"): "qkv",
              ("self_attn", "v_proj"): "qkv", ("self_attn", "o_proj"): "attn_out",
              ("mlp", "gate_proj"): "mlp_in", ("mlp", "up_proj"): "mlp_in",
              ("mlp", "down_proj"): "mlp_out"}


@struct.dataclass
class KVCache:
    """Keys and values of the positions seen so far, per layer [batch, length, kv_heads,
    head_dim]; ``segment_ids`` [batch, length] is each filled slot's segment (0: empty or
    padding, never attended); slots [0, ``index``) are filled."""

    keys: tuple
    values: tuple
    segment_ids: jax.Array
    index: jax.Array


@struct.dataclass
class LlamaOutput:
    logits: jax.Array | None
    cache: KVCache | None = None
    hidden: jax.Array | None = None     # the normed last hidden states (``head=False``)


def _dense(din, dout, axes, cfg: LlamaConfig, policy: Policy, rngs, bias: bool = False,
           block: bool = True):
    return dense(din, dout, axes, cfg.initializer_range, policy, rngs, bias=bias, block=block)


def _per_token(dense, x, flat: bool):
    """``dense`` (a layer or a block of them) applied to ``x`` [..., features]; ``flat``: as
    one [tokens, features] matrix (a free reshape), so that autodiff contracts the weight
    gradient over one token axis. Over the [batch, seq] pair XLA:CPU first copied a transposed
    activation or gradient per matmul (bench/README.md, "The decoder step against the stock
    Hugging Face loops"); the TPU compiler does the reverse: on the flat matrix its FSDP
    matmul loops copy the activations in [seq, features] slices first (``ModelSpec.flat_tokens``:
    flat but on TPUs)."""
    if not flat:
        return dense(x)
    return dense(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


def _rms_norm(cfg: LlamaConfig, policy: Policy, rngs):
    return rms_norm(cfg.hidden_size, cfg.rms_norm_eps, policy, rngs)


def rope_frequencies(cfg: LlamaConfig):
    """theta_i = rope_theta ** (-2i / head_dim), i < head_dim / 2 (float32); with Llama 3's
    ``rope_scaling`` (factor s, low/high frequency factors l/h, original context C), by the
    wavelength w_i = 2 pi / theta_i:

        w_i < C / h:   theta_i                              (high frequencies kept)
        w_i > C / l:   theta_i / s                          (low frequencies slowed)
        otherwise:     (1 - a) theta_i / s + a theta_i,     a = (C / w_i - l) / (h - l)
    """
    d = cfg.head_dim
    theta = 1.0 / cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    if cfg.rope_scaling is None:
        return theta
    r = dict(cfg.rope_scaling)
    s, lo, hi = r["factor"], r["low_freq_factor"], r["high_freq_factor"]
    context = r["original_max_position_embeddings"]
    wavelen = 2 * jnp.pi / theta
    a = (context / wavelen - lo) / (hi - lo)
    scaled = jnp.where(wavelen > context / lo, theta / s, theta)
    medium = (wavelen >= context / hi) & (wavelen <= context / lo)
    return jnp.where(medium, (1 - a) * scaled / s + a * scaled, scaled)


def rope(x, positions, inv_freq):
    """Rotary position embedding of x [batch, seq, heads, d] at ``positions`` [batch, seq]:
    (x_i, x_{i+d/2}) -> (x_i cos a - x_{i+d/2} sin a, x_{i+d/2} cos a + x_i sin a),
    a = p * inv_freq_i (``rope_frequencies``); float32, returned in x's dtype (``_rotate``)."""
    angles = positions.astype(jnp.float32)[..., None, None] * inv_freq      # [b, s, 1, d/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    return _rotate(x, jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([-sin, sin], axis=-1))


@jax.custom_vjp
def _rotate(x, cos, sin):
    """``x (cos, cos) + (x2, x1) (-sin, sin)`` over the whole head, in float32, rounded once to
    x's dtype: the pairwise rotation's float32 operations, bit for bit, in one elementwise
    expression the compiler writes in one pass. (Computing the two halves and concatenating
    them made the TPU compiler write a float32 copy of x and two half-width results: ~19 GB
    more counted HBM traffic per step of ``llama-1b`` on a v5e-8, bench/maxtext_step.py.) The
    halves swap in x's dtype (exact); the gradient is the rotation back (``_rotate_bwd``)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    swapped = jnp.concatenate([x2, x1], axis=-1).astype(jnp.float32)
    return (x.astype(jnp.float32) * cos + swapped * sin).astype(x.dtype)


def _rotate_fwd(x, cos, sin):
    return _rotate(x, cos, sin), (cos, sin)


def _rotate_bwd(res, g):
    """The cotangent rotated back, (sin, -sin), in float32 and rounded once: what autodiff of
    the pairwise form gives, where autodiff of ``_rotate`` would round the swapped half's
    cotangent to x's dtype before the sum."""
    cos, sin = res
    return _rotate(g, cos, -sin), None, None


_rotate.defvjp(_rotate_fwd, _rotate_bwd)


class LlamaAttention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, policy: Policy, spec: ModelSpec, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        b = cfg.attention_bias
        self.cfg, self.attention_impl = cfg, spec.attention_impl
        self.flat = spec.flat_tokens is not False
        self.q_proj = _dense(h, q, ("embed", "heads"), cfg, policy, rngs, b)
        self.k_proj = _dense(h, kv, ("embed", "kv_heads"), cfg, policy, rngs, b)
        self.v_proj = _dense(h, kv, ("embed", "kv_heads"), cfg, policy, rngs, b)
        self.o_proj = _dense(q, h, ("heads", "embed"), cfg, policy, rngs, b)

    def __call__(self, x, positions, segment_ids, deterministic, rngs, cache=None, rows=None):
        """``(output, (keys, values))``: with ``cache`` = (keys, values, kv segment ids, index)
        of this layer, this call's keys and values are written at ``index`` first; ``rows``
        numbers x's rows in the whole batch (``models.stack``)."""
        cfg = self.cfg
        b, s, _ = x.shape
        heads = lambda t, n: t.reshape(b, s, n, cfg.head_dim)
        freq = rope_frequencies(cfg)
        project = lambda dense, name: tag(_per_token(dense, x, self.flat), name)
        q = rope(heads(project(self.q_proj, "query_proj"), cfg.num_attention_heads), positions,
                 freq)
        k = rope(heads(project(self.k_proj, "key_proj"), cfg.num_key_value_heads), positions,
                 freq)
        v = heads(project(self.v_proj, "value_proj"), cfg.num_key_value_heads)
        kv = (k, v)
        segments, causal = segment_ids, True
        if cache is not None:
            cache_k, cache_v, kv_segments, index = cache
            at = (0, index, 0, 0)
            kv = (jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), at),
                  jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), at))
            if s == 1:      # one new token: every filled slot of its segment is in its past
                k, v = kv
                segments, causal = (segment_ids, kv_segments), False
        dropout_rng = None
        if not deterministic and cfg.attention_dropout > 0:
            dropout_rng = rngs.dropout()
        ctx = attention(q, k, v, segment_ids=segments, causal=causal, impl=self.attention_impl,
                        dropout_rate=cfg.attention_dropout, deterministic=deterministic,
                        dropout_rng=dropout_rng, dropout_rows=rows)
        return tag(_per_token(self.o_proj, ctx.reshape(b, s, -1), self.flat), "out_proj"), kv


class LlamaMLP(nnx.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, cfg: LlamaConfig, policy: Policy, spec: ModelSpec, rngs: nnx.Rngs):
        h, f, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.flat = spec.flat_tokens is not False
        self.gate_proj = _dense(h, f, ("embed", "mlp"), cfg, policy, rngs, b)
        self.up_proj = _dense(h, f, ("embed", "mlp"), cfg, policy, rngs, b)
        self.down_proj = _dense(f, h, ("mlp", "embed"), cfg, policy, rngs, b)

    def __call__(self, x):
        return tag(_per_token(lambda t: self.down_proj(jax.nn.silu(self.gate_proj(t))
                                                       * self.up_proj(t)), x, self.flat), "mlpwo")


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, policy: Policy, spec: ModelSpec, rngs: nnx.Rngs):
        self.input_layernorm = _rms_norm(cfg, policy, rngs)
        self.self_attn = LlamaAttention(cfg, policy, spec, rngs)
        self.post_attention_layernorm = _rms_norm(cfg, policy, rngs)
        self.mlp = LlamaMLP(cfg, policy, spec, rngs)

    def __call__(self, x, positions, segment_ids, deterministic, rngs, cache=None, rows=None):
        y, kv = self.self_attn(self.input_layernorm(x), positions, segment_ids, deterministic,
                               rngs, cache, rows)
        x = x + y
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class LlamaForCausalLM(FamilyModel):
    """The decoder with its LM head.

    Args:
      spec: the architecture (a ``LlamaConfig``) and options (``spec.ModelSpec``).
      policy: precision policy name or object (default fp32).
      rngs: parameter initialisation RNGs (default ``nnx.Rngs(params=0)``).
    """

    def __init__(self, spec: ModelSpec, policy: str | Policy | None = None,
                 rngs: nnx.Rngs | None = None):
        if not isinstance(spec, ModelSpec) or not isinstance(spec.architecture, LlamaConfig):
            raise TypeError(f"LlamaForCausalLM takes a ModelSpec of a LlamaConfig, got "
                            f"{spec!r}; e.g. LlamaForCausalLM(ModelSpec(LLAMA_PRESETS["
                            "'llama-tiny'])).")
        check_impl(spec.attention_impl, spec.architecture.attention_dropout)
        rngs = rngs if rngs is not None else nnx.Rngs(params=0)
        policy = get_policy(policy)
        cfg = spec.architecture
        self.spec, self.config, self.policy = spec, cfg, policy
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=policy.activation_dtype,
            param_dtype=policy.param_dtype,
            embedding_init=partitioned(nnx.initializers.normal(cfg.initializer_range),
                                       ("vocab", "embed")), rngs=rngs)
        self.layers = nnx.List([LlamaDecoderLayer(cfg, policy, spec, rngs)
                                for _ in range(cfg.num_hidden_layers)])
        self.norm = _rms_norm(cfg, policy, rngs)
        self.lm_head = nnx.data(None if cfg.tie_word_embeddings else _dense(
            cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), cfg, policy, rngs, block=False))

    FP8_GROUPS = FP8_GROUPS
    input_keys = ("input_ids", "positions", "segment_ids")    # the batch keys it reads
    generates = True

    @staticmethod
    def layer_call(layer, x, args, deterministic, rngs, rows=None):
        """One layer on ``x`` with ``args`` = (positions, segment ids) (``models.stack``)."""
        positions, segment_ids = args
        return layer(x, positions, segment_ids, deterministic, rngs, rows=rows)[0]

    @staticmethod
    def flops_shape(spec: ModelSpec) -> Shape:
        """A Llama decoder (causal, grouped-query attention, SwiGLU MLP, pre-norm layers) with
        its vocabulary projection (tied to the embedding or not: a matmul either way)."""
        a = spec.architecture
        return Shape(hidden=a.hidden_size, layers=a.num_hidden_layers,
                     heads=a.num_attention_heads, kv_heads=a.num_key_value_heads,
                     head_dim=a.head_dim, intermediate=a.intermediate_size, mlp_matrices=3,
                     head_weights=a.hidden_size * a.vocab_size, causal=spec.family.causal,
                     pre_norm=spec.family.pre_norm)

    def init_cache(self, batch: int, length: int, dtype=None) -> KVCache:
        """An empty cache of ``length`` slots per row (keys/values in ``dtype``, default the
        compute dtype)."""
        cfg = self.config
        shape = (batch, length, cfg.num_key_value_heads, cfg.head_dim)
        zeros = lambda: tuple(jnp.zeros(shape, dtype or self.policy.compute_dtype)
                              for _ in range(cfg.num_hidden_layers))
        return KVCache(zeros(), zeros(), jnp.zeros((batch, length), jnp.int32),
                       jnp.zeros((), jnp.int32))

    def __call__(self, input_ids, positions=None, segment_ids=None, *,
                 cache: KVCache | None = None, deterministic: bool = True,
                 rngs: nnx.Rngs | None = None, stack=None, head: bool = True) -> LlamaOutput:
        """Logits [batch, seq, vocab] of every position, in ``policy.logits_dtype`` (float32
        by default; ``head=False``: none, but the normed last hidden states in the compute
        dtype, ``hidden``, whose logits are ``hidden @ head_kernel()``: a loss taken over
        chunks of them, ``train.tasks``).

        ``positions`` [batch, seq] (default 0, 1, ...; the cache's ``index`` onwards with a
        cache), ``segment_ids`` [batch, seq] (default one document per row). With ``cache``
        the call either fills it from empty (a prompt; ``cache.index`` must be 0) or appends
        one token (seq 1), and ``LlamaOutput.cache`` is the updated cache. ``stack`` runs the
        layers instead of this model's own loop (``models.stack``: a pipeline's; no cache)."""
        cfg = self.config
        b, s = input_ids.shape
        limit = cfg.max_position_embeddings if cache is None else cache.segment_ids.shape[1]
        if s > limit:
            raise ValueError(f"sequence length {s} exceeds "
                             f"{'max_position_embeddings' if cache is None else 'the cache'}"
                             f"={limit}; truncate the inputs.")
        if not deterministic and rngs is None:
            raise ValueError("deterministic=False needs rngs=nnx.Rngs(dropout=key).")
        start = 0 if cache is None else cache.index
        if positions is None:
            positions = jnp.broadcast_to(start + jnp.arange(s, dtype=jnp.int32), (b, s))
        if segment_ids is None and cache is not None:
            segment_ids = jnp.ones((b, s), jnp.int32)
        x = residual(self.embed_tokens(input_ids))
        key = layers_key(rngs, deterministic)
        new_kv, kv_segments = [], None
        if cache is None:
            stack = stack or sequential(self.layers, self.layer_call, remat=self.spec.remat)
            x = stack(x, (positions, segment_ids), key, deterministic)
        else:
            kv_segments = jax.lax.dynamic_update_slice(cache.segment_ids,
                                                       segment_ids.astype(jnp.int32), (0, start))
            for i, layer in enumerate(self.layers):
                x, kv = layer(x, positions, segment_ids, deterministic, layer_rngs(key, i),
                              (cache.keys[i], cache.values[i], kv_segments, start))
                new_kv.append(kv)
                x = residual(x)
        h = self.policy.cast_to_compute(self.norm(x))
        new_cache = None if cache is None else KVCache(
            tuple(k for k, _ in new_kv), tuple(v for _, v in new_kv), kv_segments, start + s)
        if not head:
            return LlamaOutput(logits=None, cache=new_cache, hidden=h)
        return LlamaOutput(logits=head_logits(h, self.head_kernel(), self.policy.logits_dtype),
                           cache=new_cache)

    def head_kernel(self):
        """The LM head's [hidden, vocab] matrix in the compute dtype (the embeddings' transpose
        when tied)."""
        head = (self.embed_tokens.embedding[...].T if self.lm_head is None
                else self.lm_head.kernel[...])
        return self.policy.cast_to_compute(head)


def head_logits(h, kernel, dtype=jnp.float32):
    """Logits [..., vocab] of hidden states ``h`` [..., hidden], one [tokens, hidden] matmul
    (``_per_token``'s reason) accumulated in float32 and written in ``dtype``
    (``Policy.logits_dtype``; their gradient is rounded to it too)."""
    return jnp.einsum("th,hv->tv", h.reshape(-1, h.shape[-1]), kernel,
                      preferred_element_type=jnp.float32).astype(dtype) \
        .reshape(*h.shape[:-1], -1)


__all__ = ["FP8_GROUPS", "KVCache", "LlamaForCausalLM", "LlamaOutput", "head_logits", "rope",
           "rope_frequencies"]
