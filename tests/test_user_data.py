"""Training on your own data: the files, TFDS, Hugging Face and audio sources, their errors
(file and line), and the data commands (jaxaccel.data.files, tfds_source, hf_disk, audio;
jaxaccel.train.datacmd). The token cache itself: test_token_cache.py."""
import glob
import json
import os
import re

import jax
import numpy as np
import pytest

from jaxaccel import config
from jaxaccel.data import files
from jaxaccel.data.spec import DataError
from jaxaccel.train import datacmd, loop
from jaxaccel.train.inference import Predictor, evaluate_run
from jaxaccel.train.metrics import read_metrics
from jaxaccel.train.run import resolve
from support import run_cli

REVIEWS = [("a gripping, beautifully shot film", "pos"), ("dull and lifeless", "neg"),
           ('a "quiet" triumph, moving\nand wise', "pos"), ("naïve café plot — 東京", "neg"),
           ("the best thing all year", "pos"), ("a waste of two hours", "neg")] * 4


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def reviews_jsonl(path, rows=REVIEWS, text="text", label="label"):
    return write_jsonl(path, [{text: t, label: y} for t, y in rows])


def files_sets(tmp_path, *extra):
    """A tiny BERT classifier on data.name=files, the cache in ``tmp_path`` (batches of 8 rows:
    one a test device)."""
    return [f"workdir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}", "model.name=tiny",
            "data.name=files", "train.batch_size=8", "train.eval_batch_size=8",
            "train.max_steps=2", "train.progress=false", "train.learning_rate=1e-3", *extra]


def records(sets) -> list[tuple]:
    """Every (text, label) the files source reads for the training split of ``sets``."""
    data = resolve(config.build(sets=sets)).data
    out = []
    for chunk in data.reader.chunks("train"):
        r = data.reader.read(chunk)
        out += list(zip(r.texts, r.labels or [None] * len(r.texts)))
    return out


def cache_folders(tmp_path):
    root = tmp_path / "cache"
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.exists() else []


# ---- formats ----

