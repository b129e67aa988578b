"""A Vision Transformer over any 2-D input (an image, or a log-mel spectrogram of [frames, mel
bins]) in Flax NNX, with the two heads of Audio-MAE (Huang et al. 2022): masked-autoencoder
pretraining and classification.

Numerically the models of transformers' ``ViTMAEForPreTraining`` (the ``mae`` task) and
``ViTForImageClassification`` (``classification``, CLS pooling); parameter paths mirror their
tensor names where the structure allows (``embeddings/patch_embeddings``, ``layers/i/
attention/query``, ..., ``layernorm``, ``decoder/...``, ``classifier``;
``jaxaccel.models.hf_vit`` converts). For inputs ``x`` [batch, height, width(, channels)]:

    patches = patchify(x)                   # [B, N, p*p*C], row-major over the patch grid
    e = patches W_patch + b + pos[1:]       # pos: fixed 2-D sin-cos (MAE), or learned (ViT)
    layer: h = x + o(attn(ln_before(x)));  x' = h + W2 gelu(W1 ln_after(h))   (pre-norm)

* ``mae``: each row keeps a random ``1 - mask_ratio`` of its patches (per-row noise: the
  patches of the ``len_keep`` smallest noise values stay, transformers' ``random_masking``);
  the encoder sees ``[CLS] + kept`` only. The decoder embeds them to ``decoder_hidden_size``,
  puts a learned mask token at every dropped patch, adds its own sin-cos positions, runs its
  layers and predicts each patch's pixels (``logits`` [B, N, p*p*C]). With
  ``decoder_window`` (rows, cols) its attention is local, as Audio-MAE's Swin-style decoder:
  a patch attends the patches of its window of the grid, the windows shifted by half a window
  in every other layer (Swin's masked cyclic shift is the same partition: windows of the
  shifted grid, cut at its edges); the CLS token attends itself. Swin's relative position
  bias is left out.
* ``classification``: ``logits = classifier(pool(layernorm(x)))``, pool = the CLS token
  (``pooling="cls"``, transformers' ViT) or the mean of the patch tokens (``"mean"``,
  Audio-MAE's fine-tuning; the CLS token left out).
* Sin-cos positions (MAE's ``get_2d_sincos_pos_embed``, also for non-square grids as
  Audio-MAE's ``get_2d_sincos_pos_embed_flexible``): patch (r, c) gets
  ``[sincos(c) | sincos(r)]``, ``sincos(p) = [sin(p w_k) | cos(p w_k)]``, ``w_k = 10000 **
  (-k / (D/4))``, k < D/4; the CLS token's position is 0. They are computed, not stored.
* Precision (``precision.Policy``): parameters in ``param_dtype``, matmuls in
  ``compute_dtype``, the residual stream in ``activation_dtype``; the layer norms'
  statistics, softmax and the outputs in float32. Under fp8 the block
  Dense layers of the encoder and the decoder (query/key/value, attention output, MLP in/out)
  are ``fp8.Fp8Linear``; the patch embedding and the heads stay bf16.
* Logical axes: ``embed`` (either hidden size), ``heads``, ``mlp``.

    model = ViTModel(ModelSpec(VIT_PRESETS["vit-tiny"], task="mae"))
    out = model(x, noise=noise)                       # out.logits, out.mask
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import struct

from jaxaccel.flops import Shape, ViTShape
from jaxaccel.models.architectures import ViTConfig
from jaxaccel.models.attention import attention, check_impl
from jaxaccel.models.dropout import Dropout
from jaxaccel.models.family import FamilyModel
from jaxaccel.models.layers import ACTIVATIONS, dense, layer_norm
from jaxaccel.models import remat as remat_lib
from jaxaccel.models.remat import tag
from jaxaccel.models.spec import ModelSpec
from jaxaccel.models.stack import layer_rngs, layers_key, sequential, token_rows
from jaxaccel.precision import Policy, get_policy
from jaxaccel.sharding import residual

# fp8 layer groups: in-layer path of each block Dense -> group name (metrics).
FP8_GROUPS = {("attention", "query"): "qkv", ("attention", "key"): "qkv",
              ("attention", "value"): "qkv", ("attention", "output"): "attn_out",
              ("intermediate",): "mlp_in", ("output",): "mlp_out"}


@struct.dataclass
class ViTOutput:
    """``logits``: classification [B, labels], or MAE's predicted patches [B, N, p*p*C];
    ``mask`` (MAE) [B, N] 1 where a patch was dropped; ``last_hidden_state`` the encoder's."""

    last_hidden_state: jax.Array
    logits: jax.Array | None = None
    mask: jax.Array | None = None


