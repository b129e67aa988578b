"""The fifth fault probe (issue 57), on the own-data side: each item driven as the probe's user
drove it, through ``jaxaccel.cli.main([...])`` on the tiny BERT reading ``data.name=files``
(or ``audio``) from folders written here: links, leaks, class folders, formats and
compression. The run-side items (resumes, eval, the token cache's folder, TFDS names, the
README's audio example) are in test_probe5_runs.py."""
import contextlib
import json
import logging
import os
import re
import signal

import pytest

from jaxaccel import cli
from support import cli_sets, own_data_sets, run_cli, write_rows, write_wav


@contextlib.contextmanager
def within(seconds):
    """A ``TimeoutError`` in this thread where the block runs past ``seconds``."""
    def fire(*_):
        raise TimeoutError(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def audio_sets(tmp_path, root, *extra):
    return own_data_sets(tmp_path, "data.name=audio", f"data.train_files={root}",
                         "model.name=vit-tiny", *extra)


# ---- items 1, 2: links to a folder above are searched once, a file reached twice read once ----

def test_a_folder_holding_two_links_to_itself_is_searched_once(tmp_path, capsys):
    """Two links to ``.`` made the recursive glob walk 2**40 paths: no answer for minutes."""
    write_rows(tmp_path / "L" / "a.jsonl")
    os.symlink(".", tmp_path / "L" / "s1")
    os.symlink(".", tmp_path / "L" / "s2")
    with within(60):
        code, out, err = cli_sets(capsys, "data prepare", *own_data_sets(
            tmp_path, f"data.train_files={tmp_path / 'L'}", "data.holdout=0.2"))
    assert code == 0, err
    assert "train: 24 examples" in out and "test: 6 examples" in out, out


@pytest.mark.parametrize("glob_", ["{L}", "{L}/**/*.jsonl", "{L}/*/*.jsonl,{L}/*.jsonl"])
def test_a_link_to_its_own_folder_does_not_multiply_the_data(tmp_path, capsys, glob_):
    """One link to ``.`` beside a 30-record file cached 1,230 documents (41 copies)."""
    L = tmp_path / "L1"
    write_rows(L / "a.jsonl")
    os.symlink(".", L / "self")
    os.symlink(L / "a.jsonl", L / "b.jsonl")           # a link to a file: the same file
    code, out, err = cli_sets(capsys, "data prepare", *own_data_sets(
        tmp_path, f"data.train_files={glob_.format(L=L)}", "data.holdout=0.2"))
    assert code == 0, err
    assert "train: 24 examples" in out and "test: 6 examples" in out, out


def test_a_linked_audio_folder_puts_no_clip_in_both_splits(tmp_path, capsys):
    """12 clips became 492, and data.holdout put copies of one clip in train and test."""
    for i in range(6):
        write_wav(tmp_path / "calls" / "low" / f"{i}.wav", 300 + 10 * i)
        write_wav(tmp_path / "calls" / "high" / f"{i}.wav", 2000 + 10 * i)
    os.symlink(".", tmp_path / "calls" / "self")
    code, out, err = cli_sets(capsys, "data prepare", *audio_sets(
        tmp_path, tmp_path / "calls", "data.holdout=0.25"))
    assert code == 0, err
    assert "train: 9 examples" in out and "test: 3 examples" in out, out


# ---- item 3: an eval file that is a training file is refused, named ----

LEAK = "eval file(s) also in data.train_files (by real path or identical bytes)"


@pytest.mark.parametrize("eval_files", ["{d}/train.jsonl", "{d}/*.jsonl", "{d}/link.jsonl",
                                        "{d}/copy.jsonl"])
def test_an_eval_file_that_is_a_training_file_is_refused(tmp_path, capsys, eval_files):
    """eval_files equal to train_files (or matched by the train glob, or a link to one, or a
    byte-identical copy) trained and reported a test accuracy, exit 0."""
    d = tmp_path / "d"
    write_rows(d / "train.jsonl")
    os.symlink(d / "train.jsonl", tmp_path / "link.jsonl")
    (tmp_path / "copy.jsonl").write_bytes((d / "train.jsonl").read_bytes())
    where = tmp_path if "link" in eval_files or "copy" in eval_files else d
    code, out, err = cli_sets(capsys, "train", *own_data_sets(
        tmp_path, f"data.train_files={d}/*.jsonl",
        f"data.eval_files={eval_files.format(d=where)}"))
    assert code == cli.EXIT_ERROR and out == ""
    assert f"error: data.eval_files: {where}/" in err and LEAK in err, err


def test_eval_of_a_run_on_one_of_its_training_files_is_refused(tmp_path, capsys):
    """``jaxaccel eval --checkpoint RUN --set data.eval_files=<a training file>`` scored
    training rows, exit 0."""
    train = write_rows(tmp_path / "d" / "train.jsonl")
    held = write_rows(tmp_path / "held.jsonl", 8, "text", "label")
    held.write_text(held.read_text().replace("of the folder", "held out"))
    code, _, err = cli_sets(capsys, "train", *own_data_sets(
        tmp_path, f"data.train_files={train}", f"data.eval_files={held}", "name=r"))
    assert code == 0, err
    code, out, err = run_cli(capsys, "eval", "--checkpoint", str(tmp_path / "r"),
                             "--set", f"data.eval_files={train}")
    assert code == cli.EXIT_ERROR and out == ""
    assert f"error: data.eval_files: {train}: 1 {LEAK}" in err, err


# ---- item 4: the class is the first folder level under the root ----

def test_nested_audio_class_folders_are_classed_by_their_first_level(tmp_path, capsys):
    """nested/{bird,frog}/day{0,1}/*.wav trained a day0/day1 classifier."""
    for kind, base in (("bird", 2000), ("frog", 300)):
        for day in (0, 1):
            for i in range(3):
                write_wav(tmp_path / "nested" / kind / f"day{day}" / f"{i}.wav",
                          base + 10 * i + day)
    code, out, err = cli_sets(capsys, "data prepare", *audio_sets(
        tmp_path, tmp_path / "nested", "data.holdout=0.25", "model.task=classification"))
    assert code == 0, err
    assert "labels: bird " in out and "frog " in out and "day0" not in out, out


@pytest.mark.parametrize("glob_", ["{r}", "{r}/*/*/*.txt", "{r}/**/*.txt"])
def test_nested_text_class_folders_are_classed_by_their_first_level(tmp_path, capsys, glob_):
    """Plain-text files under {pos,neg}/{a,b}/ trained an a/b classifier."""
    root = tmp_path / "reviews"
    for label in ("pos", "neg"):
        for sub in ("a", "b"):
            for i in range(3):
                (root / label / sub).mkdir(parents=True, exist_ok=True)
                (root / label / sub / f"{i}.txt").write_text(f"{label} review {sub}{i}")
    code, out, err = cli_sets(capsys, "data prepare", *own_data_sets(
        tmp_path, f"data.train_files={glob_.format(r=root)}", "data.holdout=0.25"))
    assert code == 0, err
    assert re.findall(r"labels: (\w+) \d+, (\w+) \d+;", out) == [("neg", "pos")] * 2, out


# ---- item 10: a UTF-8 byte order mark is not part of the first field's name ----

@pytest.mark.parametrize("name,content", [
    ("r.csv", "review,sentiment\n" + "a fine film,pos\na dull film,neg\n" * 10),
    ("r.jsonl", "".join(json.dumps({"review": f"film {i}", "sentiment": "ab"[i % 2]}) + "\n"
                        for i in range(20)))])
def test_a_utf8_byte_order_mark_is_stripped(tmp_path, capsys, name, content):
    """Excel's "CSV UTF-8" got ``no field 'review' (fields: review, sentiment)``."""
    (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + content.encode())
    code, out, err = cli_sets(capsys, "data prepare", *own_data_sets(
        tmp_path, f"data.train_files={tmp_path / name}", "data.holdout=0.2",
        "data.text_field=review", "data.label_field=sentiment"))
    assert code == 0, err
    assert "train: 16 examples" in out, out


# ---- item 11: compressed JSONL, CSV and text are read; others refused by name ----

def _compress(path, ext):
    import bz2
    import gzip
    import lzma
    module = {".gz": gzip, ".bz2": bz2, ".xz": lzma}[ext]
    packed = path.with_name(path.name + ext)
    packed.write_bytes(module.compress(path.read_bytes()))
    path.unlink()
    return packed


@pytest.mark.parametrize("ext", [".gz", ".bz2", ".xz"])
@pytest.mark.parametrize("fmt", ["jsonl", "csv", "text"])
def test_compressed_files_are_read(tmp_path, capsys, ext, fmt):
    """Gzipped JSONL: "cannot tell its format by the extension '.gz'", then "not valid UTF-8"
    with data.format=jsonl."""
    if fmt == "jsonl":
        where = _compress(write_rows(tmp_path / "d" / "a.jsonl"), ext)
    elif fmt == "csv":
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "a.csv").write_text("text,label\n" + "".join(
            f'"row {i}, quoted",{"ab"[i % 2]}\n' for i in range(30)))
        where = _compress(tmp_path / "d" / "a.csv", ext)
    else:
        for i in range(30):
            path = tmp_path / "d" / "ab"[i % 2] / f"{i}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"row {i}")
            _compress(path, ext)
        where = tmp_path / "d"
    code, out, err = cli_sets(capsys, "data prepare", *own_data_sets(
        tmp_path, f"data.train_files={where}", "data.holdout=0.2"))
    assert code == 0, err
    assert "train: 24 examples" in out and "labels: a 1" in out, out


