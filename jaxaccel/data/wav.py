"""WAV recordings made into a model's inputs (``bfsong``, ``audio``): the checks that refuse a
file, each naming the file and the rule, and what ``jaxaccel predict`` reports of each file
(docs/guides/audio-mae.md, "Audio inputs").

* Format: WAV (RIFF/RIFX/RF64, read by ``scipy.io.wavfile``), integer PCM (scaled to [-1, 1))
  or float samples. Anything else, a file cut off inside its header, or one fewer bytes long
  than its header says (truncated: it would be classified from part of the recording) is
  refused, as is a file with no samples or with a NaN or infinite sample.
* Channels: mixed down to mono by averaging them, as librosa's ``load(mono=True)`` and the
  ``datasets`` library's ``Audio(mono=True)`` do (Kaldi's ``fbank`` reads channel 0 only: sound
  on channel 1 alone would score as silence).
"""
from __future__ import annotations

import struct
import warnings

import numpy as np

from jaxaccel.data.spec import DataError


def read(path: str) -> tuple[int, np.ndarray, int]:
    """``(rate, samples float64 [n] in [-1, 1), channels)`` of a WAV file, mixed down to mono
    (module doc); ``DataError`` naming the file and the rule it breaks."""
    from scipy.io import wavfile
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", wavfile.WavFileWarning)
            rate, samples = wavfile.read(path)
    except OSError as e:
        raise DataError(f"{path!r} cannot be read: {e.strerror or e}") from None
    except (EOFError, struct.error):
        raise DataError(f"{path!r} is not a WAV file that can be read: it ends inside its "
                        "header") from None
    except ValueError as e:
        raise DataError(f"{path!r} is not a WAV file that can be read ({e}); WAV recordings "
                        "(integer PCM or float) are read: convert others, e.g. sox in.flac "
                        "-b 16 out.wav") from None
    short = [w for w in caught if "EOF prematurely" in str(w.message)]
    if short:
        raise DataError(f"{path!r} is truncated ({short[0].message}): its samples would be "
                        "classified from part of the recording")
    channels = samples.shape[1] if samples.ndim == 2 else 1
    if samples.dtype.kind == "u":
        x = (samples.astype(np.float64) - 128.0) / 128.0
    elif samples.dtype.kind == "i":
        x = samples.astype(np.float64) / float(np.iinfo(samples.dtype).max + 1)
    else:
        x = samples.astype(np.float64)
    x = x.reshape(len(x), channels).mean(axis=1)
    if not x.size:
        raise DataError(f"{path!r} holds no samples: there is nothing to classify")
    bad = int(np.count_nonzero(~np.isfinite(x)))
    if bad:
        raise DataError(f"{path!r} has {bad} non-finite samples (NaN or infinity) of {x.size}: "
                        "its spectrogram would be too")
    return rate, x, channels


def span(frames: int, hop: int, n_fft: int, rate: int) -> float:
    """The seconds of recording ``frames`` spectrogram frames (``bfsong.log_mel``: ``n_fft``
    samples every ``hop``, from sample 0) read: the first ``(frames - 1) hop + n_fft``
    samples."""
    return ((frames - 1) * hop + n_fft) / rate


def per_file(paths: list[str], make, normalise) -> list:
    """Per path, ``(x float32, facts)`` or the ``DataError`` refusing the file: ``make(path) ->
    (spectrogram, facts)`` for each file, then ``normalise`` (float32 [n, ...] -> the same,
    normalised) over those made. ``facts``: ``{"seconds"`` (the recording's length),
    ``"seconds_classified"`` (the part the input holds), ``"channels"`` (mixed down)``}``."""
    made = []
    for path in paths:
        try:
            made.append(make(path))
        except DataError as e:
            made.append(e)
    good = [i for i, m in enumerate(made) if not isinstance(m, DataError)]
    if good:
        x = normalise(np.stack([made[i][0] for i in good]))
        for i, xi in zip(good, x):
            made[i] = (xi, made[i][1])
    return made


def facts(samples: np.ndarray, rate: int, channels: int, read_s: float) -> dict:
    """What a prediction's record says was read of a file (``per_file``)."""
    seconds = samples.size / rate
    return {"seconds": seconds, "seconds_classified": min(seconds, read_s),
            "channels": channels}


__all__ = ["facts", "per_file", "read", "span"]
