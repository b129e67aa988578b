"""``data.name=mixture``: sources of one task mixed by weight into one training stream
(``data.mixture``), a row of ``sources.SOURCES``.

    data.name=mixture
    data.mixture=[{"name": "canterbury", "weight": 3},
                  {"name": "files", "train_files": "notes/*.txt", "weight": 1}]

Each source is the ``data`` section with the keys it sets (``data.max_len`` and
``data.tokenizer_vocab`` are the mixture's: one row length, one tokenizer), described by its
own row of the table, and tokenized into its own token cache. Training rows are interleaved by
the weights (``mixing``: the order, the epoch's length, resume, each process's share); the eval
split is every source's eval split one after another (each document once, unweighted). Without
``model.tokenizer`` the mixture is tokenized by one byte-level BPE trained on all its sources'
training splits (``MixtureReader``). The sources must give batches of one task, and be all
corpora (causal LM) or all labelled texts (classification: the classes are all the sources'
labels); ready token ids and arrays are not mixed.
"""
from __future__ import annotations

import dataclasses

from jaxaccel.data import mixing, sources
from jaxaccel.data.spec import Batching, DataSpec, ModelInput, Settings

MIXED_KINDS = ("corpus", "text")
"""The data kinds a mixture mixes (``spec.KINDS``)."""


@dataclasses.dataclass(frozen=True)
class MixtureReader:
    """The sources' record readers as one (``spec.RecordReader``): what the mixture's BPE is
    trained on, and the training split's identity a resumed run compares."""

    readers: tuple

    def identity(self, split: str) -> dict:
        return {"mixture": [r.identity(split) for r in self.readers]}

    def chunks(self, split: str) -> list:
        return [(i, chunk) for i, r in enumerate(self.readers) for chunk in r.chunks(split)]

    def read(self, chunk):
        i, own = chunk
        return self.readers[i].read(own)

    def size(self, chunk) -> int:
        i, own = chunk
        return self.readers[i].size(own)


def section(settings: Settings, part: dict) -> dict:
    """The ``data`` section of one source of the mixture: the mixture's, with the keys the
    source sets (its ``weight`` aside)."""
    return {**settings, "mixture": [], **{k: v for k, v in part.items() if k != "weight"}}


def _check_kinds(parts: tuple, model: ModelInput) -> None:
    """The sources must give batches of one task, and be of a kind a mixture mixes."""
    listed = ", ".join(f"[{i}] {spec.name} ({'/'.join(spec.tasks)})"
                       for i, (spec, _) in enumerate(parts))
    if len({spec.tasks for spec, _ in parts}) > 1:
        raise ValueError(f"data.mixture mixes sources of different tasks: {listed}; the model "
                         f"(model.name={model.name!r}) trains {model.task}. Mix sources of one "
                         "task.")
    for i, (spec, _) in enumerate(parts):
        if spec.kind not in MIXED_KINDS or spec.kind != parts[0][0].kind:
            raise ValueError(f"data.mixture[{i}] ({spec.name}) holds {spec.kind} data, and a "
                             f"mixture mixes corpora (causal LM documents) or labelled texts "
                             f"read from their records, of one kind ([0] holds "
                             f"{parts[0][0].kind}): train on it alone, or mix sources of one "
                             "of those kinds.")


def describe(settings: Settings, model: ModelInput, batching: Batching) -> DataSpec:
    """The mixture's ``DataSpec``: its sources described by their rows (``parts``), their
    kind, and the rows an epoch trains on where every source's are known (``counted``)."""
    parts = tuple((sources.describe(section(settings, part), batching, model),
                   float(part["weight"])) for part in settings.mixture)
    _check_kinds(parts, model)
    reader = MixtureReader(tuple(spec.reader for spec, _ in parts))
    return counted(DataSpec("mixture", parts[0][0].kind, reader, settings, batching, model,
                            ("train",), parts=parts))


def counted(spec: DataSpec) -> DataSpec:
    """``spec`` with the rows an epoch trains on (``mixing.epoch_rows``: until the first source
    runs out) where every source's rows are known, and where that is a batch or more."""
    if any(part.rows is None for part, _ in spec.parts):
        return spec
    batch = spec.batching.batch_size
    interleave = mixing.Interleave([w for _, w in spec.parts], spec.batching.seed, batch)
    rows, first = mixing.epoch_rows(interleave, [part.rows for part, _ in spec.parts], batch)
    if not rows:
        return spec
    return dataclasses.replace(spec, rows=rows, count_source=(
        f"data.mixture's sources ({'; '.join(p.count_source for p, _ in spec.parts)}), until "
        f"[{first}] runs out"))


__all__ = ["MixtureReader", "counted", "describe", "section"]
