"""Causal-LM data: the Canterbury corpus (TFDS, no TensorFlow), the trained BPE, packing and
packed batches, and how a config picks them (jaxaccel.data.splits).

The first corpus build needs PyPI (pip downloads the brotli sdist once per session).
"""

import dataclasses
import hashlib
import os

import numpy as np
import pytest

from jaxaccel import config
from jaxaccel.models.architectures import LLAMA_PRESETS, PRESETS, VIT_PRESETS
from jaxaccel.models.spec import ModelSpec
from jaxaccel.data import (bpe, canterbury, load_corpus, load_text_dataset, load_tokenizer,
                           run_tokenizer, splits)
from jaxaccel.data.packing import KEYS, PackedBatches, pack, tokenize_documents
from jaxaccel.data.sources import check_task
from jaxaccel.train.run import resolve
from jaxaccel.train.run_data import describe_data
from support import CLI, CONFIGS, ROOT, cpu_env

NUM_DOCS, NUM_TRAIN = 2678, 2678 - canterbury.NUM_VALIDATION


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory, brotli_sdist):
    data_dir = str(tmp_path_factory.mktemp("tfds_canterbury"))
    canterbury.prepare(data_dir, source=brotli_sdist)
    return data_dir


def lm_data(*sets):
    """The resolved data of canterbury for the llama-cpu preset, with ``sets``."""
    return resolve(config.build(sets=["data.name=canterbury", "model.name=llama-cpu",
                                      *sets])).data


@pytest.fixture(scope="session")
def bpe_dir(corpus_dir):
    data = lm_data(f"data.data_dir={corpus_dir}", "data.tokenizer_vocab=1024")
    return run_tokenizer.tokenizer_dir(data)


def test_corpus_texts_and_documents(brotli_sdist):
    texts = canterbury.fetch_texts(brotli_sdist)
    assert {k: len(v) for k, v in texts.items()} == {
        "alice29.txt": 152_089, "asyoulik.txt": 125_179, "lcet10.txt": 426_754,
        "plrabn12.txt": 481_861}
    docs = canterbury.all_documents(texts)
    assert len(docs) == NUM_DOCS
    assert docs[0] == ("alice29.txt", "ALICE'S ADVENTURES IN WONDERLAND")
    assert all(text and "\n\n" not in text and text == text.strip() for _, text in docs)


def test_corpus_splits(corpus_dir):
    docs = load_corpus("canterbury", data_dir=corpus_dir)
    train, val = docs["train"], docs["validation"]
    assert (len(train), len(val)) == (NUM_TRAIN, canterbury.NUM_VALIDATION)
    assert (sum(map(len, train)), sum(map(len, val))) == (978_051, 150_848)
    assert not set(train) & set(val)
    with pytest.raises(ValueError, match="no split 'test'; known: \\['train', 'validation'\\]"):
        load_corpus("canterbury", data_dir=corpus_dir, splits=("test",))
    with pytest.raises(ValueError, match="'canterbury' is a corpus.*load_corpus"):
        load_text_dataset("canterbury", data_dir=corpus_dir)
    with pytest.raises(ValueError, match="'rt_snippets' is a labelled dataset"):
        load_corpus("rt_snippets")


def test_corpus_from_a_folder_of_texts_and_no_network_once_built(corpus_dir, brotli_sdist,
                                                                   tmp_path, monkeypatch):
    folder = tmp_path / "texts"
    folder.mkdir()
    for name, data in canterbury.fetch_texts(brotli_sdist).items():
        (folder / name).write_bytes(data)

    def no_network(*args):
        raise AssertionError("no download: a local source or the cache")

    monkeypatch.setattr(canterbury, "pip_download", no_network)
    monkeypatch.setenv(canterbury.SOURCE_ENV, str(folder))
    again = load_corpus("canterbury", data_dir=str(tmp_path / "tfds"))
    monkeypatch.setenv(canterbury.SOURCE_ENV, "/nonexistent/brotli-1.2.1.tar.gz")
    assert again == load_corpus("canterbury", data_dir=corpus_dir)


