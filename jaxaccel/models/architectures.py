"""The architectures of the model families: one frozen dataclass per family (``BertConfig``,
``LlamaConfig``, ``ViTConfig``) whose field names are those of the family's transformers config
(what a checkpoint's config.json holds), the presets ``model.name`` can name, and the reading
of a config.json dict (``from_dict``, ``hf_rope``). Plain data, no JAX; ``spec.FAMILIES`` ties
each architecture to its model, tasks and checkpoint code.
"""
from __future__ import annotations

import dataclasses
from typing import Any

BERT_MODEL_TYPES = ("bert", "bert_mean_pooling")   # the latter: jaxaccel's export (remote_code)
HIDDEN_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
# BERT's dropouts: config key (None = keep the checkpoint's or preset's value) -> field
DROPOUTS = {"hidden_dropout": "hidden_dropout_prob",
            "attention_dropout": "attention_probs_dropout_prob"}


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """The architecture; field names are those of transformers' ``BertConfig``."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}.")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; expected one of "
                             f"{HIDDEN_ACTS}.")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "BertConfig":
        """Build from a transformers config.json dict (other keys are ignored); rejects
        non-BERT architectures."""
        model_type = d.get("model_type", "bert")
        if model_type not in BERT_MODEL_TYPES:
            raise ValueError(f"{source}: model_type={model_type!r} is not a BERT-family model; "
                             f"this loader reads {BERT_MODEL_TYPES}.")
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{source}: position_embedding_type="
                             f"{d['position_embedding_type']!r} is not supported (only 'absolute').")
        names = {f.name for f in dataclasses.fields(cls)}
        return _from_fields(cls, {k: v for k, v in d.items() if k in names}, source)


def _from_fields(cls, values: dict[str, Any], source: str):
    """``cls(**values)`` of a ``from_dict``, a refusal naming ``source`` (the config.json the
    values were read from) as its other refusals do."""
    try:
        return cls(**values)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


PRESETS = {
    "bert-base": BertConfig(),
    "bert-large": BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                             intermediate_size=4096),
    "minilm-l6": BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                            intermediate_size=1536),
    "tiny": BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=128, max_position_embeddings=128),
}


BERT_PRESETS = PRESETS
LLAMA_MODEL_TYPES = ("llama",)
# Supported RoPE scalings: rope_type -> the keys of its rope_scaling dict.
ROPE_SCALINGS = {"llama3": ("rope_type", "factor", "low_freq_factor", "high_freq_factor",
                            "original_max_position_embeddings")}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A Llama-style decoder's architecture; field names are those of transformers'
    ``LlamaConfig`` (what a Llama checkpoint's config.json holds).

    ``num_key_value_heads`` < ``num_attention_heads`` is grouped-query attention (query head
    ``h`` reads key/value head ``h // (num_attention_heads // num_key_value_heads)``);
    ``head_dim`` defaults to ``hidden_size // num_attention_heads``; ``rope_theta`` is the
    rotary base (``theta_i = rope_theta ** (-2i / head_dim)``). ``rope_scaling`` is None
    (plain RoPE) or Llama 3's frequency scaling (``rope_type`` "llama3" with ``factor``,
    ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``; see
    ``llama.rope_frequencies``), held as sorted (key, value) pairs so the architecture stays
    hashable; a dict is accepted."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float = 0.0
    rope_scaling: tuple | None = None

    def __post_init__(self):
        if self.rope_scaling is not None:
            items = self.rope_scaling.items() if isinstance(self.rope_scaling, dict) \
                else self.rope_scaling
            scaling = dict((k, v) for k, v in items)
            if scaling.get("rope_type") not in ROPE_SCALINGS or \
                    set(scaling) != set(ROPE_SCALINGS[scaling.get("rope_type")]):
                raise ValueError(f"rope_scaling={scaling!r} is not supported; expected None or "
                                 f"one of {ROPE_SCALINGS} (a rope_type and its keys).")
            object.__setattr__(self, "rope_scaling", tuple(sorted(scaling.items())))
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                                 f"num_attention_heads={self.num_attention_heads}; give "
                                 "head_dim explicitly.")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a "
                             f"multiple of num_key_value_heads={self.num_key_value_heads} "
                             "(grouped-query attention shares each key/value head among a "
                             "whole group of query heads).")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs).")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; the Llama MLP "
                             "here is SwiGLU (hidden_act='silu').")

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "LlamaConfig":
        """Build from a transformers config.json dict (other keys ignored); the RoPE settings
        as transformers reads them (``hf_rope``)."""
        model_type = d.get("model_type")
        if model_type not in LLAMA_MODEL_TYPES:
            raise ValueError(f"{source}: model_type={model_type!r} is not a Llama-family "
                             f"model; this loader reads {LLAMA_MODEL_TYPES}.")
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in d.items() if k in names and v is not None}
        values["rope_theta"], values["rope_scaling"] = hf_rope(d, source)
        values.setdefault("num_key_value_heads", d.get("num_attention_heads",
                                                        cls.num_attention_heads))
        return _from_fields(cls, values, source)

    def to_hf(self) -> dict[str, Any]:
        """The config.json of this architecture for transformers' ``LlamaForCausalLM``."""
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                **dataclasses.asdict(self),
                "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling)}


