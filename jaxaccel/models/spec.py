"""What a model is: its family, architecture, task and the options that shape it, as one frozen
``ModelSpec``; and the one table of model families.

``FAMILIES`` holds, per family (``bert``, ``llama``): the architecture dataclass (field names
are those of the family's transformers config, what a checkpoint's config.json holds), the
presets ``model.name`` can name, the training tasks its model has a head for, the ``ModelSpec``
options it takes, and where its model class and Hugging Face checkpoint reader/writer live
(``"module:name"``, imported when first used, so this module stays plain data, no JAX). A new
family is one entry here plus its model file; nothing else branches on the family.

``from_config(cfg.model, architecture)`` is the one place a config's ``model`` section
becomes a spec; the spec is saved beside every checkpoint (``to_dict`` / ``from_dict``, plain
JSON, naming its family and task) so that a run folder rebuilds its model from the spec alone.
Option names are the config keys (``num_labels``, ``pooling``, ``attention_impl``, ``remat``);
the dropout options (``model.hidden_dropout``, ``model.attention_dropout``) are folded into
the architecture.

    family = family_of(spec)                     # FAMILIES entry of the spec's architecture
    model = family.resolve("model")(spec, policy, nnx.Rngs(params=seed))
    model = family.resolve("reader")(path, spec, policy, seed)      # a HF checkpoint's weights
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
from typing import Any, Mapping

BERT_MODEL_TYPES = ("bert", "bert_mean_pooling")   # the latter: jaxaccel's export (remote_code)
POOLINGS = ("cls", "mean")
# Rematerialisation policies (models/remat.py), and what the config's true/false/None name.
REMATS = ("none", "minimal", "save_dot_except_mlp", "save_qkv_proj", "minimal_offloaded",
          "full")
REMAT_ALIASES = {None: "none", False: "none", True: "full"}
HIDDEN_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
# BERT's dropouts: config key (None = keep the checkpoint's or preset's value) -> field
DROPOUTS = {"hidden_dropout": "hidden_dropout_prob",
            "attention_dropout": "attention_probs_dropout_prob"}
DROPOUT_KEYS = ("hidden_dropout", "attention_dropout")     # the config's dropout keys


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


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family's entry in ``FAMILIES``.

    Attributes:
      name: the family's name (saved in every spec).
      architecture: its architecture dataclass, with ``from_dict(config_json, source)``.
      presets: ``model.name`` -> architecture.
      options: per training task (``jaxaccel.train.tasks``) its model has a head for (the
        first is the default, ``tasks``), the ``ModelSpec`` options (config keys of the same
        names) a model of that task takes; the others must keep their defaults.
      dropouts: config key -> architecture field the configured dropout goes to.
      hf_model_types: the config.json ``model_type`` values it reads.
      model, reader, writer: ``"module:name"`` of the model class (``Model(spec, policy,
        rngs)``), the checkpoint reader (``load(path, spec, policy, seed) -> model``) and
        writer (``save(model, path, max_shard_size=None, *, exact=False)``: ``exact`` refuses
        a model that transformers' class would run with other outputs, e.g. a head it does
        not have; None: none yet); ``resolve`` imports them.
      flops: ``"module:name"`` of ``shape(spec) -> jaxaccel.flops.Shape``, what the model
        FLOPs formula (tokens/s, TFLOP/s and MFU of every run) reads from a spec.
      embeddings: the top-level parameter collections below the first layer (the layers are
        ``layers[i]`` in every family; anything else is the head), which layer-wise
        learning-rate decay (``train.layer_decay``, ``optim.scale_by_layer``) reads.
    """

    name: str
    architecture: type
    presets: Mapping[str, Any]
    options: Mapping[str, tuple[str, ...]]
    dropouts: Mapping[str, str]
    hf_model_types: tuple[str, ...]
    model: str
    reader: str
    writer: str | None
    flops: str
    embeddings: tuple[str, ...]

    @property
    def tasks(self) -> tuple[str, ...]:
        """The training tasks its model has a head for; the first is the default."""
        return tuple(self.options)

    def resolve(self, part: str):
        """The object ``part`` ("model", "reader" or "writer") names, imported."""
        if getattr(self, part) is None:
            raise NotImplementedError(f"the {self.name} family has no checkpoint {part} yet.")
        module, name = getattr(self, part).split(":")
        return getattr(importlib.import_module(module), name)


