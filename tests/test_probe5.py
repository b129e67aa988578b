"""The fifth fault probe (issue 57), on the own-data side: each item driven as the probe's user
drove it, through ``jaxaccel.cli.main([...])`` on the tiny BERT reading ``data.name=files``
(or ``audio``) from folders written here."""
import contextlib
import errno
import json
import logging
import os
import re
import signal

import numpy as np
import pytest

from jaxaccel import cli
from support import CONFIGS, run_cli


def write_rows(path, n=30, text="text", label="label"):
    """``n`` JSONL records of two classes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({text: f"row {i} of the folder", label: "ab"[i % 2]})
                            + "\n" for i in range(n)))
    return path


def sets(tmp_path, *extra):
    """The tiny classifier on ``data.name=files`` (its cache and runs in ``tmp_path``)."""
    return [f"workdir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}", "model.name=tiny",
            "data.name=files", "train.batch_size=8", "train.eval_batch_size=8",
            "train.max_steps=2", "train.progress=false", "train.learning_rate=1e-3", *extra]


def jaxaccel(capsys, command, *argv_sets):
    """``jaxaccel <command> --set ...``: (exit status, stdout, stderr)."""
    return run_cli(capsys, *command.split(), *(f"--set={s}" for s in argv_sets))


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


def _wav(path, freq, rate=8000):
    from scipy.io import wavfile
    t = np.arange(int(0.3 * rate)) / rate
    path.parent.mkdir(parents=True, exist_ok=True)
    wavfile.write(path, rate, (0.5 * np.sin(2 * np.pi * freq * t) * 32767).astype(np.int16))


def audio_sets(tmp_path, root, *extra):
    return sets(tmp_path, "data.name=audio", f"data.train_files={root}", "model.name=vit-tiny",
                *extra)


# ---- items 1, 2: links to a folder above are searched once, a file reached twice read once ----

def test_a_folder_holding_two_links_to_itself_is_searched_once(tmp_path, capsys):
    """Two links to ``.`` made the recursive glob walk 2**40 paths: no answer for minutes."""
    write_rows(tmp_path / "L" / "a.jsonl")
    os.symlink(".", tmp_path / "L" / "s1")
    os.symlink(".", tmp_path / "L" / "s2")
    with within(60):
        code, out, err = jaxaccel(capsys, "data prepare", *sets(
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
    code, out, err = jaxaccel(capsys, "data prepare", *sets(
        tmp_path, f"data.train_files={glob_.format(L=L)}", "data.holdout=0.2"))
    assert code == 0, err
    assert "train: 24 examples" in out and "test: 6 examples" in out, out


def test_a_linked_audio_folder_puts_no_clip_in_both_splits(tmp_path, capsys):
    """12 clips became 492, and data.holdout put copies of one clip in train and test."""
    for i in range(6):
        _wav(tmp_path / "calls" / "low" / f"{i}.wav", 300 + 10 * i)
        _wav(tmp_path / "calls" / "high" / f"{i}.wav", 2000 + 10 * i)
    os.symlink(".", tmp_path / "calls" / "self")
    code, out, err = jaxaccel(capsys, "data prepare", *audio_sets(
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
    code, out, err = jaxaccel(capsys, "train", *sets(
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
    code, _, err = jaxaccel(capsys, "train", *sets(
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
                _wav(tmp_path / "nested" / kind / f"day{day}" / f"{i}.wav", base + 10 * i + day)
    code, out, err = jaxaccel(capsys, "data prepare", *audio_sets(
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
    code, out, err = jaxaccel(capsys, "data prepare", *sets(
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
    code, out, err = jaxaccel(capsys, "data prepare", *sets(
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
    code, out, err = jaxaccel(capsys, "data prepare", *sets(
        tmp_path, f"data.train_files={where}", "data.holdout=0.2"))
    assert code == 0, err
    assert "train: 24 examples" in out and "labels: a 1" in out, out


def test_a_gzipped_file_without_a_format_extension_is_read_as_data_format_says(tmp_path,
                                                                              capsys):
    """``a.gz`` with data.format=jsonl: "not a JSON object (... not valid UTF-8 ...)"."""
    where = _compress(write_rows(tmp_path / "a"), ".gz")
    code, out, err = jaxaccel(capsys, "data prepare", *sets(
        tmp_path, f"data.train_files={where}", "data.holdout=0.2", "data.format=jsonl"))
    assert code == 0, err
    assert "train: 24 examples" in out, out


@pytest.mark.parametrize("fmt", ["auto", "jsonl"])
def test_a_compression_without_a_reader_is_refused_by_name(tmp_path, capsys, fmt):
    (tmp_path / "a.jsonl.zst").write_bytes(b"(\xb5/\xfd" + b"\0" * 20)
    code, out, err = jaxaccel(capsys, "data prepare", *sets(
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
    code, out, err = jaxaccel(capsys, "data prepare", *sets(
        tmp_path, f"data.train_files={path}", "data.holdout=0.2", "data.format=csv"))
    assert code == cli.EXIT_ERROR and out == ""
    assert f"error: {tmp_path}/{says}" in err, err


def test_a_label_field_that_is_the_text_field_is_refused(tmp_path, capsys):
    """It got "set model.num_labels=30" (each of the 30 texts a class)."""
    code, out, err = jaxaccel(capsys, "data prepare", *sets(
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
        code, out, err = jaxaccel(capsys, "data prepare", *sets(
            tmp_path, f"data.train_files={train}", f"data.eval_files={held}",
            "data.holdout=0.2"))
    assert code == 0, err
    assert "train: 30 examples" in out and "test: 10 examples" in out, out
    assert "data.holdout=0.2 is ignored: the eval split 'test' is the source's own " \
        "(data.eval_files); drop data.holdout, or that eval split" in caplog.text


# ---- item 8: a resume on changed training files says so, naming them ----

def test_a_resume_on_changed_training_files_names_them(tmp_path, capsys, caplog):
    """The resume notice listed config changes but not that the data changed."""
    train = write_rows(tmp_path / "train.jsonl")
    run = sets(tmp_path, f"data.train_files={train}", "data.holdout=0.2", "name=r")
    code, _, err = jaxaccel(capsys, "train", *run)
    assert code == 0, err
    before = train.stat().st_size
    write_rows(train, 40)
    with caplog.at_level(logging.INFO, "jaxaccel"):
        code, _, err = jaxaccel(capsys, "train", *run, "train.max_steps=3")
    assert code == 0, err
    assert f"resuming at step 2 on training data other than the run trained on: {train} " \
        f"changed (size {before} -> {train.stat().st_size} bytes)" in caplog.text, caplog.text
    # item 18: the mesh filled from -1 is no change a resume reports
    assert "resuming with config changes: train.max_steps: 2 -> 3\n" in caplog.text, caplog.text
    caplog.clear()
    os.utime(train, ns=(train.stat().st_atime_ns, train.stat().st_mtime_ns + 10 ** 9))
    with caplog.at_level(logging.INFO, "jaxaccel"):
        code, _, err = jaxaccel(capsys, "train", *run, "train.max_steps=4")
    assert code == 0, err
    assert f"at step 3 on training data other than the run trained on: {train} changed " \
        "(same size, modified since)" in caplog.text, caplog.text


# ---- item 6: a save_to_disk Arrow shard keeps its ClassLabel names ----

def test_an_arrow_shard_keeps_its_class_label_names(tmp_path, capsys):
    """predict answered "0"/"1": the names are in the shard's schema metadata."""
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["neg", "pos"])})
    rows = {"text": [f"review {i}" for i in range(30)], "label": [i % 2 for i in range(30)]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "saved"))
    shard = next((tmp_path / "saved").glob("*.arrow"))
    code, _, err = jaxaccel(capsys, "train", *sets(
        tmp_path, f"data.train_files={shard}", "data.holdout=0.2", "name=r"))
    assert code == 0, err
    code, out, err = run_cli(capsys, "predict", "--checkpoint", str(tmp_path / "r"), "review 3")
    assert code == 0, err
    assert json.loads(out.splitlines()[0])["label"] in ("neg", "pos"), out


