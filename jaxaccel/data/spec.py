"""What a run's data is, resolved once (``sources.describe``) and read by every layer after.

A source (one row of ``sources.SOURCES``) describes itself as a frozen ``DataSpec``: its kind
(``KINDS``), hence the tasks it serves and how batches are made; its splits and the counts it
knows without reading; its label names where they are fixed before reading; and its reader,
the one object that reads records. Readers take one of two forms:

* ``RecordReader`` (kinds ``text`` and ``corpus``): records (text, and a label for ``text``)
  in units of work (``chunks``) that worker processes read and tokenize into the token cache
  (``jaxaccel.data.tokencache``); ``identity`` says what the records depend on (files and
  their sizes and times, a dataset's version), so a changed source rebuilds its cache;
* ``ArrayReader`` (kinds ``arrays`` and ``tokens``): the examples of a split as arrays
  (spectrograms, images, ready token ids), and, for ``predict``, examples made from files.

The model's side arrives as ``ModelInput`` (what it reads, its input shape, positions, task):
the data never imports the models.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

VALIDATION_SEED = 0    # held-out rows are the same for every run seed


def held_rows(n: int, size: int, key: str = "data.validation_size") -> np.ndarray:
    """Sorted indices of the ``size`` examples (of ``n``) held out of a training split: the
    first ``size`` of a fixed permutation (``VALIDATION_SEED``), so they do not move with the
    run's seed; the training split keeps the other ``n - size``."""
    if not 0 < size < n:
        raise ValueError(f"{key} holds out {size} of the training split's {n} examples; it must "
                         f"hold out 1 to {n - 1} (0 holds out nothing).")
    return np.sort(np.random.default_rng(VALIDATION_SEED).permutation(n)[:size])


def holdout_size(n: int, fraction: float) -> int:
    """Examples ``data.holdout`` (a fraction) holds out of ``n``: at least one."""
    return max(1, round(fraction * n))


KINDS = {
    # kind: (tasks it serves, what it holds, how batches are made)
    "text": (("classification",), "text", "padded"),
    "tokens": (("classification",), "text", "padded"),
    "corpus": (("causal_lm",), "text", "packed"),
    "arrays": (("mae", "classification"), "arrays", "arrays"),
}
"""Data kinds: labelled texts, labelled token ids (synthetic), documents for causal LM, and
fixed-shape arrays with labels (spectrograms, images)."""


class DataError(ValueError):
    """Bad input data: the message names the file (and line) and what to fix."""


class DataMissing(DataError):
    """The data is not on this machine (a glob matching nothing, a dataset folder missing): a
    plan made elsewhere can go on without it (``sources.describe(..., absent_ok=True)``)."""


class Settings(Mapping):
    """The config's ``data`` section, frozen: ``settings.max_len``, ``settings["name"]``."""

    def __init__(self, section: Mapping[str, Any]):
        self._items = dict(section)

    def __getitem__(self, key: str):
        return self._items[key]

    def __getattr__(self, key: str):
        try:
            return self._items[key]
        except KeyError:
            raise AttributeError(key) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, repr(v)) for k, v in self._items.items())))

    def __repr__(self) -> str:
        return f"Settings({self._items!r})"


@dataclasses.dataclass(frozen=True)
class ModelInput:
    """What the model reads, as the trainer tells the data (``train.run.resolve``).

    name: ``model.name`` (for messages).
    task: the model's training task (``train.tasks.TASKS``).
    reads: ``"tokens"`` or ``"pixels"`` (arrays).
    shape: one array example's shape (``pixels``); None for tokens.
    max_positions: the longest token sequence the model takes; None for arrays.
    num_labels: a classifier's classes; None otherwise.
    tokenizer: the tokenizer folder a model that reads tokens names (``model.tokenizer``, the
      checkpoint's, a run folder's), or None: it names none (the run's tokenizer is then a
      corpus's own BPE or the model's default: ``DataSpec.tokenizer``).
    vocab_size: the model's embedding rows (what token ids must stay below).
    processor: the checkpoint folder whose ``preprocessor_config.json`` says how images
      become the model's pixels (``model.checkpoint``), or None (random init).
    """

    name: str
    task: str
    reads: str
    shape: tuple[int, ...] | None = None
    max_positions: int | None = None
    num_labels: int | None = None
    tokenizer: str | None = None
    vocab_size: int | None = None
    processor: str | None = None


@dataclasses.dataclass(frozen=True)
class Batching:
    """How batches are cut: global batch sizes, the seed of the order, and the devices a final
    eval batch must still split over."""

    batch_size: int
    eval_batch_size: int
    seed: int
    devices: int = 1


@dataclasses.dataclass(frozen=True)
class Records:
    """Records of one chunk, in order: texts, labels (str or int each; None for a corpus), and
    where each came from (``place(i)``: ``file:line``; ``file row r``; ``dataset record i``;
    the file itself for a file a record)."""

    texts: list[str]
    labels: list | None
    origin: str
    numbers: Sequence[int]
    unit: str = "line"

    def place(self, i: int) -> str:
        n = self.numbers[i]
        if self.unit == "file":
            return str(n)
        return f"{self.origin}:{n}" if self.unit == "line" else f"{self.origin} {self.unit} {n}"


class RecordReader(Protocol):
    """Reads a ``text`` or ``corpus`` source's records (see the module doc)."""

    def identity(self, split: str) -> dict:
        """What the split's records depend on (JSON): paths with sizes and modification times,
        a dataset's name and version. Cheap: stats, never the records."""

    def chunks(self, split: str) -> list:
        """Picklable units of work covering the split's records in order."""

    def read(self, chunk) -> Records:
        """The records of one chunk (in a worker process), checked: ``DataError`` naming the
        file and line of a record without a field, not UTF-8, ..."""

    def size(self, chunk) -> int:
        """The chunk's size in bytes (or records), for the progress bar."""