def _write_formats(tmp_path) -> dict:
    """The same labelled records as each format: {format: [--set, ...]}."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    out = {"jsonl": [f"data.train_files={reviews_jsonl(tmp_path / 'r.jsonl')}"]}
    import csv
    with open(tmp_path / "r.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "text"])
        w.writerows([(y, t) for t, y in REVIEWS])
    out["csv"] = [f"data.train_files={tmp_path / 'r.csv'}"]
    (tmp_path / "r.tsv").write_text("text\tlabel\n" + "".join(
        f"{t.replace(chr(10), ' ')}\t{y}\n" for t, y in REVIEWS))
    out["tsv"] = [f"data.train_files={tmp_path / 'r.tsv'}"]
    table = pa.table({"text": [t for t, _ in REVIEWS], "label": [y for _, y in REVIEWS]})
    pq.write_table(table, tmp_path / "r.parquet", row_group_size=5)
    out["parquet"] = [f"data.train_files={tmp_path / 'r.parquet'}"]
    with pa.OSFile(str(tmp_path / "r.arrow"), "wb") as sink:   # a stream, as datasets writes
        with pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=7):
                writer.write_batch(batch)
    out["arrow"] = [f"data.train_files={tmp_path / 'r.arrow'}"]
    for i, (t, y) in enumerate(REVIEWS):
        (tmp_path / "txt" / y).mkdir(parents=True, exist_ok=True)
        (tmp_path / "txt" / y / f"{i:03d}.txt").write_text(t)
    out["text"] = [f"data.train_files={tmp_path / 'txt'}"]
    return out


def test_every_file_format_reads_the_same_records(tmp_path):
    expected = sorted(REVIEWS)
    for fmt, sets in _write_formats(tmp_path).items():
        got = records(files_sets(tmp_path, *sets))
        want = expected if fmt != "tsv" else sorted((t.replace("\n", " "), y) for t, y in REVIEWS)
        assert sorted(got) == want, fmt


def test_large_files_are_read_in_chunks_cut_at_record_boundaries(tmp_path, monkeypatch):
    """Chunks of ~40 bytes (CHUNK_BYTES) cover each file exactly, cut at a record's end (a
    line; a newline outside CSV quotes; a blank line), and name each record's own line."""
    formats = _write_formats(tmp_path)
    whole = {fmt: records(files_sets(tmp_path, *formats[fmt])) for fmt in ("jsonl", "csv")}
    (tmp_path / "book.txt").write_text("One para\ngoes on.\n\n\nTwo.\n \nThree\n\n" * 20)
    book = files_sets(tmp_path, f"data.train_files={tmp_path / 'book.txt'}",
                      "data.documents=paragraph", "model.name=llama-cpu",
                      "data.tokenizer_vocab=300")
    whole["text"] = records(book)
    monkeypatch.setattr(files, "CHUNK_BYTES", 40)
    for fmt in ("jsonl", "csv"):
        data = resolve(config.build(sets=files_sets(tmp_path, *formats[fmt]))).data
        chunks = data.reader.chunks("train")
        assert len(chunks) > 5 and all(a[3] == b[2] for a, b in zip(chunks, chunks[1:]))
        assert records(files_sets(tmp_path, *formats[fmt])) == whole[fmt], fmt
    assert records(book) == whole["text"] and len(whole["text"]) == 60
    assert whole["text"][:3] == [("One para\ngoes on.", None), ("Two.", None), ("Three", None)]
    rows = [json.dumps({"text": f"row {i}", "label": "ab"[i % 2]}) for i in range(30)]
    rows[22] = '{"text": "no label here"}'
    (tmp_path / "long.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(DataError, match=f"{tmp_path / 'long.jsonl'}:23: no field 'label'"):
        datacmd.prepare(config.build(sets=files_sets(
            tmp_path, f"data.train_files={tmp_path / 'long.jsonl'}", "data.holdout=0.2")))


# ---- bad input: a clear error naming the file and line, and nothing kept ----

def _bad(tmp_path, name: str, content: bytes):
    path = tmp_path / name
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("name,content,message", [
    ("a.jsonl", b'{"text": "fine", "label": "pos"}\n{"body": "x", "label": "neg"}\n',
     "a.jsonl:2: no field 'text' \\(fields: body, label\\); set data.text_field"),
    ("a.csv", b"review,label\nfine,pos\n",
     "a.csv: no field 'text' \\(fields: review, label\\)"),
    ("a.jsonl", b'{"text": "fine", "label": "pos"}\n{"text": "caf\xe9", "label": "neg"}\n',
     "a.jsonl:2: not valid UTF-8 \\(invalid continuation byte at byte 14 of the line\\)"),
    ("a.jsonl", b'{"text": "fine", "label": "pos"}\n{"text": "  ", "label": "neg"}\n',
     "a.jsonl:2: empty text; remove the record"),
    ("a.jsonl", b'{"text": "fine", "label": "pos"}\nnot json\n',
     "a.jsonl:2: not a JSON object"),
])
def test_bad_records_are_named_by_file_and_line_and_nothing_is_kept(tmp_path, name, content,
                                                                  message):
    path = _bad(tmp_path, name, content)
    cfg = config.build(sets=files_sets(tmp_path, f"data.train_files={path}", "data.holdout=0.5"))
    with pytest.raises(DataError, match=message):
        datacmd.prepare(cfg)
    assert cache_folders(tmp_path) == []


def test_a_single_class_label_column_is_refused(tmp_path):
    """The records are sound (their cache is whole and kept), their labels are not."""
    path = _bad(tmp_path, "a.jsonl", b'{"text": "fine", "label": "pos"}\n'
                                     b'{"text": "also", "label": "pos"}\n')
    cfg = config.build(sets=files_sets(tmp_path, f"data.train_files={path}", "data.holdout=0.5"))
    with pytest.raises(DataError, match="every training example has the label 'pos' \\(the "
                                        "first at .*a.jsonl:1\\): a classifier needs two "
                                        "classes"):
        datacmd.prepare(cfg)
    assert not [n for n in cache_folders(tmp_path) if ".partial" in n]


def test_integer_labels_are_named_by_their_values(tmp_path):
    """Stars 1-3 as JSON integers, or as CSV text: the same classes, named "1", "2", "3"."""
    rows = [{"text": f"review {i}", "stars": 1 + i % 3} for i in range(24)]
    write_jsonl(tmp_path / "stars.jsonl", rows)
    (tmp_path / "stars.csv").write_text("text,stars\n" + "".join(
        f"{r['text']},{r['stars']}\n" for r in rows))
    for name in ("stars.jsonl", "stars.csv"):
        lines = datacmd.prepare(config.build(sets=files_sets(
            tmp_path, f"data.train_files={tmp_path / name}", "data.holdout=0.25",
            "data.label_field=stars", "model.num_labels=3")))
        assert re.search(r"train: 18 examples, [0-9]+ tokens; labels: 1 \d+, 2 \d+, 3 \d+",
                         lines[1]), lines


def test_a_label_eval_never_saw_in_train_is_named(tmp_path):
    train = reviews_jsonl(tmp_path / "train.jsonl")
    evals = write_jsonl(tmp_path / "eval.jsonl", [{"text": "ok", "label": "pos"},
                                                  {"text": "so-so", "label": "meh"}])
    cfg = config.build(sets=files_sets(tmp_path, f"data.train_files={train}",
                                       f"data.eval_files={evals}"))
    with pytest.raises(DataError, match=f"{evals}:2: label 'meh' of the 'test' split is not one "
                                        "of the training classes \\(neg, pos\\)"):
        datacmd.prepare(cfg)


def test_a_glob_matching_nothing_and_mixed_formats_are_refused(tmp_path):
    with pytest.raises(DataError, match="data.train_files='.*/none-\\*.jsonl' matches no file"):
        resolve(config.build(sets=files_sets(tmp_path,
                                             f"data.train_files={tmp_path}/none-*.jsonl")))
    reviews_jsonl(tmp_path / "d" / "a.jsonl")
    (tmp_path / "d" / "b.csv").write_text("text,label\nx,pos\n")
    with pytest.raises(DataError, match="data.train_files matches files of several formats "
                                        "\\(jsonl: a.jsonl; csv: b.csv\\)"):
        resolve(config.build(sets=files_sets(tmp_path, f"data.train_files={tmp_path / 'd'}")))


def test_a_corpus_shorter_than_a_row_or_a_batch_is_refused(tmp_path):
    (tmp_path / "tiny.txt").write_text("A few words.\n\nAnd a few more words here.\n")
    (tmp_path / "held.txt").write_text("Some other words.\n")
    sets = files_sets(tmp_path, f"data.train_files={tmp_path / 'tiny.txt'}",
                      "data.documents=paragraph", "model.name=llama-cpu",
                      "data.tokenizer_vocab=300", f"data.eval_files={tmp_path / 'held.txt'}")
    with pytest.raises(DataError, match="'train' split of data.name='files' holds [0-9]+ tokens, "
                                        "less than one row of data.max_len=128"):
        datacmd.prepare(config.build(sets=sets))
    with pytest.raises(ValueError, match="train.batch_size=64 is more than the [0-9]+ rows of "
                                         "4 tokens"):
        datacmd.prepare(config.build(sets=sets + ["data.max_len=4", "train.batch_size=64"]))


# ---- each source trains end to end ----

@pytest.mark.long
def test_files_train_eval_and_predict_name_the_labels(tmp_path, capsys):
    """A classifier trained on JSONL with string labels: the label names are kept with the run,
    so predict (and the data commands) name them; eval reads the eval files again and reports
    per-class precision/recall/F1, macro-F1 and the confusion matrix (JSON, metrics.jsonl, a
    PNG, TensorBoard) counted exactly: 7 examples in batches of 8 (a padding row), the same
    on 8 devices or 1; predict --top-k gives the likeliest labels."""
    train = reviews_jsonl(tmp_path / "train.jsonl", text="review", label="sentiment")
    evals = reviews_jsonl(tmp_path / "test.jsonl", REVIEWS[:7], text="review",
                          label="sentiment")
    sets = files_sets(tmp_path, f"data.train_files={train}", f"data.eval_files={evals}",
                      "data.text_field=review", "data.label_field=sentiment", "name=reviews")
    result = loop.train(config.build(sets=sets))
    assert result["status"] == "completed" and result["eval_examples"] == 7
    run_dir = result["run_dir"]
    code, out, err = run_cli(capsys, "eval", "--checkpoint", run_dir)
    assert code == 0, err
    ev = json.loads(out)
    assert ev["accuracy"] == result["eval_accuracy"] and ev["label_names"] == ["neg", "pos"]
    check_confusion(ev, run_dir, support=[3, 4])
    assert evaluate_run(run_dir, devices=jax.devices()[:1])["confusion_matrix"] == \
        ev["confusion_matrix"]
    labels = {label for label, _, _ in Predictor(run_dir)(["a film", "a waste"])}
    assert labels <= {"neg", "pos"}
    code, out, err = run_cli(capsys, "predict", "--checkpoint", run_dir, "--top-k", "2", "a film")
    assert code == 0, err
    record = json.loads(out)
    assert [t["label"] for t in record["top_k"]][0] == record["label"]
    assert {t["label"] for t in record["top_k"]} == {"neg", "pos"}
    assert sum(t["probability"] for t in record["top_k"]) == pytest.approx(1.0, abs=1e-5)
    code, _, err = run_cli(capsys, "predict", "--checkpoint", run_dir, "--top-k", "3", "a film")
    assert code == 2 and "error: --top-k 3: the run" in err and "from 1 to 2" in err
    code, out, err = run_cli(capsys, "data", "show", "-n", "2", *[f"--set={s}" for s in sets])
    assert code == 0, err
    assert out.count("row ") == 2 and ("label 'neg'" in out or "label 'pos'" in out)
    code, out, err = run_cli(capsys, "data", "prepare", *[f"--set={s}" for s in sets])
    assert code == 0, err
    assert "train: 24 examples" in out and "neg 12, pos 12" in out and "cache:" in out


def check_confusion(ev, run_dir, support):
    """``ev``'s per-class report agrees with its exact counts (padding rows left out), and the
    trainer's last evaluation wrote it to metrics.jsonl, the PNG and TensorBoard."""
    m = np.array(ev["confusion_matrix"])
    assert m.sum(1).tolist() == ev["support"] == support and m.sum() == ev["examples"]
    assert np.trace(m) / m.sum() == pytest.approx(ev["accuracy"])
    assert ev["recall"] == pytest.approx(list(np.diag(m) / m.sum(1)))
    assert ev["macro_f1"] == pytest.approx(np.mean(ev["f1"]))
    last = [r for r in read_metrics(run_dir) if "eval/accuracy" in r][-1]
    assert last["eval/confusion_matrix"] == ev["confusion_matrix"]
    assert last["eval/label_names"] == ev["label_names"]
    with open(os.path.join(run_dir, "confusion_matrix.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    events = glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents*"))
    data = b"".join(open(p, "rb").read() for p in events)
    assert b"eval/confusion_matrix" in data and b"\x89PNG" in data


def corpus_sets(tmp_path):
    """Plain-text paragraphs (5% held out) for a decoder, through the corpus's own BPE."""
    book = tmp_path / "books" / "one.txt"
    book.parent.mkdir()
    book.write_text("\n\n".join(f"Paragraph {i}: the river ran past the mill, and the miller "
                                f"sang of rain number {i}." for i in range(200)))
    return files_sets(tmp_path, f"data.train_files={tmp_path / 'books'}",
                      "data.documents=paragraph", "data.holdout=0.05", "model.name=llama-cpu",
                      "data.tokenizer_vocab=300", "data.max_len=32", "name=lm")


def test_a_text_corpus_is_packed_for_a_decoder(tmp_path, capsys):
    sets = corpus_sets(tmp_path)
    code, out, err = run_cli(capsys, "data", "prepare", *[f"--set={s}" for s in sets])
    assert code == 0, err
    assert re.search(r"train: 190 documents, [0-9,]+ tokens, [0-9,]+ rows of 32", out), out
    code, out, _ = run_cli(capsys, "data", "show", "-n", "1", *[f"--set={s}" for s in sets])
    assert code == 0 and "segment 1 (positions 0-" in out and "targets" in out


def tfds_sets(tmp_path):
    """A TFDS dataset prepared offline (ArrayRecord) from a builder defined here, not
    registered: the source reads the prepared folder without its code."""
    import tensorflow_datasets as tfds

    class JaxaccelTestReviews(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        name = "jaxaccel_test_reviews"
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
                "review": tfds.features.Text(),
                "stars": tfds.features.ClassLabel(names=["bad", "good"])}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(REVIEWS),
                    "test": self._generate_examples(REVIEWS[:8])}

        def _generate_examples(self, rows):
            for i, (text, label) in enumerate(rows):
                yield i, {"review": text, "stars": int(label == "pos")}

    folder = str(tmp_path / "tfds")
    JaxaccelTestReviews(data_dir=folder, file_format="array_record").download_and_prepare()
    return files_sets(tmp_path, "data.name=tfds", "data.dataset=jaxaccel_test_reviews",
                      f"data.data_dir={folder}", "data.text_field=review",
                      "data.label_field=stars")