# ---- items 13, 15, 19: the token cache's folder, its space and its mode ----

def prepare_cli(capsys, tmp_path, *extra):
    return jaxaccel(capsys, "data prepare", *sets(
        tmp_path, f"data.train_files={write_rows(tmp_path / 'a.jsonl')}", "data.holdout=0.2",
        *extra))


def test_a_full_disk_during_a_cache_build_names_the_folder_and_the_space(tmp_path, capsys,
                                                                         monkeypatch):
    """It was ``error: [Errno 28] No space left on device``."""
    from jaxaccel.data import tokencache

    def full(self, part):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(tokencache.Writer, "add", full)
    code, out, err = prepare_cli(capsys, tmp_path)
    assert code == cli.EXIT_ERROR and out == ""
    assert re.search(rf"error: no space left on the device of data.cache_dir "
                     rf"'{tmp_path}/cache' while building the token cache of files train "
                     rf"\([0-9,.]+ MB free; it needs up to about 0.0 MB, the source's size\); "
                     "nothing was kept. Free space there, or set data.cache_dir", err), err
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]


def test_a_cache_dir_that_is_a_file_is_called_a_file(tmp_path, capsys):
    """It was reported as "not writable"."""
    (tmp_path / "cache").write_text("")
    code, out, err = prepare_cli(capsys, tmp_path)
    assert code == cli.EXIT_ERROR and out == ""
    assert f"error: data.cache_dir '{tmp_path}/cache': {tmp_path}/cache is a file, not a " \
        "folder; set data.cache_dir to a folder" in err, err


