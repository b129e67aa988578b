"""Hugging Face BERT-family checkpoints (config.json + safetensors) to and from the NNX model.

No torch needed. Reads ``model.safetensors`` or a sharded ``model.safetensors.index.json``,
accepts the ``bert.``-prefixed layout (``BertFor*`` checkpoints) and the un-prefixed one
(``BertModel``), and the old ``gamma``/``beta`` LayerNorm names. Tensors the model does not
know, and missing encoder tensors, are errors that name them; heads absent from the checkpoint
(classifier, MLM head, pooler) are initialised fresh and reported.

    model = from_pretrained("path/to/hf_checkpoint", num_labels=2, pooling="mean")
    model = load_checkpoint(path, spec, policy, seed)     # the spec built elsewhere (from config)
    save_checkpoint(model, "out_dir")            # transformers loads out_dir

``save_checkpoint`` writes what transformers' ``save_pretrained`` writes for the model's head:
a classifier as ``BertForSequenceClassification`` (``bert.``-prefixed encoder and pooler,
``classifier``), the MLM head as ``BertForMaskedLM`` (no pooler; the decoder is tied to the
word embeddings and its bias to ``cls.predictions.bias``, so neither is stored), no head as
``BertModel`` (un-prefixed). transformers' classifier reads the pooler output (the CLS token):
a classifier of mean pooling is written with a warning that transformers' outputs differ
(``differences``), or refused with ``exact=True``; with ``custom_code=True`` it is written
with a class of its own for transformers (``remote_code.BERT_MEAN_POOLING``: its
``modeling_*.py`` in the folder, config.json's ``model_type`` "bert_mean_pooling" and
``auto_map``, the head ``mean_pooling_classifier``), which
``AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=True)`` loads
and this module reads back (pooling "mean" by default).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re

import jax
import numpy as np
from flax import nnx

from jaxaccel.models import remote_code
from jaxaccel.models.architectures import DROPOUTS, BertConfig
from jaxaccel.models.bert import BertModel
from jaxaccel.models.spec import ModelSpec
from jaxaccel.precision import Policy

log = logging.getLogger(__name__)

# Checkpoint tensors that carry no parameters of ours (buffers, NSP head, tied decoder weight).
_IGNORED = re.compile(r"^(embeddings\.position_ids|cls\.seq_relationship\..*"
                      r"|cls\.predictions\.decoder\.(weight|bias))$")
_OPTIONAL_PREFIXES = ("classifier.", "cls.predictions.", "pooler.")


def _linear(hf: str, ours: str) -> dict[str, tuple[str, bool]]:
    return {f"{hf}.weight": (f"{ours}/kernel", True), f"{hf}.bias": (f"{ours}/bias", False)}


def _norm(hf: str, ours: str) -> dict[str, tuple[str, bool]]:
    return {f"{hf}.weight": (f"{ours}/scale", False), f"{hf}.bias": (f"{ours}/bias", False)}


def key_map(config: BertConfig, num_labels: int | None, mlm_head: bool):
    """HF tensor name -> (our '/'-joined parameter path, transpose?)."""
    m = {f"embeddings.{n}.weight": (f"embeddings/{n}/embedding", False)
         for n in ("word_embeddings", "position_embeddings", "token_type_embeddings")}
    m.update(_norm("embeddings.LayerNorm", "embeddings/layer_norm"))
    for i in range(config.num_hidden_layers):
        hf, ours = f"encoder.layer.{i}", f"layers/{i}"
        for n in ("query", "key", "value"):
            m.update(_linear(f"{hf}.attention.self.{n}", f"{ours}/attention/{n}"))
        m.update(_linear(f"{hf}.attention.output.dense", f"{ours}/attention/output"))
        m.update(_norm(f"{hf}.attention.output.LayerNorm", f"{ours}/attention/layer_norm"))
        m.update(_linear(f"{hf}.intermediate.dense", f"{ours}/intermediate"))
        m.update(_linear(f"{hf}.output.dense", f"{ours}/output"))
        m.update(_norm(f"{hf}.output.LayerNorm", f"{ours}/layer_norm"))
    m.update(_linear("pooler.dense", "pooler"))
    if num_labels is not None:
        m.update(_linear("classifier", "classifier"))
    if mlm_head:
        m.update(_linear("cls.predictions.transform.dense", "mlm/dense"))
        m.update(_norm("cls.predictions.transform.LayerNorm", "mlm/layer_norm"))
        m["cls.predictions.bias"] = ("mlm/bias", False)
    return m


def _normalise(name: str) -> str:
    name = remote_code.standard_name(name.removeprefix("bert."))
    name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", name)
    return re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name)


def read_config(path: str) -> dict:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist.")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"{path!r} has no config.json; expected a Hugging Face "
                                "checkpoint directory (config.json + model.safetensors).")
    config = read_json(cfg_file)
    if not isinstance(config, dict):
        raise ValueError(f"{cfg_file} holds a {type(config).__name__}, not a JSON object of "
                         "model settings; restore the checkpoint's own config.json.")
    return config


def read_json(file: str):
    """The JSON in ``file``; a file that is not JSON (cut short, edited by hand, binary) is
    one ``ValueError`` naming it, where parsing stopped and what to do, not the parser's bare
    "Expecting property name ..."."""
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = (f"{e.msg} at line {e.lineno}, column {e.colno}"
                 if isinstance(e, json.JSONDecodeError) else f"not UTF-8 at byte {e.start}")
        raise ValueError(f"{file} is not valid JSON ({where}); the checkpoint folder is "
                         "damaged or was edited: copy or download that file again.") from e


def architecture_of(path) -> BertConfig:
    """The architecture in the config.json of the checkpoint directory ``path``."""
    path = os.fspath(path)
    return BertConfig.from_dict(read_config(path), source=os.path.join(path, "config.json"))


def read_tensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory, single-file or sharded safetensors."""
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        return _load_safetensors(single)
    if os.path.isfile(index):
        listing = read_json(index)
        if not isinstance(listing, dict) or not isinstance(listing.get("weight_map"), dict):
            raise ValueError(f"{index} has no \"weight_map\" object (tensor name -> shard "
                             "file); copy or download the checkpoint's own index file again.")
        files = sorted(set(listing["weight_map"].values()))
        tensors = {}
        for name in files:
            if not os.path.isfile(os.path.join(path, name)):
                raise FileNotFoundError(f"{index} lists the shard {name!r}, which {path!r} "
                                        "does not have; copy or download the whole checkpoint "
                                        "folder again.")
            tensors.update(_load_safetensors(os.path.join(path, name)))
        return tensors
    found = sorted(os.listdir(path))
    raise FileNotFoundError(
        f"{path!r} has no model.safetensors (or sharded index); found {found}. Convert "
        "PyTorch .bin weights with transformers' save_pretrained(..., safe_serialization=True).")