def test_a_prepared_tfds_dataset_is_read_by_name(tmp_path):
    sets = tfds_sets(tmp_path)
    r = resolve(config.build(sets=sets))
    assert r.data.label_names == ("bad", "good") and r.steps_per_epoch == 24 // 8
    lines = datacmd.prepare(config.build(sets=sets))
    assert "train: 24 examples" in lines[1] and "bad 12, good 12" in lines[1], lines
    assert "test: 8 examples" in lines[3], lines


def hf_sets(tmp_path):
    """A Hugging Face DatasetDict of one split (ClassLabel labels) saved to disk."""
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["neg", "pos"])})
    rows = {"text": [t for t, _ in REVIEWS], "label": [int(y == "pos") for _, y in REVIEWS]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows, features=features)}
                         ).save_to_disk(str(tmp_path / "saved"))
    return files_sets(tmp_path, "data.name=hf", f"data.dataset={tmp_path / 'saved'}",
                      "data.holdout=0.25")


def test_a_hugging_face_dataset_saved_to_disk_is_read(tmp_path):
    sets = hf_sets(tmp_path)
    r = resolve(config.build(sets=sets))
    assert r.data.label_names == ("neg", "pos") and r.data.rows == 18
    lines = datacmd.prepare(config.build(sets=sets))
    assert "train: 18 examples" in lines[1] and "test: 6 examples" in lines[3], lines


