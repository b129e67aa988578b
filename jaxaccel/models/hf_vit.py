"""Hugging Face ViT-family checkpoints (config.json + safetensors) to and from the NNX
``models.vit.ViTModel``, without torch.

Reads transformers' ``ViTMAEForPreTraining`` (``model_type`` "vit_mae": encoder + MAE decoder)
and ``ViTForImageClassification`` (``"vit"``: encoder + classifier) checkpoints, and the bare
encoders ``ViTModel`` / ``ViTMAEModel`` (tensor names without the ``vit.`` prefix; ViTModel's
pooler is ignored, as ``ViTForImageClassification`` ignores it). Writes a spec of task "mae"
as ``ViTMAEForPreTraining`` and one of task "classification" as
``ViTForImageClassification``, which transformers' ``from_pretrained`` loads.

Tensor names. Checkpoints spell a block's tensors in one of three ways, all read:

* the hub's (transformers 4, and what transformers 5.24's ``save_pretrained`` writes for the
  encoder): ``vit.encoder.layer.{i}.attention.attention.{query,key,value}``,
  ``...attention.output.dense``, ``...intermediate.dense``, ``...output.dense``,
  ``...layernorm_{before,after}``; the decoder's ``decoder.decoder_layers.{i}.<same>``;
* transformers 5.24's module names (its ``state_dict()``): ``vit.layers.{i}.attention.
  {q,k,v,o}_proj``, ``...mlp.fc{1,2}``;
* transformers 5.24's ``save_pretrained`` of a ``ViTMAEForPreTraining``, which renames the
  decoder's blocks ``decoder.decoder_encoder.layer.{i}.<hub names>`` (its reverse renaming of
  ``encoder.layer.`` -> ``layers.`` hits ``decoder_layers.``; it reads them back).

``save_checkpoint`` writes the hub's names (those of transformers 4 and of the published
checkpoints; transformers 5.24 loads them, none missing or unexpected). The rest:
``vit.embeddings.{cls_token, position_embeddings}``, ``vit.embeddings.patch_embeddings.
projection.{weight, bias}`` (a Conv2d, weight [hidden, C, p, p]; here the Dense kernel
[p*p*C, hidden] on (row, column, channel)-ordered patches), ``vit.layernorm``,
``decoder.{mask_token, decoder_pos_embed, decoder_embed, decoder_norm, decoder_pred}``,
``classifier``. Linear weights are [out, in] there and [in, out] here.

Position tables. A "sincos" model's positions (and the MAE decoder's, always) are computed
(``vit.sincos_positions``), no parameters: reading, the checkpoint's ``position_embeddings`` /
``decoder_pos_embed`` must equal that table (within 1e-5, or the rounding of the tensor's
dtype), else the checkpoint is refused (it describes another model); a "learned" spec reads
``position_embeddings`` as its parameter (also from a ViT-MAE checkpoint: fine-tuning with a
trainable table initialised to MAE's, as ``ViTForImageClassification.from_pretrained`` does).
Writing stores the sin-cos tables. Tables of zeros are refused too unless
``zero_positions="sincos"``: transformers 5.24 leaves both tables zero in a freshly built
``ViTMAEForPreTraining`` (its weight init skips the encoder's sin-cos init once the patch
projection is initialised, and zeroes ``decoder_pos_embed`` and ``mask_token`` after the
decoder set them), so a checkpoint it saved untrained has zeros there; a model trained that
way has no position information at all, which this model cannot compute. ``"sincos"`` reads
such a checkpoint with the sin-cos positions (right for an untrained initialisation).

A ViT-MAE checkpoint read into a "classification" spec (fine-tuning from MAE) gives the
encoder's weights and a classifier freshly initialised from ``seed``; its decoder tensors are
ignored. Tensors the model does not have, and missing ones, are errors that name them; a
checkpoint of another architecture is refused by its ``model_type`` and its config.

transformers' ViT-MAE runs square grids only: a ``ViTMAEForPreTraining`` of a non-square
``image_size`` whose patch count is not a square (a 4 x 2 grid) fails to build (its sin-cos
init makes a sqrt(N) x sqrt(N) table), and one whose count is (8 x 2) builds but its forward
refuses the input (``patchify`` wants square pixel values); its decoder attends globally, so a
windowed decoder (``decoder_window``) computes other outputs there. Such checkpoints are
written (with a warning) and read back here; transformers cannot run them. Their encoder is
transformers' ``ViTModel`` exactly, whatever the grid (``image_size`` [height, width], the
sin-cos table stored as its ``position_embeddings``): ``save_encoder`` writes any ViT's
encoder alone so (what fine-tuning elsewhere starts from).

A classifier of mean pooling (``pooling="mean"``; transformers' classifies the CLS token) is
written with a class of its own with ``custom_code=True``: ``remote_code.VIT_MEAN_POOLING``
(its ``modeling_*.py`` in the folder, model_type "vit_mean_pooling", ``auto_map``, the head
``mean_pooling_classifier``), which ``AutoModelForImageClassification.from_pretrained(path,
trust_remote_code=True)`` loads and this module reads back (pooling "mean" by default).

    model = from_pretrained("path/to/vit_mae_checkpoint")                      # task "mae"
    model = from_pretrained("path/to/vit_mae_checkpoint", task="classification", num_labels=10)
    save_checkpoint(model, "out_dir")            # transformers loads out_dir
    save_encoder(model, "encoder_dir")           # transformers' ViTModel loads encoder_dir
"""
from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxaccel.models import hf, remote_code
from jaxaccel.models.architectures import DROPOUTS, ViTConfig
from jaxaccel.models.hf_vit_names import POOLER, SINCOS, key_map, normalise, to_hf, to_ours
from jaxaccel.models.spec import ModelSpec
from jaxaccel.models.vit import ViTModel, sincos_positions
from jaxaccel.precision import Policy