class ArrayReader(Protocol):
    """Reads an ``arrays`` (or ``tokens``) source's examples."""

    def examples(self, split: str):
        """``(x float32 [n, *shape], labels int32 [n])``, or ``Tokenized`` for ``tokens``."""

    def features(self, paths: list[str]) -> list:
        """Per path, the model's input made from the file (``jaxaccel predict``) as
        ``examples`` makes them, with what was read of it: ``(x float32 [*shape], facts)``, or
        the ``DataError`` refusing that file (``wav.per_file``)."""


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """A run's data, resolved once (module doc).

    name: the ``sources.SOURCES`` row (``data.name``).
    kind: one of ``KINDS``.
    reader: the source's ``RecordReader`` or ``ArrayReader``.
    settings: the ``data`` section.
    batching: batch sizes and seed.
    model: what the model reads.
    splits: the source's own splits (a held-out split is cut from ``train``).
    counts: examples per split known without reading (a dataset's metadata).
    rows: the rows an epoch trains on (examples, or a corpus's packed rows; after the held-out
      and validation examples), where known before reading: from ``counts``, a count the
      config gives, or a prepared cache's index (``splits.prepared``).
    count_source: where ``rows`` came from ("" where it is unknown).
    label_names: the classes, where fixed before reading (a dataset's class names, a trained
      run's); None where they are learnt from the training split.
    labels_are_ids: the source's integer labels are indices into ``label_names`` (a TFDS or
      Hugging Face ``ClassLabel``); otherwise labels are values, named by their text.
    row_length: the longest row, where the source knows it (ready token ids); else rows are
      up to ``max_len`` tokens.
    absent: why the data could not be described from its source (not on this machine: a
      plan goes on without it; ``reader`` is then None), or why its training split could not
      (a run's eval reads its own eval files alone; ``reader`` reads them); "" where it was.
    trained: the ``data`` section a trained model was trained with, where this data is its
      evaluation's (``inference.checkpoint_run``): an eval split cut from the training split
      must hold none of the examples it trained on (``splits.split_rows``); None otherwise.
    parts: a mixture's sources (``data.mixture``), each ``(DataSpec, weight)``; () for one
      source.
    tokenizer: the folder of the run's tokenizer, decided once when the run is resolved
      (``train.run_data.tokenizer_folder``) and read by all that tokenizes (the token cache,
      ``data prepare/show``, eval, predict, generate: ``run_tokenizer.tokenizer_dir``): the
      one the model names (``model.tokenizer``), else a corpus's own BPE (trained there the
      first time it is read), else the model's default; None for arrays, and for a plan (no
      tokens read) of a model that names none.
    """

    name: str
    kind: str
    reader: Any
    settings: Settings
    batching: Batching
    model: ModelInput
    splits: tuple[str, ...] = ("train", "test")
    counts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    count_source: str = ""
    label_names: tuple[str, ...] | None = None
    labels_are_ids: bool = False
    row_length: int | None = None
    rows: int | None = None
    absent: str = ""
    trained: Settings | None = None
    parts: tuple = ()
    tokenizer: str | None = None

    @property
    def tasks(self) -> tuple[str, ...]:
        return KINDS[self.kind][0]

    @property
    def holds(self) -> str:
        """``"text"`` or ``"arrays"``."""
        return KINDS[self.kind][1]

    @property
    def batches(self) -> str:
        """How batches are made: ``padded`` (labelled rows, dynamic padding), ``packed``
        (causal-LM rows), ``arrays``."""
        return KINDS[self.kind][2]

    @property
    def tokenized(self) -> bool:
        """Whether the data is text for the token cache (``text``, ``corpus``)."""
        return self.kind in ("text", "corpus")

    @property
    def max_len(self) -> int:
        """Tokens per row: ``data.max_len``, at most the model's positions for labelled texts
        (a corpus's longer rows are refused: ``splits.check_rows``)."""
        d, limit = self.settings, self.model.max_positions
        return d.max_len if self.kind == "corpus" or limit is None else min(d.max_len, limit)

    @property
    def eval_split(self) -> str:
        return self.settings.eval_split

    @property
    def steps_per_epoch(self) -> int | None:
        """Whole training batches an epoch, where ``rows`` is known."""
        return None if self.rows is None else self.rows // self.batching.batch_size

    def run_files(self) -> dict:
        """``{name: JSON object}`` a trained run keeps in its folder for its eval, predict and
        export to read the data as it did (the reader's ``run_files``; images: the image
        processor's config); {} for most sources."""
        keep = getattr(self.reader, "run_files", None)
        return keep() if keep else {}

    @property
    def held_out(self) -> bool:
        """Whether the eval split is ``data.holdout`` of the training split (the source has
        none of that name)."""
        return self.eval_split not in self.splits and self.settings.holdout > 0

    def longest(self) -> int:
        """The longest row a batch can have, padded (what a plan's memory must hold)."""
        if self.row_length is None:
            return self.max_len
        m = self.settings.pad_multiple
        return min(-(-self.row_length // m) * m, self.max_len)


__all__ = ["held_rows", "holdout_size", "ArrayReader", "Batching", "DataError", "DataMissing",
           "DataSpec", "KINDS", "ModelInput",
           "RecordReader", "Records", "Settings"]
