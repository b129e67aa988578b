"""``jaxaccel data prepare`` and ``jaxaccel data show``: a run's data made and looked at before
it trains, through the trainer's own resolve and batching (``train.run``, ``data.splits``).

    prepare(cfg) -> lines    # builds the token caches (e.g. on a CPU host before a TPU job)
    show(cfg, n=5) -> lines  # the first n training rows, decoded: what the model will read
"""
from __future__ import annotations

import os

import numpy as np

from jaxaccel.data import load_tokenizer, run_tokenizer, splits, tokencache
from jaxaccel.data.mixing import MixedBatches
from jaxaccel.data.packing import PackedBatches
from jaxaccel.data.spec import DataSpec
from jaxaccel.models import check_vocab, packaged_minilm_dir
from jaxaccel.train.run import resolve


def _tokenizer(data: DataSpec, architecture):
    """The run's tokenizer as training loads it (the model's, or a corpus's own BPE)."""
    if data.holds != "text":
        return None
    default = None if data.model.tokenizer else packaged_minilm_dir()
    folder = run_tokenizer.tokenizer_dir(data, default)
    tokenizer = load_tokenizer(folder)
    check_vocab(len(tokenizer), architecture, folder)
    return tokenizer


def _batches(cfg):
    r = resolve(cfg)
    tokenizer = _tokenizer(r.data, r.spec.architecture)
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


def _caches(batches) -> list[tokencache.TokenCache]:
    if isinstance(batches, MixedBatches):
        return [c for source in batches.sources for c in _caches(source)]
    data = batches.docs if isinstance(batches, PackedBatches) else getattr(batches, "data", None)
    rows = getattr(data, "input_ids", data)
    stores = getattr(rows, "stores", [rows])                # a mixture's sources: chained
    return [s.cache for s in stores if getattr(s, "cache", None) is not None]


def _mixed(data: DataSpec, b) -> list[str]:
    """A mixture's epoch and its sources (``MixedBatches``, ``MixedExamples``): documents and
    tokens, or examples and tokens, and the share of the epoch's rows each gives (the realised
    proportions beside the weights)."""
    mix = b.mixture
    lines = [f"train: a mixture of {len(mix.sizes)} sources; {b.steps_per_epoch:,} steps an "
             f"epoch, until [{mix.first_out}] {data.parts[mix.first_out][0].name} runs out "
             "(each source then goes on, one that runs out with its next epoch's order)"]
    for i, taken in enumerate(mix.taken()):
        if isinstance(b, MixedBatches):
            s = b.sources[i]
            what = (f"{len(s.docs):,} documents, {s.tokens:,} tokens, {s.rows_per_epoch:,} rows "
                    f"of {b.seq_len}")
        else:
            lengths = b.lengths[b.offsets[i]:b.offsets[i + 1]]
            what = f"{len(lengths):,} examples, {int(lengths.sum()):,} tokens"
        lines.append(f"  [{i}] {data.parts[i][0].name}, weight {mix.interleave.weights[i]:.3f}: "
                     f"{what}; {taken:,} rows an epoch, {taken / mix.rows_per_epoch:.3f} of them")
    return lines


def _counts(labels: np.ndarray, names) -> str:
    counts = np.bincount(labels, minlength=len(names))
    return ", ".join(f"{name} {c:,}" for name, c in zip(names, counts))


def prepare(cfg) -> list[str]:
    """Build the run's caches (both splits, as ``jaxaccel train`` would) and say what they
    hold: documents, tokens, rows, label counts, the cache's size and path."""
    r, _, batches, names = _batches(cfg)
    lines = [f"data.name={r.data.name} ({r.data.kind}): {r.spec.task} batches of "
             f"{r.data.batching.batch_size} rows"]
    for split, b in batches.items():
        if hasattr(b, "mixture"):
            lines += _mixed(r.data, b)
            lines += [f"  cache: {c.folder} ({_size(c.folder) / 1e6:,.1f} MB)" for c in _caches(b)]
            continue
        if isinstance(b, PackedBatches):
            what = (f"{len(b.docs):,} documents, {b.tokens:,} tokens, {b.rows_per_epoch:,} rows "
                    f"of {b.seq_len}")
        elif hasattr(b, "data"):
            what = (f"{len(b.data):,} examples, {int(b.lengths.sum()):,} tokens; labels: "
                    f"{_counts(b.data.labels, names)}")
        else:
            what = f"{len(b):,} examples of {tuple(b.x.shape[1:])}; labels: " \
                   f"{_counts(b.labels, names)}"
        lines.append(f"{split}: {what}; {b.steps_per_epoch:,} steps an epoch")
        lines += [f"  cache: {c.folder} ({_size(c.folder) / 1e6:,.1f} MB)" for c in _caches(b)]
    return lines


def _text(tokenizer, ids) -> str:
    return repr(tokenizer.decode([int(i) for i in ids]))


def _packed_row(tokenizer, batch: dict, r: int) -> list[str]:
    seg, w = batch["segment_ids"][r], batch["target_weights"][r]
    out = [f"  {int((seg > 0).sum())} tokens in {int(seg.max())} segment(s), "
           f"{int(w.sum())} targets"]
    for s in range(1, int(seg.max()) + 1):
        where = np.flatnonzero(seg == s)
        last = where[-1]
        end = ("its last token's target is the next row's first token" if w[last] else
               "ends its document (no target after its EOS)")
        out.append(f"  segment {s} (positions 0-{len(where) - 1}; {end}): "
                   f"{_text(tokenizer, batch['input_ids'][r][where])}")
    return out


def show(cfg, n: int = 5, split: str = "train") -> list[str]:
    """The first ``n`` rows of ``split``'s first batches (epoch 0), decoded: segments and
    targets of packed rows, label and text of labelled rows, the array and label of arrays."""
    r, tokenizer, batches, names = _batches(cfg)
    if split not in ("train", "eval"):
        raise ValueError(f"data show --split {split!r}: train or eval.")
    b = batches["train" if split == "train" else _eval_name(r.data)]
    lines, row = [], 0
    for step, batch in enumerate(b.batches(0)):
        mixed = b.mixture.rows(0, step)[0] if hasattr(b, "mixture") else None
        for i in range(len(next(iter(batch.values())))):
            if row == n:
                return lines
            source = "" if mixed is None else \
                f", source [{mixed[i]}] {r.data.parts[mixed[i]][0].name}"
            lines.append(f"row {row} (step {step}{source}):")
            if isinstance(b, (PackedBatches, MixedBatches)):
                lines += _packed_row(tokenizer, batch, i)
            elif "pixels" in batch:
                x = batch["pixels"][i]
                lines.append(f"  label {names[batch['labels'][i]]!r}: array {x.shape}, mean "
                             f"{x.mean():.3f}, std {x.std():.3f}")
            else:
                length = int(batch["attention_mask"][i].sum())
                lines.append(f"  label {names[batch['labels'][i]]!r}, {length} tokens: "
                             f"{_text(tokenizer, batch['input_ids'][i][:length])}")
            row += 1
    return lines


__all__ = ["prepare", "show"]
