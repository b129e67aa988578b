"""Datasets (TFDS ArrayRecord, no TensorFlow), tokenization and batching.

ds = load_text_dataset("rt_snippets")                 # built once, then cached
docs = load_corpus("canterbury")                      # {"train": [text, ...], "validation": ...}
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
from collections.abc import Callable

import numpy as np

# TFDS 4.9.10 builders look up `importlib_resources.abc.Traversable` when preparing a
# dataset but only declare that backport for Python < 3.9 (tensorflow/datasets#11212);
# the stdlib module has the same `abc.Traversable`.
if importlib.util.find_spec("importlib_resources") is None:
    sys.modules["importlib_resources"] = importlib.resources

from jaxaccel.data import bfsong, canterbury, imdb, rt_snippets
from jaxaccel.data.pipeline import BatchIterator, Tokenized, load_tokenizer, tokenize
from jaxaccel.data.synthetic import synthetic


@dataclasses.dataclass(frozen=True)
class DatasetEntry:
    """One TFDS text dataset: how its builder is prepared and what its records hold.

    prepare: ``(data_dir, manual_dir, source) -> builder``, built on first use.
    label_names: a labelled dataset's classes; None for a corpus of documents (causal LM:
      records hold text only, read with ``load_corpus``).
    train_examples: examples in the train split (steps per epoch before the data is read:
      ``jaxaccel compile``); None for a corpus, whose rows depend on the packing.
    arrays: an array dataset's reader (``load_arrays``): ``(data_dir, source, split, shape)
      -> (x float32 [n, *shape], labels int32 [n])``, ``shape`` the model's input (e.g.
      [frames, mel bins] of a spectrogram); None for text.
    features: an array dataset's examples made from files (``jaxaccel predict``):
      ``(data_dir, paths, shape) -> x float32 [len(paths), *shape]``, as ``arrays`` makes
      them; None where it reads none.
    """

    prepare: Callable
    label_names: tuple[str, ...] | None
    train_examples: int | None = None
    arrays: Callable | None = None
    features: Callable | None = None

    @property
    def is_corpus(self) -> bool:
        return self.label_names is None

    @property
    def is_arrays(self) -> bool:
        return self.arrays is not None


DATASETS: dict[str, DatasetEntry] = {
    "rt_snippets": DatasetEntry(lambda data_dir, manual_dir, source: rt_snippets.prepare(
        data_dir, source), rt_snippets.LABEL_NAMES, 9_566),
    "imdb_reviews": DatasetEntry(lambda data_dir, manual_dir, source: imdb.prepare(
        data_dir, manual_dir), imdb.LABEL_NAMES, 25_000),
    "canterbury": DatasetEntry(lambda data_dir, manual_dir, source: canterbury.prepare(
        data_dir, source), None),
    "bfsong": DatasetEntry(lambda data_dir, manual_dir, source: bfsong.prepare(
        data_dir, source), bfsong.LABEL_NAMES, 450, arrays=bfsong.arrays,
        features=bfsong.features),
}
"""Datasets by name (``data.name``): labelled texts, a corpus, and labelled log-mel
spectrograms (``bfsong``, for the ViT family); ``synthetic`` makes token ids or arrays."""


def dataset_entry(name: str) -> DatasetEntry:
    """The DATASETS entry of ``name``; an unknown name lists the known ones."""
    if name not in DATASETS:
        close = difflib.get_close_matches(name, [*DATASETS, "synthetic"], n=2, cutoff=0.5)
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(
            f"data.name={name!r} is not a dataset; known: {', '.join(DATASETS)}, synthetic "
            f"(random token ids, or arrays for a ViT).{hint} Set data.name to one of them."
        )
    return DATASETS[name]


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
      (default $JAXACCEL_RT_SOURCE, else pip download); canterbury (load_corpus): the brotli
      sdist or a folder of its texts (default $JAXACCEL_CANTERBURY_SOURCE, else pip download).
    splits: the splits read (e.g. only the eval split, for evaluation).
    """
    entry = dataset_entry(name)
    if entry.is_corpus:
        raise ValueError(f"{name!r} is a corpus of unlabelled documents (causal LM); read it "
                         "with load_corpus, or pick a labelled dataset for classification: "
                         f"{', '.join(n for n, e in DATASETS.items() if not e.is_corpus)}.")
    builder = entry.prepare(data_dir, manual_dir, source)
    labels = entry.label_names
    return TextDataset(name, {s: _read_split(builder, s) for s in splits}, labels)


def load_arrays(name: str, split: str, shape: tuple[int, ...], *, data_dir: str | None = None,
                source: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(x float32 [n, *shape], labels int32 [n])`` of ``split`` of an array dataset of
    DATASETS, built on first use; ``shape`` the model's input shape."""
    entry = dataset_entry(name)
    if not entry.is_arrays:
        raise ValueError(f"{name!r} is a text dataset; array datasets: "
                         f"{', '.join(n for n, e in DATASETS.items() if e.is_arrays)}.")
    return entry.arrays(data_dir, source, split, tuple(shape))


def load_corpus(name: str, *, data_dir: str | None = None,
                source: str | os.PathLike | None = None,
                splits: tuple[str, ...] = ("train", "validation")) -> dict[str, list[str]]:
    """The documents (texts, in id order) of ``splits`` of a corpus entry of DATASETS, its
    TFDS cache built on first use; arguments as ``load_text_dataset``'s."""
    entry = dataset_entry(name)
    if not entry.is_corpus:
        raise ValueError(f"{name!r} is a labelled dataset (classification), not a corpus of "
                         "documents; read it with load_text_dataset, or pick a corpus for "
                         f"causal LM: {', '.join(n for n, e in DATASETS.items() if e.is_corpus)}.")
    builder = entry.prepare(data_dir, None, source)
    out = {}
    for split in splits:
        if split not in builder.info.splits:
            raise ValueError(f"{name} has no split {split!r}; known: "
                             f"{sorted(builder.info.splits)}.")
        source_ = builder.as_data_source(split)
        records = sorted(source_.__getitems__(range(len(source_))), key=lambda r: r["id"])
        out[split] = [r["text"].decode("utf-8") for r in records]
    return out


def corpus_folder(name: str, data_dir: str | None = None) -> str:
    """The folder of a corpus's built TFDS dataset (its version folder), where tokenizers
    trained on it are cached."""
    return os.fspath(dataset_entry(name).prepare(data_dir, None, None).data_dir)


__all__ = [
    "DATASETS",
    "DatasetEntry",
    "load_arrays",
    "BatchIterator",
    "TextDataset",
    "Tokenized",
    "corpus_folder",
    "dataset_entry",
    "load_corpus",
    "load_text_dataset",
    "load_tokenizer",
    "synthetic",
    "tokenize",
]
