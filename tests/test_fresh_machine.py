"""A machine where nothing was prepared before: every command's stdout is its result alone.

Each command runs in a subprocess whose every per-user folder is new and empty (HOME, the XDG
cache, the TFDS data dir, the token cache, the JAX compilation cache, the temporary folder), so
whatever a library prints on first use (TensorFlow Datasets preparing a dataset, a sdist
downloaded with pip, a tokenizer trained on a corpus, a cache folder set up) would land on
stdout before the result, as it once did: ``jaxaccel train ... > result.json`` must parse."""
import json
import os
import subprocess

import pytest

from support import CLI, CONFIGS, LONG_WAIT_S, cpu_env

# What TFDS prints while it prepares a dataset (termcolor, to stdout).
TFDS_LINES = ("Downloading and preparing dataset", "Subsequent calls will reuse this data")


def fresh_env(root) -> dict:
    """This session's CPU environment with every per-user folder new and empty under ``root``."""
    folders = {name: os.path.join(root, name) for name in
               ("home", "xdg-cache", "tfds", "token-cache", "jax-cache", "tmp", "hf-modules")}
    for folder in folders.values():
        os.makedirs(folder)
    env = cpu_env(HOME=folders["home"], XDG_CACHE_HOME=folders["xdg-cache"],
                  TFDS_DATA_DIR=folders["tfds"], JAXACCEL_DATA_CACHE=folders["token-cache"],
                  JAX_COMPILATION_CACHE_DIR=folders["jax-cache"], TMPDIR=folders["tmp"],
                  HF_MODULES_CACHE=folders["hf-modules"])
    for local_copy in ("JAXACCEL_RT_SOURCE", "JAXACCEL_CANTERBURY_SOURCE"):
        env.pop(local_copy, None)           # the first run downloads, as a new user's does
    return env


def jaxaccel(env, *argv) -> str:
    """``jaxaccel *argv``'s stdout; the command must succeed."""
    done = subprocess.run([*CLI, *argv], env=env, capture_output=True, text=True,
                          timeout=LONG_WAIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.long
def test_a_classifier_run_prints_only_its_results_on_a_fresh_machine(tmp_path):
    env = fresh_env(tmp_path / "fresh")
    sets = ["--set", f"workdir={tmp_path}", "--set", "model.name=tiny", "--set",
            "train.max_steps=2", "--set", "train.batch_size=16", "--set", "train.progress=false"]
    trained = json.loads(jaxaccel(env, "train", "--config", f"{CONFIGS}/minilm_rt.py", *sets))
    assert trained["status"] == "completed" and trained["step"] == 2
    run = os.path.join(tmp_path, "minilm_rt")
    evaluated = json.loads(jaxaccel(env, "eval", "--checkpoint", run))
    assert evaluated["accuracy"] == trained["eval_accuracy"]
    lines = jaxaccel(env, "predict", "--checkpoint", run, "a gripping film").splitlines()
    assert [json.loads(line)["index"] for line in lines] == [0]
    exported = json.loads(jaxaccel(env, "export", "--checkpoint", run, "--out",
                                   str(tmp_path / "hf"), "--custom-code"))
    assert os.path.isdir(exported["out"])
    # data show on a data dir of its own, prepared by this command: its documented text alone
    shown = jaxaccel(env, "data", "show", "--config", f"{CONFIGS}/minilm_rt.py", "-n", "1",
                     "--set", "model.name=tiny", "--set", f"data.data_dir={tmp_path / 'tfds2'}")
    assert shown.startswith("row 0 (step 0):"), shown[:500]
    assert not any(line in shown for line in TFDS_LINES)


@pytest.mark.long
def test_a_corpus_run_prints_only_its_results_on_a_fresh_machine(tmp_path):
    """data prepare trains the corpus's own tokenizer and builds the token cache; generate
    continues a prompt: their text and JSON alone."""
    env = fresh_env(tmp_path / "fresh")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"the river {i} runs to the sea, and the "
                                                  f"sea is wide and deep {i}."}) + "\n"
                              for i in range(200)))
    sets = ["--set", f"data.train_files={corpus}", "--set", "model.name=llama-cpu",
            "--set", "data.max_len=32", "--set", "data.tokenizer_vocab=300",
            "--set", "train.batch_size=4", "--set", "train.max_steps=2",
            "--set", f"workdir={tmp_path}", "--set", "train.progress=false"]
    prepared = jaxaccel(env, "data", "prepare", "--config", f"{CONFIGS}/files_lm.py", *sets)
    assert prepared.startswith("data.name=files (corpus): causal_lm batches"), prepared[:500]
    trained = json.loads(jaxaccel(env, "train", "--config", f"{CONFIGS}/files_lm.py", *sets))
    assert trained["status"] == "completed"
    out = jaxaccel(env, "generate", "--checkpoint", os.path.join(tmp_path, "files_lm"),
                   "--max-new-tokens", "4", "the river")
    assert json.loads(out)["prompt"] == "the river"


@pytest.mark.parametrize("argv", [["compile", "--config", f"{CONFIGS}/tiny_synthetic.py",
                                   "--topology", "local"]])
def test_a_plan_prints_only_its_report(tmp_path, argv):
    out = jaxaccel(fresh_env(tmp_path / "fresh"), *argv)
    assert out.startswith("target "), out[:500]