log = logging.getLogger(__name__)

# Architecture fields a classifier does not have (its decoder and MAE's training settings).
MAE_ONLY = ("decoder_num_attention_heads", "decoder_hidden_size", "decoder_num_hidden_layers",
            "decoder_intermediate_size", "mask_ratio", "norm_pix_loss", "decoder_window")
# Not compared with the checkpoint's: training settings, and the position table's kind (the
# table itself is checked or read).
_NOT_ARCHITECTURE = (*DROPOUTS.values(), "mask_ratio", "norm_pix_loss",
                     "position_embedding_type")
ZERO_POSITIONS = ("refuse", "sincos")


def _sincos_table(hf_name: str, config: ViTConfig) -> np.ndarray:
    """float32 [1, 1 + N, D]: the computed table stored as ``hf_name``."""
    dim = config.decoder_hidden_size if hf_name.startswith("decoder.") else config.hidden_size
    return sincos_positions(dim, *config.grid)[None]


def architecture_of(path) -> ViTConfig:
    """The architecture in the config.json of the checkpoint directory ``path``."""
    path = os.fspath(path)
    return ViTConfig.from_dict(hf.read_config(path), source=os.path.join(path, "config.json"))


def _num_labels(config_json: dict) -> int | None:
    if isinstance(config_json.get("id2label"), dict) and config_json["id2label"]:
        return len(config_json["id2label"])
    return config_json.get("num_labels")


def from_pretrained(path, policy: str | Policy | None = None, *, seed: int = 0,
                    zero_positions: str = "refuse", **options) -> ViTModel:
    """Load a ViT-family checkpoint directory with the architecture of its config.json;
    ``options`` are ``ModelSpec``'s (``task``, ``num_labels``, ``pooling``,
    ``attention_impl``, ``remat``). The task defaults to the checkpoint's ("mae" for
    model_type "vit_mae", "classification" for "vit"), a classifier's ``num_labels`` to the
    checkpoint's (its ``id2label``) when it has one; a checkpoint of jaxaccel's mean-pooling
    class (module doc) is read with ``pooling="mean"`` unless ``options`` say otherwise."""
    path = os.fspath(path)
    config_json = hf.read_config(path)
    architecture = ViTConfig.from_dict(config_json, source=os.path.join(path, "config.json"))
    model_type = config_json.get("model_type")
    options.setdefault("task", "mae" if model_type == "vit_mae" else "classification")
    if model_type == remote_code.VIT_MEAN_POOLING.model_type:
        options.setdefault("pooling", "mean")
    if options["task"] == "classification" and options.get("num_labels") is None:
        options["num_labels"] = _num_labels(config_json)
    return load_checkpoint(path, ModelSpec(architecture, **options), policy, seed,
                           zero_positions=zero_positions)