def test_a_gzipped_file_without_a_format_extension_is_read_as_data_format_says(tmp_path,
                                                                              capsys):
    """``a.gz`` with data.format=jsonl: "not a JSON object (... not valid UTF-8 ...)"."""
    where = _compress(write_rows(tmp_path / "a"), ".gz")
    code, out, err = cli_sets(capsys, "data prepare", *own_data_sets(
        tmp_path, f"data.train_files={where}", "data.holdout=0.2", "data.format=jsonl"))
    assert code == 0, err
    assert "train: 24 examples" in out, out


@pytest.mark.parametrize("fmt", ["auto", "jsonl"])
def test_a_compression_without_a_reader_is_refused_by_name(tmp_path, capsys, fmt):
    (tmp_path / "a.jsonl.zst").write_bytes(b"(\xb5/\xfd" + b"\0" * 20)
    code, out, err = cli_sets(capsys, "data prepare", *own_data_sets(
        tmp_path, f"data.train_files={tmp_path / 'a.jsonl.zst'}", "data.holdout=0.2",
        f"data.format={fmt}"))
    assert code == cli.EXIT_ERROR and out == ""
    assert f"error: {tmp_path / 'a.jsonl.zst'}: compressed with Zstandard (.zst), which " \
        "data.name=files does not read (it reads .gz, .bz2, .xz); decompress it, or " \
        "recompress it with gzip." in err, err