def test_a_cache_folder_takes_the_umasks_mode(tmp_path, capsys):
    """``mkdtemp`` made it 0700: a cache shared by a team was unreadable to the others."""
    old = os.umask(0o022)
    try:
        code, _, err = prepare_cli(capsys, tmp_path)
    finally:
        os.umask(old)
    assert code == 0, err
    folders = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert folders and {oct(p.stat().st_mode & 0o777) for p in folders} == {"0o755"}


# ---- item 14: a TFDS name or data_dir not found, in a line, with close matches ----

def tfds_cli(capsys, tmp_path, dataset, data_dir):
    return jaxaccel(capsys, "data show", *sets(tmp_path, "data.name=tfds",
                                               f"data.dataset={dataset}",
                                               f"data.data_dir={data_dir}"))


def test_a_tfds_name_not_found_is_one_line_with_close_matches(tmp_path, capsys):
    """It printed TFDS's whole catalogue (262 lines), and no close match."""
    (tmp_path / "tfds" / "my_reviews" / "1.0.0").mkdir(parents=True)
    code, out, err = tfds_cli(capsys, tmp_path, "imdb_reviewz", tmp_path / "tfds")
    assert code == cli.EXIT_ERROR and out == ""
    line = next(x for x in err.splitlines() if x.startswith("error: "))
    assert "data.dataset='imdb_reviewz': no TFDS dataset of that name in data_dir " in line
    assert "; prepared there: my_reviews. Did you mean 'imdb_reviews' or 'my_reviews'? Prepare " \
        "it there first" in line, line
    assert len(err) < 1000, err
    code, _, err = tfds_cli(capsys, tmp_path, "my_review", tmp_path / "tfds")
    assert code == cli.EXIT_ERROR and "Did you mean 'my_reviews' or" in err, err


def test_a_tfds_data_dir_that_does_not_exist_is_called_missing(tmp_path, capsys):
    code, out, err = tfds_cli(capsys, tmp_path, "imdb_reviews", tmp_path / "nowhere")
    assert code == cli.EXIT_ERROR and out == ""
    assert f"error: data.data_dir='{tmp_path}/nowhere' does not exist (from " in err, err


# ---- item 18: what changed, said plainly ----

