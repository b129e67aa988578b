"""bench/hf_llama.py without its transformers 4.57.6 environment, the corpus or the network: the
interleaved timing, the stock loops' data and schedule, the PyTorch side (in this process and
as the child process the bench steps in lock-step) and rows that ``jaxaccel compare`` joins."""
import json
import math
import os
import sys

import numpy as np
import pytest

from support import ROOT

sys.path.insert(0, ROOT)

from bench import hf_llama  # noqa: E402
from bench.common import interleave  # noqa: E402

WORDS = ["[UNK]", "</s>"] + [f"w{i}" for i in range(60)]


def test_interleave_warms_up_then_alternates_the_order():
    calls = []

    def side(name):
        def run(indices):
            calls.append((name, list(indices)))
            return [(1.0 if name == "a" else 2.0, 0.5)] * len(indices)
        return run
    samples, first = interleave({"a": side("a"), "b": side("b")}, rounds=3, steps=2)
    assert calls == [("a", [0, 1]), ("b", [0, 1]), ("a", [2, 3]), ("b", [2, 3]),
                     ("b", [4, 5]), ("a", [4, 5]), ("a", [6, 7]), ("b", [6, 7])]
    assert first == {"a": 1.0, "b": 2.0} and len(samples["a"]) == len(samples["b"]) == 6


def test_stock_batches_are_whole_batches_of_each_epochs_permutation():
    got = list(hf_llama.stock_batches(rows=10, batch=4, steps=5, seed=3))
    assert len(got) == 5 and all(len(i) == 4 for i in got)
    first = np.random.default_rng((3, 0)).permutation(10)
    assert np.array_equal(np.concatenate(got[:2]), first[:8])         # the remainder dropped
    assert np.array_equal(np.concatenate(got[2:4]), np.random.default_rng((3, 1))
                          .permutation(10)[:8])
    rows = {"input_ids": np.ones((5, 3), np.int32), "targets": np.ones((5, 3), np.int32),
            "target_weights": np.ones((5, 3), np.float32)}
    parts = list(hf_llama.eval_batches(rows, 4))
    assert [p[0].shape for p in parts] == [(4, 3), (4, 3)]
    assert parts[1][2].sum() == 3            # one real row, three weight-0 filler rows


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_the_pytorch_schedule_is_the_flax_examples(kind):
    from bench.hf_flax import hf_schedule
    recipe = {"total_steps": 40, "warmup_steps": 4, "schedule": kind}
    sched = hf_schedule(2e-3, 40, 4, kind)
    for step in (0, 1, 3, 4, 5, 20, 39, 40):
        assert abs(2e-3 * hf_llama.lr_factor(step, recipe) - float(sched(step))) < 1e-9


def _config(tmp_path, **extra) -> str:
    """A config of the tiny decoder on the corpus (the batches come from ``fake_batches``;
    ``model.tokenizer`` keeps the corpus's BPE from being trained)."""
    values = {"name": "t", "model.name": "llama-tiny", "model.tokenizer": "/unused",
              "data.name": "canterbury", "data.max_len": 16, "train.batch_size": 2,
              "train.max_steps": 4, "train.eval_batch_size": 4, "train.learning_rate": 1e-3,
              "train.b2": 0.95, "train.weight_decay": 0.1, **extra}
    path = tmp_path / "tiny_lm.py"
    path.write_text(f"def get_config():\n    return {values!r}\n")
    return str(path)


