"""The fifth fault probe (issue 57), its run-side items: resumes and eval on changed or gone
training files, the token cache's folder (a full disk, a file in its place, its mode, a
same-size edit), TFDS names not found, what changed said plainly, and the README's audio
example; each driven through ``jaxaccel.cli.main([...])`` as the probe's user drove it (the
file-side items: test_probe5.py)."""
import errno
import json
import logging
import os
import re

import pytest

from jaxaccel import cli
from support import CONFIGS, cli_sets, own_data_sets, run_cli, write_rows, write_wav


# ---- item 8: a resume on changed training files says so, naming them ----

@pytest.mark.long
def test_a_resume_on_changed_training_files_names_them(tmp_path, capsys, caplog):
    """The resume notice listed config changes but not that the data changed."""
    train = write_rows(tmp_path / "train.jsonl")
    run = own_data_sets(tmp_path, f"data.train_files={train}", "data.holdout=0.2", "name=r")
    code, _, err = cli_sets(capsys, "train", *run)
    assert code == 0, err
    before = train.stat().st_size
    write_rows(train, 40)
    with caplog.at_level(logging.INFO, "jaxaccel"):
        code, _, err = cli_sets(capsys, "train", *run, "train.max_steps=3")
    assert code == 0, err
    assert f"resuming at step 2 on training data other than the run trained on: {train} " \
        f"changed (size {before} -> {train.stat().st_size} bytes)" in caplog.text, caplog.text
    # item 18: the mesh filled from -1 is no change a resume reports
    assert "resuming with config changes: train.max_steps: 2 -> 3\n" in caplog.text, caplog.text
    caplog.clear()
    os.utime(train, ns=(train.stat().st_atime_ns, train.stat().st_mtime_ns + 10 ** 9))
    with caplog.at_level(logging.INFO, "jaxaccel"):
        code, _, err = cli_sets(capsys, "train", *run, "train.max_steps=4")
    assert code == 0, err
    assert f"at step 3 on training data other than the run trained on: {train} changed " \
        "(same size, modified since)" in caplog.text, caplog.text


# ---- items 13, 15, 19: the token cache's folder, its space and its mode ----

def prepare_cli(capsys, tmp_path, *extra):
    return cli_sets(capsys, "data prepare", *own_data_sets(
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
    return cli_sets(capsys, "data show", *own_data_sets(tmp_path, "data.name=tfds",
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
    lm = own_data_sets(tmp_path, f"data.train_files={corpus}", "data.documents=paragraph",
              "data.holdout=0.1", "model.name=llama-cpu", "data.tokenizer_vocab=300",
              "data.max_len=32")
    assert cli_sets(capsys, "data prepare", *lm)[0] == 0
    before = corpus.stat().st_size
    corpus.write_text(corpus.read_text() + "\n\nA new paragraph about the weather at sea.")
    with caplog.at_level(logging.INFO, "jaxaccel"):
        code, _, err = cli_sets(capsys, "data prepare", *lm)
    assert code == 0, err
    assert f"rebuilding the token cache of files split 'train': {corpus} changed (size " \
        f"{before} -> {corpus.stat().st_size} bytes); the tokenizer differs too" in caplog.text


def test_a_text_field_of_another_type_is_named_with_its_article(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text('{"text": 7, "label": "a"}\n')
    code, _, err = cli_sets(capsys, "data prepare", *own_data_sets(
        tmp_path, f"data.train_files={tmp_path / 'a.jsonl'}", "data.holdout=0.2"))
    assert code == cli.EXIT_ERROR
    assert "a.jsonl:1: field 'text' holds an int, not text." in err, err


def test_a_float_key_set_to_nan_asks_for_a_finite_number(tmp_path, capsys):
    """It said ``got 'nan' of type str``."""
    code, _, err = cli_sets(capsys, "data show",
                            *own_data_sets(tmp_path, "train.learning_rate=nan"))
    assert code == cli.EXIT_ERROR
    assert "config key 'train.learning_rate' expects a finite number (default 0.001), got " \
        "nan." in err, err


# ---- item 9: a same-size edit with its modification time put back is seen ----

def test_a_same_size_edit_with_the_old_modification_time_rebuilds_the_cache(tmp_path, capsys,
                                                                            caplog):
    """The cache (keyed by path, size and modification time) served the old records."""
    path = write_rows(tmp_path / "a.jsonl")
    run = own_data_sets(tmp_path, f"data.train_files={path}", "data.holdout=0.2")
    assert cli_sets(capsys, "data prepare", *run)[0] == 0
    old = path.stat()
    path.write_text(path.read_text().replace("of the folder", "OF THE FOLDER"))
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert path.stat().st_size == old.st_size and path.stat().st_mtime_ns == old.st_mtime_ns
    with caplog.at_level(logging.INFO, "jaxaccel"):
        code, out, err = cli_sets(capsys, "data show -n 1", *run)
    assert code == 0, err
    assert f"{path} changed (same size, modified since)" in caplog.text, caplog.text


# ---- item 20: the README's audio example runs as written on a few dozen clips ----

@pytest.mark.long
def test_the_readme_audio_example_trains_on_a_few_dozen_clips(tmp_path, capsys, monkeypatch):
    """configs/audio_classifier.py shipped batches of 32: refused on a first small folder."""
    for split, n, shift in (("train", 12, 0), ("test", 3, 5)):
        for i in range(n):
            write_wav(tmp_path / "calls" / split / "low" / f"{i}.wav", 300 + 10 * i + shift)
            write_wav(tmp_path / "calls" / split / "high" / f"{i}.wav", 2000 + 10 * i + shift)
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
    run = own_data_sets(tmp_path, f"data.train_files={train}", f"data.eval_files={held}", "name=r")
    code, _, err = cli_sets(capsys, "train", *run)
    assert code == 0, err
    train.unlink()
    code, out, err = run_cli(capsys, "eval", "--checkpoint", str(tmp_path / "r"))
    assert code == 0, err
    assert json.loads(out)["examples"] == 8, out
    code, out, err = cli_sets(capsys, "train", *run, "name=again")     # training needs them
    assert code == cli.EXIT_ERROR and out == ""
    assert f"error: data.train_files={str(train)!r} matches no file" in err, err
