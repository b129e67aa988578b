"""Tokenize once, then batch with dynamic padding, length bucketing and per-process shards.

Every process computes the same global plan for an epoch (order from (seed, epoch),
batch composition, padded length) and keeps only its contiguous rows of each global
batch, so process p of P gets rows [p*B/P, (p+1)*B/P) and the processes' rows
concatenate to the global batch.

Padded length of a batch: its longest row rounded up to a multiple of `pad_multiple`
(few distinct shapes, few jit recompiles), capped at the tokenization `max_len`.
Length bucketing (`bucket_window=k`): after the shuffle, each window of k global batches
is sorted by length and cut into batches, and the batch order is shuffled, so rows in
a batch have similar lengths and padding stays small.
Without drop_remainder the last global batch is completed with weight-0 copies of its
first row (real tokens, so no fully masked rows reach attention), keeping shapes fixed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Iterator, Sequence

import numpy as np

from jaxaccel.data.batches import (Batches, caches_of, check_start, decoded, epoch_order,
                                   label_counts, whole_steps)
from jaxaccel.padding import padded_length


@dataclasses.dataclass(frozen=True)
class Tokenized:
    """Token ids of every example (int32, variable length <= max_len) and their labels.

    input_ids: a list of arrays, or any sequence of them (rows read from a token cache as
      they are asked for: ``cached.CachedRows``).
    lengths: each row's length where known without reading the rows (a cache's index).
    """

    input_ids: Sequence[np.ndarray]
    labels: np.ndarray
    max_len: int
    pad_id: int = 0
    lengths: np.ndarray | None = None

    def __post_init__(self):
        if len(self.input_ids) != len(self.labels):
            raise ValueError(
                f"Tokenized: {len(self.input_ids)} id rows but {len(self.labels)} "
                "labels; expected one label per row."
            )

    def __len__(self) -> int:
        return len(self.labels)

    def row_lengths(self) -> np.ndarray:
        """int64 [n]: each row's length."""
        if self.lengths is not None:
            return np.asarray(self.lengths, np.int64)
        return np.fromiter(map(len, self.input_ids), np.int64, len(self.input_ids))


def _named_class(path):
    """The tokenizer class the folder's tokenizer_config.json names, taken from transformers by
    name as ``AutoTokenizer`` resolves it (its fast class where there is one), without
    ``AutoTokenizer``'s model-config imports, which load torch (a second or more at every
    start); None where the folder names no class this transformers has."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        return None
    if not isinstance(name, str) or not name:
        return None
    import transformers
    for candidate in (name if name.endswith("Fast") else f"{name}Fast", name):
        try:
            return getattr(transformers, candidate)
        except (AttributeError, ImportError):
            continue
    return None


def load_tokenizer(path: str | os.PathLike, *, light: bool = False):
    """A Hugging Face (fast) tokenizer from a local checkpoint folder, never the network.

    light: read the folder's tokenizer.json (where it has one) through the tokenizers backend
      alone, without ``AutoTokenizer``, whose model-config imports load torch (seconds at
      start-up); the same ids. For reading only (eval, predict): it saves under another class
      name than the folder's.

    A folder whose tokenizer_config.json names a class this transformers lacks (one saved by
    transformers 5, "TokenizersBackend", read by transformers 4) is read from its
    tokenizer.json as in ``light``.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"Tokenizer folder {os.fspath(path)!r} does not exist; expected a local Hugging Face "
            "checkpoint folder (tokenizer.json or vocab.txt, tokenizer_config.json). Fix the path."
        )
    # Heavy imports, only needed for text datasets.
    from transformers import PreTrainedTokenizerFast
    has_json = os.path.isfile(os.path.join(path, "tokenizer.json"))
    if light and has_json:
        Tokenizer = PreTrainedTokenizerFast
    else:
        Tokenizer = _named_class(path)
        if Tokenizer is None:
            from transformers import AutoTokenizer as Tokenizer
    try:
        return Tokenizer.from_pretrained(os.fspath(path), local_files_only=True)
    except (OSError, ValueError) as e:
        # A folder saved by transformers 5 names its class "TokenizersBackend", which
        # transformers 4 has not; its tokenizer.json gives the same ids through the fast class.
        if Tokenizer is not PreTrainedTokenizerFast and has_json:
            try:
                return PreTrainedTokenizerFast.from_pretrained(os.fspath(path),
                                                               local_files_only=True)
            except (OSError, ValueError):
                pass
        raise FileNotFoundError(
            f"Could not load a tokenizer from {os.fspath(path)!r} without the network: {e}. "
            "The folder needs tokenizer.json or vocab.txt plus tokenizer_config.json."
        ) from e


