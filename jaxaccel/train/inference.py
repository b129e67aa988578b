"""Evaluation and prediction from a run folder (its latest checkpoint, config and tokenizer)."""
from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from flax import nnx

from jaxaccel import config as config_lib
from jaxaccel.data import load_tokenizer
from jaxaccel.models.bert import BertConfig, BertModel
from jaxaccel.models.fp8 import Fp8Meta
from jaxaccel.precision import get_policy
from jaxaccel.train.checkpoint import Checkpointer, like


def load_run(run_dir: str):
    """``(model, cfg, meta)``: the model of the run's latest checkpoint (with its fp8 scaling
    state under the fp8 policy), rebuilt from the architecture saved with it (the original HF
    checkpoint is not needed)."""
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"))
    try:
        saved, meta = ckpt.restore_params()
        cfg = config_lib.build(meta["config"])
        policy = dataclasses.replace(get_policy(cfg.precision.policy),
                                     amax_history_length=cfg.precision.fp8_amax_history)
        model = BertModel(BertConfig(**meta["architecture"]), num_labels=cfg.model.num_labels,
                          policy=policy, attention_impl=cfg.model.attention_impl,
                          classifier_pooling=cfg.model.pooling)
        restored = [(nnx.Param, saved)]
        if policy.fp8:
            restored.append((Fp8Meta, ckpt.restore_params(item="fp8")[0]))
    finally:
        ckpt.close()
    for kind, values in restored:
        state = nnx.state(model, kind)
        nnx.replace_by_pure_dict(state, like(nnx.to_pure_dict(state), values))
        nnx.update(model, state)
    return model, cfg, meta


def evaluate_run(run_dir: str, sets: list[str] | None = None) -> dict:
    """Accuracy and loss of the run's latest checkpoint on its eval split, data parallel over
    the devices at hand (not the training mesh, which may need more) unless ``sets`` say."""
    from jaxaccel.train.loop import build, evaluate
    model, cfg, meta = load_run(run_dir)
    cfg = config_lib.build(cfg.to_dict(), ["mesh.data=-1", "mesh.fsdp=1", "mesh.tensor=1",
                                           *(sets or [])])
    run = build(cfg)
    params = jax.device_put(nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                            run.state_shardings.params)
    fp8 = jax.device_put(nnx.to_pure_dict(nnx.state(model, Fp8Meta)),
                         run.state_shardings.fp8) if run.state.fp8 is not None else None
    result = evaluate(run, params, fp8=fp8)
    result.update(step=meta["epoch"] * run.train_data.steps_per_epoch + meta["step_in_epoch"],
                  run_dir=run_dir)
    return result


class Predictor:
    """``Predictor(run_dir)(texts) -> [(label_name, probability), ...]``."""

    def __init__(self, run_dir: str):
        model, cfg, meta = load_run(run_dir)
        self.label_names = meta.get("label_names") or [str(i) for i in
                                                      range(cfg.model.num_labels)]
        self.tokenizer = load_tokenizer(os.path.join(run_dir, "tokenizer"))
        self.max_len = min(cfg.data.max_len, model.config.max_position_embeddings)
        graphdef, params = nnx.split(model)

        @jax.jit
        def probs(params, ids, mask):
            m = nnx.merge(graphdef, params)
            return jax.nn.softmax(m(ids, mask).logits, axis=-1)
        self._probs, self._params = probs, params

    def __call__(self, texts: list[str]) -> list[tuple[str, float]]:
        enc = self.tokenizer(list(texts), truncation=True, max_length=self.max_len,
                             padding=True, return_tensors="np")
        p = np.asarray(self._probs(self._params, enc["input_ids"].astype(np.int32),
                                   enc["attention_mask"].astype(np.int32)))
        return [(self.label_names[i], float(p[r, i])) for r, i in enumerate(p.argmax(-1))]
