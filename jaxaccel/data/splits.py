"""A run's batches, from its resolved data (``spec.DataSpec``): which examples each split holds
and how they are batched.

    train, label_names = train_batches(data, tokenizer, share)
    evals, _ = eval_batches(data, tokenizer, share, label_names)   # the training split unread
    check_batch_fits(cfg.train, {"data": 2, "fsdp": 4})            # before anything compiles

Text (labelled texts and corpora) is tokenized once into the token cache
(``jaxaccel.data.tokencache``) and read from it as batches are made; ready token ids and arrays
come from their source's reader. Splits:

* a source's own split, by name (``data.eval_split``: test, validation, ...);
* ``data.holdout`` > 0 where the source has no eval split of that name: that fraction of the
  training split is the eval split, the rest trains;
* ``data.validation_size`` > 0: that many training examples are held out as the
  ``"validation"`` split (then ``data.eval_split=validation``), the rest trains: a recipe is
  chosen on it, the test split is read once at the end.

Both are drawn by a fixed permutation (``spec.held_rows``), the same whatever the run's seed.
Batching, per process (its ``share`` of every batch: part i of n, ``sharding.batch_share``):

* labelled rows (``pipeline.BatchIterator``): train shuffled per (seed, epoch), whole batches
  only, length-bucketed over windows of 50 batches when ``data.bucket``; eval in no particular
  order, sorted by length over the whole split to pad least, the last batch completed with
  weight-0 rows;
* corpora (``packing.PackedBatches``): documents (each ending with EOS) packed into rows of
  ``data.max_len``; train from a document order shuffled per (seed, epoch), whole batches;
  eval in document order, the last batch completed with padding rows;
* arrays (``arrays.ArrayBatches``): train shuffled per (seed, epoch), eval in order;
* a mixture (``data.name=mixture``): train rows interleaved by weight from each source's own
  packed rows (``mixing.MixedBatches``) or examples (``mixing.MixedExamples``, classes learnt
  from all its sources), eval every source's eval split in turn.

Text is tokenized by the run's tokenizer, decided when the run is resolved
(``DataSpec.tokenizer``: a corpus without ``model.tokenizer`` or ``model.checkpoint`` has a
byte-level BPE of ``data.tokenizer_vocab`` tokens trained on its training split).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os

import numpy as np

from jaxaccel.data import encode, mixture, tokencache
from jaxaccel.data.arrays import ArrayBatches
from jaxaccel.data.cached import CachedDocs, CachedRows
from jaxaccel.data.mixing import MixedBatches, MixedExamples, chained
from jaxaccel.data.packing import ChainedDocs, PackedBatches
from jaxaccel.data.pipeline import BatchIterator, Tokenized
from jaxaccel.data.spec import DataError, DataMissing, DataSpec, held_rows, holdout_size

TRAIN_BUCKET_WINDOW = 50     # global batches sorted by length together (data.bucket)

log = logging.getLogger("jaxaccel")


# ----------------------------------------------------------------------------- splits


def source_split(data: DataSpec, split: str) -> str:
    """The source's split that holds ``split`` (a held-out split is cut from ``train``)."""
    d = data.settings
    if split == "validation" and d.validation_size:
        return "train"
    if split == data.eval_split and data.held_out:
        return "train"
    if split == "validation" and "validation" not in data.splits:
        raise ValueError("data.eval_split='validation' needs data.validation_size > 0 (e.g. "
                         "1000): the validation split is held out of the training split.")
    if split not in data.splits and data.absent:
        raise DataMissing(data.absent)          # e.g. training files gone (files.describe)
    if split not in data.splits:
        raise ValueError(f"data.name={data.name!r} has no split {split!r} (it has "
                         f"{', '.join(data.splits)}); set data.eval_split to one of them, or "
                         "hold one out of the training split with data.holdout (e.g. 0.1).")
    return split


def split_rows(data: DataSpec, split: str, n: int) -> np.ndarray | None:
    """The indices (into its source split of ``n`` examples) of ``split``; None: all. The
    eval split of a trained model's evaluation must hold none of the examples it trained on
    (``DataSpec.trained``): ``DataError`` otherwise."""
    rows = _rows(data, split, n)
    if data.trained is not None and split == data.eval_split != "train":
        _check_unseen(data, split, n, rows)
    return rows


