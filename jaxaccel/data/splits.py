"""A run's data, from its config: which examples each split holds and how they are batched.

    train, label_names = train_batches(cfg, tokenizer, max_positions)
    evals, label_names = eval_batches(cfg, tokenizer, max_positions)   # no training split read
    check_batch_fits(cfg.train, {"data": 2, "fsdp": 4})                 # before anything compiles

Examples: ``data.name=synthetic`` makes random token ids (train from ``seed``, eval from
``seed + 1``); a text dataset is read from its TFDS cache and only the split asked for is
tokenized. A corpus of documents (``DATASETS`` entries without labels, e.g. ``canterbury``)
gives causal-LM batches instead: its documents tokenized (with EOS) and packed into rows of
``data.max_len`` tokens (``jaxaccel.data.packing``), by the model's tokenizer when the config
names one (``model.tokenizer`` / ``model.checkpoint``), else by a byte-level BPE of
``data.tokenizer_vocab`` tokens trained on the corpus's train split (``tokenizer_dir``).
Batching, per process (``jax.process_index()`` of ``jax.process_count()``):

* train: shuffled per (seed, epoch), whole batches only, length-bucketed over windows of 50
  batches when ``data.bucket`` (less padding);
* validation (``data.eval_split=validation``): ``data.validation_size`` examples held out of
  the training split by a fixed permutation (``validation_rows``), which then trains on the
  rest: a recipe is chosen on it, the test split is read once at the end;
* eval: in no particular order, so sorted by length over the whole split (one window) to pad
  least, the last batch completed with weight-0 rows.

Packed corpora: train rows from a document order shuffled per (seed, epoch), whole batches
only; eval rows in document order, the last batch completed with padding rows.
"""
from __future__ import annotations

import logging
import math

import jax
import numpy as np

from jaxaccel.data import (bpe, corpus_folder, dataset_entry, load_arrays, load_corpus,
                           load_text_dataset)
from jaxaccel.data.arrays import ArrayBatches
from jaxaccel.data.packing import PackedBatches, tokenize_documents
from jaxaccel.data.pipeline import BatchIterator, Tokenized, tokenize
from jaxaccel.data.synthetic import synthetic, synthetic_arrays

SYNTHETIC_VOCAB = 30522      # BERT's uncased vocabulary: synthetic ids lie in [0, 30522)
TRAIN_BUCKET_WINDOW = 50     # global batches sorted by length together (data.bucket)
VALIDATION_SEED = 0          # the held-out validation rows are the same for every run seed

log = logging.getLogger("jaxaccel")


def validation_rows(n: int, size: int) -> np.ndarray:
    """Sorted indices of the ``size`` training examples (of ``n``) that ``data.validation_size``
    holds out as the ``"validation"`` split: the first ``size`` of a fixed permutation
    (``VALIDATION_SEED``), so the split does not move with ``seed``; the training split is
    the other ``n - size``."""
    if not 0 < size < n:
        raise ValueError(f"data.validation_size={size} must be in [1, {n - 1}] for a training "
                         f"split of {n} examples (0 holds out nothing).")
    return np.sort(np.random.default_rng(VALIDATION_SEED).permutation(n)[:size])


def _rows(texts: list[str], labels: np.ndarray, split: str, validation_size: int):
    """``(texts, labels)`` of ``split`` read from the training split's ``texts``/``labels``:
    the held-out validation rows, or the rest."""
    held = validation_rows(len(labels), validation_size)
    keep = held if split == "validation" else np.setdiff1d(np.arange(len(labels)), held)
    return [texts[i] for i in keep], labels[keep]


def split_examples(cfg, tokenizer, max_positions: int,
                   split: str) -> tuple[Tokenized, tuple]:
    """``(examples, label_names)`` of ``split``; text is truncated to ``data.max_len`` (at
    most the model's ``max_positions``)."""
    d = cfg.data
    if d.name == "synthetic":
        examples = synthetic(vocab_size=SYNTHETIC_VOCAB, seq_len=d.synthetic_seq_len,
                             min_len=d.synthetic_min_len, num_examples=d.synthetic_examples,
                             seed=cfg.seed if split == "train" else cfg.seed + 1,
                             num_classes=cfg.model.num_labels)
        return examples, tuple(str(i) for i in range(cfg.model.num_labels))
    if split == "validation" and not d.validation_size:
        raise ValueError("data.eval_split='validation' needs data.validation_size > 0 (e.g. "
                         "1000): the validation split is held out of the training split.")
    source = "train" if split == "validation" else split
    ds = load_text_dataset(d.name, data_dir=d.data_dir or None, manual_dir=d.manual_dir or None,
                           splits=(source,))
    if ds.num_classes > cfg.model.num_labels:
        raise ValueError(f"data {d.name!r} has {ds.num_classes} classes but "
                         f"model.num_labels={cfg.model.num_labels}; set model.num_labels="
                         f"{ds.num_classes}.")
    texts, labels = ds[source]
    if source == "train" and d.validation_size:
        texts, labels = _rows(texts, labels, split, d.validation_size)
    return (tokenize(tokenizer, texts, labels, max_len=d.max_len, max_positions=max_positions),
            ds.label_names)