def test_an_edited_corpus_is_named_before_its_tokenizer(tmp_path, capsys, caplog):
    """A corpus trained its own BPE, so an edit was reported as "built by another tokenizer"
    without naming the file."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Paragraph {i}: the river ran past the mill." * 3
                                   for i in range(60)))
    lm = sets(tmp_path, f"data.train_files={corpus}", "data.documents=paragraph",
              "data.holdout=0.1", "model.name=llama-cpu", "data.tokenizer_vocab=300",
              "data.max_len=32")
    assert jaxaccel(capsys, "data prepare", *lm)[0] == 0
    before = corpus.stat().st_size
    corpus.write_text(corpus.read_text() + "\n\nA new paragraph about the weather at sea.")
    with caplog.at_level(logging.INFO, "jaxaccel"):
        code, _, err = jaxaccel(capsys, "data prepare", *lm)
    assert code == 0, err
    assert f"rebuilding the token cache of files split 'train': {corpus} changed (size " \
        f"{before} -> {corpus.stat().st_size} bytes); the tokenizer differs too" in caplog.text


def test_a_text_field_of_another_type_is_named_with_its_article(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text('{"text": 7, "label": "a"}\n')
    code, _, err = jaxaccel(capsys, "data prepare", *sets(
        tmp_path, f"data.train_files={tmp_path / 'a.jsonl'}", "data.holdout=0.2"))
    assert code == cli.EXIT_ERROR
    assert "a.jsonl:1: field 'text' holds an int, not text." in err, err


def test_a_float_key_set_to_nan_asks_for_a_finite_number(tmp_path, capsys):
    """It said ``got 'nan' of type str``."""
    code, _, err = jaxaccel(capsys, "data show", *sets(tmp_path, "train.learning_rate=nan"))
    assert code == cli.EXIT_ERROR
    assert "config key 'train.learning_rate' expects a finite number (default 0.001), got " \
        "nan." in err, err


# ---- item 9: a same-size edit with its modification time put back is seen ----

def test_a_same_size_edit_with_the_old_modification_time_rebuilds_the_cache(tmp_path, capsys,
                                                                            caplog):
    """The cache (keyed by path, size and modification time) served the old records."""
    path = write_rows(tmp_path / "a.jsonl")
    run = sets(tmp_path, f"data.train_files={path}", "data.holdout=0.2")
    assert jaxaccel(capsys, "data prepare", *run)[0] == 0
    old = path.stat()
    path.write_text(path.read_text().replace("of the folder", "OF THE FOLDER"))
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert path.stat().st_size == old.st_size and path.stat().st_mtime_ns == old.st_mtime_ns
    with caplog.at_level(logging.INFO, "jaxaccel"):
        code, out, err = jaxaccel(capsys, "data show -n 1", *run)
    assert code == 0, err
    assert f"{path} changed (same size, modified since)" in caplog.text, caplog.text


# ---- item 20: the README's audio example runs as written on a few dozen clips ----

def test_the_readme_audio_example_trains_on_a_few_dozen_clips(tmp_path, capsys, monkeypatch):
    """configs/audio_classifier.py shipped batches of 32: refused on a first small folder."""
    for split, n, shift in (("train", 12, 0), ("test", 3, 5)):
        for i in range(n):
            _wav(tmp_path / "calls" / split / "low" / f"{i}.wav", 300 + 10 * i + shift)
            _wav(tmp_path / "calls" / split / "high" / f"{i}.wav", 2000 + 10 * i + shift)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(
        capsys, "train", "--config", os.path.join(CONFIGS, "audio_classifier.py"),
        "--set", "data.train_files=calls/train", "--set", "data.eval_files=calls/test",
        "--set", f"workdir={tmp_path / 'runs'}", "--set", "train.epochs=1",
        "--set", "train.progress=false")
    assert code == 0, err
    assert '"status": "completed"' in out, out


# ---- item 16: eval of a run whose training files are gone reads its eval files ----

def test_eval_of_a_run_whose_training_files_are_gone_reads_its_eval_files(tmp_path, capsys):
    """It stopped on ``data.train_files=... matches no file``, where it reads the eval file."""
    train = write_rows(tmp_path / "train.jsonl")
    held = write_rows(tmp_path / "test.jsonl", 8)
    held.write_text(held.read_text().replace("of the folder", "held out"))
    run = sets(tmp_path, f"data.train_files={train}", f"data.eval_files={held}", "name=r")
    code, _, err = jaxaccel(capsys, "train", *run)
    assert code == 0, err
    train.unlink()
    code, out, err = run_cli(capsys, "eval", "--checkpoint", str(tmp_path / "r"))
    assert code == 0, err
    assert json.loads(out)["examples"] == 8, out
    code, out, err = jaxaccel(capsys, "train", *run, "name=again")     # training needs them
    assert code == cli.EXIT_ERROR and out == ""
    assert f"error: data.train_files={str(train)!r} matches no file" in err, err