SOURCE_KEYS = ("name", "data_dir", "train_files", "dataset")
"""The ``data`` keys that say which examples a source's training split holds."""

CUT_KEYS = ("eval_split", "holdout", "validation_size")
"""The ``data`` keys that cut a held-out split out of the training split."""


def _check_unseen(data: DataSpec, split: str, n: int, rows: np.ndarray | None) -> None:
    """``DataError`` where ``split``, cut from the training split (``data.holdout``,
    ``data.validation_size``), holds examples the model of ``data.trained`` trained on (a
    score on them would not be a held-out score)."""
    d, t = data.settings, data.trained
    if source_split(data, split) != "train" or any(t.get(k) != d.get(k) for k in SOURCE_KEYS):
        return
    seen = _rows(dataclasses.replace(data, settings=t, trained=None), "train", n)
    scored = np.arange(n) if rows is None else rows
    both = np.intersect1d(scored, np.arange(n) if seen is None else seen).size
    if both:
        was = ", ".join(f"data.{k}={t.get(k)!r}" for k in CUT_KEYS)
        now = ", ".join(f"data.{k}={d.get(k)!r}" for k in CUT_KEYS)
        raise DataError(f"the eval split {split!r} ({now}) holds {both} of the {len(scored)} "
                        f"examples it would score from the training split the model trained "
                        f"on ({was}): a held-out split holds none of them (docs/getting-"
                        "started.md, Held-out splits). Evaluate on a split the run held out (its "
                        "own data.eval_split, or data.validation_size up to the run's), or train "
                        "a run that holds these examples out.")


def _rows(data: DataSpec, split: str, n: int) -> np.ndarray | None:
    d = data.settings
    if source_split(data, split) != "train" or split not in ("train", "validation",
                                                             data.eval_split):
        return None
    rows = np.arange(n)
    if data.held_out:
        held = held_rows(n, holdout_size(n, d.holdout), "data.holdout")
        if split == data.eval_split:
            return held
        rows = np.setdiff1d(rows, held)
    if d.validation_size:
        held = rows[held_rows(len(rows), d.validation_size)]
        if split == "validation":
            return held
        rows = np.setdiff1d(rows, held)
    return None if len(rows) == n else rows


# ----------------------------------------------------------------------------- token caches


def _cache(data: DataSpec, split: str, tokenizer) -> tuple[tokencache.TokenCache, np.ndarray]:
    """The token cache of ``split``'s source split, and ``split``'s rows of it."""
    cache = tokencache.tokens(data, source_split(data, split), tokenizer,
                              workers=data.settings.workers or None)
    rows = split_rows(data, split, len(cache))
    return cache, np.arange(len(cache)) if rows is None else rows


def learnt_names(data: DataSpec, values: list[dict]) -> tuple[str, ...]:
    """The classes of a labelled training split of label ``values`` (a token cache's
    ``label_values``): the source's, else the labels sorted (integers by value); a split of one
    class is refused."""
    if data.label_names is not None:
        return data.label_names
    ints = [v for v in values if isinstance(v["value"], int)]
    words = [v for v in values if not isinstance(v["value"], int)]
    if ints and words:
        raise DataError(f"the labels mix integers ({ints[0]['value']} at {ints[0]['first']}) "
                        f"and names ({words[0]['value']!r} at {words[0]['first']}); give every "
                        "label the same way.")
    if len(values) < 2:
        only = values[0]
        raise DataError(f"every training example has the label {only['value']!r} (the first at "
                        f"{only['first']}): a classifier needs two classes or more. Check "
                        "data.label_field.")
    return tuple(str(v["value"]) for v in sorted(values, key=lambda v: v["value"]))


