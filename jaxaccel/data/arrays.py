"""Batches of fixed-shape arrays (spectrograms, images) with labels: what the ViT family's tasks
train and evaluate on (``mae``, ``classification``).

A batch is ``{"pixels": float32 [rows, *shape], "labels": int32 [rows], "weights": float32
[rows]}`` (weight 0: a padding row completing the last eval batch). Training batches are
whole, from an order shuffled per (seed, epoch); evaluation batches take every example once,
in order. The examples are arrays made ahead, or made per batch by an object with ``shape``,
``len`` and ``pixels(rows, epoch, augment) -> float32 [len(rows), *shape]`` (``augment``:
the batches are training's; ``data.images.ImageExamples`` decodes and augments images).
Each process loads its part of every global batch (``process_index`` of
``process_count`` equal contiguous parts), as the text iterators do.

    data = ArrayBatches(x, y, 32, shuffle=True, seed=0)
    for batch in data.batches(epoch, start_step): ...
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from jaxaccel.data.batches import Batches, check_start, epoch_order, label_counts, whole_steps


class ArrayBatches(Batches):
    """Epochs of batches of ``x`` [n, *shape] (float32) and ``labels`` [n] (module doc)."""

    def __init__(self, x: np.ndarray, labels: np.ndarray, global_batch_size: int, *,
                 shuffle: bool = True, seed: int = 0, drop_remainder: bool = True,
                 process_index: int = 0, process_count: int = 1):
        x, labels = (x if hasattr(x, "pixels") else Ready(x)), np.asarray(labels, np.int32)
        if len(x) == 0 or len(x) != len(labels):
            raise ValueError(f"ArrayBatches: {len(x)} examples and {len(labels)} labels; "
                             "expected the same number, at least one.")
        self._share("ArrayBatches", global_batch_size, process_index, process_count)
        if drop_remainder and len(x) < global_batch_size:
            raise ValueError(f"ArrayBatches: {len(x)} examples < global_batch_size="
                             f"{global_batch_size} with drop_remainder=True gives no batch.")
        self.x, self.labels = x, labels
        self.shuffle, self.seed, self.drop_remainder = shuffle, seed, drop_remainder

    def __len__(self) -> int:
        return len(self.x)

    @property
    def steps_per_epoch(self) -> int:
        return whole_steps(len(self.x), self.global_batch_size, self.drop_remainder)

    def batch_lengths(self, start: int, stop: int) -> set[int]:
        """The sizes of the batches' second dimension (``x.shape[1]``): every batch has it."""
        return {self.x.shape[1]} if stop > start else set()

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """This process's rows of each batch of ``epoch``, from ``start_step`` on."""
        check_start(start_step, self.steps_per_epoch)
        lo = self.process_index * self.local_batch_size
        for idx in self.plan(epoch)[start_step:]:
            rows = idx[lo:lo + self.local_batch_size]
            short = self.local_batch_size - len(rows)
            weights = np.concatenate([np.ones(len(rows), np.float32),
                                      np.zeros(short, np.float32)])
            rows = np.concatenate([rows, np.zeros(short, rows.dtype)])
            yield {"pixels": self.x.pixels(rows, epoch, self.shuffle),
                   "labels": self.labels[rows], "weights": weights}

    def plan(self, epoch: int) -> list[np.ndarray]:
        """The examples of each global batch of ``epoch`` (the last one may be short)."""
        order, _ = epoch_order(len(self.x), self.seed, epoch, self.shuffle)
        b = self.global_batch_size
        return [order[s * b:(s + 1) * b] for s in range(self.steps_per_epoch)]

    def describe(self, label_names) -> list[str]:
        return [f"{len(self):,} examples of {tuple(self.x.shape[1:])}; labels: "
                f"{label_counts(self.labels, label_names)}; {self.steps_per_epoch:,} steps an "
                "epoch"]

    def show_row(self, batch: dict, i: int, tokenizer, label_names) -> list[str]:
        x = batch["pixels"][i]
        return [f"  label {label_names[batch['labels'][i]]!r}: array {x.shape}, mean "
                f"{x.mean():.3f}, std {x.std():.3f}"]


class Ready:
    """Examples made ahead: float32 [n, *shape] (``ArrayBatches``' ``pixels`` protocol)."""

    def __init__(self, x):
        self.x = np.asarray(x, np.float32)
        self.shape = self.x.shape

    def __len__(self) -> int:
        return len(self.x)

    def pixels(self, rows, epoch: int, augment: bool) -> np.ndarray:
        return self.x[rows]


__all__ = ["ArrayBatches"]