def test_corpus_bad_sources(tmp_path):
    empty = tmp_path / "corpus.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=f"corpus file '{empty}' is empty \\(0 bytes\\)"):
        load_corpus("canterbury", data_dir=str(tmp_path / "tfds"), source=empty)
    assert not (tmp_path / "tfds").exists()             # nothing written
    bogus = tmp_path / canterbury.SDIST_NAME
    bogus.write_bytes(b"not the sdist")
    digest = hashlib.sha256(b"not the sdist").hexdigest()
    with pytest.raises(ValueError, match=f"sha256 {digest}; expected {canterbury.SDIST_SHA256}"):
        canterbury.fetch_texts(bogus)
    folder = tmp_path / "texts"
    folder.mkdir()
    for name in canterbury.TEXTS:
        (folder / name).write_bytes(b"x")
    with pytest.raises(ValueError, match="Checksum mismatch.*alice29.txt of brotli"):
        canterbury.fetch_texts(folder)


def test_bpe_is_deterministic_cached_and_round_trips(bpe_dir, corpus_dir):
    texts = load_corpus("canterbury", data_dir=corpus_dir, splits=("train",))["train"][:300]
    a, b = bpe.train(texts, 600), bpe.train(texts, 600)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert len(a) == 600 and a.eos_token_id == 0
    tok = load_tokenizer(bpe_dir, light=True)
    assert len(tok) == 1024 and tok.eos_token == bpe.EOS
    text = "Alice said: `Curiouser and curiouser!'\n\tnaïve café"   # non-ASCII: byte-level
    assert tok.decode(tok(text)["input_ids"]) == text
    mtime = os.path.getmtime(os.path.join(bpe_dir, "tokenizer.json"))
    data = lm_data(f"data.data_dir={corpus_dir}", "data.tokenizer_vocab=1024")
    assert run_tokenizer.tokenizer_dir(data) == bpe_dir            # trained once
    assert os.path.getmtime(os.path.join(bpe_dir, "tokenizer.json")) == mtime
    named = lm_data("model.tokenizer=/my/llama")
    assert run_tokenizer.tokenizer_dir(named) == "/my/llama"


def test_tokenize_documents_adds_eos(bpe_dir):
    tok = load_tokenizer(bpe_dir, light=True)
    docs = tokenize_documents(tok, ["To be, or not", "Paradise"])
    assert [d[-1] for d in docs] == [tok.eos_token_id] * 2 and docs[0].dtype == np.int32
    assert tok.decode(docs[0][:-1]) == "To be, or not"


def test_pack_by_hand():
    rows = pack([np.array([1, 2, 3, 9]), np.array([4, 5, 9]), np.array([6, 9])], seq_len=4)
    expected = {
        "input_ids": [[1, 2, 3, 9], [4, 5, 9, 6], [9, 0, 0, 0]],
        "segment_ids": [[1, 1, 1, 1], [1, 1, 1, 2], [1, 0, 0, 0]],
        "positions": [[0, 1, 2, 3], [0, 1, 2, 0], [0, 0, 0, 0]],
        "targets": [[2, 3, 9, 0], [5, 9, 0, 9], [0, 0, 0, 0]],
        "target_weights": [[1, 1, 1, 0], [1, 1, 0, 1], [0, 0, 0, 0]],
    }
    assert set(rows) == set(KEYS)
    for k, v in expected.items():
        np.testing.assert_array_equal(rows[k], v, err_msg=k)
    assert rows["target_weights"].dtype == np.float32
    assert all(rows[k].dtype == np.int32 for k in KEYS if k != "target_weights")


def _random_docs(n, seed=0, eos=1):
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(2, 50, rng.integers(0, 40)), eos).astype(np.int32)
            for _ in range(n)]