def _process_shard(share: tuple[int, int] | None) -> dict:
    """The part of every batch this process loads: ``share`` = (i, n), part i of n equal
    contiguous parts (``sharding.batch_share`` of the run's mesh; processes that hold the same
    rows, e.g. two pipeline stages, load the same part); None: its process index of the
    process count."""
    i, n = share or (jax.process_index(), jax.process_count())
    return dict(process_index=i, process_count=n)


def _is_corpus(cfg) -> bool:
    return cfg.data.name != "synthetic" and dataset_entry(cfg.data.name).is_corpus


DATA_FOR = {"causal_lm": ("data.name=canterbury",),
            "classification": ("data.name=rt_snippets", "imdb_reviews", "bfsong",
                               "synthetic"),
            "mae": ("data.name=bfsong", "synthetic")}


def reads_pixels(spec) -> bool:
    """Whether the model of ``spec`` reads arrays (``pixels``: images, spectrograms) rather
    than tokens."""
    return "pixels" in spec.family.resolve("model").input_keys


def _pixels_shape(spec) -> tuple[int, ...]:
    """The shape of one example of the array input of the model of ``spec``."""
    return spec.family.resolve("model").input_shapes(spec.architecture, None)["pixels"][0]


def reads_arrays(cfg, spec=None) -> bool:
    """Whether the configured data is arrays (an array dataset, or synthetic arrays for a
    model that reads pixels: the model, ``spec`` or the config's, decides)."""
    if cfg.data.name == "synthetic":
        if spec is None:
            from jaxaccel.models import model_spec
            spec = model_spec(cfg.model)
        return reads_pixels(spec)
    return dataset_entry(cfg.data.name).is_arrays


def split_arrays(cfg, spec, split: str) -> tuple[np.ndarray, np.ndarray, tuple]:
    """``(x, labels, label_names)`` of ``split`` of array data, each example the shape of the
    model's input (``spec``'s ``pixels``): synthetic arrays (train from ``seed``, eval from
    ``seed + 1``) or an array dataset's, the validation split held out of its training split
    as for text."""
    d = cfg.data
    shape = _pixels_shape(spec)
    if d.name == "synthetic":
        n = cfg.model.num_labels
        x, labels = synthetic_arrays(shape=shape, num_examples=d.synthetic_examples,
                                     seed=cfg.seed if split == "train" else cfg.seed + 1,
                                     num_classes=n)
        return x, labels, tuple(str(i) for i in range(n))
    if split == "validation" and not d.validation_size:
        raise ValueError("data.eval_split='validation' needs data.validation_size > 0 (e.g. "
                         "300): the validation split is held out of the training split.")
    source = "train" if split == "validation" else split
    x, labels = load_arrays(d.name, source, shape, data_dir=d.data_dir or None)
    if source == "train" and d.validation_size:
        held = validation_rows(len(labels), d.validation_size)
        keep = held if split == "validation" else np.setdiff1d(np.arange(len(labels)), held)
        x, labels = x[keep], labels[keep]
    names = dataset_entry(d.name).label_names
    if spec.num_labels is not None and len(names) > spec.num_labels:
        raise ValueError(f"data {d.name!r} has {len(names)} classes but model.num_labels="
                         f"{spec.num_labels}; set model.num_labels={len(names)}.")
    return x, labels, names


def input_features(cfg, spec, paths: list[str]) -> np.ndarray:
    """float32 [len(paths), *input shape]: the model's inputs made from files (recordings) as
    the array dataset ``data.name`` makes its examples (``DatasetEntry.features``), for
    ``jaxaccel predict``."""
    entry = dataset_entry(cfg.data.name) if cfg.data.name != "synthetic" else None
    if entry is None or entry.features is None:
        raise ValueError(f"data.name={cfg.data.name!r} makes no inputs from files; predict "
                         "takes files for an array dataset that reads them (e.g. bfsong: WAV "
                         "recordings).")
    shape = _pixels_shape(spec)
    return entry.features(cfg.data.data_dir or None, paths, tuple(shape))


def _array_batches(cfg, spec, split: str, *, training: bool, share) -> tuple:
    x, labels, names = split_arrays(cfg, spec, split)
    if training:
        _check_train_batch(cfg, len(x), f"examples of the {cfg.data.name!r} {split!r} split")
    size = cfg.train.batch_size if training else _eval_batch_size(cfg, len(x), split)
    return ArrayBatches(x, labels, size, shuffle=training, seed=cfg.seed,
                        drop_remainder=training, **_process_shard(share)), names


