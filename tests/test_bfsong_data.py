"""Bengalese finch syllables (jaxaccel.data.bfsong): the checked evfuncs sdist, the TFDS
ArrayRecord build (no TensorFlow), the split and class counts, and the log-mel spectrogram
against transformers' independent implementation and by hand.

The build needs PyPI once per session (pip downloads the 56 MB evfuncs sdist); without it
the tests that read the data skip and say why.
"""

import hashlib

import numpy as np
import pytest

from jaxaccel.data import bfsong

SR, N_FFT, HOP, N_MELS, FMIN, FMAX = (bfsong.SAMPLE_RATE, bfsong.N_FFT, bfsong.HOP,
                                      bfsong.N_MELS, bfsong.FMIN, bfsong.FMAX)


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    try:
        return bfsong.pip_download(bfsong.SDIST_REQUIREMENT, bfsong.SDIST_NAME,
                                   bfsong.SDIST_SHA256, bfsong.SOURCE_ENV,
                                   str(tmp_path_factory.mktemp("evfuncs")))
    except RuntimeError as e:
        pytest.skip(f"pip could not download {bfsong.SDIST_REQUIREMENT} from PyPI: "
                    f"{str(e)[-300:]}")


@pytest.fixture(scope="module")
def files(sdist):
    return bfsong.fetch_files(sdist)


@pytest.fixture(scope="module")
def bf_dir(tmp_path_factory, sdist):
    data_dir = str(tmp_path_factory.mktemp("tfds_bfsong"))
    bfsong.prepare(data_dir, source=sdist)
    return data_dir


def test_bad_sources_are_refused_before_anything_is_written(tmp_path):
    bogus = tmp_path / bfsong.SDIST_NAME
    bogus.write_bytes(b"not the sdist")
    digest = hashlib.sha256(b"not the sdist").hexdigest()
    with pytest.raises(ValueError, match=f"Checksum mismatch for {bogus}: sha256 {digest}; "
                                         f"expected {bfsong.SDIST_SHA256} \\(evfuncs-0.3.3"):
        bfsong.prepare(str(tmp_path / "tfds"), source=bogus)
    assert not (tmp_path / "tfds").exists()
    empty = tmp_path / "empty.tar.gz"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty \\(0 bytes\\).*JAXACCEL_BFSONG_SOURCE"):
        bfsong.fetch_files(empty)
    folder = tmp_path / "songs"
    folder.mkdir()
    for name in bfsong.FILES:
        (folder / name).write_bytes(b"x")
    with pytest.raises(ValueError, match="Checksum mismatch.*"
                                         "gy6or6_baseline_230312_0808.138.cbin of evfuncs"):
        bfsong.fetch_files(folder)


def test_syllables_of_the_source(files):
    assert set(files) == set(bfsong.FILES)
    syllables = bfsong.all_syllables(files)
    assert len(syllables) == 601
    song, index, onset, label, clip = syllables[0]
    # first syllable of the first song: .not.mat onset 1277.78125 ms, offset 1351.21875 ms
    assert (song, index, label) == ("gy6or6_baseline_230312_0808.138", 0, "i")
    assert onset == round(1277.78125 * 32) == 40889
    assert clip.dtype == np.int16 and len(clip) == round(1351.21875 * 32) - 40889 == 2350
    raw = np.frombuffer(files[song + ".cbin"], ">i2")    # channels interleaved, mic first
    np.testing.assert_array_equal(clip, raw[2 * onset:2 * (onset + len(clip)):2])
    lengths = [len(s[-1]) for s in syllables]
    assert (min(lengths), max(lengths)) == (871, 3784)   # 27 ms to 118 ms
    assert "".join(s[3] for s in syllables if s[0] == bfsong.SONGS[-1]) == (
        "iiiiiiiiiiabcdeefghjkiabcdeefghjkiabcdeef")


def test_splits_counts_and_shapes(bf_dir, files):
    data = bfsong.load(bf_dir)
    for split, n in (("train", 450), ("test", 151)):
        x, y = data[split]
        assert x.shape == (n, bfsong.FRAMES, N_MELS) and x.dtype == np.float32
        assert y.shape == (n,) and y.dtype == np.int32
        assert tuple(np.bincount(y, minlength=11)) == bfsong.SPLIT_COUNTS[split]
        assert np.isfinite(x).all() and x.min() == np.float32(np.log(bfsong.LOG_EPS))
    builder = bfsong.prepare(bf_dir)
    songs = {s: {r["song"].decode() for r in builder.as_data_source(s)} for s in ("train", "test")}
    assert songs["test"] == set(bfsong.TEST_SONGS)
    assert songs["train"] == set(bfsong.SONGS) - set(bfsong.TEST_SONGS)
    # the stored clips are the source's, in recording order, labels as annotated
    clips, labels = bfsong.read_clips(builder, "test")
    expected = [s for s in bfsong.all_syllables(files) if s[0] in bfsong.TEST_SONGS]
    assert all(np.array_equal(c, s[-1]) for c, s in zip(clips, expected))
    assert [bfsong.LABEL_NAMES[i] for i in labels] == [s[3] for s in expected]
    # one test clip's features are log_mel of it, scaled to [-1, 1)
    np.testing.assert_array_equal(data["test"][0][5], bfsong.log_mel(
        clips[5] / 32768.0, SR, n_fft=N_FFT, hop=HOP, n_mels=N_MELS, frames=bfsong.FRAMES,
        fmin=FMIN, fmax=FMAX))
    # the array-dataset reader (DatasetEntry.arrays): other shapes, one split
    x, y = bfsong.arrays(bf_dir, None, "test", (32, 40))
    assert x.shape == (151, 32, 40) and (y == data["test"][1]).all()
    with pytest.raises(ValueError, match="\\[frames, mel bins\\]"):
        bfsong.arrays(bf_dir, None, "test", (64,))
    with pytest.raises(ValueError, match="no split 'validation'"):
        bfsong.load(bf_dir, splits=("validation",))