@pytest.mark.parametrize("seq_len", [1, 7, 16, 64])
def test_pack_invariants(seq_len):
    docs = _random_docs(60)
    rows = pack(docs, seq_len)
    ids, seg, pos = rows["input_ids"], rows["segment_ids"], rows["positions"]
    tgt, w = rows["targets"], rows["target_weights"]
    assert ids.shape == (-(-sum(map(len, docs)) // seq_len), seq_len)
    # Segments in reading order are the documents' pieces: every token once, in order.
    pieces = [ids[r][seg[r] == s] for r in range(len(ids)) for s in range(1, seg[r].max() + 1)]
    np.testing.assert_array_equal(np.concatenate(pieces), np.concatenate(docs))
    for r in range(len(ids)):
        real = seg[r] > 0
        assert real[:real.sum()].all() and np.all(np.diff(seg[r][real]) == np.diff(
            seg[r][real]).clip(0, 1))       # padding only at the end; segments 1, 2, ...
        for s in range(1, seg[r].max() + 1):
            np.testing.assert_array_equal(pos[r][seg[r] == s], np.arange((seg[r] == s).sum()))
    assert not np.any(pos[seg == 0]) and not np.any(w[seg == 0]) and not np.any(tgt[w == 0])
    # Targets: exactly the next token of the same document, wherever it lies.
    flat_w, flat_t = w.reshape(-1), tgt.reshape(-1)
    expected_w = np.concatenate([np.append(np.ones(len(d) - 1), 0) for d in docs])
    expected_t = np.concatenate([np.append(d[1:], 0) for d in docs])
    n = len(expected_w)
    np.testing.assert_array_equal(flat_w[:n], expected_w)
    np.testing.assert_array_equal(flat_t[:n], expected_t)
    assert expected_w.sum() == n - len(docs)       # each document's EOS predicts nothing


def test_packed_batches_resume_order_and_filler():
    docs = _random_docs(80)
    it = PackedBatches(docs, 16, 4, seed=3)
    assert it.steps_per_epoch == it.rows_per_epoch // 4
    first = list(it.batches(1))
    assert len(first) == it.steps_per_epoch and first[0]["input_ids"].shape == (4, 16)
    for a, b in zip(first[2:], it.batches(1, start_step=2)):
        for k in KEYS:
            np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(first[0]["input_ids"], next(it.batches(2))["input_ids"])
    same_seed = next(PackedBatches(docs, 16, 4, seed=3).batches(1))
    np.testing.assert_array_equal(first[0]["input_ids"], same_seed["input_ids"])
    ev = PackedBatches(docs, 16, 5, shuffle=False, drop_remainder=False)
    rows = list(ev.batches(0))
    assert len(rows) == -(-ev.rows_per_epoch // 5)
    stacked = {k: np.concatenate([b[k] for b in rows]) for k in KEYS}
    np.testing.assert_array_equal(stacked["input_ids"][:ev.rows_per_epoch],
                                  pack(docs, 16)["input_ids"])
    assert not stacked["segment_ids"][ev.rows_per_epoch:].any()
    assert not stacked["target_weights"][ev.rows_per_epoch:].any()


def test_packed_process_shards_are_disjoint_and_complete():
    docs = _random_docs(80)
    whole = list(PackedBatches(docs, 16, 8, seed=1).batches(0))
    shards = [list(PackedBatches(docs, 16, 8, seed=1, process_index=p,
                                 process_count=4).batches(0)) for p in range(4)]
    for step, batch in enumerate(whole):
        for k in KEYS:
            np.testing.assert_array_equal(np.concatenate([s[step][k] for s in shards]), batch[k])
    with pytest.raises(ValueError, match="global_batch_size=8 does not divide by "
                                         "process_count=3"):
        PackedBatches(docs, 16, 8, process_count=3)


def test_config_picks_packed_lm_batches(corpus_dir, bpe_dir):
    data = lm_data(f"data.data_dir={corpus_dir}", "data.tokenizer_vocab=1024",
                   "data.max_len=64", "data.eval_split=validation", "train.batch_size=8",
                   "train.eval_batch_size=16")
    tok = load_tokenizer(run_tokenizer.tokenizer_dir(data), light=True)
    train, labels = splits.train_batches(data, tok)
    ev, _ = splits.eval_batches(data, tok)
    assert labels == ()
    batch = next(train.batches(0))
    assert set(batch) == set(KEYS) and batch["input_ids"].shape == (8, 64)
    assert ev.tokens < train.tokens and ev.steps_per_epoch == -(-ev.rows_per_epoch // 16)
    with pytest.raises(ValueError, match="data.max_len=64 .* exceeds the model's maximum "
                                         "sequence length 32; set data.max_len <= 32"):
        splits.train_batches(dataclasses.replace(
            data, model=dataclasses.replace(data.model, max_positions=32)), tok)


def test_finetune_config_trains_from_a_llama_checkpoint(tmp_path, corpus_dir, bpe_dir):
    """configs/canterbury_lm_finetune.py on a tiny Llama checkpoint folder (weights written by
    jaxaccel's HF writer, the corpus's BPE as its tokenizer): the run reads the folder's
    tokenizer, trains, and evaluates every validation token once."""
    import dataclasses
    import math

    from jaxaccel.models import LLAMA_PRESETS, ModelSpec, build_model, save_checkpoint
    from jaxaccel.train import loop
    ckpt = str(tmp_path / "llama")
    arch = dataclasses.replace(LLAMA_PRESETS["llama-tiny"], vocab_size=1024)
    save_checkpoint(build_model(ModelSpec(arch)), ckpt)
    load_tokenizer(bpe_dir, light=True).save_pretrained(ckpt)
    cfg = config.load(os.path.join(CONFIGS, "canterbury_lm_finetune.py"), [
        f"workdir={tmp_path}", f"model.checkpoint={ckpt}", f"data.data_dir={corpus_dir}",
        "data.max_len=64", "train.max_steps=2", "train.batch_size=8",
        "train.eval_batch_size=64", "precision.policy=fp32", "model.remat=false",
        "model.attention_impl=xla", "train.progress=false"])
    result = loop.train(cfg)
    assert result["status"] == "completed" and result["task"] == "causal_lm"
    docs = tokenize_documents(load_tokenizer(ckpt, light=True), load_corpus(
        "canterbury", data_dir=corpus_dir, splits=("validation",))["validation"])
    assert result["eval_tokens"] == sum(len(d) - 1 for d in docs)
    assert math.isfinite(result["eval_perplexity"]) and result["eval_perplexity"] > 1


@pytest.mark.slow
def test_fp16_and_fp8_match_fp32_perplexity_on_the_cpu_lm_job(tmp_path):
    """The README's CPU pretraining command (configs/canterbury_lm.py on one CPU device) under
    each policy: fp16 and fp8 reach a validation perplexity within 2% of fp32's. Measured with
    the same commands on the shared CPU: 674.6 / 675.1 / 672.3, 7.5 to 13.5 min per policy."""
    import json
    import subprocess

    ppl = {}
    for policy in ("fp32", "fp16", "fp8"):
        proc = subprocess.run(
            [*CLI, "train", "--config", os.path.join(CONFIGS, "canterbury_lm.py"),
             "--set", f"workdir={tmp_path}",
             "--set", f"name={policy}", "--set", f"precision.policy={policy}",
             "--set", "train.progress=false"],
            capture_output=True, text=True, env=cpu_env(PYTHONPATH=ROOT))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        result, _ = json.JSONDecoder().raw_decode(proc.stdout)
        assert result["status"] == "completed", result
        ppl[policy] = result["eval_perplexity"]
        print(f"{policy}: validation perplexity {ppl[policy]:.2f}", flush=True)
    for policy in ("fp16", "fp8"):
        assert abs(ppl[policy] - ppl["fp32"]) <= 0.02 * ppl["fp32"], ppl


def test_data_and_model_tasks_must_agree():
    def check(cfg, spec):
        check_task(describe_data(cfg, spec, 1))
    lm = config.build(sets=["data.name=canterbury", "model.name=minilm-l6"])
    with pytest.raises(ValueError, match="data.name='canterbury' gives causal_lm batches but "
                                         "the model \\(model.name='minilm-l6'\\) trains "
                                         "classification; use a decoder"):
        check(lm, ModelSpec(PRESETS["minilm-l6"], num_labels=2))
    check(lm, ModelSpec(LLAMA_PRESETS["llama-cpu"]))
    with pytest.raises(ValueError, match="'rt_snippets' gives classification batches"):
        check(config.build(sets=["model.name=llama-cpu"]), ModelSpec(LLAMA_PRESETS["llama-cpu"]))
    with pytest.raises(ValueError, match="'rt_snippets' holds text but the model "
                                         "\\(model.name='vit-tiny'\\) reads arrays"):
        check(config.build(sets=["model.name=vit-tiny"]),
              ModelSpec(VIT_PRESETS["vit-tiny"], task="mae"))