def load_checkpoint(path, spec: ModelSpec, policy: str | Policy | None = None,
                    seed: int = 0, *, zero_positions: str = "refuse") -> ViTModel:
    """The model of ``spec`` with the weights of the checkpoint at ``path``, whose config.json
    must describe the same architecture (the dropouts, ``mask_ratio``, ``norm_pix_loss`` and
    the position table's kind aside; a classifier's aside from the MAE decoder's fields).

    A classification spec reads the encoder of a ViT-MAE checkpoint (its decoder tensors are
    ignored) and initialises the classifier from ``seed`` when the checkpoint has none.
    ``zero_positions``: "refuse" (default) or "sincos", what a sin-cos position table of all
    zeros in the checkpoint means (module doc)."""
    path = os.fspath(path)
    if zero_positions not in ZERO_POSITIONS:
        raise ValueError(f"zero_positions={zero_positions!r} is not one of {ZERO_POSITIONS}.")
    source = os.path.join(path, "config.json")
    cfg = spec.architecture
    if not isinstance(cfg, ViTConfig):
        raise TypeError(f"load_checkpoint takes a ModelSpec of a ViTConfig, got {spec!r}.")
    _check_architecture(spec, architecture_of(path), source)
    tensors = _read_tensors(path)
    mapping = key_map(cfg, spec.task, spec.num_labels)
    _check_coverage(tensors, mapping, spec, path)
    for name, (ours, transform) in mapping.items():
        if transform == SINCOS:
            _check_positions(name, tensors[name], _sincos_table(name, cfg), path,
                             zero_positions)
    model = ViTModel(spec, policy, nnx.Rngs(params=seed))
    converted = {name: to_ours(tensors[name], transform, cfg)
                 for name, (ours, transform) in mapping.items()
                 if ours is not None and name in tensors}
    hf.assign(model, converted, {name: (mapping[name][0], False) for name in converted},
              f"{path}: ", f" (num_labels={spec.num_labels})" if spec.num_labels else "")
    return model


def _check_architecture(spec: ModelSpec, found: ViTConfig, source: str) -> None:
    """Refuse a checkpoint whose config.json (``found``) describes another architecture than
    ``spec`` (the fields ``load_checkpoint`` names aside)."""
    cfg = spec.architecture
    ignore = _NOT_ARCHITECTURE + (MAE_ONLY if spec.task == "classification" else ())
    differ = {f.name: (getattr(cfg, f.name), getattr(found, f.name))
              for f in dataclasses.fields(ViTConfig) if f.name not in ignore
              and getattr(cfg, f.name) != getattr(found, f.name)}
    if differ:
        raise ValueError(f"{source} describes another architecture than the model spec: "
                         + ", ".join(f"{k}={c!r} (spec: {s!r})" for k, (s, c) in differ.items())
                         + ". Build the spec's architecture with architecture_of(path).")


def _read_tensors(path: str) -> dict:
    """The checkpoint's tensors by normalised name; a name spelled twice is refused."""
    tensors = {}
    for name, value in hf.read_tensors(path).items():
        key = normalise(name)
        if key in tensors:
            raise ValueError(f"{path}: the checkpoint holds tensor {key!r} twice (once as "
                             f"{name!r}); keep one spelling.")
        tensors[key] = value
    return tensors


