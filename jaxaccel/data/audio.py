"""A folder of audio files (``data.name=audio``): labelled by sub-folder for a ViT classifier, or
unlabelled for MAE pretraining; each clip becomes a log-mel spectrogram of the model's input
shape.

    data.name=audio data.train_files=birds/train data.eval_files=birds/test   # birds/*/x.wav
    data.name=audio data.train_files="clips/*.wav" data.holdout=0.1           # MAE, unlabelled

* Files: WAV (integer PCM or float; channels mixed down; ``wav`` says what is refused), found
  as ``data.name=files`` finds them (globs, or folders searched recursively); a clip's label
  is its class folder (``filesplits.folder_class``: the first folder level under the folder
  or glob root given), the classes the training files', sorted. Without
  ``data.eval_files`` the eval split is ``data.holdout`` of the training clips.
* Spectrograms (``bfsong.log_mel``): clips resampled to ``data.sample_rate``, 25 ms Hann
  windows every 10 ms (the Kaldi filterbank framing AST and Audio-MAE use), as many mel bands
  over 0 to half the sample rate as the model's input has, padded with silence or cut to its
  frames; then normalised by the training clips' mean and standard deviation (one scalar each,
  as AST and Audio-MAE normalise theirs). ``jaxaccel predict`` makes its inputs the same way.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxaccel.data import wav
from jaxaccel.data.bfsong import log_mel
from jaxaccel.data.files import expand
from jaxaccel.data.filesplits import folder_class, refuse_shared, split_files, split_roots
from jaxaccel.data.spec import DataError, DataMissing, DataSpec

WINDOW_S, HOP_S = 0.025, 0.010


def read_wav(path: str, rate: int) -> tuple[np.ndarray, int]:
    """``(samples, channels)``: a WAV file as ``wav.read`` reads it (mono float samples in
    [-1, 1), and the channels it had), resampled to ``rate``."""
    from scipy.signal import resample_poly
    have, x, channels = wav.read(path)
    if have != rate:
        g = math.gcd(rate, have)
        x = resample_poly(x, rate // g, have // g)
    return x, channels


def _framing(rate: int) -> tuple[int, int]:
    """``(n_fft, hop)``: 25 ms windows every 10 ms at ``rate``."""
    return round(WINDOW_S * rate), round(HOP_S * rate)


def _spectrogram(path: str, rate: int, shape: tuple[int, ...]) -> tuple[np.ndarray, dict]:
    frames, bands = shape
    samples, channels = read_wav(path, rate)
    n_fft, hop = _framing(rate)
    x = log_mel(samples, rate, n_fft=n_fft, hop=hop, n_mels=bands, frames=frames,
                fmax=rate / 2)
    return x, wav.facts(samples, rate, channels, wav.span(frames, hop, n_fft, rate))


def spectrogram(path: str, rate: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 [frames, mel bands] of one clip (module doc), before normalisation."""
    return _spectrogram(path, rate, shape)[0]


_FEATURES: dict[tuple, np.ndarray] = {}


@dataclasses.dataclass(frozen=True)
class AudioArrays:
    """The ``ArrayReader`` of ``data.name=audio``: spectrograms of each split's clips (computed
    once a process), labelled by folder."""

    files: tuple[tuple[str, tuple[str, ...]], ...]
    names: tuple[str, ...]
    shape: tuple[int, ...]
    rate: int
    roots: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def _raw(self, paths: tuple[str, ...]) -> np.ndarray:
        key = (paths, self.shape, self.rate)
        if key not in _FEATURES:
            _FEATURES[key] = np.stack([spectrogram(p, self.rate, self.shape) for p in paths])
        return _FEATURES[key]

    def _normalised(self, x: np.ndarray) -> np.ndarray:
        train = self._raw(dict(self.files)["train"])
        return ((x - train.mean()) / train.std()).astype(np.float32)

    def examples(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        paths = dict(self.files)[split]
        labels = []
        for p in paths:
            name = folder_class(p, dict(self.roots)[split])
            if name not in self.names:
                raise DataError(f"{p}: its class {name!r} (its folder) is not among the "
                                f"training classes ({', '.join(self.names)}).")
            labels.append(self.names.index(name))
        return self._normalised(self._raw(paths)), np.asarray(labels, np.int32)

    def features(self, paths: list[str]) -> list:
        return wav.per_file(paths, lambda p: _spectrogram(p, self.rate, self.shape),
                            self._normalised)


def _clips(globs: str, key: str) -> tuple[str, ...]:
    files = expand(globs, key)
    other = [p for p in files if not p.lower().endswith(".wav")]
    if other:
        raise DataError(f"{other[0]}: not a .wav file; {key} takes WAV recordings (convert "
                        "others, e.g. sox in.flac -b 16 out.wav).")
    return files


def describe(settings, model, batching) -> DataSpec:
    """``data.name=audio`` (module doc): the clips are found and their classes named here."""
    if not settings.train_files:
        raise DataMissing("data.name=audio needs data.train_files: a folder (or glob) of WAV "
                        "files, in one sub-folder a class for a classifier.")
    files, _ = split_files(settings, _clips)
    refuse_shared(files, settings, examples_are_files=True)
    roots = split_roots(settings)
    names = tuple(sorted({folder_class(p, roots["train"]) for p in files["train"]}))
    if model.task == "classification" and len(names) < 2:
        raise DataError(f"data.train_files={settings.train_files!r}: every clip is in the folder "
                        f"{names[0]!r}, one class; a classifier needs a sub-folder a class (two "
                        "or more).")
    shape = tuple(model.shape) if model.shape is not None else None
    if shape is not None and len(shape) != 2:
        raise DataError(f"data.name=audio makes [frames, mel bands] spectrograms; the model's "
                        f"input is {shape}.")
    reader = AudioArrays(tuple(files.items()), names, shape, settings.sample_rate,
                         tuple(roots.items()))
    counts = {s: len(p) for s, p in files.items()}
    return DataSpec("audio", "arrays", reader, settings, batching, model, tuple(files), counts,
                    "the number of clips", names, labels_are_ids=True)


__all__ = ["AudioArrays", "describe", "read_wav", "spectrogram"]