def hf_rope(d: dict[str, Any], source: str = "config") -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` of a Llama config.json dict, read the way transformers 5
    reads it (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict``), so that a file
    means the same here as there: the RoPE dict is ``rope_scaling`` (transformers < 5) when
    it is set, else ``rope_parameters`` (transformers >= 5); its ``rope_type`` (or the older
    ``type``) defaults to "default" (plain RoPE, ``rope_scaling`` None); the dict's own
    ``rope_theta`` wins over the top-level one (default 10000); Llama 3's
    ``original_max_position_embeddings`` defaults to ``max_position_embeddings``. A rope type
    not in ``ROPE_SCALINGS``, or one missing its keys, is a ``ValueError`` naming the key it
    was read from."""
    key = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    rope = d.get(key) or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{source}: {key}={rope!r} is not a dict; expected e.g. "
                         '{"rope_type": "default", "rope_theta": 10000.0}.')
    theta = float(rope.get("rope_theta", d.get("rope_theta") or 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ROPE_SCALINGS:
        hidden = (" (transformers reads rope_scaling in place of rope_parameters "
                  f"{d['rope_parameters']!r}: drop rope_scaling if that is what the model was "
                  "trained with)" if key == "rope_scaling" and d.get("rope_parameters") else "")
        raise ValueError(f"{source}: {key}={rope!r}: RoPE scaling {kind!r} is not supported "
                         f"(plain RoPE or {tuple(ROPE_SCALINGS)}){hidden}; use such a "
                         "checkpoint (e.g. TinyLlama, Llama 3.x).")
    given = {"original_max_position_embeddings": d.get("max_position_embeddings"), **rope}
    missing = [k for k in ROPE_SCALINGS[kind] if k != "rope_type" and given.get(k) is None]
    if missing:
        raise ValueError(f"{source}: {key}={rope!r} lacks {missing}, which RoPE scaling "
                         f"{kind!r} needs ({ROPE_SCALINGS[kind]}); add them to the file.")
    return theta, {"rope_type": kind, **{k: given[k] for k in ROPE_SCALINGS[kind]
                                         if k != "rope_type"}}


LLAMA_PRESETS = {
    # Tests: 8 query heads sharing 4 key/value heads (GQA), everything divisible by 4 (TP).
    "llama-tiny": LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                              max_position_embeddings=128),
    # The CPU decoder job's (configs/canterbury_lm.py): 4 layers, d=128, a tied 2k vocabulary;
    # 1.05M matmul weights with the logits, compute-optimal for minutes of a 2-core CPU.
    "llama-cpu": LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=384,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=512, tie_word_embeddings=True),
    # GPT-3 Small (Brown et al. 2020, table 2.1: 12 layers, d=768, 12 heads, 2048 tokens) in
    # Llama form: SwiGLU at 8/3 d, RMSNorm, RoPE, tied embeddings, Llama-2's 32k vocabulary.
    "llama-125m": LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                              num_hidden_layers=12, num_attention_heads=12,
                              num_key_value_heads=12, tie_word_embeddings=True),
    # GPT-3 Medium (24 layers, d=1024, 16 heads; OPT-350m's depth and width) in Llama form.
    "llama-350m": LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                              num_hidden_layers=24, num_attention_heads=16,
                              num_key_value_heads=16, tie_word_embeddings=True),
    # TinyLlama-1.1B (TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T config.json):
    # 22 layers, d=2048, 32 query / 4 key-value heads, SwiGLU 5632, 32k vocabulary.
    "llama-1b": LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                            num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                            rms_norm_eps=1e-5),
    # At scale, for plans and the MaxText comparison (bench/maxtext_step.py), not for a CPU:
    # Meta-Llama-3-8B's config.json (32 layers, d=4096, 32 query / 8 key-value heads, SwiGLU
    # 14336, a 128,256-token vocabulary, RoPE base 500,000, 8k context) and Llama-2-70b-hf's
    # (80 layers, d=8192, 64 / 8 heads, SwiGLU 28672, 32k vocabulary, 4k context).
    "llama3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                             max_position_embeddings=8192, rms_norm_eps=1e-5,
                             rope_theta=500000.0),
    "llama2-70b": LlamaConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                              num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                              max_position_embeddings=4096, rms_norm_eps=1e-5),
}


VIT_MODEL_TYPES = ("vit_mae", "vit", "vit_mean_pooling")   # the last: jaxaccel's export
POSITION_EMBEDDINGS = ("sincos", "learned")


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """A Vision Transformer over 2-D inputs (images, spectrograms) and its masked-autoencoder
    decoder; field names are those of transformers' ``ViTMAEConfig`` (a ``ViTConfig``'s are a
    subset of them), plus ``decoder_window`` and ``position_embedding_type``.

    ``image_size`` (height, width) need not be square: a spectrogram of 1024 frames x 128 mel
    bins is a 64 x 8 grid of 16 x 16 patches; an int is a square. ``position_embedding_type``
    "sincos": fixed 2-D sin-cos positions (MAE's; computed, never trained or stored),
    "learned": a trained table (transformers' ``ViTForImageClassification``).
    ``decoder_window`` (rows, cols): the MAE decoder attends within local windows of that
    many patches, shifted by half a window every other layer (Audio-MAE); None: globally.
    ``mask_ratio`` and ``norm_pix_loss`` are the MAE task's (``models.vit``)."""

    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    image_size: tuple = (224, 224)
    patch_size: int = 16
    num_channels: int = 3
    qkv_bias: bool = True
    decoder_num_attention_heads: int = 16
    decoder_hidden_size: int = 512
    decoder_num_hidden_layers: int = 8
    decoder_intermediate_size: int = 2048
    mask_ratio: float = 0.75
    norm_pix_loss: bool = False
    decoder_window: tuple | None = None
    position_embedding_type: str = "sincos"

    def __post_init__(self):
        size = self.image_size
        size = (size, size) if isinstance(size, int) else tuple(size)
        object.__setattr__(self, "image_size", size)
        if self.decoder_window is not None:
            object.__setattr__(self, "decoder_window", tuple(self.decoder_window))
        problems = []
        if len(size) != 2 or any(s % self.patch_size for s in size):
            problems.append(f"image_size={size} must be (height, width), each a multiple of "
                            f"patch_size={self.patch_size}")
        for hidden, heads in (("hidden_size", "num_attention_heads"),
                              ("decoder_hidden_size", "decoder_num_attention_heads")):
            if getattr(self, hidden) % getattr(self, heads):
                problems.append(f"{hidden}={getattr(self, hidden)} is not divisible by "
                                f"{heads}={getattr(self, heads)}")
            if getattr(self, hidden) % 4:
                problems.append(f"{hidden}={getattr(self, hidden)} must be a multiple of 4 "
                                "(2-D sin-cos positions)")
        if not 0.0 <= self.mask_ratio < 1.0:
            problems.append(f"mask_ratio={self.mask_ratio} must be in [0, 1)")
        elif int(self.num_patches * (1 - self.mask_ratio)) < 1:
            problems.append(f"mask_ratio={self.mask_ratio} keeps no patch of {self.num_patches}")
        if self.hidden_act not in HIDDEN_ACTS:
            problems.append(f"hidden_act={self.hidden_act!r} is not one of {HIDDEN_ACTS}")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            problems.append(f"position_embedding_type={self.position_embedding_type!r} is not "
                            f"one of {POSITION_EMBEDDINGS}")
        w = self.decoder_window
        if w is not None and (len(w) != 2 or min(w) < 1):
            problems.append(f"decoder_window={w} must be None or (rows, cols) of patches >= 1")
        if problems:
            raise ValueError("ViTConfig: " + "; ".join(problems) + ".")

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, cols) of the patch grid."""
        return (self.image_size[0] // self.patch_size, self.image_size[1] // self.patch_size)

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def patch_dim(self) -> int:
        """Values per patch: patch_size**2 x num_channels."""
        return self.patch_size * self.patch_size * self.num_channels

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def max_position_embeddings(self) -> int:
        """Positions of a row: the CLS token and every patch."""
        return self.num_patches + 1

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "ViTConfig":
        """Build from a transformers ``ViTMAEConfig`` or ``ViTConfig`` config.json dict (other
        keys ignored): a ViT's positions are learned, a ViT-MAE's sin-cos, unless it names
        ``position_embedding_type`` (jaxaccel's writers do)."""
        model_type = d.get("model_type")
        if model_type not in VIT_MODEL_TYPES:
            raise ValueError(f"{source}: model_type={model_type!r} is not a ViT-family model; "
                             f"this loader reads {VIT_MODEL_TYPES}.")
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in d.items() if k in names}
        values.setdefault("position_embedding_type",
                          "sincos" if model_type == "vit_mae" else "learned")
        return _from_fields(cls, values, source)


VIT_PRESETS = {
    # Tests: a non-square 5 x 3 grid of 8 x 8 patches of a one-channel input, MAE decoder.
    "vit-tiny": ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=128, image_size=(40, 24), patch_size=8,
                          num_channels=1, decoder_num_attention_heads=4,
                          decoder_hidden_size=64, decoder_num_hidden_layers=1,
                          decoder_intermediate_size=128, mask_ratio=0.6, norm_pix_loss=True),
    # Trains on a 2-core CPU in minutes: 64 frames x 64 mel bins (bfsong) as an 8 x 8 grid of
    # 8 x 8 patches, 4 layers of 192, Audio-MAE's 80% masking and local-window decoder.
    "vit-audio-cpu": ViTConfig(hidden_size=192, num_hidden_layers=4, num_attention_heads=4,
                               intermediate_size=768, image_size=(64, 64), patch_size=8,
                               num_channels=1, decoder_num_attention_heads=4,
                               decoder_hidden_size=128, decoder_num_hidden_layers=2,
                               decoder_intermediate_size=512, mask_ratio=0.8,
                               norm_pix_loss=True, decoder_window=(4, 4)),
    # ViT-B/16 with MAE's ViT-B decoder (He et al. 2022: 8 blocks of 512, 16 heads) on
    # 224 x 224 RGB images: facebook/vit-mae-base's config.
    "vit-b16-mae": ViTConfig(),
    # Audio-MAE's ViT-B/16 (Huang et al. 2022): 1024 frames x 128 mel bins (a 64 x 8 grid),
    # one channel, 80% of the patches masked, normalised-patch targets, a local-window decoder.
    "audiomae-b16": ViTConfig(image_size=(1024, 128), num_channels=1, mask_ratio=0.8,
                              norm_pix_loss=True, decoder_window=(4, 4)),
}


__all__ = ["BertConfig", "LLAMA_PRESETS", "LlamaConfig", "PRESETS", "VIT_PRESETS", "ViTConfig",
           "hf_rope"]