def data_tasks(cfg) -> tuple[str, ...]:
    """The tasks (``train.tasks.TASKS``) the configured data gives batches for: a corpus
    ``causal_lm``, an array dataset ``mae`` and ``classification``, a labelled text dataset
    ``classification``."""
    if _is_corpus(cfg):
        return ("causal_lm",)
    return ("mae", "classification") if reads_arrays(cfg) else ("classification",)


def check_task(cfg, spec) -> None:
    """The model's training task must be one the data gives batches for (``data_tasks``),
    and the model must read what the data holds (tokens or arrays)."""
    given, task = data_tasks(cfg), spec.task
    arrays = cfg.data.name != "synthetic" and dataset_entry(cfg.data.name).is_arrays
    if arrays != reads_pixels(spec) and cfg.data.name != "synthetic":
        holds, reads = ("arrays", "tokens") if arrays else ("text", "arrays")
        raise ValueError(f"data.name={cfg.data.name!r} holds {holds} but the model "
                         f"(model.name={cfg.model.name!r}) reads {reads}; pick a model of "
                         f"the {'vit' if arrays else 'bert or llama'} family for it.")
    if task not in given:
        models = {"causal_lm": "a decoder (e.g. model.name=llama-cpu)",
                  "classification": "a classifier (e.g. model.name=minilm-l6)",
                  "mae": "a ViT (e.g. model.name=vit-tiny)"}
        raise ValueError(f"data.name={cfg.data.name!r} gives {'/'.join(given)} batches but "
                         f"the model (model.name={cfg.model.name!r}) trains {task}; use "
                         f"{models[given[0]]} for it, or data for {task} "
                         f"({', '.join(DATA_FOR[task])}).")


def _trains_bpe(cfg) -> bool:
    """Whether the run's tokenizer is the corpus's own BPE (a corpus, and the config names
    neither ``model.tokenizer`` nor ``model.checkpoint``)."""
    return _is_corpus(cfg) and not (cfg.model.tokenizer or cfg.model.checkpoint)


def check_tokenizer_vocab(cfg, architecture) -> None:
    """A run that trains the corpus's BPE: ``data.tokenizer_vocab`` must be a size a byte-level
    BPE can have and that the model's embedding table (``architecture.vocab_size``) can index,
    checked before the BPE is trained and cached."""
    if not _trains_bpe(cfg):
        return
    n, vocab = cfg.data.tokenizer_vocab, architecture.vocab_size
    if n < bpe.MIN_VOCAB:
        raise ValueError(f"data.tokenizer_vocab={n} is too small: a byte-level BPE needs its "
                         f"{bpe.MIN_VOCAB - 1} byte symbols and the end-of-text token; use at "
                         f"least {bpe.MIN_VOCAB} (e.g. 8192).")
    if n > vocab:
        raise ValueError(f"data.tokenizer_vocab={n} is more than the model's vocab_size={vocab} "
                         f"(model.name={cfg.model.name!r}): its token ids would index past the "
                         f"embedding table. Set data.tokenizer_vocab <= {vocab}, or train a "
                         "preset whose vocabulary is at least the tokenizer's.")


def tokenizer_dir(cfg, model_tokenizer_dir: str) -> str:
    """The tokenizer folder of a run: ``model_tokenizer_dir`` (the model's, from
    ``create_model``), except for a corpus when the config names neither ``model.tokenizer``
    nor ``model.checkpoint``: then the corpus's BPE of ``data.tokenizer_vocab`` tokens, trained
    on its train split the first time."""
    d = cfg.data
    if not _trains_bpe(cfg):
        return model_tokenizer_dir
    return bpe.cached(corpus_folder(d.name, d.data_dir or None), d.tokenizer_vocab,
                      lambda: load_corpus(d.name, data_dir=d.data_dir or None,
                                          splits=("train",))["train"])