def label_ids(data: DataSpec, cache: tokencache.TokenCache, names: tuple[str, ...],
              split: str) -> np.ndarray:
    """int32 [n]: each example's class in ``names``; a label that is not one is refused
    with its first example's file and line."""
    lookup = np.empty(len(cache.label_values), np.int32)
    for i, v in enumerate(cache.label_values):
        value = v["value"]
        if data.labels_are_ids and isinstance(value, int):
            ok = 0 <= value < len(names)
            lookup[i] = value
        else:
            ok = str(value) in names
            lookup[i] = names.index(str(value)) if ok else -1
        if not ok:
            raise DataError(f"{v['first']}: label {value!r} of the {split!r} split is not one of "
                            f"the training classes ({', '.join(names)}); train on it too, or "
                            "drop those examples.")
    return lookup[cache.labels]


def _labelled(data: DataSpec, split: str, tokenizer, names) -> tuple[Tokenized, tuple]:
    cache, rows = _cache(data, split, tokenizer)
    names = learnt_names(data, cache.label_values) if names is None else names
    if data.model.num_labels is not None and len(names) > data.model.num_labels:
        raise ValueError(f"data {data.name!r} has {len(names)} classes but model.num_labels="
                         f"{data.model.num_labels}; set model.num_labels={len(names)}.")
    labels = label_ids(data, cache, names, split)[rows]
    return Tokenized(CachedRows(cache, rows), labels, data.max_len,
                     tokenizer.pad_token_id or 0, cache.lengths()[rows]), names


# ----------------------------------------------------------------------------- batches


def _share(share: tuple[int, int] | None) -> dict:
    """The part of every batch this process loads: ``share`` = (i, n), part i of n equal
    contiguous parts (``sharding.batch_share`` of the run's mesh; processes that hold the same
    rows, e.g. two pipeline stages, load the same part); None: the whole batch."""
    i, n = share or (0, 1)
    return dict(process_index=i, process_count=n)


def _check_train_batch(data: DataSpec, rows: int, what: str) -> None:
    """A training batch of ``train.batch_size`` rows is refused where the train split has fewer
    (no full batch to train on), naming the key and the data's size, before any batch is
    made."""
    size = data.batching.batch_size
    if rows < size:
        raise ValueError(f"train.batch_size={size} is more than the {rows} {what}: no full "
                         f"batch to train on. Set train.batch_size to at most {rows} (a "
                         "multiple of the device count), or train on more data.")


