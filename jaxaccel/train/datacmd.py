"""``jaxaccel data prepare`` and ``jaxaccel data show``: a run's data made and looked at before
it trains, through the trainer's own resolve, tokenizer and batching (``train.run``,
``train.run_data``, ``data.splits``), each split described by its batches
(``data.batches.Batches``: ``describe``, ``show_row``, ``caches``, ``row_sources``).

    prepare(cfg) -> lines    # builds the token caches (e.g. on a CPU host before a TPU job)
    show(cfg, n=5) -> lines  # the first n training rows, decoded: what the model will read
"""
from __future__ import annotations

import os

from jaxaccel.data import splits
from jaxaccel.data.spec import DataSpec
from jaxaccel.train.run import resolve
from jaxaccel.train.run_data import tokenizer_of


def _batches(cfg):
    r = resolve(cfg)
    tokenizer = tokenizer_of(r.data, r.spec.architecture)
    train, names = splits.train_batches(r.data, tokenizer)
    evals, _ = splits.eval_batches(r.data, tokenizer, None, names)
    return r, tokenizer, {"train": train, _eval_name(r.data): evals}, names


def _eval_name(data: DataSpec) -> str:
    """The eval split's name; a mixture's is its sources' eval splits, one after another."""
    if not data.parts:
        return data.eval_split
    return " + ".join(f"[{i}] {part.eval_split}" for i, (part, _) in enumerate(data.parts))


def _size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


def prepare(cfg) -> list[str]:
    """Build the run's caches (both splits, as ``jaxaccel train`` would) and say what they
    hold: documents, tokens, rows, label counts, the cache's size and path."""
    r, _, batches, names = _batches(cfg)
    lines = [f"data.name={r.data.name} ({r.data.kind}): {r.spec.task} batches of "
             f"{r.data.batching.batch_size} rows"]
    for split, b in batches.items():
        first, *rest = b.describe(names)
        lines += [f"{split}: {first}", *rest]
        lines += [f"  cache: {c.folder} ({_size(c.folder) / 1e6:,.1f} MB)" for c in b.caches()]
    return lines


def show(cfg, n: int = 5, split: str = "train") -> list[str]:
    """The first ``n`` rows of ``split``'s first batches (epoch 0), decoded: segments and
    targets of packed rows, label and text of labelled rows, the array and label of arrays."""
    r, tokenizer, batches, names = _batches(cfg)
    if split not in ("train", "eval"):
        raise ValueError(f"data show --split {split!r}: train or eval.")
    b = batches["train" if split == "train" else _eval_name(r.data)]
    lines, row = [], 0
    for step, batch in enumerate(b.batches(0)):
        sources = b.row_sources(0, step)
        for i in range(len(next(iter(batch.values())))):
            if row == n:
                return lines
            source = "" if sources is None else f", source {sources[i]}"
            lines.append(f"row {row} (step {step}{source}):")
            lines += b.show_row(batch, i, tokenizer, names)
            row += 1
    return lines


__all__ = ["prepare", "show"]