def tokenize(
    tokenizer,
    texts: Sequence[str],
    labels: Sequence[int],
    *,
    max_len: int,
    max_positions: int | None = None,
) -> Tokenized:
    """Tokenizes all texts in one batched call, truncating to max_len.

    max_positions is the model's number of position embeddings; a larger max_len warns
    once and is clamped to it.
    """
    if len(texts) == 0:
        raise ValueError("tokenize: no texts; expected a non-empty split.")
    if max_positions is not None and max_len > max_positions:
        warnings.warn(
            f"max_len={max_len} exceeds the model's max_positions={max_positions}; "
            f"truncating to {max_positions}.",
            stacklevel=2,
        )
        max_len = max_positions
    enc = tokenizer(
        list(texts),
        truncation=True,
        max_length=max_len,
        return_attention_mask=False,
        return_token_type_ids=False,
    )
    ids = [np.asarray(row, np.int32) for row in enc["input_ids"]]
    return Tokenized(ids, np.asarray(labels, np.int32), max_len, tokenizer.pad_token_id or 0)


class BatchIterator(Batches):
    """Epochs of dict batches: input_ids, attention_mask, token_type_ids, labels (int32
    [b, L] / [b]) and weights (float32 [b], 0 for filler rows); b = global_batch_size /
    process_count."""

    def __init__(
        self,
        data: Tokenized,
        global_batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_remainder: bool = True,
        pad_multiple: int = 16,
        bucket_window: int = 0,
        process_index: int = 0,
        process_count: int = 1,
    ):
        if len(data) == 0:
            raise ValueError("BatchIterator: empty dataset; expected at least one example.")
        if pad_multiple < 1 or bucket_window < 0:
            raise ValueError(f"BatchIterator: pad_multiple={pad_multiple}, bucket_window="
                             f"{bucket_window}; expected >= 1 and >= 0.")
        self._share("BatchIterator", global_batch_size, process_index, process_count)
        if drop_remainder and len(data) < global_batch_size:
            raise ValueError(
                f"BatchIterator: {len(data)} examples < global_batch_size="
                f"{global_batch_size} with drop_remainder=True gives no batch; use a "
                "smaller batch or drop_remainder=False."
            )
        self.data = data
        self.shuffle, self.seed, self.drop_remainder = shuffle, seed, drop_remainder
        self.pad_multiple, self.bucket_window = pad_multiple, bucket_window
        self.lengths = data.row_lengths()
        if self.lengths.max() > data.max_len:
            raise ValueError(
                f"BatchIterator: a row has {self.lengths.max()} ids > max_len="
                f"{data.max_len}; truncate rows to max_len when building Tokenized."
            )

    @property
    def steps_per_epoch(self) -> int:
        return whole_steps(len(self.data), self.global_batch_size, self.drop_remainder)

    def plan(self, epoch: int) -> list[np.ndarray]:
        """Example indices of each global batch of `epoch` (last one may be short)."""
        b = self.global_batch_size
        order, rng = epoch_order(len(self.data), self.seed, epoch, self.shuffle)
        order = order[: self.steps_per_epoch * b] if self.drop_remainder else order
        if self.bucket_window:
            w = self.bucket_window * b
            order = np.concatenate(
                [
                    chunk[np.argsort(self.lengths[chunk], kind="stable")]
                    for chunk in (order[i : i + w] for i in range(0, len(order), w))
                ]
            )
        batches = [order[i : i + b] for i in range(0, len(order), b)]
        if self.bucket_window and self.shuffle:
            num_full = len(order) // b
            batches = [batches[i] for i in rng.permutation(num_full)] + batches[num_full:]
        return batches

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """This process's rows of each batch of `epoch`, from `start_step` on."""
        check_start(start_step, self.steps_per_epoch)
        for idx in self.plan(epoch)[start_step:]:
            yield self._assemble(idx)

    def batch_lengths(self, start: int, stop: int) -> set[int]:
        """The padded lengths of the global batches ``start`` to ``stop`` (counted over
        epochs, as a run's steps are): what a run compiles its step for."""
        per, out = self.steps_per_epoch, set()
        for epoch in range(start // per, -(-stop // per)):
            plan = self.plan(epoch)[max(start - epoch * per, 0):stop - epoch * per]
            out |= {self.padded_length(idx) for idx in plan}
        return out

    def token_capacity(self, start: int, stop: int, groups: int) -> dict:
        """For each global batch shape (rows, padded length) of the batches ``start`` to
        ``stop`` (counted over epochs): the most real tokens any one of ``groups`` contiguous
        row groups of such a batch holds (``models.unpad.Capacity``)."""
        b = self.global_batch_size
        if b % groups:
            raise ValueError(f"token_capacity: {b} rows do not split into {groups} groups.")
        per, out = self.steps_per_epoch, {}
        for epoch in range(start // per, -(-stop // per)):
            for idx in self.plan(epoch)[max(start - epoch * per, 0):stop - epoch * per]:
                rows = np.concatenate([idx, np.full(b - len(idx), idx[0])])   # as _assemble
                most = int(self.lengths[rows].reshape(groups, -1).sum(1).max())
                shape = (b, self.padded_length(idx))
                out[shape] = max(out.get(shape, 0), most)
        return out

    def describe(self, label_names) -> list[str]:
        return [f"{len(self.data):,} examples, {int(self.lengths.sum()):,} tokens; labels: "
                f"{label_counts(self.data.labels, label_names)}; {self.steps_per_epoch:,} "
                "steps an epoch"]

    def show_row(self, batch: dict, i: int, tokenizer, label_names) -> list[str]:
        length = int(batch["attention_mask"][i].sum())
        return [f"  label {label_names[batch['labels'][i]]!r}, {length} tokens: "
                f"{decoded(tokenizer, batch['input_ids'][i][:length])}"]

    def caches(self) -> list:
        return caches_of(self.data.input_ids)

    def padded_length(self, idx: np.ndarray) -> int:
        """The [b, L] length of the batch of examples ``idx``: its longest row rounded up to
        ``pad_multiple``, at most ``max_len``."""
        return padded_length(int(self.lengths[idx].max()), self.pad_multiple,
                             self.data.max_len)

    def _assemble(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        length = self.padded_length(idx)
        real = len(idx)
        idx = np.concatenate([idx, np.full(self.global_batch_size - real, idx[0])])
        weights = (np.arange(self.global_batch_size) < real).astype(np.float32)
        lo = self.process_index * self.local_batch_size
        rows = slice(lo, lo + self.local_batch_size)
        input_ids = np.full((self.local_batch_size, length), self.data.pad_id, np.int32)
        mask = np.zeros((self.local_batch_size, length), np.int32)
        for r, i in enumerate(idx[rows]):
            ids = self.data.input_ids[i]
            input_ids[r, : len(ids)] = ids
            mask[r, : len(ids)] = 1
        return {
            "input_ids": input_ids,
            "attention_mask": mask,
            "token_type_ids": np.zeros_like(input_ids),
            "labels": self.data.labels[idx[rows]].astype(np.int32),
            "weights": weights[rows],
        }