def _wav(path, freq: float, seconds=0.3, rate=8000):
    from scipy.io import wavfile
    t = np.arange(int(seconds * rate)) / rate
    path.parent.mkdir(parents=True, exist_ok=True)
    wavfile.write(path, rate, (0.5 * np.sin(2 * np.pi * freq * t) * 32767).astype(np.int16))


def audio_sets(tmp_path, task="classification"):
    """Clips in a sub-folder a class (8 kHz, resampled to data.sample_rate) for the ViT; MAE
    reads one folder of them, unlabelled."""
    for i in range(12):
        _wav(tmp_path / "birds" / "low" / f"{i}.wav", 300 + 10 * i)
        _wav(tmp_path / "birds" / "high" / f"{i}.wav", 2000 + 10 * i)
    where = tmp_path / "birds" if task == "classification" else f"{tmp_path}/birds/low/*.wav"
    return files_sets(tmp_path, "data.name=audio", f"data.train_files={where}",
                      "data.holdout=0.25", "model.name=vit-tiny", f"model.task={task}")


def test_audio_folders_are_spectrograms_labelled_by_folder(tmp_path):
    sets = audio_sets(tmp_path)
    r = resolve(config.build(sets=sets))
    assert r.data.label_names == ("high", "low") and r.data.rows == 18
    x, labels = r.data.reader.examples("train")
    assert x.shape == (24, 40, 24) and abs(float(x.mean())) < 1e-5 and labels.sum() == 12
    lines = datacmd.prepare(config.build(sets=sets))
    assert "train: 18 examples of (40, 24)" in lines[1], lines
    mae = audio_sets(tmp_path / "mae", "mae")
    assert resolve(config.build(sets=mae)).data.label_names == ("low",)
    with pytest.raises(DataError, match="every clip is in the folder 'low', one class"):
        resolve(config.build(sets=mae + ["model.task=classification"]))


