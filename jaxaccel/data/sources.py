"""The table of data sources (``data.name``) and the one way a run's data is described.

    spec = describe(cfg.data, Batching(32, 128, seed=0), ModelInput("minilm-l6", ...))
    check_task(spec)                      # the model's task and input against the data's

Each row names the module that describes the source: a module-level
``describe(settings, model, batching) -> spec.DataSpec``. Adding a source is one module and
one row; nothing else branches on a source's name.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import logging
from collections.abc import Mapping

from jaxaccel import storage
from jaxaccel.data.spec import (Batching, DataMissing, DataSpec, ModelInput, Settings,
                                holdout_size)

log = logging.getLogger("jaxaccel")


@dataclasses.dataclass(frozen=True)
class Source:
    """A row: the describing module, a line for listings, the tasks any of its configurations
    serves (for messages before anything is described), and whether it reads your data (else
    it is shipped or made)."""

    module: str
    summary: str
    tasks: tuple[str, ...]
    yours: bool = False


SOURCES: dict[str, Source] = dict(
    rt_snippets=Source("jaxaccel.data.rt_snippets", "Rotten Tomatoes snippets (shipped): "
                       "labelled texts", ("classification",)),
    imdb_reviews=Source("jaxaccel.data.imdb", "IMDb reviews (your archive): labelled texts",
                        ("classification",)),
    canterbury=Source("jaxaccel.data.canterbury", "Canterbury corpus (shipped): documents",
                      ("causal_lm",)),
    bfsong=Source("jaxaccel.data.bfsong", "birdsong syllables (shipped): log-mel arrays",
                  ("mae", "classification")),
    synthetic=Source("jaxaccel.data.synthetic", "random token ids, or arrays for a ViT",
                     ("classification", "mae")),
    files=Source("jaxaccel.data.files", "your files by glob: JSONL, CSV/TSV, Parquet, Arrow, "
                 "plain text", ("classification", "causal_lm"), yours=True),
    tfds=Source("jaxaccel.data.tfds_source", "a TFDS dataset prepared in data.data_dir",
                ("classification", "causal_lm"), yours=True),
    hf=Source("jaxaccel.data.hf_disk", "a Hugging Face dataset saved with save_to_disk",
              ("classification", "causal_lm"), yours=True),
    audio=Source("jaxaccel.data.audio", "a folder of audio files (labels: sub-folder names)",
                 ("mae", "classification"), yours=True),
    images=Source("jaxaccel.data.images", "images (JPEG/PNG/WebP) in class sub-folders, or "
                  "a CSV/JSONL of path and label", ("classification",), yours=True),
    mixture=Source("jaxaccel.data.mixture", "sources of one task mixed by weight "
                   "(data.mixture)", ("causal_lm", "classification"), yours=True),
)
"""Data sources by name (``data.name``): the module that describes each (``describe``)."""

MODEL_FOR = {"causal_lm": "a decoder (e.g. model.name=llama-cpu)",
             "classification": "a classifier (e.g. model.name=minilm-l6)",
             "mae": "a ViT (e.g. model.name=vit-tiny)"}


def source(name: str) -> Source:
    """The row of ``name``; an unknown name lists the rows and close matches."""
    if name not in SOURCES:
        close = difflib.get_close_matches(name, SOURCES, n=2, cutoff=0.5)
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        ours = ", ".join(n for n, s in SOURCES.items() if not s.yours)
        yours = ", ".join(n for n, s in SOURCES.items() if s.yours)
        raise ValueError(f"data.name={name!r} is not a data source; known: {ours} (shipped, "
                         f"or made: synthetic), and for your data {yours} (docs/guides/"
                         f"your-data.md).{hint} Set data.name to one of them.")
    return SOURCES[name]


def serving(task: str) -> tuple[str, ...]:
    """The sources that serve ``task``."""
    return tuple(n for n, s in SOURCES.items() if task in s.tasks)


def describe(section: Mapping, batching: Batching, model: ModelInput, *,
             absent_ok: bool = False) -> DataSpec:
    """The ``DataSpec`` of the config's ``data`` section for a model that reads ``model``,
    from its source's row; nothing is read but metadata (a dataset's sizes, file stats).
    ``absent_ok`` (a plan): data that is not on this machine is described from the config
    alone (``unread``) instead of refused."""
    settings = Settings(section)
    row = source(settings.name)
    try:
        settings = _local_files(settings, absent_ok)
        spec = importlib.import_module(row.module).describe(settings, model, batching)
    except DataMissing as e:
        if not absent_ok:
            raise
        spec = unread(settings, model, batching, str(e))
    if spec.absent and absent_ok and spec.reader is not None:
        spec = unread(settings, model, batching, spec.absent)      # part of it is missing
    _note_unused_holdout(spec)
    return counted(spec)


FILE_KEYS = ("train_files", "eval_files")
"""The settings that name files by glob, which may be bucket URLs (``gs://``, ``s3://``)."""


def _local_files(settings: Settings, absent_ok: bool) -> Settings:
    """``settings`` with each bucket glob of ``FILE_KEYS`` replaced by the glob of its local
    copies (``storage.mirror``: downloaded once per version of the objects, laid out as in the
    bucket, so class folders keep their names), which the readers and the token cache's key
    then see as local files. A plan (``absent_ok``) reads no data: the files stay where they
    are and the data is described from the config (``DataMissing``)."""
    urls = {k: settings[k] for k in FILE_KEYS if storage.is_url(settings.get(k) or "")}
    if not urls:
        return settings
    if absent_ok:
        raise DataMissing(f"data.{next(iter(urls))}={next(iter(urls.values()))!r} is in a "
                          "bucket, which a plan does not read")
    local = {k: ",".join(storage.mirror(g.strip()) for g in v.split(",") if g.strip())
             for k, v in urls.items()}
    for key, glob in local.items():
        log.info("data.%s=%s: read from its local copy %s", key, urls[key], glob)
    return Settings({**settings, **local})


def _note_unused_holdout(spec: DataSpec) -> None:
    """Warn where ``data.holdout`` is given but the source has an eval split of its own."""
    d = spec.settings
    if d.holdout > 0 and spec.eval_split in spec.splits:
        own = "data.eval_files" if d.get("eval_files") else "a split of the dataset"
        log.warning("data.holdout=%s is ignored: the eval split %r is the source's own (%s); "
                    "drop data.holdout, or that eval split to hold out part of the training "
                    "split.", d.holdout, spec.eval_split, own)


def unread(settings: Settings, model: ModelInput, batching: Batching, why: str) -> DataSpec:
    """The data as the config alone says it is (no reader): the kind the model's task takes
    of the row's, and the counts the config gives (``counted``)."""
    kind = "arrays" if model.reads == "pixels" else \
        "corpus" if model.task == "causal_lm" else "text"
    return DataSpec(settings.name, kind, None, settings, batching, model, ("train",),
                    absent=why)


def counted(spec: DataSpec) -> DataSpec:
    """``spec`` with the rows an epoch trains on where they are known before reading: a count
    the config gives (``data.train_examples``, a corpus's ``data.train_tokens``), else the
    source's count of its training split less the held-out and validation examples."""
    d = spec.settings
    if spec.kind == "corpus" and d.train_tokens:
        return dataclasses.replace(spec, rows=-(-d.train_tokens // spec.max_len),
                                   count_source=f"data.train_tokens={d.train_tokens}")
    if spec.kind != "corpus" and d.train_examples:
        return dataclasses.replace(spec, rows=d.train_examples,
                                   count_source=f"data.train_examples={d.train_examples}")
    n = spec.counts.get("train")
    if n is None or spec.kind == "corpus":
        return spec
    held = holdout_size(n, d.holdout) if spec.held_out else 0
    return dataclasses.replace(spec, rows=n - held - d.validation_size)


def check_task(spec: DataSpec) -> None:
    """The model must read what the data holds (tokens or arrays) and train a task the data
    gives batches for (a run that trains, or evaluates a trained model on other data)."""
    d, model = spec.settings, spec.model
    holds = spec.holds
    reads = "arrays" if model.reads == "pixels" else "text"
    if holds != reads:
        family = "vit" if holds == "arrays" else "bert or llama"
        raise ValueError(f"data.name={d.name!r} holds {holds} but the model (model.name="
                         f"{model.name!r}) reads {'arrays' if reads == 'arrays' else 'tokens'}:"
                         f" it takes a model of the {family} family.")
    if model.task not in spec.tasks:
        others = ", ".join(f"data.name={n}" for n in serving(model.task))
        raise ValueError(f"data.name={d.name!r} gives {'/'.join(spec.tasks)} batches but the "
                         f"model (model.name={model.name!r}) trains {model.task}; use "
                         f"{MODEL_FOR[spec.tasks[0]]} for it, or data for {model.task} "
                         f"({others}).")


__all__ = ["SOURCES", "Source", "check_task", "describe", "serving", "source"]