def _check_coverage(tensors: dict, mapping: dict, spec: ModelSpec, path: str) -> None:
    """Refuse tensors the model does not have and missing tensors it needs; log the ones
    ignored (pooler, an MAE decoder read into a classifier) and a fresh classifier."""
    ignored = sorted(k for k in tensors if k not in mapping and (
        POOLER.match(k) or (spec.task == "classification" and k.startswith("decoder."))))
    if ignored:
        log.info("%s: tensors the %s model does not use, ignored: %s", path, spec.task,
                 ignored[:10])
    unexpected = sorted(k for k in tensors if k not in mapping and k not in ignored)
    if unexpected:
        raise ValueError(f"{path}: the checkpoint has tensors a ViT {spec.task} model of this "
                         f"architecture does not have: {unexpected[:10]}"
                         f"{' ...' if len(unexpected) > 10 else ''}")
    missing = sorted(k for k in mapping if k not in tensors)
    fresh = [k for k in missing if k.startswith("classifier.")]
    required = [k for k in missing if k not in fresh]
    if required:
        hint = ("; a checkpoint without the MAE decoder (ViTForImageClassification, "
                "ViTModel) is read into a 'classification' spec"
                if spec.task == "mae" and not any(k.startswith("decoder.") for k in tensors)
                else "")
        raise ValueError(f"{path}: the checkpoint lacks tensors the model needs: "
                         f"{required[:10]}{' ...' if len(required) > 10 else ''}{hint}")
    if fresh:
        log.info("newly initialised (absent from %s): %s", path, fresh)


def _check_positions(name: str, table: np.ndarray, expected: np.ndarray, path: str,
                     zero_positions: str) -> None:
    """Refuse a stored position table that is not the computed sin-cos one (module doc)."""
    if table.shape != expected.shape:
        raise ValueError(f"{path}: tensor {name!r} has shape {table.shape}; the model's "
                         f"{expected.shape[1] - 1} patches need {expected.shape}.")
    # 1e-5, or the rounding of a half-precision tensor (|sin|, |cos| <= 1)
    tolerance = (max(1e-5, float(jnp.finfo(table.dtype).eps))
                 if jnp.issubdtype(table.dtype, jnp.floating) else 1e-5)
    table = table.astype(np.float32)
    error = float(np.abs(table - expected).max())
    if error <= tolerance:
        return
    if not table.any():
        if zero_positions == "sincos":
            log.warning("%s: %r is all zeros; read with the sin-cos positions "
                        "(zero_positions='sincos').", path, name)
            return
        raise ValueError(
            f"{path}: tensor {name!r} is all zeros, not the 2-D sin-cos positions this model "
            "computes. transformers 5.24 leaves the position tables of a freshly built "
            "ViTMAEForPreTraining zero (its weight init skips them), so the checkpoint was "
            "saved untrained, or trained without position information (which this model "
            "cannot compute). If it is an untrained initialisation, read it with "
            "zero_positions='sincos'.")
    learned = (" Read it as a trainable table with position_embedding_type='learned' in the "
               "spec's architecture." if name.startswith("vit.") else "")
    raise ValueError(f"{path}: tensor {name!r} differs from the fixed 2-D sin-cos positions of "
                     f"this model's patch grid by up to {error:.3g}: it holds other positions "
                     "(learned, interpolated, or of another grid or layout), which the "
                     f"model would not compute.{learned}")


def _hf_tensors(model: ViTModel, mapping) -> dict[str, np.ndarray]:
    """The model's tensors of ``mapping`` (``key_map``) in transformers' layout, the sin-cos
    tables computed, in the parameters' dtype."""
    cfg, flat = model.config, hf.flat_params(model)
    dtype = np.asarray(jax.device_get(flat["embeddings/cls_token"])).dtype
    return {name: _sincos_table(name, cfg).astype(dtype) if transform == SINCOS
            else to_hf(np.asarray(jax.device_get(flat[ours])), transform, cfg)
            for name, (ours, transform) in mapping.items()}


def save_checkpoint(model: ViTModel, path, max_shard_size: int | None = None, *,
                    exact: bool = False, custom_code: bool = False) -> None:
    """Write ``model`` as a Hugging Face checkpoint directory (config.json + safetensors in
    the parameters' dtype, the hub's tensor names, the sin-cos tables stored), sharded above
    ``max_shard_size`` bytes: a "mae" model as ``ViTMAEForPreTraining``, a "classification"
    one as ``ViTForImageClassification``, or, with ``custom_code``, one of mean pooling with a
    class of its own (module doc). ``decoder_window`` and ``position_embedding_type`` go into
    config.json (transformers keeps but ignores them). What transformers would compute
    differently (``differences``) is a warning, or with ``exact`` a ``ValueError``."""
    spec = model.spec
    hf.check_differences(differences(spec, custom_code), exact)
    custom = _custom_class(spec) if custom_code else None
    tensors = _hf_tensors(model, key_map(model.config, spec.task, spec.num_labels))
    config = config_json(spec)
    if custom:
        tensors = {remote_code.custom_name(k): v for k, v in tensors.items()}
        config.update(custom.config_json())
    hf.write_checkpoint(path, config, tensors, max_shard_size)
    if custom:
        custom.copy_to(path)