@pytest.mark.slow
@pytest.mark.parametrize("source", ["corpus", "tfds", "hf", "audio", "audio_mae"])
def test_each_source_trains_end_to_end(tmp_path, source):
    """Each source through the whole loop (the files classifier trains in the default suite,
    a corpus from the token cache in test_token_cache.py's resume test); the audio
    classifier's predict reads a recording."""
    sets = {"corpus": corpus_sets, "tfds": tfds_sets, "hf": hf_sets, "audio": audio_sets,
            "audio_mae": lambda p: audio_sets(p, "mae")}[source](tmp_path)
    result = loop.train(config.build(sets=sets))
    assert result["status"] == "completed", result
    assert np.isfinite(result["eval_loss"])
    if source == "audio":
        (label, _, facts), = Predictor(result["run_dir"])(
            [str(tmp_path / "birds" / "low" / "0.wav")])
        assert label in ("high", "low") and facts["channels"] == 1


def test_a_plan_on_data_not_on_this_machine_says_where_the_epoch_comes_from(tmp_path):
    """The planner resolves a run on files that are not here (the steps from a count the
    config gives, or from train.max_steps) and on files whose cache was prepared (its index);
    nothing is tokenized."""
    from jaxaccel.plan import abstract_run, topology
    target = topology.resolve("local")
    absent = config.build(sets=files_sets(tmp_path, "data.train_files=/nowhere/*.jsonl",
                                          "data.train_examples=800"))
    run = abstract_run(absent, target)
    assert run.resolved.steps_per_epoch == 100
    assert run.resolved.data.count_source == "data.train_examples=800"
    assert "matches no file" in run.resolved.data.absent
    train = reviews_jsonl(tmp_path / "train.jsonl")
    here = files_sets(tmp_path, f"data.train_files={train}", "data.holdout=0.25",
                      "model.name=minilm-l6")
    assert resolve(config.build(sets=here)).steps_per_epoch is None
    datacmd.prepare(config.build(sets=here))
    r = resolve(config.build(sets=here))
    assert r.steps_per_epoch == 18 // 8 and "the prepared cache " in r.data.count_source