def _packed(cfg, tokenizer, max_positions: int, split: str, *, training: bool,
            share: tuple[int, int] | None = None) -> PackedBatches:
    """A corpus split's documents, tokenized and packed into rows of ``data.max_len``."""
    d = cfg.data
    if d.max_len > max_positions:
        raise ValueError(f"data.max_len={d.max_len} (the packed row length) exceeds the "
                         f"model's maximum sequence length {max_positions}; set data.max_len "
                         f"<= {max_positions}.")
    docs = tokenize_documents(
        tokenizer, load_corpus(d.name, data_dir=d.data_dir or None, splits=(split,))[split])
    rows = -(-sum(map(len, docs)) // d.max_len)
    if training:
        _check_train_batch(cfg, rows, f"rows of {d.max_len} tokens (data.max_len) that the "
                           f"{d.name!r} {split!r} split packs into")
    size = cfg.train.batch_size if training else _eval_batch_size(cfg, rows, split)
    return PackedBatches(docs, d.max_len, size, shuffle=training, seed=cfg.seed,
                         drop_remainder=training, **_process_shard(share))


def _check_train_batch(cfg, rows: int, what: str) -> None:
    """A training batch of ``train.batch_size`` rows is refused where the train split has fewer
    (no full batch to train on), naming the key and the data's size, before any batch is
    made."""
    size = cfg.train.batch_size
    if rows < size:
        raise ValueError(f"train.batch_size={size} is more than the {rows} {what}: no full "
                         f"batch to train on. Set train.batch_size to at most {rows} (a "
                         "multiple of the device count), or train on more data.")


def _eval_batch_size(cfg, rows: int, split: str) -> int:
    """``train.eval_batch_size``, or, where that is more than the ``rows`` of the eval split,
    the least multiple of the device count that holds them all (one batch; a multiple of
    every mesh's batch shards and of the process count). Without the clamp the rows beyond
    the split are padding the eval step still computes: 100,000 rows of 128 tokens asked XLA
    for 485 GB of logits at an 8k vocabulary."""
    size, n = cfg.train.eval_batch_size, jax.device_count()
    fit = -(-rows // n) * n
    if size <= fit:
        return size
    log.info("train.eval_batch_size=%d is more than the %d rows of the %r split: evaluating "
             "them in one batch of %d rows", size, rows, split, fit)
    return fit


def train_batches(cfg, tokenizer, max_positions: int, share: tuple[int, int] | None = None,
                  spec=None) -> tuple[BatchIterator | PackedBatches | ArrayBatches, tuple]:
    """This process's training batches (shuffled, bucketed, full; its ``share`` of every
    batch, ``_process_shard``) and the label names; for a corpus, packed causal-LM rows and no
    labels; for array data (``reads_arrays``; ``tokenizer`` unused), ``ArrayBatches`` of the
    model ``spec``'s input shape."""
    if spec is not None and reads_arrays(cfg, spec):
        return _array_batches(cfg, spec, "train", training=True, share=share)
    if _is_corpus(cfg):
        return _packed(cfg, tokenizer, max_positions, "train", training=True, share=share), ()
    examples, label_names = split_examples(cfg, tokenizer, max_positions, "train")
    t = cfg.train
    _check_train_batch(cfg, len(examples), f"examples of the {cfg.data.name!r} 'train' split")
    batches = BatchIterator(examples, t.batch_size, shuffle=True, seed=cfg.seed,
                            drop_remainder=True,
                            bucket_window=TRAIN_BUCKET_WINDOW if cfg.data.bucket else 0,
                            pad_multiple=cfg.data.pad_multiple, **_process_shard(share))
    return batches, label_names


def eval_batches(cfg, tokenizer, max_positions: int, share: tuple[int, int] | None = None,
                 spec=None) -> tuple[BatchIterator | PackedBatches | ArrayBatches, tuple]:
    """This process's batches of ``data.eval_split`` (length-sorted, every example once; its
    ``share`` as ``train_batches``') and the label names; the training split is neither read
    nor tokenized. A corpus: packed rows in document order, every token once, and no labels;
    array data: in order, the last batch completed with weight-0 rows."""
    if spec is not None and reads_arrays(cfg, spec):
        return _array_batches(cfg, spec, cfg.data.eval_split, training=False, share=share)
    if _is_corpus(cfg):
        return _packed(cfg, tokenizer, max_positions, cfg.data.eval_split, training=False,
                       share=share), ()
    examples, label_names = split_examples(cfg, tokenizer, max_positions,
                                           cfg.data.eval_split)
    size = cfg.train.eval_batch_size
    batches = BatchIterator(examples, size, shuffle=False, drop_remainder=False,
                            bucket_window=len(examples) // size + 1,
                            pad_multiple=cfg.data.pad_multiple, **_process_shard(share))
    return batches, label_names


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


def steps_per_epoch(cfg) -> int | None:
    """Training steps per epoch (whole global batches of the training split, less
    ``data.validation_size`` examples) known before anything is read or tokenized: from the
    synthetic example count, or the dataset's ``train_examples`` (its ``DATASETS`` entry; the
    split is read and counted only where the entry gives no count). None for a corpus, whose
    rows depend on the packing (the packed data knows: ``PackedBatches.steps_per_epoch``)."""
    d = cfg.data
    if d.name == "synthetic":
        return d.synthetic_examples // cfg.train.batch_size
    if _is_corpus(cfg):
        return None
    n = dataset_entry(d.name).train_examples
    if n is None:
        n = len(load_text_dataset(d.name, data_dir=d.data_dir or None,
                                  manual_dir=d.manual_dir or None, splits=("train",))["train"][1])
    return (n - d.validation_size) // cfg.train.batch_size
