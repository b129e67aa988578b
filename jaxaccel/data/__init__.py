"""Datasets (TFDS ArrayRecord, no TensorFlow), tokenization and batching.

ds = load_text_dataset("rt_snippets")                 # built once, then cached
tok = load_tokenizer(checkpoint_dir)
train = tokenize(tok, *ds["train"], max_len=128, max_positions=512)
it = BatchIterator(train, 32, seed=0, bucket_window=50, process_index=i, process_count=n)
for batch in it.batches(epoch, start_step=step): ...

What a run trains and evaluates on, decided from its config: ``jaxaccel.data.splits``.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import importlib.util
import os
import sys

import numpy as np

# TFDS 4.9.10 builders look up `importlib_resources.abc.Traversable` when preparing a
# dataset but only declare that backport for Python < 3.9 (tensorflow/datasets#11212);
# the stdlib module has the same `abc.Traversable`.
if importlib.util.find_spec("importlib_resources") is None:
    sys.modules["importlib_resources"] = importlib.resources

from jaxaccel.data import imdb, rt_snippets
from jaxaccel.data.pipeline import BatchIterator, Tokenized, load_tokenizer, tokenize
from jaxaccel.data.synthetic import synthetic

DATASETS = ("rt_snippets", "imdb_reviews")
"""Text datasets for load_text_dataset; `synthetic(...)` makes token ids directly."""
TRAIN_EXAMPLES = {"rt_snippets": 9_566, "imdb_reviews": 25_000}
"""Examples in each text dataset's train split (steps per epoch before the data is read)."""


@dataclasses.dataclass(frozen=True)
class TextDataset:
    """Split name -> (texts, int32 labels), plus the label names."""

    name: str
    splits: dict[str, tuple[list[str], np.ndarray]]
    label_names: tuple[str, ...]

    @property
    def num_classes(self) -> int:
        return len(self.label_names)

    def __getitem__(self, split: str) -> tuple[list[str], np.ndarray]:
        if split not in self.splits:
            raise ValueError(f"{self.name} has no split {split!r}; known: {sorted(self.splits)}.")
        return self.splits[split]


def _read_split(builder, split: str) -> tuple[list[str], np.ndarray]:
    source = builder.as_data_source(split)
    records = source.__getitems__(range(len(source)))
    if not records:
        raise ValueError(
            f"{builder.name} split {split!r} in {builder.data_dir} is empty; delete "
            "that folder and load again to rebuild it."
        )
    return (
        [r["text"].decode("utf-8") for r in records],
        np.asarray([r["label"] for r in records], np.int32),
    )


def load_text_dataset(
    name: str,
    *,
    data_dir: str | None = None,
    manual_dir: str | os.PathLike | None = None,
    source: str | os.PathLike | None = None,
    splits: tuple[str, ...] = ("train", "test"),
) -> TextDataset:
    """Loads `splits` of a DATASETS entry, building its TFDS cache on first use.

    data_dir: TFDS data dir (default $TFDS_DATA_DIR or ~/tensorflow_datasets).
    manual_dir: imdb_reviews only, the folder holding aclImdb_v1.tar.gz.
    source: rt_snippets only, a local vaderSentiment sdist or ground-truth .txt
      (default $JAXACCEL_RT_SOURCE, else pip download).
    splits: the splits read (e.g. only the eval split, for evaluation).
    """
    if name == "rt_snippets":
        builder, labels = rt_snippets.prepare(data_dir, source), rt_snippets.LABEL_NAMES
    elif name == "imdb_reviews":
        builder, labels = imdb.prepare(data_dir, manual_dir), imdb.LABEL_NAMES
    else:
        close = difflib.get_close_matches(name, DATASETS + ("synthetic",), n=2, cutoff=0.5)
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(
            f"Unknown dataset {name!r}; known: {', '.join(DATASETS)} "
            f"(and `synthetic(...)` for token ids).{hint}"
        )
    return TextDataset(name, {s: _read_split(builder, s) for s in splits}, labels)


__all__ = [
    "DATASETS",
    "TRAIN_EXAMPLES",
    "BatchIterator",
    "TextDataset",
    "Tokenized",
    "load_text_dataset",
    "load_tokenizer",
    "synthetic",
    "tokenize",
]
