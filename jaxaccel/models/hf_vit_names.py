"""The tensor names of ViT-family Hugging Face checkpoints (``hf_vit``, whose module doc lists
them): the spellings read, normalised to the hub's (``normalise``); the map from those names to
our parameter paths and layout transforms (``key_map``); and the transforms both ways
(``to_ours``, ``to_hf``).
"""
from __future__ import annotations

import re

import numpy as np

from jaxaccel.models import remote_code
from jaxaccel.models.architectures import ViTConfig

# Transforms of key_map: HF layout -> ours.
COPY, LINEAR, CONV, SINCOS = "copy", "linear", "conv", "sincos"

# Other spellings of a tensor name -> the hub's (hf_vit's module doc), applied in order.
_RENAMES = [
    (re.compile(r"^(embeddings|encoder|layernorm|layers|pooler)\."), r"vit.\1."),   # ViTModel
    (re.compile(r"^vit\.layers\.(\d+)\."), r"vit.encoder.layer.\1."),
    (re.compile(r"^decoder\.decoder_encoder\.layer\.(\d+)\."), r"decoder.decoder_layers.\1."),
]
_BLOCK = r"^((?:vit\.encoder\.layer|decoder\.decoder_layers)\.\d+)\."
_BLOCK_RENAMES = [(re.compile(_BLOCK + old), new) for old, new in (
    (r"attention\.q_proj\.", r"\1.attention.attention.query."),
    (r"attention\.k_proj\.", r"\1.attention.attention.key."),
    (r"attention\.v_proj\.", r"\1.attention.attention.value."),
    (r"attention\.o_proj\.", r"\1.attention.output.dense."),
    (r"mlp\.fc1\.", r"\1.intermediate.dense."),
    (r"mlp\.fc2\.", r"\1.output.dense."))]
POOLER = re.compile(r"^vit\.pooler\.")           # ViTModel's pooler: read, ignored


def _linear(hf_name: str, ours: str, bias: bool = True) -> dict[str, tuple[str, str]]:
    m = {f"{hf_name}.weight": (f"{ours}/kernel", LINEAR)}
    if bias:
        m[f"{hf_name}.bias"] = (f"{ours}/bias", COPY)
    return m


def _norm(hf_name: str, ours: str) -> dict[str, tuple[str, str]]:
    return {f"{hf_name}.weight": (f"{ours}/scale", COPY), f"{hf_name}.bias": (f"{ours}/bias", COPY)}


def _block(hf_name: str, ours: str, qkv_bias: bool) -> dict[str, tuple[str, str]]:
    m = {}
    for n in ("query", "key", "value"):
        m.update(_linear(f"{hf_name}.attention.attention.{n}", f"{ours}/attention/{n}", qkv_bias))
    m.update(_linear(f"{hf_name}.attention.output.dense", f"{ours}/attention/output"))
    m.update(_norm(f"{hf_name}.layernorm_before", f"{ours}/layernorm_before"))
    m.update(_norm(f"{hf_name}.layernorm_after", f"{ours}/layernorm_after"))
    m.update(_linear(f"{hf_name}.intermediate.dense", f"{ours}/intermediate"))
    m.update(_linear(f"{hf_name}.output.dense", f"{ours}/output"))
    return m


def key_map(config: ViTConfig, task: str, num_labels: int | None = None
            ) -> dict[str, tuple[str | None, str]]:
    """HF tensor name (the hub's spelling) -> (our '/'-joined parameter path, transform):
    ``"copy"``, ``"linear"`` (transposed), ``"conv"`` (Conv2d weight [out, C, p, p] <-> Dense
    kernel [p*p*C, out]) or ``"sincos"`` (path None: no parameter, the computed sin-cos
    table). ``task`` "mae" maps the decoder, "classification" the classifier (``num_labels``
    None: none)."""
    if task not in ("mae", "classification"):
        raise ValueError(f"task={task!r}: a ViT checkpoint holds an 'mae' or a "
                         "'classification' model.")
    m = {"vit.embeddings.cls_token": ("embeddings/cls_token", COPY),
         "vit.embeddings.position_embeddings":
             ("embeddings/position_embeddings", COPY)
             if config.position_embedding_type == "learned" else (None, SINCOS),
         "vit.embeddings.patch_embeddings.projection.weight":
             ("embeddings/patch_embeddings/projection/kernel", CONV),
         "vit.embeddings.patch_embeddings.projection.bias":
             ("embeddings/patch_embeddings/projection/bias", COPY)}
    for i in range(config.num_hidden_layers):
        m.update(_block(f"vit.encoder.layer.{i}", f"layers/{i}", config.qkv_bias))
    m.update(_norm("vit.layernorm", "layernorm"))
    if task == "mae":
        m["decoder.mask_token"] = ("decoder/mask_token", COPY)
        m["decoder.decoder_pos_embed"] = (None, SINCOS)
        m.update(_linear("decoder.decoder_embed", "decoder/decoder_embed"))
        for i in range(config.decoder_num_hidden_layers):
            m.update(_block(f"decoder.decoder_layers.{i}", f"decoder/decoder_layers/{i}",
                            config.qkv_bias))
        m.update(_norm("decoder.decoder_norm", "decoder/decoder_norm"))
        m.update(_linear("decoder.decoder_pred", "decoder/decoder_pred"))
    elif num_labels is not None:
        m.update(_linear("classifier", "classifier"))
    return m


def normalise(name: str) -> str:
    """The hub's spelling of a checkpoint tensor name (``hf_vit``'s module doc)."""
    name = remote_code.standard_name(name)
    for pattern, new in _RENAMES + _BLOCK_RENAMES:
        name = pattern.sub(new, name)
    return name


def to_ours(value: np.ndarray, transform: str, config: ViTConfig) -> np.ndarray:
    """A checkpoint tensor in our layout (``transform`` of ``key_map``)."""
    if transform == LINEAR:
        return value.T
    if transform == CONV:
        if value.ndim != 4:
            return value            # a wrong shape: assign() names it
        return value.transpose(2, 3, 1, 0).reshape(-1, value.shape[0])
    return value


def to_hf(value: np.ndarray, transform: str, config: ViTConfig) -> np.ndarray:
    """One of our parameters in transformers' layout (``transform`` of ``key_map``)."""
    if transform == LINEAR:
        return value.T
    if transform == CONV:
        p, c = config.patch_size, config.num_channels
        return value.reshape(p, p, c, -1).transpose(3, 2, 0, 1)
    return value


__all__ = ["CONV", "COPY", "LINEAR", "POOLER", "SINCOS", "key_map", "normalise", "to_hf", "to_ours"]
