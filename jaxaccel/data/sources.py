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
from collections.abc import Mapping

from jaxaccel.data.spec import (Batching, DataMissing, DataSpec, ModelInput, Settings,
                                holdout_size)


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
        spec = importlib.import_module(row.module).describe(settings, model, batching)
    except DataMissing as e:
        if not absent_ok:
            raise
        spec = unread(settings, model, batching, str(e))
    return counted(spec)


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