# ---- items 5, 12: a CSV header that is JSON, or names a field twice; label = text ----

@pytest.mark.parametrize("header,says", [
    (None, "a.csv:1: starts '{\"text\": \"row 0 of the folder\"', a JSON line, not a CSV "
           "header row; set data.format=jsonl (or auto: by the extension)."),
    ("text,label,text", "a.csv:1: the header row names 'text' more than once; give each "
                        "column its own name.")])
def test_a_csv_header_that_cannot_name_the_fields_is_refused(tmp_path, capsys, header, says):
    """data.format=csv on JSONL was a field-name problem; a field named twice kept the last
    column of that name without a word."""
    path = write_rows(tmp_path / "a.csv")
    if header is not None:
        path.write_text(header + "\n" + "a,b,c\n" * 10)
    code, out, err = cli_sets(capsys, "data prepare", *own_data_sets(
        tmp_path, f"data.train_files={path}", "data.holdout=0.2", "data.format=csv"))
    assert code == cli.EXIT_ERROR and out == ""
    assert f"error: {tmp_path}/{says}" in err, err


def test_a_label_field_that_is_the_text_field_is_refused(tmp_path, capsys):
    """It got "set model.num_labels=30" (each of the 30 texts a class)."""
    code, out, err = cli_sets(capsys, "data prepare", *own_data_sets(
        tmp_path, f"data.train_files={write_rows(tmp_path / 'a.jsonl')}", "data.holdout=0.2",
        "data.label_field=text"))
    assert code == cli.EXIT_ERROR and out == ""
    assert "error: data.label_field='text' is data.text_field too: each text would be its own " \
        "class; set data.label_field to the field holding the label" in err, err