def save_encoder(model: ViTModel, path, max_shard_size: int | None = None) -> None:
    """Write the encoder of ``model`` (of either task; its head left out) as transformers'
    ``ViTModel`` checkpoint (un-prefixed tensor names, as its ``save_pretrained`` writes; no
    pooler, which this model has not): its ``last_hidden_state`` is this model's encoder
    output on all the patches, unmasked, for any grid (module doc)."""
    tensors = _hf_tensors(model, key_map(model.config, "classification"))
    hf.write_checkpoint(path, encoder_config_json(model.config),
                        {k.removeprefix("vit."): v for k, v in tensors.items()}, max_shard_size)


def _custom_class(spec: ModelSpec) -> remote_code.CustomClass | None:
    """The class written for ``spec``'s model with ``custom_code``: a classifier of mean
    pooling has one (transformers has none), every other model transformers' own (None)."""
    pools_by_mean = spec.task == "classification" and spec.pooling == "mean"
    return remote_code.VIT_MEAN_POOLING if pools_by_mean else None


def differences(spec: ModelSpec, custom_code: bool = False) -> list[str]:
    """How transformers' class for ``spec``'s model (``save_checkpoint``, with or without
    ``custom_code``) computes other outputs than this model, or cannot run it (module doc):
    empty when it computes the same."""
    cfg, found = spec.architecture, []
    encoder = ("; save_encoder (jaxaccel export --encoder) writes its encoder alone as "
               "transformers' ViTModel")
    if spec.task == "mae" and cfg.grid[0] != cfg.grid[1]:
        found.append(f"a ViT-MAE of a {cfg.grid[0]} x {cfg.grid[1]} patch grid: transformers' "
                     "ViTMAEForPreTraining runs square grids only (jaxaccel reads it back)"
                     + encoder)
    if spec.task == "mae" and cfg.decoder_window is not None:
        found.append(f"decoder_window={cfg.decoder_window}: transformers' ViTMAE decoder "
                     "attends globally and ignores it" + encoder)
    if _custom_class(spec) is not None and not custom_code:
        found.append(f"pooling={spec.pooling!r}: transformers' ViTForImageClassification "
                     "classifies the CLS token; custom_code=True (jaxaccel export "
                     "--custom-code) writes a class of its own that transformers loads with "
                     "trust_remote_code=True (a classifier trained with model.pooling=cls "
                     "is written as it is)")
    return found


def config_json(spec: ModelSpec) -> dict:
    """The config.json of ``spec``'s model for transformers (module doc)."""
    fields = _config_fields(spec.architecture)
    if spec.task == "mae":
        return {"architectures": ["ViTMAEForPreTraining"], "model_type": "vit_mae", **fields}
    fields = {k: v for k, v in fields.items() if k not in MAE_ONLY}
    return {"architectures": ["ViTForImageClassification"], "model_type": "vit", **fields,
            **hf.labels_json(spec.num_labels or 0)}


def encoder_config_json(cfg: ViTConfig) -> dict:
    """The config.json of ``save_encoder``'s ``ViTModel`` of the architecture ``cfg``."""
    return {"architectures": ["ViTModel"], "model_type": "vit",
            **{k: v for k, v in _config_fields(cfg).items() if k not in MAE_ONLY}}


def _config_fields(cfg: ViTConfig) -> dict:
    """``cfg``'s fields as config.json holds them (a square ``image_size`` as one int)."""
    fields = dataclasses.asdict(cfg)
    height, width = cfg.image_size
    fields["image_size"] = height if height == width else [height, width]
    fields["decoder_window"] = None if cfg.decoder_window is None else list(cfg.decoder_window)
    return fields


__all__ = ["architecture_of", "config_json", "differences", "encoder_config_json",
           "from_pretrained", "load_checkpoint", "save_checkpoint", "save_encoder"]