FAMILIES = {
    "bert": Family("bert", BertConfig, BERT_PRESETS,
                   options={"classification": ("num_labels", "pooling", "attention_impl",
                                               "remat", "mlm_head")},
                   dropouts=DROPOUTS, hf_model_types=BERT_MODEL_TYPES,
                   model="jaxaccel.models.bert:BertModel",
                   reader="jaxaccel.models.hf:load_checkpoint",
                   writer="jaxaccel.models.hf:save_checkpoint", flops="jaxaccel.flops:bert_shape",
                   embeddings=("embeddings",)),
    "llama": Family("llama", LlamaConfig, LLAMA_PRESETS,
                    options={"causal_lm": ("attention_impl", "remat")},
                    dropouts={"attention_dropout": "attention_dropout"},
                    hf_model_types=LLAMA_MODEL_TYPES,
                    model="jaxaccel.models.llama:LlamaForCausalLM",
                    reader="jaxaccel.models.hf_llama:load_checkpoint",
                    writer="jaxaccel.models.hf_llama:save_checkpoint",
                    flops="jaxaccel.flops:llama_shape", embeddings=("embed_tokens",)),
    "vit": Family("vit", ViTConfig, VIT_PRESETS,
                  options={"mae": ("attention_impl", "remat"),
                           "classification": ("num_labels", "pooling", "attention_impl",
                                              "remat")},
                  dropouts=DROPOUTS, hf_model_types=VIT_MODEL_TYPES,
                  model="jaxaccel.models.vit:ViTModel",
                  reader="jaxaccel.models.hf_vit:load_checkpoint",
                  writer="jaxaccel.models.hf_vit:save_checkpoint",
                  flops="jaxaccel.flops:vit_shape", embeddings=("embeddings",)),
}
ARCHITECTURES = tuple(f.architecture for f in FAMILIES.values())


def family_of(architecture) -> Family:
    """The ``FAMILIES`` entry of an architecture (or of a spec's)."""
    architecture = getattr(architecture, "architecture", architecture)
    for family in FAMILIES.values():
        if isinstance(architecture, family.architecture):
            return family
    first = ARCHITECTURES[0].__name__
    raise TypeError(f"architecture={architecture!r} is not a {first}; build one with "
                    f"{first}(...) or {first}.from_dict(config_json), or another family's "
                    f"architecture ({', '.join(a.__name__ for a in ARCHITECTURES[1:])}).")


def architecture_from_hf(config_json: dict[str, Any], source: str = "config"):
    """The architecture a transformers config.json describes, by its ``model_type``."""
    model_type = config_json.get("model_type", "bert")
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family.architecture.from_dict(config_json, source=source)
    known = {f.name: f.hf_model_types for f in FAMILIES.values()}
    raise ValueError(f"{source}: model_type={model_type!r} (architectures "
                     f"{config_json.get('architectures')}) is not a family jaxaccel reads; "
                     f"known families and their model types: {known}.")