def test_built_once_then_offline_and_from_a_folder(bf_dir, files, tmp_path, monkeypatch):
    def no_network(*args):
        raise AssertionError("no download: a local source or the cache")

    monkeypatch.setattr(bfsong, "pip_download", no_network)
    monkeypatch.setenv(bfsong.SOURCE_ENV, "/nonexistent/evfuncs-0.3.3.tar.gz")
    cached = bfsong.load(bf_dir, splits=("test",))["test"]       # the cache: no source read
    folder = tmp_path / "songs"
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    monkeypatch.setenv(bfsong.SOURCE_ENV, str(folder))
    again = bfsong.load(str(tmp_path / "tfds"), splits=("test",))["test"]
    np.testing.assert_array_equal(again[0], cached[0])
    np.testing.assert_array_equal(again[1], cached[1])


@pytest.mark.parametrize("sr,n_fft,hop,n_mels,fmin,fmax", [
    (SR, N_FFT, HOP, N_MELS, FMIN, FMAX),         # the dataset's settings
    (16_000, 400, 160, 80, 0.0, None),            # speech-style: 25 ms / 10 ms at 16 kHz
])
def test_log_mel_matches_transformers(sr, n_fft, hop, n_mels, fmin, fmax):
    from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

    ref_fb = mel_filter_bank(n_fft // 2 + 1, n_mels, fmin, sr / 2 if fmax is None else fmax,
                             sr, norm=None, mel_scale="htk")
    np.testing.assert_allclose(bfsong.mel_filterbank(sr, n_fft, n_mels, fmin, fmax), ref_fb,
                               rtol=0, atol=1e-12)
    x = np.random.default_rng(0).standard_normal(5_000) * 0.1
    ref = spectrogram(x, window_function(n_fft, "hann"), frame_length=n_fft, hop_length=hop,
                      power=2.0, center=False, mel_filters=ref_fb, mel_floor=0.0,
                      log_mel=None, dtype=np.float64)                # [n_mels, frames] power
    ref = np.log(ref.T + bfsong.LOG_EPS)
    n = len(ref)                                                     # 1 + (5000 - n_fft) // hop
    assert n == 1 + (5_000 - n_fft) // hop
    got = bfsong.log_mel(x, sr, n_fft=n_fft, hop=hop, n_mels=n_mels, frames=n + 7, fmin=fmin,
                         fmax=fmax)
    assert got.shape == (n + 7, n_mels) and got.dtype == np.float32
    np.testing.assert_allclose(got[:n], ref, rtol=0, atol=1e-5)
    assert (got[n:] == np.float32(np.log(bfsong.LOG_EPS))).all()    # padding = silence
    cropped = bfsong.log_mel(x, sr, n_fft=n_fft, hop=hop, n_mels=n_mels, frames=5, fmin=fmin,
                             fmax=fmax)
    np.testing.assert_array_equal(cropped, got[:5])                  # first frames kept


def test_a_sine_lands_in_its_band():
    # HTK mel of f: 2595 log10(1 + f/700). With 64 bands over 500-10,000 Hz the 66 edges are
    # 607.45 + 37.935 k mel (607.45 = mel(500), (3073.22 - 607.45) / 65 = 37.935); band m
    # peaks at edge m + 1. A 2,000 Hz tone (mel 1521.36; FFT bin 32 exactly at 62.5 Hz a
    # bin) sits at edge (1521.36 - 607.45) / 37.935 = 24.09, nearest 24: band 23. A
    # 6,000 Hz tone (bin 96, mel 2545.63): edge 51.09 -> band 50.
    t = np.arange(4_000) / SR
    for freq, band in ((2_000.0, 23), (6_000.0, 50)):
        spec = bfsong.log_mel(0.5 * np.sin(2 * np.pi * freq * t), SR, n_fft=N_FFT, hop=HOP,
                              n_mels=N_MELS, frames=bfsong.FRAMES, fmin=FMIN, fmax=FMAX)
        frames = 1 + (4_000 - N_FFT) // HOP                                    # 55
        assert (spec[:frames].argmax(axis=1) == band).all()
        # amplitude 0.5 on an FFT bin: |X| = 0.5 * 512 / 4 = 64 through a periodic Hann, power
        # 4,096 at the bin and a quarter of it at either neighbour, under a peak-1 triangle
        assert np.log(4_096) - 0.5 < spec[0, band] < np.log(4_096 * 1.5)
        assert (spec[frames:] == np.float32(np.log(bfsong.LOG_EPS))).all()
    fb = bfsong.mel_filterbank(SR, N_FFT, N_MELS, FMIN, FMAX)
    assert fb.shape == (N_FFT // 2 + 1, N_MELS) and (fb.max(axis=0) > 0).all()   # no empty band
    silence = bfsong.log_mel(np.zeros(100), SR, n_fft=N_FFT, hop=HOP, n_mels=N_MELS, frames=3)
    assert (silence == np.float32(np.log(bfsong.LOG_EPS))).all()       # shorter than a window
    with pytest.raises(ValueError, match="mono"):
        bfsong.log_mel(np.zeros((2, 600)), SR, n_fft=N_FFT, hop=HOP, n_mels=N_MELS, frames=3)
    with pytest.raises(ValueError, match="fmin < fmax <= sample_rate / 2"):
        bfsong.mel_filterbank(SR, N_FFT, N_MELS, 500.0, 20_000.0)
