"""A predict's inputs, made and batched as the run's data makes and batches its eval split
(``jaxaccel predict``, ``train.inference.Predictor``).

    made = input_features(data, paths)               # an array model's inputs from files
    b = input_batches(data, inputs, size, tokenizer)  # a Batches: b.plan(0), b.batches(0)
"""
from __future__ import annotations

import numpy as np

from jaxaccel.data.arrays import ArrayBatches
from jaxaccel.data.batches import Batches
from jaxaccel.data.pipeline import tokenize
from jaxaccel.data.spec import DataError, DataSpec
from jaxaccel.data.splits import eval_rows


def input_features(data: DataSpec, paths: list[str]) -> list:
    """Per path, ``(x float32 [*input shape], facts)`` or the ``DataError`` refusing that file:
    the model's inputs made from files (recordings) as the array data makes its examples
    (``ArrayReader.features``), for ``jaxaccel predict``."""
    if data.holds != "arrays":
        raise ValueError(f"data.name={data.name!r} makes no inputs from files; predict takes "
                         "files for array data that reads them (e.g. bfsong, audio: WAV "
                         "recordings).")
    if data.reader is None:
        raise DataError(f"predict makes its inputs as the run's training data made its examples "
                        f"(their normalisation), and that data is not here ({data.absent}); "
                        "predict where it is.")
    return data.reader.features(paths)


def input_batches(data: DataSpec, inputs: list, size: int, tokenizer) -> Batches:
    """``inputs`` (texts, tokenized by ``tokenizer`` to ``data.max_len``; or an array model's
    inputs, float32 arrays) in batches of ``size`` rows, every input once (labels 0): texts as
    eval batches are (sorted by length, each batch padded by ``data.pad_multiple``, the last
    one completed with filler rows), arrays in order. ``plan(0)`` says which inputs each batch
    holds."""
    zeros = np.zeros(len(inputs), np.int32)
    if data.holds == "arrays":
        return ArrayBatches(np.stack(inputs), zeros, size, shuffle=False, drop_remainder=False)
    return eval_rows(data, tokenize(tokenizer, inputs, zeros, max_len=data.max_len), None, size)


__all__ = ["input_batches", "input_features"]