def preset(name: str):
    """The architecture of preset ``name`` (``model.name``) of any family."""
    for family in FAMILIES.values():
        if name in family.presets:
            return family.presets[name]
    names = sorted(n for f in FAMILIES.values() for n in f.presets)
    close = difflib.get_close_matches(name, names, n=2, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"model.name={name!r} is unknown; presets: {names}.{hint} "
                     "For any other BERT-, Llama- or ViT-family model set model.checkpoint to its "
                     "Hugging Face directory.")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Everything that builds a model (the precision policy and the seed aside).

    Attributes:
      architecture: a family's architecture (``BertConfig``, ``LlamaConfig``), dropouts
        included; it decides the family (``family_of``).
      num_labels: (bert) if given, a sequence-classification head (dropout + dense on the
        pooled output) and ``logits`` [batch, num_labels].
      pooling: (bert) what the classification head reads: ``"cls"`` (BERT's pooler output, as
        transformers' ``BertForSequenceClassification``) or ``"mean"`` (the mask-weighted mean
        of the last hidden states, sum_s m_s x_s / sum_s m_s, for checkpoints trained with mean
        pooling such as sentence-transformers models).
      attention_impl: the attention implementation (``models.attention.ATTENTION_IMPLS``),
        checked when the model is built.
      remat: what each layer keeps for the backward pass and computes again (memory for
        compute): a ``models.remat`` policy name (true: full, false: none).
      mlm_head: (bert) add the masked-LM head; ``logits`` are then [batch, seq, vocab].
      task: the training task (``jaxaccel.train.tasks.TASKS``); None: the family's default
        (bert: classification, llama: causal_lm).
    """

    architecture: Any
    num_labels: int | None = None
    pooling: str = "cls"
    attention_impl: str = "xla"
    remat: str = "none"
    mlm_head: bool = False
    task: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "remat", remat_name(self.remat))
        family = family_of(self.architecture)
        if self.task is None:
            object.__setattr__(self, "task", family.tasks[0])
        if self.task not in family.tasks:
            raise ValueError(f"task={self.task!r}: the {family.name} family's model has heads "
                             f"for {family.tasks} only.")
        defaults = {f.name: f.default for f in dataclasses.fields(ModelSpec)}
        options = family.options[self.task]
        foreign = [k for k in defaults if k not in options + ("architecture", "task")
                   and getattr(self, k) != defaults[k]]
        if foreign:
            raise ValueError(f"the {family.name} family's {self.task} model takes no option(s) "
                             f"{foreign} (it takes {options}); leave them at their defaults.")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling={self.pooling!r} is not one of {POOLINGS} (config: "
                             "model.pooling); use 'cls' (BERT's pooler) or 'mean' (masked mean "
                             "of the last hidden states).")
        if self.num_labels is not None and (isinstance(self.num_labels, bool)
                                            or not isinstance(self.num_labels, int)
                                            or self.num_labels < 1):
            raise ValueError(f"num_labels={self.num_labels!r} must be a positive integer (or "
                             "None for no classification head).")
        if self.num_labels is not None and self.mlm_head:
            raise ValueError(f"num_labels={self.num_labels} and mlm_head=True: choose one head, "
                             "num_labels (classification) or mlm_head=True (masked LM).")

    @property
    def family(self) -> Family:
        return family_of(self.architecture)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON: ``{"family": ..., "architecture": {...fields}, "num_labels": ...,
        "task": ..., ...}``."""
        return {"family": self.family.name, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        """The inverse of ``to_dict``; unknown keys are an error that names them. Specs saved
        before families existed (no ``"family"``/``"task"``) are BERT classification ones."""
        if "architecture" not in d:
            raise ValueError(f"model spec: no 'architecture' key in {sorted(d)}; expected the "
                             "output of ModelSpec.to_dict().")
        d = dict(d)
        name = d.pop("family", "bert")
        if name not in FAMILIES:
            raise ValueError(f"model spec: family={name!r} is unknown; known: "
                             f"{sorted(FAMILIES)}. Was it written by a newer jaxaccel?")
        architecture = FAMILIES[name].architecture
        _check_keys(cls, d, "model spec")
        _check_keys(architecture, d["architecture"], "model spec architecture")
        return cls(**{**d, "architecture": architecture(**d["architecture"])})


def _check_keys(cls, d: dict, what: str) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise ValueError(f"{what}: unknown keys {unknown}; expected keys of {cls.__name__}: "
                         f"{names}. Was it written by a newer jaxaccel?")


def remat_name(value) -> str:
    """The rematerialisation policy ``value`` (a name, a bool or None) stands for;
    ``ValueError`` naming the choices for anything else."""
    if isinstance(value, bool) or value is None:
        return REMAT_ALIASES[value]
    if value not in REMATS:
        raise ValueError(f"model.remat={value!r} is not one of {list(REMATS)} (or true = "
                         "full, false = none).")
    return value


def from_config(model_cfg, architecture=None) -> ModelSpec:
    """The spec of a config's ``model`` section: ``architecture`` (a checkpoint's, from
    ``architecture_of``) or else the preset ``model.name``'s (of any family), with the
    configured dropouts, and the options of the same names the family takes."""
    return _with_options(preset(model_cfg.name) if architecture is None else architecture,
                         model_cfg)


def from_saved(saved: dict[str, Any], model_cfg) -> ModelSpec:
    """The spec saved with a checkpoint (its record's ``"architecture"``). Records written
    before specs existed hold the bare ``BertConfig`` (dropouts already the run's); the
    options then come from the run's saved config (``model_cfg``)."""
    if "architecture" in saved:
        return ModelSpec.from_dict(saved)
    _check_keys(BertConfig, saved, "saved architecture")
    return _with_options(BertConfig(**saved), model_cfg)


def _with_options(architecture, model_cfg) -> ModelSpec:
    family = family_of(architecture)
    dropouts = {}
    for key in DROPOUT_KEYS:
        if model_cfg[key] is None:
            continue
        if key not in family.dropouts:
            raise ValueError(f"model.{key}={model_cfg[key]}: the {family.name} family has no "
                             f"such dropout (it has {sorted(family.dropouts)}); leave it None.")
        dropouts[family.dropouts[key]] = model_cfg[key]
    task = (model_cfg["task"] if "task" in model_cfg else "") or family.tasks[0]
    if task not in family.tasks:
        raise ValueError(f"model.task={task!r}: the {family.name} family's model has heads for "
                         f"{family.tasks} only.")
    options = {k: model_cfg[k] for k in family.options[task] if k in model_cfg}
    return ModelSpec(dataclasses.replace(architecture, **dropouts), **options, task=task)


__all__ = ["ARCHITECTURES", "BertConfig", "FAMILIES", "Family", "LLAMA_PRESETS", "LlamaConfig",
           "ModelSpec", "POOLINGS", "PRESETS", "VIT_PRESETS", "ViTConfig", "architecture_from_hf",
           "family_of", "from_config", "from_saved", "hf_rope", "preset"]