def _load_safetensors(file: str) -> dict[str, np.ndarray]:
    """The tensors of one safetensors file; one that cannot be read (cut short by a failed
    copy or download, overwritten) is a ``ValueError`` naming it, its size and the fix."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    try:
        return load_file(file)
    except SafetensorError as e:
        raise ValueError(f"{file} ({os.path.getsize(file):,} bytes) is not a readable "
                         f"safetensors file ({e}): it is truncated or damaged; copy or "
                         "download the checkpoint again.") from e


def from_pretrained(path, num_labels: int | None = None, policy: str | Policy | None = None,
                    *, seed: int = 0, **options) -> BertModel:
    """Load a Hugging Face BERT-family checkpoint directory (config.json + model.safetensors)
    with the architecture of its config.json; ``options`` are ``ModelSpec``'s (``pooling``,
    ``attention_impl``, ``remat``, ``mlm_head``).

    Heads missing from the checkpoint (e.g. a new classifier) are freshly initialised from
    ``seed``; tensors the model does not know are an error that names them. A checkpoint of
    jaxaccel's mean-pooling class (module doc) is read with ``pooling="mean"`` unless
    ``options`` say otherwise.
    """
    if read_config(os.fspath(path)).get("model_type") == remote_code.BERT_MEAN_POOLING.model_type:
        options.setdefault("pooling", "mean")
    return load_checkpoint(path, ModelSpec(architecture_of(path), num_labels=num_labels,
                                           **options), policy, seed)


def load_checkpoint(path, spec: ModelSpec, policy: str | Policy | None = None,
                    seed: int = 0) -> BertModel:
    """The model of ``spec`` with the weights of the checkpoint at ``path``, whose config.json
    must describe the same architecture (the dropouts aside, which are training options)."""
    path = os.fspath(path)
    _check_architecture(spec.architecture, architecture_of(path),
                        os.path.join(path, "config.json"))
    tensors = {_normalise(k): v for k, v in read_tensors(path).items()}
    model = BertModel(spec, policy, nnx.Rngs(params=seed))

    mapping = key_map(spec.architecture, spec.num_labels, spec.mlm_head)
    unexpected = sorted(k for k in tensors if k not in mapping and not _IGNORED.match(k)
                        and not (k.startswith(_OPTIONAL_PREFIXES)))
    if unexpected:
        raise ValueError(f"{path}: the checkpoint has tensors a BERT model does not have: "
                         f"{unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}")
    missing = sorted(k for k in mapping if k not in tensors)
    required = [k for k in missing if not k.startswith(_OPTIONAL_PREFIXES)]
    if required:
        raise ValueError(f"{path}: the checkpoint lacks tensors the model needs: "
                         f"{required[:10]}{' ...' if len(required) > 10 else ''}")
    if missing:
        log.info("newly initialised (absent from %s): %s", path, missing)

    assign(model, tensors, mapping, f"{path}: ", f" (num_labels={spec.num_labels})")
    return model


def flat_params(model) -> dict[str, jax.Array]:
    """The model's parameters by '/'-joined path (``layers/0/attention/query/kernel``)."""
    state = nnx.state(model, nnx.Param)
    return {"/".join(map(str, p)): v for p, v in
            jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
            for p in [tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p)]}


