"""What a model is: its architecture and the options that shape it, as one frozen ``ModelSpec``.

``from_config(cfg.model, architecture)`` is the one place a config's ``model`` section
becomes a spec; the spec is saved beside every checkpoint (``to_dict`` / ``from_dict``, plain
JSON) so that a run folder rebuilds its model from the spec alone. Option names are the config
keys (``num_labels``, ``pooling``, ``attention_impl``, ``remat``); the two dropout options
(``model.hidden_dropout``, ``model.attention_dropout``) are folded into the architecture, whose
field names are those of transformers' ``BertConfig`` (what a checkpoint's config.json holds).

Plain data, no JAX: ``bert.BertModel(spec, policy, rngs)`` builds the model and
``hf.load_checkpoint(path, spec, policy, seed)`` builds it with a checkpoint's weights.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any

BERT_MODEL_TYPES = ("bert",)
POOLINGS = ("cls", "mean")
HIDDEN_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
# config key (None = keep the checkpoint's or preset's value) -> architecture field
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

    def attention_train_flops(self, batch: int, seq: int) -> float:
        """FLOPs of the attention scores and mixing (QK^T, PV) in one training step (forward
        + backward = 3 x forward): 12 x layers x seq^2 x hidden per sequence."""
        return 12.0 * self.num_hidden_layers * seq * seq * self.hidden_size * batch

    def train_flops(self, batch: int, seq: int, num_labels: int = 2) -> float:
        """Model FLOPs of one training step (DESIGN.md "Measuring"): 6 x non-embedding
        parameters x tokens for the dense part, plus ``attention_train_flops``."""
        h, f, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        non_embedding = layers * (4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h) + h * h + h \
            + h * num_labels + num_labels
        return 6.0 * non_embedding * batch * seq + self.attention_train_flops(batch, seq)

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
        return cls(**{k: v for k, v in d.items() if k in names})


PRESETS = {
    "bert-base": BertConfig(),
    "bert-large": BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                             intermediate_size=4096),
    "minilm-l6": BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                            intermediate_size=1536),
    "tiny": BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=128, max_position_embeddings=128),
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Everything that builds a model (the precision policy and the seed aside).

    Attributes:
      architecture: the ``BertConfig``, dropouts included.
      num_labels: if given, a sequence-classification head (dropout + dense on the pooled
        output) and ``logits`` [batch, num_labels].
      pooling: what the classification head reads: ``"cls"`` (BERT's pooler output, as
        transformers' ``BertForSequenceClassification``) or ``"mean"`` (the mask-weighted mean
        of the last hidden states, sum_s m_s x_s / sum_s m_s, for checkpoints trained with mean
        pooling such as sentence-transformers models).
      attention_impl: the attention implementation (``models.attention.ATTENTION_IMPLS``),
        checked when the model is built.
      remat: rematerialise each encoder layer's activations in the backward pass (memory for
        compute).
      mlm_head: add the masked-LM head; ``logits`` are then [batch, seq, vocab].
    """

    architecture: BertConfig
    num_labels: int | None = None
    pooling: str = "cls"
    attention_impl: str = "xla"
    remat: bool = False
    mlm_head: bool = False

    def __post_init__(self):
        if not isinstance(self.architecture, BertConfig):
            raise TypeError(f"architecture={self.architecture!r} is not a BertConfig; build one "
                            "with BertConfig(...) or BertConfig.from_dict(config_json).")
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

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON: ``{"architecture": {...BertConfig fields}, "num_labels": ..., ...}``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        """The inverse of ``to_dict``; unknown keys are an error that names them."""
        if "architecture" not in d:
            raise ValueError(f"model spec: no 'architecture' key in {sorted(d)}; expected the "
                             "output of ModelSpec.to_dict().")
        _check_keys(cls, d, "model spec")
        _check_keys(BertConfig, d["architecture"], "model spec architecture")
        return cls(**{**d, "architecture": BertConfig(**d["architecture"])})


def _check_keys(cls, d: dict, what: str) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise ValueError(f"{what}: unknown keys {unknown}; expected keys of {cls.__name__}: "
                         f"{names}. Was it written by a newer jaxaccel?")


def from_config(model_cfg, architecture: BertConfig | None = None) -> ModelSpec:
    """The spec of a config's ``model`` section: ``architecture`` (a checkpoint's, from
    ``hf.architecture_of``) or else the preset ``model.name``'s, with the configured dropouts,
    and the options of the same names."""
    name = model_cfg.name
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=2, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"model.name={name!r} is unknown; presets: {sorted(PRESETS)}.{hint} "
                         "For any other BERT-family model set model.checkpoint to its "
                         "Hugging Face directory.")
    return _with_options(PRESETS[name] if architecture is None else architecture, model_cfg)


def from_saved(saved: dict[str, Any], model_cfg) -> ModelSpec:
    """The spec saved with a checkpoint (its record's ``"architecture"``). Records written
    before specs existed hold the bare ``BertConfig`` (dropouts already the run's); the
    options then come from the run's saved config (``model_cfg``)."""
    if "architecture" in saved:
        return ModelSpec.from_dict(saved)
    _check_keys(BertConfig, saved, "saved architecture")
    return _with_options(BertConfig(**saved), model_cfg)


def _with_options(architecture: BertConfig, model_cfg) -> ModelSpec:
    dropouts = {field: model_cfg[key] for key, field in DROPOUTS.items()
                if model_cfg[key] is not None}
    return ModelSpec(dataclasses.replace(architecture, **dropouts),
                     num_labels=model_cfg.num_labels, pooling=model_cfg.pooling,
                     attention_impl=model_cfg.attention_impl, remat=model_cfg.remat)


__all__ = ["BertConfig", "ModelSpec", "POOLINGS", "PRESETS", "from_config", "from_saved"]