def _eval_batch_size(data: DataSpec, rows: int, split: str) -> int:
    """``train.eval_batch_size``, or, where that is more than the ``rows`` of the eval split,
    the least multiple of the device count that holds them all (one batch; a multiple of
    every mesh's batch shards and of the process count). Without the clamp the rows beyond
    the split are padding the eval step still computes: 100,000 rows of 128 tokens asked XLA
    for 485 GB of logits at an 8k vocabulary."""
    size, n = data.batching.eval_batch_size, data.batching.devices
    fit = -(-rows // n) * n
    if size <= fit:
        return size
    log.info("train.eval_batch_size=%d is more than the %d rows of the %r split: evaluating "
             "them in one batch of %d rows", size, rows, split, fit)
    return fit


def check_rows(data: DataSpec) -> None:
    """A corpus's rows must fit the model (``data.max_len`` at most its positions)."""
    limit = data.model.max_positions
    if data.kind == "corpus" and data.settings.max_len > limit:
        raise ValueError(f"data.max_len={data.settings.max_len} (the packed row length) exceeds "
                         f"the model's maximum sequence length {limit}; set data.max_len <= "
                         f"{limit}.")


def _docs(data: DataSpec, split: str, tokenizer, training: bool) -> CachedDocs:
    """The documents of a corpus's ``split``, from its token cache; a training split holds a
    row's tokens or more."""
    check_rows(data)
    docs = CachedDocs(*_cache(data, split, tokenizer))
    tokens, length = int(docs.lengths.sum()), data.max_len
    if training and tokens < length:
        raise DataError(f"the {split!r} split of data.name={data.name!r} holds {tokens} tokens, "
                        f"less than one row of data.max_len={length}; give it more text or "
                        "shorter rows.")
    return docs


def _packed(data: DataSpec, split: str, docs, training: bool, share) -> PackedBatches:
    length = data.max_len
    n = -(-int(docs.lengths.sum()) // length)
    if training:
        _check_train_batch(data, n, f"rows of {length} tokens (data.max_len) that the "
                           f"{data.name!r} {split!r} split packs into")
    size = data.batching.batch_size if training else _eval_batch_size(data, n, split)
    return PackedBatches(docs, length, size, shuffle=training, seed=data.batching.seed,
                         drop_remainder=training, **_share(share))


def _mixed_names(data: DataSpec, tokenizer) -> tuple[str, ...]:
    """A mixture's classes: the ones its sources name, where they all name the same, else all
    its sources' training labels together (``learnt_names``)."""
    named = {part.label_names for part, _ in data.parts}
    if len(named) == 1 and None not in named:
        return named.pop()
    values = {}
    for part, _ in data.parts:
        for v in _cache(part, "train", tokenizer)[0].label_values:
            values.setdefault(v["value"], v)
    return learnt_names(data, list(values.values()))


def _mixed(data: DataSpec, split: str, tokenizer, share, names, training: bool):
    """``(batches, label names)`` of a mixture (``data.parts``): training rows interleaved from
    its sources' by weight (``mixing``); its eval split, every source's own eval split one after
    another."""
    parts, weights, b = [p for p, _ in data.parts], [w for _, w in data.parts], data.batching
    mix = dict(seed=b.seed, source_names=[part.name for part in parts], **_share(share))
    own = ["train" if training else part.eval_split for part in parts]
    if data.batches == "packed":
        docs = [_docs(part, s, tokenizer, training) for part, s in zip(parts, own)]
        if not training:
            return _packed(data, split, ChainedDocs(docs), False, share), ()
        return MixedBatches(docs, weights, data.max_len, b.batch_size, **mix), ()
    names = _mixed_names(data, tokenizer) if names is None else names
    examples = [_labelled(part, s, tokenizer, names)[0] for part, s in zip(parts, own)]
    if not training:
        return eval_rows(data, chained(examples), share), names
    return MixedExamples(examples, weights, b.batch_size,
                         pad_multiple=data.settings.pad_multiple, **mix), names


def eval_rows(data: DataSpec, examples: Tokenized, share, size: int | None = None
              ) -> BatchIterator:
    """Labelled eval batches of ``size`` rows (default ``train.eval_batch_size``): every
    example once, sorted by length over the whole split."""
    size = data.batching.eval_batch_size if size is None else size
    return BatchIterator(examples, size, shuffle=False, drop_remainder=False,
                         bucket_window=len(examples) // size + 1,
                         pad_multiple=data.settings.pad_multiple, **_share(share))


def _arrays(data: DataSpec, split: str) -> tuple[np.ndarray, np.ndarray]:
    source = source_split(data, split)
    x, labels = data.reader.examples(source)
    rows = split_rows(data, split, len(labels))
    return (x, labels) if rows is None else (x[rows], labels[rows])


def _ready(data: DataSpec, split: str) -> Tokenized:
    """Ready token ids of ``split`` (synthetic)."""
    examples = data.reader.examples(source_split(data, split))
    rows = split_rows(data, split, len(examples))
    if rows is None:
        return examples
    return dataclasses.replace(examples, input_ids=[examples.input_ids[i] for i in rows],
                               labels=examples.labels[rows], lengths=None)


def _batches(data: DataSpec, split: str, tokenizer, share, names, training: bool):
    """``(batches, label names)`` of ``split`` (module doc)."""
    what = f"examples of the {data.name!r} {split!r} split"
    if data.parts:
        return _mixed(data, split, tokenizer, share, names, training)
    if data.batches == "packed":
        return _packed(data, split, _docs(data, split, tokenizer, training), training, share), ()
    if data.batches == "arrays":
        x, labels = _arrays(data, split)
        names = data.label_names if names is None else names
        if training:
            _check_train_batch(data, len(x), what)
        size = data.batching.batch_size if training else _eval_batch_size(data, len(x), split)
        return ArrayBatches(x, labels, size, shuffle=training, seed=data.batching.seed,
                            drop_remainder=training, **_share(share)), names
    if data.kind == "tokens":
        examples, names = _ready(data, split), data.label_names
    else:
        examples, names = _labelled(data, split, tokenizer, names)
    d = data.settings
    if training:
        _check_train_batch(data, len(examples), what)
        return BatchIterator(examples, data.batching.batch_size, shuffle=True,
                             seed=data.batching.seed, drop_remainder=True,
                             bucket_window=TRAIN_BUCKET_WINDOW if d.bucket else 0,
                             pad_multiple=d.pad_multiple, **_share(share)), names
    return eval_rows(data, examples, share), names


def train_batches(data: DataSpec, tokenizer, share: tuple[int, int] | None = None):
    """``(batches, label names)``: this process's training batches (shuffled, bucketed, full;
    its ``share`` of every batch); a corpus's packed causal-LM rows have no labels;
    ``tokenizer`` is unused for ready ids and arrays."""
    return _batches(data, "train", tokenizer, share, None, True)


def eval_batches(data: DataSpec, tokenizer, share: tuple[int, int] | None = None,
                 label_names: tuple[str, ...] | None = None):
    """``(batches, label names)`` of ``data.eval_split`` (every example once; its ``share`` as
    ``train_batches``'); the training split is neither read nor tokenized unless the eval split
    is held out of it. ``label_names``: the training split's classes (a run's), else the
    data's own."""
    return _batches(data, data.eval_split, tokenizer, share, label_names, False)


def check_batch_fits(train_cfg, batch_axes: dict[str, int], *, training: bool = True) -> None:
    """Each global batch (and, ``training``, each micro-batch of ``train.grad_accum``) must
    split evenly over the devices of the mesh's batch axes (``batch_axes``: axis -> size)."""
    shards = math.prod(batch_axes.values())
    t = train_cfg
    sizes = {"train.batch_size": t.batch_size, "train.eval_batch_size": t.eval_batch_size,
             "train.batch_size / train.grad_accum": t.batch_size // t.grad_accum}
    if not training:
        sizes = {"train.eval_batch_size": t.eval_batch_size}
    for key, size in sizes.items():
        if size % shards:
            raise ValueError(
                f"{key}={size} does not split over the {shards} devices of the mesh's batch "
                f"axes {batch_axes}; use a multiple of {shards} (e.g. "
                f"{-(-size // shards) * shards}), or set the mesh (mesh.data=...).")


def prepared(data: DataSpec, tokenizer) -> DataSpec:
    """``data`` with the training rows read from its prepared token cache's index (``jaxaccel
    data prepare``, or an earlier run) where the count was unknown; nothing is tokenized or
    built (``tokenizer()`` loads the run's tokenizer, ``DataSpec.tokenizer``, once there)."""
    if data.rows is not None or not data.tokenized or data.reader is None:
        return data
    if not data.tokenizer or not os.path.isdir(data.tokenizer):
        return data
    fingerprint = encode.fingerprint(tokenizer())
    if data.parts:      # each source's cache, of the mixture's tokenizer
        return mixture.counted(dataclasses.replace(data, parts=tuple(
            (_prepared_rows(part, fingerprint), w) for part, w in data.parts)))
    return _prepared_rows(data, fingerprint)


def _prepared_rows(data: DataSpec, fingerprint: str) -> DataSpec:
    """``data`` with the training rows of its cache for the tokenizer of ``fingerprint``, where
    that cache is built and the count was unknown."""
    if data.rows is not None:
        return data
    found = tokencache.lookup(tokencache.plan(data, "train", fingerprint))
    if found is None:
        return data
    rows = split_rows(data, "train", len(found))
    rows = np.arange(len(found)) if rows is None else rows
    if data.kind == "corpus":
        n = -(-int(found.lengths()[rows].sum()) // data.max_len)
    else:
        n = len(rows)
    return dataclasses.replace(data, rows=n, count_source=f"the prepared cache {found.folder}")


__all__ = ["check_batch_fits", "check_rows", "eval_batches",
           "eval_rows", "prepared", "source_split", "split_rows", "train_batches"]