def assign(model, tensors: dict[str, np.ndarray], mapping, where: str = "",
           note: str = "") -> None:
    """Set the model's parameters from checkpoint ``tensors`` by ``mapping`` (HF name ->
    (our path, transpose?)); tensors absent from ``tensors`` keep their values. A shape
    mismatch is an error naming the tensor (``where`` prefixes it, ``note`` ends it)."""
    state = nnx.state(model, nnx.Param)
    flat = flat_params(model)
    for hf_name, (ours, transpose) in mapping.items():
        if hf_name not in tensors:
            continue
        value = tensors[hf_name].T if transpose else tensors[hf_name]
        if value.shape != flat[ours].shape:
            raise ValueError(f"{where}tensor {hf_name!r} has shape {tensors[hf_name].shape}; "
                             f"the model expects {flat[ours].shape[::-1] if transpose else flat[ours].shape}"
                             f"{note}.")
        flat[ours] = value.astype(flat[ours].dtype)
    nnx.update(model, _unflatten(flat, state))


def write_checkpoint(path, config_json: dict, tensors: dict[str, np.ndarray],
                     max_shard_size: int | None = None) -> None:
    """Write a Hugging Face checkpoint directory: config.json and ``model.safetensors``, or,
    when the tensors exceed ``max_shard_size`` bytes, ``model-0000i-of-0000n.safetensors``
    shards and their ``model.safetensors.index.json`` (as ``save_pretrained`` does)."""
    from safetensors.numpy import save_file
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_json, f, indent=2)
    shards, size = [{}], 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if max_shard_size and shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = np.ascontiguousarray(tensors[name])
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata=meta)
        weight_map.update({k: name for k in shard})
    total = sum(t.nbytes for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _custom_class(spec: ModelSpec) -> remote_code.CustomClass | None:
    """The class written for ``spec``'s model with ``custom_code``: a classifier of mean
    pooling has one (transformers has none), every other model transformers' own (None)."""
    pools_by_mean = spec.num_labels is not None and spec.pooling == "mean"
    return remote_code.BERT_MEAN_POOLING if pools_by_mean else None


def differences(spec: ModelSpec, custom_code: bool = False) -> list[str]:
    """How transformers' class for ``spec``'s model (``save_checkpoint``, with or without
    ``custom_code``) computes other outputs than this model: empty when it computes the same."""
    if _custom_class(spec) is not None and not custom_code:
        return [f"pooling={spec.pooling!r}: transformers' BertForSequenceClassification "
                "classifies BERT's pooler output (the CLS token), and no transformers BERT "
                "class pools by the mean; custom_code=True (jaxaccel export --custom-code) "
                "writes a class of its own that transformers loads with "
                "trust_remote_code=True (a classifier trained with model.pooling=cls is "
                "written as it is)"]
    return []


def save_checkpoint(model: BertModel, path, max_shard_size: int | None = None, *,
                    exact: bool = False, custom_code: bool = False) -> None:
    """Write ``model`` as a Hugging Face checkpoint directory (config.json + safetensors in the
    parameters' dtype; module doc), sharded above ``max_shard_size`` bytes; ``custom_code``:
    a model transformers has no class of (a classifier of mean pooling) with a class of its
    own (module doc), every other with transformers' as without it. What transformers would
    compute differently (``differences``) is a warning, or with ``exact`` a ``ValueError``."""
    spec = model.spec
    check_differences(differences(spec, custom_code), exact)
    custom = _custom_class(spec) if custom_code else None
    mapping = key_map(spec.architecture, spec.num_labels, spec.mlm_head)
    prefix = "bert." if spec.num_labels is not None or spec.mlm_head else ""
    flat = flat_params(model)
    tensors = {}
    for name, (ours, transpose) in mapping.items():
        if spec.mlm_head and name.startswith("pooler."):
            continue                    # BertForMaskedLM has no pooler
        value = np.asarray(jax.device_get(flat[ours]))
        head = name.startswith(("classifier.", "cls."))
        name = name if head else prefix + name
        tensors[remote_code.custom_name(name) if custom else name] = \
            value.T if transpose else value
    config = config_json(spec)
    if custom:
        config.update(custom.config_json())
    write_checkpoint(path, config, tensors, max_shard_size)
    if custom:
        custom.copy_to(path)


def config_json(spec: ModelSpec) -> dict:
    """The config.json of ``spec``'s model for transformers (module doc)."""
    fields = dataclasses.asdict(spec.architecture)
    if spec.mlm_head:
        return {"architectures": ["BertForMaskedLM"], "model_type": "bert", **fields,
                "tie_word_embeddings": True}
    if spec.num_labels is None:
        return {"architectures": ["BertModel"], "model_type": "bert", **fields}
    return {"architectures": ["BertForSequenceClassification"], "model_type": "bert", **fields,
            **labels_json(spec.num_labels)}


def labels_json(num_labels: int, names=()) -> dict:
    """transformers' ``id2label`` / ``label2id`` of ``num_labels`` classes, named ``names`` (a
    run's label names) where given, ``LABEL_i`` otherwise."""
    names = [str(n) for n in names][:num_labels]
    names += [f"LABEL_{i}" for i in range(len(names), num_labels)]
    return {"id2label": {str(i): n for i, n in enumerate(names)},
            "label2id": {n: i for i, n in enumerate(names)}}


def check_differences(found: list[str], exact: bool) -> None:
    """Warn of each way transformers computes other outputs (``differences``), or, with
    ``exact``, refuse them in one ``ValueError``."""
    if found and exact:
        raise ValueError("transformers would compute other outputs than this model, so it "
                         "is not written: " + "; ".join(found) + ".")
    for line in found:
        log.warning("%s: transformers' outputs differ from this model's.", line)


def _check_architecture(spec: BertConfig, checkpoint: BertConfig, source: str) -> None:
    ignore = set(DROPOUTS.values())
    differ = {f.name: (getattr(spec, f.name), getattr(checkpoint, f.name))
              for f in dataclasses.fields(BertConfig)
              if f.name not in ignore and getattr(spec, f.name) != getattr(checkpoint, f.name)}
    if differ:
        raise ValueError(f"{source} describes another architecture than the model spec: "
                         + ", ".join(f"{k}={c!r} (spec: {s!r})" for k, (s, c) in differ.items())
                         + ". Build the spec's architecture with architecture_of(path) (as "
                         "models.create_model and from_pretrained do).")


def _unflatten(flat: dict[str, np.ndarray], state) -> nnx.State:
    pure = nnx.to_pure_dict(state)
    for key, value in flat.items():
        node = pure
        *parents, leaf = key.split("/")
        for p in parents:
            node = node[int(p) if p.isdigit() and int(p) in node else p]
        node[int(leaf) if leaf.isdigit() and int(leaf) in node else leaf] = value
    nnx.replace_by_pure_dict(state, pure)
    return state