# ---- item 7: data.holdout beside an eval split of the source's own is named ----

def test_a_holdout_beside_eval_files_is_noted(tmp_path, capsys, caplog):
    """It was dropped without a word."""
    train = write_rows(tmp_path / "train.jsonl")
    held = write_rows(tmp_path / "test.jsonl", 10, "text", "label")
    held.write_text(held.read_text().replace("of the folder", "held out"))
    with caplog.at_level(logging.WARNING, "jaxaccel"):
        code, out, err = cli_sets(capsys, "data prepare", *own_data_sets(
            tmp_path, f"data.train_files={train}", f"data.eval_files={held}",
            "data.holdout=0.2"))
    assert code == 0, err
    assert "train: 30 examples" in out and "test: 10 examples" in out, out
    assert "data.holdout=0.2 is ignored: the eval split 'test' is the source's own " \
        "(data.eval_files); drop data.holdout, or that eval split" in caplog.text


# ---- item 6: a save_to_disk Arrow shard keeps its ClassLabel names ----

def test_an_arrow_shard_keeps_its_class_label_names(tmp_path, capsys):
    """predict answered "0"/"1": the names are in the shard's schema metadata."""
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["neg", "pos"])})
    rows = {"text": [f"review {i}" for i in range(30)], "label": [i % 2 for i in range(30)]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "saved"))
    shard = next((tmp_path / "saved").glob("*.arrow"))
    code, _, err = cli_sets(capsys, "train", *own_data_sets(
        tmp_path, f"data.train_files={shard}", "data.holdout=0.2", "name=r"))
    assert code == 0, err
    code, out, err = run_cli(capsys, "predict", "--checkpoint", str(tmp_path / "r"), "review 3")
    assert code == 0, err
    assert json.loads(out.splitlines()[0])["label"] in ("neg", "pos"), out


def test_a_document_file_copied_into_the_eval_folder_is_warned_of(tmp_path, capsys, caplog):
    """A text file (or clip) is one example: a byte-identical one in both splits is a
    duplicate in the data, named, where a copied data file is refused."""
    for split in ("train", "test"):
        for label in ("pos", "neg"):
            for i in range(4):
                path = tmp_path / split / label / f"{i}.txt"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(f"{label} {split} review {i}" if i else f"{label} the same")
    with caplog.at_level(logging.WARNING, "jaxaccel"):
        code, out, err = cli_sets(capsys, "data prepare", *own_data_sets(
            tmp_path, f"data.train_files={tmp_path / 'train'}",
            f"data.eval_files={tmp_path / 'test'}"))
    assert code == 0, err
    assert "data.eval_files: 2 eval file(s) hold the bytes of training files " \
        f"({tmp_path}/test/neg/0.txt (a copy of {tmp_path}/train/neg/0.txt);" in caplog.text
