"""The model spec: built from ``cfg.model`` in one place, saved with every checkpoint, and all
that a run folder needs to rebuild its model (older folders' bare architectures too)."""
import ast
import dataclasses
import glob
import json
import os

import numpy as np
import pytest
from flax import nnx

from jaxaccel import config
from jaxaccel.models import PRESETS, BertConfig, BertModel, ModelSpec, create_model, spec
from jaxaccel.train import inference, loop
from jaxaccel.train.checkpoint import Checkpointer
from support import ROOT

MODELS = os.path.join(ROOT, "jaxaccel", "models")


def test_spec_from_config_round_trips_as_json():
    cfg = config.build(sets=["model.name=tiny", "model.num_labels=3", "model.pooling=mean",
                             "model.attention_impl=pallas", "model.remat=true",
                             "model.hidden_dropout=0.0", "model.attention_dropout=0.05"])
    s = spec.from_config(cfg.model)
    assert s == ModelSpec(dataclasses.replace(PRESETS["tiny"], hidden_dropout_prob=0.0,
                                              attention_probs_dropout_prob=0.05),
                          num_labels=3, pooling="mean", attention_impl="pallas", remat=True)
    assert ModelSpec.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    # None keeps the preset's (or checkpoint's) dropouts.
    plain = spec.from_config(config.build(sets=["model.name=tiny"]).model)
    assert plain.architecture == PRESETS["tiny"] and plain.pooling == "cls"


@pytest.mark.parametrize("make,message", [
    (lambda: ModelSpec(PRESETS["tiny"], pooling="max"),
     r"pooling='max' is not one of \('cls', 'mean'\) \(config: model.pooling\); use 'cls'"),
    (lambda: ModelSpec(PRESETS["tiny"], num_labels=0), "num_labels=0 must be a positive"),
    (lambda: ModelSpec(PRESETS["tiny"], num_labels=2, mlm_head=True), "choose one head"),
    (lambda: ModelSpec(dataclasses.asdict(PRESETS["tiny"])), "is not a BertConfig; build"),
    (lambda: BertModel(PRESETS["tiny"]), "BertModel takes a ModelSpec, got BertConfig"),
    (lambda: ModelSpec.from_dict({**ModelSpec(PRESETS["tiny"]).to_dict(), "classifier_pooling":
                                  "cls"}), r"unknown keys \['classifier_pooling'\]"),
    (lambda: ModelSpec.from_dict({"pooling": "cls"}), "no 'architecture' key"),
    (lambda: spec.from_config(config.build(sets=["model.name=bert-bass"]).model),
     "model.name='bert-bass' is unknown.*Did you mean 'bert-base'"),
    (lambda: BertConfig(hidden_act="swish"), "hidden_act='swish' is not supported"),
])
def test_bad_values_name_the_value_and_the_fix(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_spec_module_is_plain_data_and_bert_does_not_import_hf():
    """No bert.py <-> hf.py import loop: bert imports the spec, hf imports bert and the spec."""
    def imported(name):
        tree = ast.parse(open(os.path.join(MODELS, name)).read())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported("bert.py") if m.startswith("jaxaccel.models.hf")}
    assert not {m for m in imported("spec.py")
                if m == "jax" or m.startswith(("jax.", "flax"))}
    assert "jaxaccel.models.spec" in imported("hf.py")


def _logits(model, ids, mask):
    return np.asarray(model(ids, mask).logits)


@pytest.mark.long
def test_load_run_rebuilds_the_trained_model_from_its_spec(tmp_path):
    """A run folder's model comes back from the spec in its checkpoint record: the same logits
    as the model the trainer built from the config, with the saved parameters; a record of
    the older format (the bare BertConfig, options taken from the saved config) gives them
    too."""
    cfg = config.build(sets=[
        "model.name=tiny", "data.name=synthetic", "data.synthetic_examples=32",
        "data.synthetic_seq_len=16", "train.batch_size=16", "train.eval_batch_size=32",
        "train.max_steps=1", "train.progress=false", "model.pooling=mean", "model.num_labels=3",
        "model.hidden_dropout=0.0", f"workdir={tmp_path}", "name=run"])
    run_dir = loop.train(cfg)["run_dir"]
    model, saved_cfg, meta = inference.load_run(run_dir)
    assert meta["architecture"] == spec.from_config(cfg.model).to_dict()
    assert model.spec == spec.from_config(cfg.model)

    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), read_only=True)
    params, _ = ckpt.restore_params()
    ckpt.close()
    trained = create_model(cfg.model, None, cfg.seed)
    fresh = _logits(trained, *_ids())
    state = nnx.state(trained, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(trained, state)
    expected = _logits(trained, *_ids())
    assert not np.allclose(expected, fresh)          # the checkpoint's parameters, not init
    np.testing.assert_array_equal(_logits(model, *_ids()), expected)

    old_records = 0
    for path in glob.glob(os.path.join(run_dir, "checkpoints", "*", "meta", "metadata")):
        record = json.load(open(path))
        record["architecture"] = record["architecture"]["architecture"]
        json.dump(record, open(path, "w"))
        old_records += 1
    assert old_records
    old, _, old_meta = inference.load_run(run_dir)
    assert "pooling" not in old_meta["architecture"]
    assert old.spec == model.spec
    np.testing.assert_array_equal(_logits(old, *_ids()), expected)


def _ids():
    ids = np.array([[101, 7, 9, 11, 102, 0], [101, 5, 6, 7, 8, 102]], np.int32)
    return ids, (ids > 0).astype(np.int32)
