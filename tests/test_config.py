import glob
import os
import sys

import pytest

from jaxaccel import cli, config
from jaxaccel.train.run import resolve
from support import CONFIGS, run_cli


def test_base_builds_and_attribute_access():
    cfg = config.build()
    assert cfg.train.epochs == 1 and cfg.model.name == "minilm-l6"


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(CONFIGS, "*.py"))))
def test_every_config_file_loads(path):
    cfg = config.load(path)
    assert cfg.name == os.path.basename(path)[:-3]
    assert config.load_file(path).__class__ is dict


def test_unknown_key_lists_close_matches():
    with pytest.raises(KeyError, match=r"train\.learning_rate"):
        config.build(sets=["train.learnig_rate=1e-3"])


def test_type_checked_overrides():
    cfg = config.build(sets=["train.epochs=3", "train.learning_rate=1", "model.remat=true",
                             "name=my run"])
    assert cfg.train.epochs == 3 and cfg.train.learning_rate == 1.0
    assert cfg.model.remat is True and cfg.name == "my run"
    with pytest.raises(ValueError, match="train.epochs.*expects a int"):
        config.build(sets=["train.epochs=three"])


def test_nested_and_dotted_overrides_from_files():
    cfg = config.build({"train": {"epochs": 4}, "data.max_len": 64})
    assert cfg.train.epochs == 4 and cfg.data.max_len == 64


@pytest.mark.parametrize("override,match", [
    ("train.batch_size=0", "train.batch_size=0 must be >= 1"),
    ("train.optimizer=sgd", "train.optimizer='sgd' is not one of"),
    ("model.attention_impl=flash", "model.attention_impl='flash'"),
    ("train.grad_accum=3", "not divisible by train.grad_accum=3"),
    ("train.warmup_ratio=1.5", "warmup_ratio"),
])
def test_bad_values_fail_before_building(override, match):
    """Ranges by the config's checks, choices by their owners when the run is resolved
    (``train.run.resolve``: the optimizer's by ``optim``, the kernel's by ``models.attention``);
    before anything is built either way, and before the run folder is made."""
    with pytest.raises(ValueError, match=match):
        resolve(config.build(sets=["model.name=tiny", "data.name=synthetic", override]))


def test_a_refused_choice_leaves_no_run_folder(tmp_path, capsys):
    code, _, err = run_cli(capsys, "train", "--config", "tiny_synthetic", "--set",
                           f"workdir={tmp_path}", "--set", "train.optimizer=sgd")
    assert code == cli.EXIT_ERROR and "train.optimizer='sgd' is not one of" in err
    assert not os.listdir(tmp_path)


def test_missing_config_file_names_known_ones():
    with pytest.raises(FileNotFoundError, match="minilm_rt"):
        config.load("configs/nope.py")


def test_configs_import_each_other_plainly_from_any_directory(tmp_path, monkeypatch):
    """configs/bert_base_imdb_adan.py starts from ``import bert_base_imdb``: the loader puts the
    config's folder on the import path while it runs, whatever the working directory."""
    monkeypatch.chdir(tmp_path)
    adan = config.load(os.path.join(CONFIGS, "bert_base_imdb_adan.py"))
    base = config.load(os.path.join(CONFIGS, "bert_base_imdb.py"))
    assert (adan.name, adan.train.optimizer, adan.train.b1) == ("bert_base_imdb_adan", "adan", 0.98)
    assert adan.data == base.data and adan.train.epochs == base.train.epochs == 3
    monkeypatch.chdir(CONFIGS)
    assert config.load("bert_base_imdb_adan.py").to_dict() == adan.to_dict()


def test_config_imports_leave_no_trace_and_reread_the_files(tmp_path):
    """The folder leaves sys.path afterwards and its modules leave sys.modules, so an edited base
    is read again and a same-named base in another folder is not shadowed."""
    for folder, epochs in (("a", 2), ("b", 5)):
        os.makedirs(tmp_path / folder)
        (tmp_path / folder / "base_cfg.py").write_text(
            f"def get_config():\n    return {{'train.epochs': {epochs}}}\n")
        (tmp_path / folder / "child.py").write_text(
            "import base_cfg\n\ndef get_config():\n"
            "    return {**base_cfg.get_config(), 'name': 'child'}\n")
    assert config.load(str(tmp_path / "a" / "child.py")).train.epochs == 2
    assert config.load(str(tmp_path / "b" / "child.py")).train.epochs == 5
    (tmp_path / "a" / "base_cfg.py").write_text("def get_config():\n    return {'train.epochs': 7}\n")
    assert config.load(str(tmp_path / "a" / "child.py")).train.epochs == 7
    assert "base_cfg" not in sys.modules
    assert not any(str(tmp_path) in p for p in sys.path)
