"""Synthetic token ids and labels for benchmarks and tests: fixed length, deterministic by seed.

``data.name=synthetic`` gives token ids to a model that reads tokens and arrays of its input
shape to one that reads arrays (a ViT): ``data.synthetic_examples`` examples a split, the
training split drawn from the run's seed, the validation split from seed + 2 and every other
split (test, ...) from seed + 1 (``SPLIT_SEEDS``): validation and test are different examples.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxaccel.data.pipeline import Tokenized
from jaxaccel.data.spec import DataError, DataSpec

VOCAB = 30522      # BERT's uncased vocabulary: synthetic ids lie in [0, 30522)
SPLIT_SEEDS = {"train": 0, "validation": 2}    # the run's seed + this; other splits + 1


def synthetic(
    *, vocab_size: int, seq_len: int, num_examples: int, seed: int = 0, num_classes: int = 2,
    min_len: int = 0,
) -> Tokenized:
    """`num_examples` rows of `seq_len` ids uniform in [1, vocab_size) (0 is padding); with
    `min_len` > 0 each row is cut to a length uniform in [min_len, seq_len]."""
    if not 0 <= min_len <= seq_len:
        raise ValueError(f"synthetic: min_len={min_len}; expected 0 (fixed length) to "
                         f"seq_len={seq_len}.")
    for name, value, low in (
        ("vocab_size", vocab_size, 2),
        ("seq_len", seq_len, 1),
        ("num_examples", num_examples, 1),
        ("num_classes", num_classes, 2),
    ):
        if value < low:
            raise ValueError(f"synthetic: {name}={value}; expected an integer >= {low}.")
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab_size, size=(num_examples, seq_len), dtype=np.int32)
    # The label is a function of the first token, so the task is learnable (losses must fall).
    labels = (ids[:, 0] % num_classes).astype(np.int32)
    rows = list(ids)
    if min_len:
        rows = [r[:n] for r, n in zip(rows, rng.integers(min_len, seq_len + 1, num_examples))]
    return Tokenized(input_ids=rows, labels=labels, max_len=seq_len, pad_id=0)


def synthetic_arrays(*, shape: tuple[int, ...], num_examples: int, seed: int = 0,
                     num_classes: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """``(x float32 [num_examples, *shape], labels int32)``: standard-normal noise plus one of
    ``num_classes`` fixed patterns (drawn from a seed of their own, the same for every split),
    the label the pattern's index, so the task is learnable and the splits share it."""
    if num_examples < 1 or num_classes < 2:
        raise ValueError(f"synthetic_arrays: num_examples={num_examples}, num_classes="
                         f"{num_classes}; expected >= 1 and >= 2.")
    patterns = np.random.default_rng(12345).normal(size=(num_classes, *shape))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, num_examples).astype(np.int32)
    x = rng.normal(size=(num_examples, *shape)) + patterns[labels]
    return x.astype(np.float32), labels


@dataclasses.dataclass(frozen=True)
class SyntheticExamples:
    """The ``ArrayReader`` of ``data.name=synthetic``: ``Tokenized`` rows for a model that
    reads tokens, ``(x, labels)`` arrays of ``shape`` otherwise."""

    shape: tuple[int, ...] | None
    seq_len: int
    min_len: int
    num_examples: int
    num_classes: int
    seed: int

    def examples(self, split: str):
        seed = self.seed + SPLIT_SEEDS.get(split, 1)
        if self.shape is None:
            return synthetic(vocab_size=VOCAB, seq_len=self.seq_len, min_len=self.min_len,
                             num_examples=self.num_examples, seed=seed,
                             num_classes=self.num_classes)
        return synthetic_arrays(shape=self.shape, num_examples=self.num_examples, seed=seed,
                                num_classes=self.num_classes)

    def features(self, paths: list[str]) -> list:
        raise DataError("data.name=synthetic makes no inputs from files; predict takes files "
                        "for array data that reads them (e.g. bfsong, audio: WAV recordings).")


def describe(settings, model, batching) -> DataSpec:
    """The ``DataSpec`` of ``data.name=synthetic`` (``sources.SOURCES``)."""
    arrays = model.reads == "pixels"
    n = settings.synthetic_examples
    reader = SyntheticExamples(model.shape if arrays else None, settings.synthetic_seq_len,
                               settings.synthetic_min_len, n, model.num_labels, batching.seed)
    return DataSpec("synthetic", "arrays" if arrays else "tokens", reader, settings, batching,
                    model, ("train", settings.eval_split),
                    {"train": n, settings.eval_split: n}, "data.synthetic_examples",
                    tuple(str(i) for i in range(model.num_labels)), labels_are_ids=True,
                    row_length=None if arrays else settings.synthetic_seq_len)