def _dense(din, dout, axes, cfg: ViTConfig, policy: Policy, rngs, bias: bool = True,
           block: bool = True):
    return dense(din, dout, axes, cfg.initializer_range, policy, rngs, bias=bias, block=block)


def _layer_norm(size: int, cfg: ViTConfig, policy: Policy, rngs):
    return layer_norm(size, cfg.layer_norm_eps, policy, rngs)


def sincos_positions(dim: int, rows: int, cols: int) -> np.ndarray:
    """float32 [1 + rows * cols, dim]: the CLS token's zeros, then patch (r, c) row-major as
    ``[sincos(c) | sincos(r)]`` (module doc; MAE's layout)."""
    if dim % 4:
        raise ValueError(f"sin-cos positions need a hidden size divisible by 4, got {dim}.")
    omega = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float64) / (dim / 4.0))

    def sincos(p):
        out = p.reshape(-1)[:, None] * omega[None]
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    r, c = np.meshgrid(np.arange(rows, dtype=np.float64), np.arange(cols, dtype=np.float64),
                       indexing="ij")
    table = np.concatenate([sincos(c), sincos(r)], axis=1)
    return np.concatenate([np.zeros((1, dim)), table], axis=0).astype(np.float32)


def patchify(x, patch: int) -> jax.Array:
    """[B, H, W(, C)] -> [B, (H/p)(W/p), p*p*C]: patch (r, c) row-major, each patch's values in
    (row, column, channel) order (transformers' ``ViTMAEForPreTraining.patchify``)."""
    x = x[..., None] if x.ndim == 3 else x
    b, h, w, c = x.shape
    x = x.reshape(b, h // patch, patch, w // patch, patch, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, (h // patch) * (w // patch), patch * patch * c)


def window_segments(rows: int, cols: int, window: tuple[int, int], shift: bool) -> np.ndarray:
    """int32 [1 + rows * cols]: the attention window of the CLS token (its own) and of each
    patch, windows of ``window`` patches over the grid, offset by half a window if ``shift``
    (Swin's shifted windows, cut at the grid's edges)."""
    wr, wc = window
    sr, sc = (wr // 2, wc // 2) if shift else (0, 0)
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    per_row = (cols + sc) // wc + 1
    ids = ((r + sr) // wr) * per_row + (c + sc) // wc
    return np.concatenate([[0], ids.reshape(-1) + 1]).astype(np.int32)


class ViTAttention(nnx.Module):
    def __init__(self, hidden: int, heads: int, cfg: ViTConfig, policy: Policy,
                 attention_impl: str, rngs: nnx.Rngs):
        self.heads, self.cfg, self.attention_impl = heads, cfg, attention_impl
        b = cfg.qkv_bias
        self.query = _dense(hidden, hidden, ("embed", "heads"), cfg, policy, rngs, b)
        self.key = _dense(hidden, hidden, ("embed", "heads"), cfg, policy, rngs, b)
        self.value = _dense(hidden, hidden, ("embed", "heads"), cfg, policy, rngs, b)
        self.output = _dense(hidden, hidden, ("heads", "embed"), cfg, policy, rngs)
        self.dropout = Dropout(cfg.hidden_dropout_prob)

    def __call__(self, x, segment_ids, deterministic, rngs, rows=None):
        b, s, hidden = x.shape
        split = lambda t: t.reshape(b, s, self.heads, hidden // self.heads)
        dropout_rng = None
        if not deterministic and self.cfg.attention_probs_dropout_prob > 0:
            dropout_rng = rngs.dropout()
        ctx = attention(split(tag(self.query(x), "query_proj")),
                        split(tag(self.key(x), "key_proj")),
                        split(tag(self.value(x), "value_proj")), segment_ids=segment_ids,
                        impl=self.attention_impl, dropout_rate=self.cfg.attention_probs_dropout_prob,
                        deterministic=deterministic, dropout_rng=dropout_rng,
                        dropout_rows=rows)
        return self.dropout(tag(self.output(ctx.reshape(b, s, hidden)), "out_proj"),
                            deterministic=deterministic, rngs=rngs, rows=token_rows(rows, s))


class ViTLayer(nnx.Module):
    """A pre-norm block (transformers' ``ViTLayer`` / ``ViTMAELayer``) of ``hidden`` units."""

    def __init__(self, hidden: int, heads: int, intermediate: int, cfg: ViTConfig,
                 policy: Policy, attention_impl: str, rngs: nnx.Rngs):
        self.layernorm_before = _layer_norm(hidden, cfg, policy, rngs)
        self.attention = ViTAttention(hidden, heads, cfg, policy, attention_impl, rngs)
        self.layernorm_after = _layer_norm(hidden, cfg, policy, rngs)
        self.intermediate = _dense(hidden, intermediate, ("embed", "mlp"), cfg, policy, rngs)
        self.output = _dense(intermediate, hidden, ("mlp", "embed"), cfg, policy, rngs)
        self.dropout = Dropout(cfg.hidden_dropout_prob)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x, segment_ids, deterministic, rngs, rows=None):
        x = x + self.attention(self.layernorm_before(x), segment_ids, deterministic, rngs, rows)
        y = tag(self.output(self.act(self.intermediate(self.layernorm_after(x)))), "mlpwo")
        return x + self.dropout(y, deterministic=deterministic, rngs=rngs,
                                rows=token_rows(rows, x.shape[1]))


class ViTPatchEmbeddings(nnx.Module):
    """transformers' ``patch_embeddings``: a stride-p convolution, here the same map as a Dense
    layer on the flattened patches (``projection``, kernel [p*p*C, hidden])."""

    def __init__(self, cfg: ViTConfig, policy: Policy, rngs: nnx.Rngs):
        self.patch = cfg.patch_size
        self.projection = _dense(cfg.patch_dim, cfg.hidden_size, (None, "embed"), cfg, policy,
                                 rngs, block=False)

    def __call__(self, x):
        return self.projection(patchify(x, self.patch))


class ViTEmbeddings(nnx.Module):
    def __init__(self, cfg: ViTConfig, policy: Policy, rngs: nnx.Rngs):
        self.patch_embeddings = ViTPatchEmbeddings(cfg, policy, rngs)
        self.cls_token = nnx.Param(
            cfg.initializer_range * jax.random.normal(rngs.params(), (1, 1, cfg.hidden_size),
                                                      policy.param_dtype),
            out_sharding=(None, None, "embed"), eager_sharding=False)
        self.position_embeddings = nnx.data(None)
        if cfg.position_embedding_type == "learned":
            self.position_embeddings = nnx.Param(
                cfg.initializer_range * jax.random.normal(
                    rngs.params(), (1, cfg.num_patches + 1, cfg.hidden_size), policy.param_dtype),
                out_sharding=(None, None, "embed"), eager_sharding=False)
        self.cfg = cfg

    def positions(self):
        """[1, 1 + N, hidden] float32: the learned or the sin-cos table."""
        if self.position_embeddings is not None:
            return self.position_embeddings[...].astype(jnp.float32)
        rows, cols = self.cfg.grid
        return jnp.asarray(sincos_positions(self.cfg.hidden_size, rows, cols))[None]


def _decoder_call(layer, x, segments, rngs, deterministic):
    return layer(x, segments, deterministic, rngs)


class ViTMAEDecoder(nnx.Module):
    """The MAE decoder; its layers are rematerialised in the backward pass with ``remat``
    (``model.remat``, as the encoder's: at Audio-MAE's size its 513-token rows hold most of
    the activations)."""

    def __init__(self, cfg: ViTConfig, policy: Policy, attention_impl: str, rngs: nnx.Rngs,
                 remat="none"):
        d = cfg.decoder_hidden_size
        self.cfg, self.policy, self.remat = cfg, policy, remat
        self.decoder_embed = _dense(cfg.hidden_size, d, ("embed", None), cfg, policy, rngs,
                                    block=False)
        self.mask_token = nnx.Param(
            cfg.initializer_range * jax.random.normal(rngs.params(), (1, 1, d),
                                                      policy.param_dtype),
            out_sharding=(None, None, "embed"), eager_sharding=False)
        self.decoder_layers = nnx.List([
            ViTLayer(d, cfg.decoder_num_attention_heads, cfg.decoder_intermediate_size, cfg,
                     policy, attention_impl, rngs)
            for _ in range(cfg.decoder_num_hidden_layers)])
        self.decoder_norm = _layer_norm(d, cfg, policy, rngs)
        self.decoder_pred = _dense(d, cfg.patch_dim, ("embed", None), cfg, policy, rngs,
                                   block=False)

    def __call__(self, x, ids_restore, key, deterministic):
        """Patch predictions [B, N, p*p*C] (float32) from the encoder's output ``x`` [B, 1 +
        kept, hidden] and each row's unshuffling permutation ``ids_restore`` [B, N]."""
        cfg = self.cfg
        x = self.decoder_embed(x)
        b, n = ids_restore.shape
        mask_tokens = jnp.broadcast_to(self.mask_token[...].astype(x.dtype),
                                       (b, n + 1 - x.shape[1], x.shape[2]))
        patches = jnp.concatenate([x[:, 1:], mask_tokens], axis=1)
        patches = jnp.take_along_axis(patches, ids_restore[..., None], axis=1)
        rows, cols = cfg.grid
        pos = sincos_positions(cfg.decoder_hidden_size, rows, cols)[None]
        x = jnp.concatenate([x[:, :1], patches], axis=1).astype(jnp.float32) + pos
        x = residual(x.astype(self.policy.activation_dtype))
        call = remat_lib.checkpoint(_decoder_call, self.remat, static_argnums=(4,), modules=True)
        for i, layer in enumerate(self.decoder_layers):
            segments = None
            if cfg.decoder_window is not None:
                segments = jnp.broadcast_to(
                    window_segments(rows, cols, cfg.decoder_window, shift=i % 2 == 1), (b, n + 1))
            x = residual(call(layer, x, segments, layer_rngs(key, cfg.num_hidden_layers + i),
                              deterministic))
        pred = self.decoder_pred(self.decoder_norm(x))
        return pred[:, 1:].astype(jnp.float32)


def random_masking(x, noise, mask_ratio: float):
    """transformers' ``ViTMAEEmbeddings.random_masking``: ``(kept [B, len_keep, D], mask [B, N]
    (1 = dropped), ids_restore [B, N])``; each row keeps the patches of its ``len_keep = int(N
    * (1 - mask_ratio))`` smallest ``noise`` values, in that order."""
    b, n, _ = x.shape
    keep = int(n * (1 - mask_ratio))
    ids_shuffle = jnp.argsort(noise, axis=1)
    ids_restore = jnp.argsort(ids_shuffle, axis=1)
    kept = jnp.take_along_axis(x, ids_shuffle[:, :keep, None], axis=1)
    mask = jnp.where(jnp.arange(n)[None] < keep, 0.0, 1.0) * jnp.ones((b, 1))
    return kept, jnp.take_along_axis(mask, ids_restore, axis=1), ids_restore


class ViTModel(FamilyModel):
    """The encoder with the head of ``spec.task``: ``mae`` (the decoder) or ``classification``
    (``spec.num_labels`` classes).

    Args:
      spec: the architecture (a ``ViTConfig``) and options (``spec.ModelSpec``).
      policy: precision policy name or object (default fp32).
      rngs: parameter initialisation RNGs (default ``nnx.Rngs(params=0)``).
    """

    def __init__(self, spec: ModelSpec, policy: str | Policy | None = None,
                 rngs: nnx.Rngs | None = None):
        if not isinstance(spec, ModelSpec) or not isinstance(spec.architecture, ViTConfig):
            raise TypeError(f"ViTModel takes a ModelSpec of a ViTConfig, got {spec!r}; e.g. "
                            "ViTModel(ModelSpec(VIT_PRESETS['vit-tiny'], task='mae')).")
        cfg = spec.architecture
        check_impl(spec.attention_impl, cfg.attention_probs_dropout_prob)
        if spec.task == "classification" and spec.num_labels is None:
            raise ValueError("a ViT classifier needs num_labels (config: model.num_labels).")
        rngs = rngs if rngs is not None else nnx.Rngs(params=0)
        policy = get_policy(policy)
        self.spec, self.config, self.policy = spec, cfg, policy
        self.embeddings = ViTEmbeddings(cfg, policy, rngs)
        self.layers = nnx.List([
            ViTLayer(cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size, cfg,
                     policy, spec.attention_impl, rngs) for _ in range(cfg.num_hidden_layers)])
        self.layernorm = _layer_norm(cfg.hidden_size, cfg, policy, rngs)
        self.decoder = nnx.data(ViTMAEDecoder(cfg, policy, spec.attention_impl, rngs,
                                              spec.remat) if spec.task == "mae" else None)
        self.classifier = nnx.data(None if spec.task != "classification" else _dense(
            cfg.hidden_size, spec.num_labels, ("embed", None), cfg, policy, rngs, block=False))

    FP8_GROUPS = FP8_GROUPS
    fp8_stacks = (("layers",), ("decoder", "decoder_layers"))
    input_keys = ("pixels",)          # the batch key it reads

    @classmethod
    def input_shapes(cls, config: ViTConfig, length: int | None = None) -> dict:
        """{"pixels": (shape of one row, float32)}: [height, width] for one channel, else
        [height, width, channels] (``length``, a text row's, is unused)."""
        channels = () if config.num_channels == 1 else (config.num_channels,)
        return {"pixels": ((*config.image_size, *channels), jnp.float32)}

    @staticmethod
    def layer_call(layer, x, args, deterministic, rngs, rows=None):
        """One encoder layer on ``x`` (``models.stack``; no other inputs)."""
        return layer(x, None, deterministic, rngs, rows)

    @staticmethod
    def flops_shape(spec: ModelSpec) -> ViTShape:
        """A ViT (bidirectional, GELU MLP, pre-norm layers): the encoder, and under MAE the
        decoder (its embedding and its patch prediction counted as its head), else the
        classifier on one token per row (counted per encoder token, as BERT's head)."""
        a = spec.architecture
        h, n = a.hidden_size, a.num_patches
        mae, causal, pre_norm = spec.task == "mae", spec.family.causal, spec.family.pre_norm
        encoder = Shape(hidden=h, layers=a.num_hidden_layers, heads=a.num_attention_heads,
                        kv_heads=a.num_attention_heads, head_dim=a.head_dim,
                        intermediate=a.intermediate_size, mlp_matrices=2,
                        head_weights=0 if mae else h * (spec.num_labels or 0), causal=causal,
                        pre_norm=pre_norm)
        decoder = None
        if mae:
            d, heads = a.decoder_hidden_size, a.decoder_num_attention_heads
            decoder = Shape(hidden=d, layers=a.decoder_num_hidden_layers, heads=heads,
                            kv_heads=heads, head_dim=d // heads,
                            intermediate=a.decoder_intermediate_size, mlp_matrices=2,
                            head_weights=h * d + d * a.patch_dim, causal=causal,
                            pre_norm=pre_norm)
        kept = 1 + int(n * (1 - a.mask_ratio)) if mae else 1 + n
        return ViTShape(encoder, kept, decoder, n + 1 if mae else 0, n, a.patch_dim * h)

    def target(self, x) -> jax.Array:
        """MAE's regression target of inputs ``x``: the patches [B, N, p*p*C] (float32),
        each normalised to zero mean and unit variance (unbiased, + 1e-6) under
        ``norm_pix_loss`` (transformers' ``forward_loss``)."""
        t = patchify(x.astype(jnp.float32), self.config.patch_size)
        if not self.config.norm_pix_loss:
            return t
        mean = t.mean(-1, keepdims=True)
        var = t.var(-1, keepdims=True, ddof=1)
        return (t - mean) / jnp.sqrt(var + 1e-6)

    def __call__(self, x, *, noise=None, deterministic: bool = True,
                 rngs: nnx.Rngs | None = None, stack=None) -> ViTOutput:
        """``x`` [B, height, width] (one channel: a spectrogram) or [B, height, width,
        channels]. MAE masks by ``noise`` [B, N] (default: uniform, from ``rngs``' dropout
        stream while training, else a fixed key: an evaluation masks the same patches every
        time). ``stack`` runs the encoder layers instead of this model's loop (a
        pipeline's)."""
        cfg = self.config
        expected = (*cfg.image_size, *((cfg.num_channels,) if x.ndim == 4 else ()))
        if x.ndim not in (3, 4) or tuple(x.shape[1:]) != expected or \
                (x.ndim == 3 and cfg.num_channels != 1):
            raise ValueError(f"inputs of shape {tuple(x.shape)}: the model takes [batch, "
                             f"{cfg.image_size[0]}, {cfg.image_size[1]}"
                             f"{'' if cfg.num_channels == 1 else ', ' + str(cfg.num_channels)}]"
                             " (image_size, num_channels).")
        if not deterministic and rngs is None:
            raise ValueError("deterministic=False needs rngs=nnx.Rngs(dropout=key).")
        pos = self.embeddings.positions()
        e = self.embeddings.patch_embeddings(x).astype(jnp.float32) + pos[:, 1:]
        mask = ids_restore = None
        if self.decoder is not None:
            if noise is None:
                key = rngs.dropout() if not deterministic else jax.random.PRNGKey(0)
                noise = jax.random.uniform(key, e.shape[:2])
            e, mask, ids_restore = random_masking(e, noise, cfg.mask_ratio)
        cls = jnp.broadcast_to(self.embeddings.cls_token[...].astype(jnp.float32) + pos[:, :1],
                               (e.shape[0], 1, e.shape[2]))
        h = residual(jnp.concatenate([cls, e], axis=1).astype(self.policy.activation_dtype))
        key = layers_key(rngs, deterministic)
        stack = stack or sequential(self.layers, self.layer_call, remat=self.spec.remat)
        h = self.layernorm(stack(h, (), key, deterministic))
        if self.decoder is not None:
            return ViTOutput(h, self.decoder(h, ids_restore, key, deterministic), mask)
        pooled = h[:, 0] if self.spec.pooling == "cls" else h[:, 1:].mean(axis=1)
        logits = self.classifier(self.policy.cast_to_compute(pooled)).astype(jnp.float32)
        return ViTOutput(h, logits)


__all__ = ["FP8_GROUPS", "ViTModel", "ViTOutput", "patchify", "random_masking",
           "sincos_positions", "window_segments"]
