"""The one contract a run's batches keep, whatever they hold (``Batches``), and the pieces every
kind shares: the share check, the epoch's (seed, epoch) order, the steps of an epoch.

    data: Batches = splits.train_batches(spec, tokenizer, share)[0]
    for batch in data.batches(epoch, start_step): ...     # this process's rows, resumable
    data.batch_lengths(0, steps)                            # the [b, L] lengths a run compiles
    data.token_capacity(0, steps, groups)                   # an unpadding plan, or None
    data.plan(epoch)                                        # each batch's examples, or None
    data.describe(label_names); data.show_row(batch, i, tokenizer, label_names)   # data cmds

The kinds: labelled rows padded per batch (``pipeline.BatchIterator``), packed causal-LM rows
(``packing.PackedBatches``), fixed-shape arrays (``arrays.ArrayBatches``), and mixtures of
sources (``mixing.MixedBatches``, ``mixing.MixedExamples``). As levanter's dataset base class,
callers ask the contract, never the kind: a capability only some kinds have is a method here
whose default says "none" (``plan``, ``token_capacity``, ``caches``, ``row_sources``).
"""
from __future__ import annotations

import abc
from collections.abc import Iterator

import numpy as np


class Batches(abc.ABC):
    """Epochs of global batches of ``global_batch_size`` rows (dicts of numpy arrays), of which
    this process makes its share (``process_index`` of ``process_count`` equal contiguous
    parts: ``local_batch_size`` rows)."""

    global_batch_size: int

    def _share(self, name: str, global_batch_size: int, process_index: int,
               process_count: int) -> None:
        """Checks and keeps this process's share of every global batch (``name``: the class,
        for messages)."""
        if global_batch_size < 1:
            raise ValueError(f"{name}: global_batch_size={global_batch_size}; expected >= 1.")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ValueError(f"{name}: process_index={process_index}, process_count="
                             f"{process_count}; expected 0 <= process_index < process_count.")
        if global_batch_size % process_count:
            raise ValueError(f"{name}: global_batch_size={global_batch_size} does not divide "
                             f"by process_count={process_count}; use a multiple of "
                             f"{process_count}.")
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // process_count
        self.process_index = process_index

    @property
    @abc.abstractmethod
    def steps_per_epoch(self) -> int:
        """Global batches an epoch (every epoch has as many)."""

    @abc.abstractmethod
    def batches(self, epoch: int, start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """This process's rows of each batch of ``epoch``, from ``start_step`` on: the same
        rows whether the epoch is read whole or resumed there."""

    @abc.abstractmethod
    def batch_lengths(self, start: int, stop: int) -> set[int]:
        """The lengths (second dimension) of the global batches ``start`` to ``stop``, counted
        over epochs as a run's steps are: what a run compiles its step for."""

    @abc.abstractmethod
    def describe(self, label_names) -> list[str]:
        """What ``jaxaccel data prepare`` says of the split: examples or documents, tokens,
        labels (``label_names``: the classes, in label order), steps an epoch."""

    @abc.abstractmethod
    def show_row(self, batch: dict, i: int, tokenizer, label_names) -> list[str]:
        """What ``jaxaccel data show`` says of row ``i`` of ``batch`` (one of ``batches``'),
        decoded by ``tokenizer`` where it holds tokens."""

    def plan(self, epoch: int) -> list[np.ndarray] | None:
        """The examples of each global batch of ``epoch`` (indices into the split; the last
        one may be short), where a batch is made of whole examples; None where it is not
        (packed rows, pieces of documents)."""
        return None

    def token_capacity(self, start: int, stop: int, groups: int) -> dict | None:
        """For each global batch shape (rows, padded length) of the batches ``start`` to
        ``stop``: the most real tokens any one of ``groups`` contiguous row groups holds
        (``models.unpad.Capacity``); None where rows are not padded per batch (nothing to
        unpad)."""
        return None

    def caches(self) -> list:
        """The token caches (``tokencache.TokenCache``) the batches are read from; [] where
        they are made from memory."""
        return []

    def row_sources(self, epoch: int, step: int) -> list[str] | None:
        """A mixture's source of each of this process's rows of ``step`` of ``epoch``
        (``"[i] name"``); None for batches of one source."""
        return None


def epoch_order(n: int, seed: int, epoch: int,
                shuffle: bool = True) -> tuple[np.ndarray, np.random.Generator]:
    """The order of ``n`` rows in ``epoch``: a permutation drawn from (seed, epoch), or the rows
    in order without ``shuffle``; and the generator it was drawn from, for the epoch's further
    draws (``BatchIterator``'s order of length buckets)."""
    if epoch < 0:
        raise ValueError(f"epoch={epoch}; expected >= 0.")
    rng = np.random.default_rng((seed, epoch))
    return (rng.permutation(n) if shuffle else np.arange(n)), rng


def whole_steps(rows: int, global_batch_size: int, drop_remainder: bool) -> int:
    """Batches of ``rows`` rows: the whole ones, or with the last, short one."""
    return rows // global_batch_size if drop_remainder else -(-rows // global_batch_size)


def check_start(start_step: int, steps_per_epoch: int) -> None:
    """A step of an epoch to start at: 0 to ``steps_per_epoch`` (the end: no batch)."""
    if not 0 <= start_step <= steps_per_epoch:
        raise ValueError(f"start_step={start_step}; expected 0..{steps_per_epoch}.")


def caches_of(store) -> list:
    """The token caches of rows or documents (``CachedRows``, ``CachedDocs``, their chained
    forms: ``caches()``); [] for ones held in memory (a list, ``ListDocs``)."""
    caches = getattr(store, "caches", None)
    return caches() if caches is not None else []


def decoded(tokenizer, ids) -> str:
    """Token ids as text (quoted), as ``data show`` prints them."""
    return repr(tokenizer.decode([int(i) for i in ids]))


def label_counts(labels: np.ndarray, names) -> str:
    """Examples of each class, as ``data prepare`` prints them."""
    counts = np.bincount(labels, minlength=len(names))
    return ", ".join(f"{name} {c:,}" for name, c in zip(names, counts))


__all__ = ["Batches", "caches_of", "check_start", "decoded", "epoch_order", "label_counts",
           "whole_steps"]
