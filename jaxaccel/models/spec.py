"""What a model is: its family, architecture, task and the options that shape it, as one frozen
``ModelSpec``; and the one table of model families.

``FAMILIES`` holds, per family (``bert``, ``llama``, ``vit``): the architecture dataclass
(``models.architectures``: field names are those of the family's transformers config, what a
checkpoint's config.json holds), the presets ``model.name`` can name, the training tasks its
model has a head for, the ``ModelSpec`` options it takes, and where its model class and
Hugging Face checkpoint reader/writer live (``"module:name"``, imported when first used, so
this module stays plain data, no JAX). A new family is one entry here plus its architecture
and its model file (a class of the contract ``models.family.FamilyModel``); nothing else
branches on the family.

``from_config(cfg.model, architecture)`` is the one place a config's ``model`` section
becomes a spec; the spec is saved beside every checkpoint (``to_dict`` / ``from_dict``, plain
JSON, naming its family and task) so that a run folder rebuilds its model from the spec alone.
Option names are the config keys (``num_labels``, ``pooling``, ``attention_impl``, ``remat``);
the dropout options (``model.hidden_dropout``, ``model.attention_dropout``) are folded into
the architecture.

    family = family_of(spec)                     # FAMILIES entry of the spec's architecture
    model = family.model_class()(spec, policy, nnx.Rngs(params=seed))   # a FamilyModel
    model = family.resolve("reader")(path, spec, policy, seed)      # a HF checkpoint's weights
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
from typing import TYPE_CHECKING, Any, Mapping

from jaxaccel.models.architectures import (BERT_MODEL_TYPES, BERT_PRESETS, DROPOUTS,
                                           LLAMA_MODEL_TYPES, LLAMA_PRESETS, VIT_MODEL_TYPES,
                                           VIT_PRESETS, BertConfig, LlamaConfig, ViTConfig)

if TYPE_CHECKING:
    from jaxaccel.models.family import FamilyModel

POOLINGS = ("cls", "mean")
# Rematerialisation policies (models/remat.py), and what the config's true/false/None name.
REMATS = ("none", "minimal", "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj",
          "minimal_offloaded", "full")
REMAT_ALIASES = {None: "none", False: "none", True: "full"}
DROPOUT_KEYS = ("hidden_dropout", "attention_dropout")     # the config's dropout keys


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
        rngs)``, a ``models.family.FamilyModel``: the contract every caller relies on), the
        checkpoint reader (``load(path, spec, policy, seed) -> model``) and writer
        (``save(model, path, max_shard_size=None, *, exact=False)``: ``exact`` refuses a
        model that transformers' class would run with other outputs, e.g. a head it does not
        have; None: none yet); ``resolve`` imports them.
      embeddings: the top-level parameter collections below the first layer (the layers are
        ``layers[i]`` in every family; anything else is the head), which layer-wise
        learning-rate decay (``train.layer_decay``, ``optim.scale_by_layer``) reads.
      causal: whether its attention is causal (a decoder), which halves attention's FLOPs
        (``jaxaccel.flops``; the forecast reads it for a published run of the family).
      pre_norm: whether its layers norm a sublayer's input, not the residual sum after it, so
        no remat policy computes the MLP's output projection again (``jaxaccel.flops``; the
        forecast reads it for a published run of the family too).
      encoder_writer: ``"module:name"`` of ``save(model, path)`` writing the model's encoder
        alone as a transformers checkpoint (``jaxaccel export --encoder``); None: the family
        has none.
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
    embeddings: tuple[str, ...]
    causal: bool = False
    pre_norm: bool = False
    encoder_writer: str | None = None

    @property
    def tasks(self) -> tuple[str, ...]:
        """The training tasks its model has a head for; the first is the default."""
        return tuple(self.options)

    def model_class(self) -> type[FamilyModel]:
        """The family's model class, imported."""
        return self.resolve("model")

    def resolve(self, part: str):
        """The object ``part`` ("model", "reader", "writer" or "encoder_writer") names,
        imported."""
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
                   writer="jaxaccel.models.hf:save_checkpoint", embeddings=("embeddings",)),
    "llama": Family("llama", LlamaConfig, LLAMA_PRESETS,
                    options={"causal_lm": ("attention_impl", "remat", "flat_tokens")},
                    dropouts={"attention_dropout": "attention_dropout"},
                    hf_model_types=LLAMA_MODEL_TYPES,
                    model="jaxaccel.models.llama:LlamaForCausalLM",
                    reader="jaxaccel.models.hf_llama:load_checkpoint",
                    writer="jaxaccel.models.hf_llama:save_checkpoint",
                    embeddings=("embed_tokens",), causal=True, pre_norm=True),
    "vit": Family("vit", ViTConfig, VIT_PRESETS,
                  options={"mae": ("attention_impl", "remat"),
                           "classification": ("num_labels", "pooling", "attention_impl",
                                              "remat")},
                  dropouts=DROPOUTS, hf_model_types=VIT_MODEL_TYPES,
                  model="jaxaccel.models.vit:ViTModel",
                  reader="jaxaccel.models.hf_vit:load_checkpoint",
                  writer="jaxaccel.models.hf_vit:save_checkpoint", embeddings=("embeddings",),
                  encoder_writer="jaxaccel.models.hf_vit:save_encoder", pre_norm=True),
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
      flat_tokens: (llama) the Dense layers run on [tokens, features] (a free reshape of
        [batch, seq, features]; faster on XLA:CPU) or, False, on [batch, seq, features]
        (less HBM traffic on TPUs). How the same model is laid out for a compiler, not part of
        it: not saved (``to_dict``); None is flat, and ``for_platform`` chooses per platform.
    """

    architecture: Any
    num_labels: int | None = None
    pooling: str = "cls"
    attention_impl: str = "xla"
    remat: str = "none"
    mlm_head: bool = False
    task: str | None = None
    flat_tokens: bool | None = None

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
        d = dataclasses.asdict(self)
        del d["flat_tokens"]
        return {"family": self.family.name, **d}

    def for_platform(self, platform: str) -> "ModelSpec":
        """This spec with ``flat_tokens``, where its family takes it and it is None, chosen for
        ``platform``'s devices: flat but on TPUs (``bench/maxtext_step.py``: 15 GB less HBM
        traffic per ``llama-1b`` step on a v5e-8 batched; the CPU decoder step is ~9% faster
        flat; GPUs keep the layout their measured steps used)."""
        if self.flat_tokens is not None or "flat_tokens" not in \
                self.family.options[self.task]:
            return self
        return dataclasses.replace(self, flat_tokens=platform != "tpu")

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


__all__ = ["ARCHITECTURES", "FAMILIES", "Family", "ModelSpec", "POOLINGS", "architecture_from_hf",
           "family_of", "from_config", "from_saved", "preset"]
