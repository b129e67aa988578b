"""The jaxaccel command: clear errors for bad input, and train -> eval -> predict on a run."""
import json
import os

import pytest

from jaxaccel import cli, compilation_cache
from jaxaccel.data import tokencache
from support import CONFIGS, TINY_CONFIG, run_cli


def test_unknown_config_key_lists_close_matches(capsys):
    code, _, err = run_cli(capsys, "train", "--config", f"{CONFIGS}/minilm_rt.py",
                           "--set", "train.epoch=2")
    assert code == cli.EXIT_ERROR
    assert "unknown config key 'train.epoch'" in err and "train.epochs" in err


@pytest.mark.parametrize("override,message", [
    ("model.name=bert-huge", "model.name='bert-huge' is unknown"),
    ("data.name=imbd_reviews", "Did you mean 'imdb_reviews'"),
    ("model.checkpoint=/nonexistent/ckpt", "does not exist"),
])
def test_unknown_model_dataset_checkpoint(capsys, tmp_path, override, message):
    code, _, err = run_cli(capsys, "train", "--config", TINY_CONFIG,
                           "--set", f"workdir={tmp_path}", "--set", override,
                           "--set", "data.name=synthetic" if override.startswith("model") else
                           "model.name=tiny")
    assert code == cli.EXIT_ERROR and message in err, err


def test_mesh_not_dividing_devices_is_named(capsys, tmp_path, eight_devices):
    code, _, err = run_cli(capsys, "train", "--config", TINY_CONFIG,
                           "--set", f"workdir={tmp_path}", "--set", "mesh.tensor=3")
    assert code == cli.EXIT_ERROR and "does not divide the 8 devices" in err


def test_predict_on_missing_run(capsys, tmp_path):
    code, _, err = run_cli(capsys, "predict", "--checkpoint", str(tmp_path), "great film")
    assert code == cli.EXIT_ERROR and "not a run folder" in err


@pytest.mark.long
def test_train_eval_predict_round_trip(capsys, tmp_path, monkeypatch):
    code, out, err = run_cli(capsys, "train", "--config", f"{CONFIGS}/minilm_rt.py",
                             "--set", f"workdir={tmp_path}", "--set", "model.name=tiny",
                             "--set", "train.max_steps=3", "--set", "train.batch_size=16",
                             "--set", "train.progress=false")
    assert code == 0, err
    trained = json.loads(out)        # stdout: the run's record alone; what it means on stderr
    assert "final test accuracy" in err and "checkpoints:" in err and "metrics:" in err
    run_dir = os.path.join(tmp_path, "minilm_rt")
    # eval reads (and, without its cache, tokenizes) the eval split alone, and gives the
    # trainer's final numbers.
    read, built = [], []
    real_tokens, real_build = tokencache.tokens, tokencache._build
    monkeypatch.setattr(tokencache, "tokens", lambda data, split, *a, **k: (
        read.append(split), real_tokens(data, split, *a, **k))[1])
    monkeypatch.setattr(tokencache, "_build", lambda data, split, *a: (
        built.append(split), real_build(data, split, *a))[1])
    code, out, err = run_cli(capsys, "eval", "--checkpoint", run_dir)
    assert code == 0, err
    assert read == ["test"] and set(built) <= {"test"}
    evaluated = json.loads(out)
    assert evaluated["step"] == 3 and evaluated["examples"] == trained["eval_examples"]
    assert evaluated["accuracy"] == trained["eval_accuracy"]
    assert evaluated["loss"] == pytest.approx(trained["eval_loss"], rel=1e-6)
    code, out, err = run_cli(capsys, "predict", "--checkpoint", run_dir,
                             "a gripping, beautifully shot film", "dull and lifeless")
    assert code == 0, err
    records = [json.loads(line) for line in out.strip().splitlines()]
    assert len(records) == 2
    assert records[0]["label"] in ("neg", "pos") and 0.5 <= records[0]["probability"] <= 1.0
    assert records[0]["text"] == "a gripping, beautifully shot film"


@pytest.mark.slow   # 25-35 s of training; Adan's rule and kernels: test_adan, test_flat
def test_training_with_adan_through_the_cli_lowers_the_loss(capsys, tmp_path):
    """3 epochs (48 steps) at a 3e-3 learning rate: the loss falls by 0.18 (6 epochs at the
    config's 1e-3 took twice as long for 0.15)."""
    from jaxaccel.train.metrics import read_metrics
    code, out, err = run_cli(capsys, "train", "--config", TINY_CONFIG,
                             "--set", f"workdir={tmp_path}", "--set", "train.optimizer=adan",
                             "--set", "train.epochs=3", "--set", "train.learning_rate=3e-3",
                             "--set", "train.log_every=4", "--set", "train.progress=false")
    assert code == 0, err
    losses = [r["train/loss"] for r in read_metrics(os.path.join(tmp_path, "tiny_synthetic"))
              if "train/loss" in r]
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.long
def test_training_with_pallas_attention(capsys, tmp_path):
    code, out, err = run_cli(capsys, "train", "--config", TINY_CONFIG,
                             "--set", f"workdir={tmp_path}", "--set", "model.attention_impl=pallas",
                             "--set", "train.max_steps=2", "--set", "train.progress=false")
    assert code == cli.EXIT_ERROR and "attention_impl='xla'" in err   # dropout 0.1 refused
    code, out, err = run_cli(capsys, "train", "--config", TINY_CONFIG,
                             "--set", f"workdir={tmp_path}", "--set", "model.attention_impl=pallas",
                             "--set", "model.attention_dropout=0.0", "--set", "train.max_steps=2",
                             "--set", "train.progress=false")
    assert code == 0, err


def test_compilation_cache_is_on_by_default_in_a_per_user_folder(tmp_path):
    from jaxaccel import config
    assert config.BASE["compilation_cache"] == "auto"
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    assert compilation_cache.folder("auto", env) == os.path.join(tmp_path, "jaxaccel", "jax")
    # a cache folder already set (tests/conftest.py sets one) is kept
    assert compilation_cache.folder("auto", {**env, "JAX_COMPILATION_CACHE_DIR": "/c"}) == "/c"
    assert compilation_cache.folder("off", env) is None
    assert compilation_cache.folder(str(tmp_path / "mine"), env) == str(tmp_path / "mine")


def test_enable_compilation_cache_sets_jax_and_off_leaves_it(tmp_path):
    import jax
    before = jax.config.jax_compilation_cache_dir
    try:
        assert compilation_cache.enable("off") is None
        assert jax.config.jax_compilation_cache_dir == before
        assert compilation_cache.enable(str(tmp_path)) == str(tmp_path)
        assert jax.config.jax_compilation_cache_dir == str(tmp_path)
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
