"""A Hugging Face dataset saved with ``save_to_disk`` (``data.name=hf``).

    data.name=hf data.dataset=~/data/imdb_saved data.text_field=text data.label_field=label

``data.dataset`` is the folder ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` wrote
(a ``DatasetDict``'s splits by name; a lone ``Dataset`` is the ``train`` split, its eval split
then held out with ``data.holdout``). It is opened with ``datasets.load_from_disk`` (memory-
mapped Arrow, nothing read but metadata until the cache is built): the ``datasets`` library is
the optional extra ``pip install 'jaxaccel[hf]'``, imported only here. A ``ClassLabel`` label
feature gives the class names. (The Parquet or Arrow files of a dataset, without the folder
around them: ``data.name=files``.)
"""
from __future__ import annotations

import dataclasses
import os

from jaxaccel.data.spec import DataError, DataMissing, DataSpec, Records

CHUNK_RECORDS = 20_000


def _load(path: str):
    try:
        import datasets
    except ImportError:
        raise DataError("data.name=hf reads datasets saved by Hugging Face datasets, which is "
                        "not installed: pip install 'jaxaccel[hf]' (or pip install datasets)."
                        ) from None
    if not os.path.isdir(path):
        raise DataMissing(f"data.dataset={path!r} is not a folder; give the folder a dataset "
                        "was saved to (Dataset.save_to_disk).")
    try:
        loaded = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError) as e:
        raise DataError(f"data.dataset={path!r}: not a dataset saved with save_to_disk ({e})."
                        ) from None
    return loaded if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}


_OPEN: dict[str, dict] = {}


@dataclasses.dataclass(frozen=True)
class HfRecords:
    """The ``RecordReader`` of ``data.name=hf`` (``spec.RecordReader``)."""

    path: str
    text_field: str
    label_field: str | None
    unit = "records"

    def split(self, split: str):
        if self.path not in _OPEN:
            _OPEN[self.path] = _load(self.path)
        splits = _OPEN[self.path]
        if split not in splits:
            raise DataError(f"dataset {self.path} has no split {split!r}; known: "
                            f"{sorted(splits)}.")
        return splits[split]

    def identity(self, split: str) -> dict:
        ds = self.split(split)
        files = sorted(f["filename"] for f in ds.cache_files)
        return {"fingerprint": ds._fingerprint,
                "files": [[p, os.path.getsize(p), os.stat(p).st_mtime_ns] for p in files]}

    def chunks(self, split: str) -> list:
        n = self.split(split).num_rows
        return [(split, a, min(a + CHUNK_RECORDS, n)) for a in range(0, n, CHUNK_RECORDS)]

    def size(self, chunk) -> int:
        return chunk[2] - chunk[1]

    def read(self, chunk) -> Records:
        split, a, b = chunk
        fields = [f for f in (self.text_field, self.label_field) if f is not None]
        columns = self.split(split).select_columns(fields)[a:b]
        origin = f"{self.path} {split}"
        texts = columns[self.text_field]
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise DataError(f"{origin} record {a + i}: field {self.text_field!r} holds "
                                f"{type(text).__name__}, not text.")
        labels = columns[self.label_field] if self.label_field is not None else None
        return Records(texts, labels, origin, range(a, b), unit="record")


def describe(settings, model, batching) -> DataSpec:
    """``data.name=hf``: the saved dataset ``data.dataset`` (module doc)."""
    if not settings.dataset:
        raise DataMissing("data.name=hf needs data.dataset: the folder a Hugging Face dataset was "
                        "saved to (save_to_disk).")
    path = os.path.abspath(os.path.expanduser(settings.dataset))
    splits = _load(path)
    kind = "corpus" if model.task == "causal_lm" else "text"
    label = settings.label_field if kind == "text" else None
    names = None
    for split, ds in splits.items():
        for field in (settings.text_field, label):
            if field is not None and field not in ds.features:
                raise DataError(f"dataset {path} split {split!r} has no field {field!r} "
                                f"(fields: {', '.join(ds.features)}); set data.text_field / "
                                "data.label_field.")
        if label is not None:
            names = names or getattr(ds.features[label], "names", None)
    counts = {s: ds.num_rows for s, ds in splits.items()} if kind == "text" else {}
    return DataSpec("hf", kind, HfRecords(path, settings.text_field, label), settings, batching,
                    model, tuple(splits), counts, "the dataset's row counts" if counts else "",
                    tuple(names) if names else None, labels_are_ids=bool(names))


__all__ = ["HfRecords", "describe"]
