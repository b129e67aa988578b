"""Hugging Face Llama-family checkpoints (config.json + safetensors) to and from the NNX model,
without torch.

``load_checkpoint`` reads ``model.safetensors`` or a sharded ``model.safetensors.index.json``
(``hf.read_tensors``); ``save_checkpoint`` writes config.json + safetensors (sharded above
``max_shard_size`` bytes) that ``transformers.LlamaForCausalLM.from_pretrained`` loads. Tensor
names are transformers' (``model.layers.{i}.self_attn.q_proj.weight``, ...); Linear weights
are stored [out, in] there and [in, out] here. Tensors the model does not have, and missing
ones, are errors that name them; a checkpoint of another architecture is refused by its
``model_type``.

    model = from_pretrained("path/to/llama_checkpoint", policy="bf16")
    save_checkpoint(model, "out_dir")            # transformers loads out_dir
"""
from __future__ import annotations

import dataclasses
import os
import re

import jax
import numpy as np

from jaxaccel.models import hf
from jaxaccel.models.abstract import build_abstract
from jaxaccel.models.architectures import LlamaConfig
from jaxaccel.models.llama import LlamaForCausalLM
from jaxaccel.models.spec import ModelSpec
from jaxaccel.precision import Policy

# Buffers older checkpoints carry that are no parameters (RoPE frequencies are computed).
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def key_map(config: LlamaConfig) -> dict[str, tuple[str, bool]]:
    """HF tensor name -> (our '/'-joined parameter path, transpose?)."""
    m = {"model.embed_tokens.weight": ("embed_tokens/embedding", False),
         "model.norm.weight": ("norm/scale", False)}
    linear = [("self_attn", n, config.attention_bias) for n in ("q_proj", "k_proj", "v_proj",
                                                               "o_proj")]
    linear += [("mlp", n, config.mlp_bias) for n in ("gate_proj", "up_proj", "down_proj")]
    for i in range(config.num_hidden_layers):
        hf_layer, ours = f"model.layers.{i}", f"layers/{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            m[f"{hf_layer}.{norm}.weight"] = (f"{ours}/{norm}/scale", False)
        for block, name, bias in linear:
            m[f"{hf_layer}.{block}.{name}.weight"] = (f"{ours}/{block}/{name}/kernel", True)
            if bias:
                m[f"{hf_layer}.{block}.{name}.bias"] = (f"{ours}/{block}/{name}/bias", False)
    if not config.tie_word_embeddings:
        m["lm_head.weight"] = ("lm_head/kernel", True)
    return m


def architecture_of(path) -> LlamaConfig:
    """The architecture in the config.json of the checkpoint directory ``path``."""
    path = os.fspath(path)
    return LlamaConfig.from_dict(hf.read_config(path), source=os.path.join(path, "config.json"))


def from_pretrained(path, policy: str | Policy | None = None, **options) -> LlamaForCausalLM:
    """Load a Llama-family checkpoint directory with the architecture of its config.json;
    ``options`` are ``ModelSpec``'s (``attention_impl``, ``remat``)."""
    return load_checkpoint(path, ModelSpec(architecture_of(path), **options), policy)


def load_checkpoint(path, spec: ModelSpec, policy: str | Policy | None = None,
                    seed: int = 0) -> LlamaForCausalLM:
    """The model of ``spec`` with the weights of the checkpoint at ``path``, whose config.json
    must describe the same architecture (the attention dropout aside). Built from shapes
    only: every parameter comes from the checkpoint (``seed`` is unused)."""
    path = os.fspath(path)
    source = os.path.join(path, "config.json")
    found = architecture_of(path)
    differ = {f.name: (getattr(spec.architecture, f.name), getattr(found, f.name))
              for f in dataclasses.fields(LlamaConfig) if f.name != "attention_dropout"
              and getattr(spec.architecture, f.name) != getattr(found, f.name)}
    if differ:
        raise ValueError(f"{source} describes another architecture than the model spec: "
                         + ", ".join(f"{k}={c!r} (spec: {s!r})" for k, (s, c) in differ.items())
                         + ". Build the spec's architecture with architecture_of(path).")
    tensors = hf.read_tensors(path)
    mapping = key_map(spec.architecture)
    if spec.architecture.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)       # transformers may store the tied copy
    unexpected = sorted(k for k in tensors if k not in mapping and not _IGNORED.match(k))
    if unexpected:
        raise ValueError(f"{path}: the checkpoint has tensors a Llama model of this "
                         f"architecture does not have: {unexpected[:10]}"
                         f"{' ...' if len(unexpected) > 10 else ''}")
    missing = sorted(k for k in mapping if k not in tensors)
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks tensors the model needs: "
                         f"{missing[:10]}{' ...' if len(missing) > 10 else ''}")
    # Shapes only, outside any ambient mesh (the trainer loads under its mesh): eval_shape
    # would otherwise lay the abstract parameters out by their logical axis names, which are
    # no mesh axes.
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        model = build_abstract(lambda: LlamaForCausalLM(spec, policy))
    hf.assign(model, tensors, mapping, f"{path}: ")     # every parameter: none is missing
    return model


def save_checkpoint(model: LlamaForCausalLM, path, max_shard_size: int | None = None, *,
                    exact: bool = False, custom_code: bool = False) -> None:
    """Write ``model`` as a Hugging Face checkpoint directory (config.json + safetensors,
    float32 or the parameters' dtype), sharded above ``max_shard_size`` bytes. transformers'
    ``LlamaForCausalLM`` computes this model's outputs, so ``exact`` (refuse what it would
    compute differently) has nothing to refuse and ``custom_code`` (write a class of the
    model's own where transformers has none) nothing to write: the other families' writers
    take both."""
    flat = hf.flat_params(model)
    tensors = {name: np.asarray(jax.device_get(flat[ours])).T if transpose
               else np.asarray(jax.device_get(flat[ours]))
               for name, (ours, transpose) in key_map(model.config).items()}
    hf.write_checkpoint(path, model.config.to_hf(), tensors, max_shard_size)


__all__ = ["architecture_of", "from_pretrained", "key_map", "load_checkpoint",
           "save_checkpoint"]