def fake_batches(resolved, n):
    """Packed rows of random documents, as ``packed_batches`` gives the corpus's."""
    from jaxaccel.data.packing import pack
    cfg, architecture = resolved.cfg, resolved.spec.architecture
    rng = np.random.default_rng(0)
    docs = [rng.integers(2, architecture.vocab_size, rng.integers(3, 12)).astype(np.int32)
            for _ in range(n * cfg.train.batch_size * cfg.data.max_len // 3)]
    rows = pack(docs, cfg.data.max_len)
    b = cfg.train.batch_size
    return [{k: v[i * b:(i + 1) * b] for k, v in rows.items()} for i in range(n)]


@pytest.mark.long
def test_ours_and_the_pytorch_child_share_rows_that_compare_joins(tmp_path, monkeypatch,
                                                                    capsys):
    """The step timing with the PyTorch side in its child process: rows per shape with the
    same ``work``, speedups, and one ``jaxaccel compare`` group per shape."""
    from jaxaccel import compare
    monkeypatch.setattr(hf_llama, "packed_batches", fake_batches)
    out = tmp_path / "out"
    hf_llama.main(["--config", _config(tmp_path), "--stock", "torch", "--torch-modes", "eager",
                   "--torch-omp-wait", "passive", "--shapes", "2x16,1x32", "--rounds", "2",
                   "--steps", "1", "--out", str(out)])
    (path,) = out.iterdir()
    result = json.loads(path.read_text())
    names = [(r["name"], r["shape"]) for r in result["rows"]]
    assert names == [("jaxaccel step", "2x16"), ("torch eager step", "2x16"),
                     ("jaxaccel step", "1x32"), ("torch eager step", "1x32")]
    assert all(r["n"] == 2 and r["median_s"] > 0 and r["cpu_median_s"] > 0
               for r in result["rows"])
    assert set(result["speedup"]) == {"2x16", "1x32"}
    assert int(result["transformers_torch"].split(".")[0]) >= 5
    assert "transformers_flax" not in result
    report = compare.compare([str(path)], os.path.join(ROOT, "bench", "results", "prices-cpu.csv"))
    assert [sorted(c.config for c in g.candidates) for g in report["groups"]] == \
        [["jaxaccel step", "torch eager step"]] * 2
    assert {g.work["seq"] for g in report["groups"]} == {16, 32}
    assert "speedup (side median / ours)" in capsys.readouterr().out


def test_the_stock_pytorch_job_tokenizes_packs_trains_and_scores_our_targets(tmp_path,
                                                                             monkeypatch):
    """``torch_job`` in this process on a word-level tokenizer and a fake corpus: the train
    stream cut into rows, the validation rows ours (``packing.pack``), a finite perplexity."""
    import tokenizers
    import torch
    from transformers import PreTrainedTokenizerFast

    import jaxaccel.data as data
    from jaxaccel.models import LLAMA_PRESETS
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>") \
        .save_pretrained(str(tmp_path / "tok"))
    rng = np.random.default_rng(0)
    texts = {split: [" ".join(f"w{i}" for i in rng.integers(0, 60, rng.integers(3, 20)))
                     for _ in range(n)] for split, n in (("train", 30), ("validation", 6))}
    monkeypatch.setattr(data, "load_corpus", lambda name, data_dir=None, splits=(): {
        s: texts[s] for s in splits})
    spec = {"name": "fake", "data_dir": "", "eval_split": "validation", "max_len": 16,
            "batch": 2, "eval_batch": 4}
    rows, val = hf_llama.stock_rows(str(tmp_path / "tok"), spec)
    tokens = sum(len(t.split()) + 1 for t in texts["train"])          # each with its EOS
    assert rows.shape == (tokens // 16, 16) and rows[0, 0] == WORDS.index(texts["train"][0]
                                                                         .split()[0])
    assert val["target_weights"].sum() == sum(len(t.split()) for t in texts["validation"])
    arch = LLAMA_PRESETS["llama-tiny"]
    recipe = {"learning_rate": 1e-3, "b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 0.1,
              "max_grad_norm": 1.0, "schedule": "cosine", "total_steps": 3, "warmup_steps": 1}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)       # OpenMP's spinning threads stall on a CPU shared with JAX's
    try:
        got = hf_llama.torch_job(arch.to_hf(), recipe, 0, "eager", "fused",
                                 str(tmp_path / "tok"), spec)
    finally:
        torch.set_num_threads(threads)
    assert got["steps"] == 3 and math.isfinite(got["final_perplexity"])
    assert got["final_perplexity"] == pytest.approx(math.exp(got["final_loss"]))
    assert abs(got["final_loss"] - math.log(arch.vocab_size)) < 1.0    # near-uniform: 3 steps


def test_flags_are_checked_before_anything_runs(tmp_path):
    for argv, message in ((["--stock", "jax"], "--stock"), (["--sides", "mine"], "--sides"),
                          (["--shapes", "8by128"], "--shapes")):
        with pytest.raises(SystemExit, match=message):
            hf_llama.main(argv + ["--out", str(tmp_path)])
    assert not os.listdir(tmp_path)


def test_default_shapes_are_the_jobs_and_as_many_tokens_in_512_token_rows():
    assert hf_llama.default_shapes(16, 128) == [(16, 128), (4, 512)]
    assert hf_llama.default_shapes(1, 128) == [(1, 128), (1, 512)]
    assert hf_llama.default_shapes(2, 512) == [(2, 512)]
