"""A TFDS dataset prepared in a data dir (``data.name=tfds``), and the record reader the shipped
TFDS datasets (rt_snippets, imdb_reviews, canterbury) share.

    data.name=tfds data.dataset=imdb_reviews data.data_dir=~/tensorflow_datasets
    data.text_field=text data.label_field=label

The dataset is opened by name from ``data.data_dir`` (a local folder or ``gs://...``) with
``tfds.builder``, which reads a prepared dataset's own ``dataset_info.json`` and
``features.json`` when its builder code is not installed, and read through
``as_data_source`` (ArrayRecord, no TensorFlow): the dataset must have been prepared with
``file_format="array_record"`` (``tfds build --file_format=array_record``). A ``ClassLabel``
label feature gives the class names; a text or integer feature is labelled by its values.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import os
from collections.abc import Callable

from jaxaccel.data.spec import DataError, DataMissing, DataSpec, Records

CHUNK_RECORDS = 20_000


def _tfds():
    import tensorflow_datasets as tfds
    return tfds


_BUILDERS: dict[str, object] = {}


@dataclasses.dataclass(frozen=True)
class TfdsRecords:
    """The ``RecordReader`` of a prepared TFDS dataset (``spec.RecordReader``).

    dataset, data_dir: what is read.
    open: ``() -> builder`` (picklable: a module function, or a partial of one).
    version: a shipped dataset's version: its name, version and data dir are its identity
      (``identity`` then builds nothing); "" for a prepared dataset, whose files' sizes and
      times are part of its identity too.
    text_field, label_field: the features read (``label_field`` None for a corpus).
    sort_by: a feature to order each split by (a corpus's document ids); the split is then
      read as one chunk.
    """

    dataset: str
    data_dir: str
    open: Callable = dataclasses.field(repr=False)
    text_field: str = "text"
    label_field: str | None = None
    sort_by: str | None = None
    version: str = ""
    unit = "records"

    def builder(self):
        key = repr(self)
        if key not in _BUILDERS:
            _BUILDERS[key] = self.open()
        return _BUILDERS[key]

    def _source(self, split: str):
        builder = self.builder()
        if split not in builder.info.splits:
            raise DataError(f"TFDS dataset {self.dataset} has no split {split!r}; known: "
                            f"{sorted(builder.info.splits)}.")
        try:
            return builder.as_data_source(split)
        except (NotImplementedError, ValueError) as e:
            raise DataError(f"TFDS dataset {self.dataset} in {builder.data_dir} cannot be read "
                            f"without TensorFlow ({e}); prepare it as ArrayRecord: tfds build "
                            f"{self.dataset} --file_format=array_record") from e

    def identity(self, split: str) -> dict:
        if self.version:
            return {"dataset": self.dataset, "version": self.version,
                    "data_dir": os.path.abspath(os.path.expanduser(
                        self.data_dir or os.environ.get("TFDS_DATA_DIR")
                        or os.path.join("~", "tensorflow_datasets")))}
        builder = self.builder()
        folder = os.fspath(builder.data_dir)
        names = sorted(n for n in _listdir(folder) if f"-{split}." in n)
        return {"dataset": builder.name, "version": str(builder.version), "dir": folder,
                "files": [[n, *_stat(os.path.join(folder, n))] for n in names]}

    def chunks(self, split: str) -> list:
        n = len(self._source(split))
        if self.sort_by:
            return [(split, 0, n)]
        return [(split, a, min(a + CHUNK_RECORDS, n)) for a in range(0, n, CHUNK_RECORDS)]

    def size(self, chunk) -> int:
        return chunk[2] - chunk[1]

    def read(self, chunk) -> Records:
        split, a, b = chunk
        records = self._source(split).__getitems__(range(a, b))
        numbers = list(range(a, b))
        if self.sort_by:
            order = sorted(range(len(records)), key=lambda i: records[i][self.sort_by])
            records, numbers = [records[i] for i in order], [numbers[i] for i in order]
        origin = f"TFDS {self.dataset} {split}"
        texts = [_text(r[self.text_field], origin, n) for r, n in zip(records, numbers)]
        labels = None if self.label_field is None else [r[self.label_field] for r in records]
        return Records(texts, labels, origin, numbers, unit="record")


def _text(value, origin: str, n: int) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{origin} record {n}: the text is not valid UTF-8 ({e.reason} at byte "
                        f"{e.start}).") from None


def _listdir(folder: str) -> list[str]:
    from etils import epath
    return [p.name for p in epath.Path(folder).iterdir()]


def _stat(path: str) -> list:
    from etils import epath
    info = epath.Path(path).stat()
    return [info.length, int(info.mtime)]


def shipped(reader: TfdsRecords, kind: str, settings, model, batching, *,
            splits: tuple[str, ...], counts: dict, label_names=None) -> DataSpec:
    """The ``DataSpec`` of a shipped TFDS text dataset read by ``reader``."""
    return DataSpec(reader.dataset, kind, reader, settings, batching, model, splits, counts,
                    f"the size of {reader.dataset}'s splits" if counts else "", label_names,
                    labels_are_ids=label_names is not None)


def open_prepared(dataset: str, data_dir: str):
    """The builder of ``dataset`` (a catalogue name, ``name:version``, ``name/config``) prepared
    in ``data_dir``; refused, with the command that prepares it, where it is not there."""
    tfds = _tfds()
    local = data_dir and "://" not in data_dir
    if local and not os.path.isdir(os.path.expanduser(data_dir)):
        raise DataMissing(f"data.data_dir={data_dir!r} does not exist (from {os.getcwd()}); set "
                          "it to the folder the dataset was prepared in (tfds build ... "
                          "--data_dir DIR --file_format=array_record).")
    try:
        builder = tfds.builder(dataset, data_dir=data_dir or None)
    except Exception as e:      # noqa: BLE001 (TFDS raises its own error classes)
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise DataMissing(f"data.dataset={dataset!r}: no TFDS dataset of that name in data_dir "
                          f"{data_dir or '(the TFDS default)'} ({type(e).__name__}: {first})"
                          f"{_close_names(tfds, dataset, data_dir if local else '')} Prepare "
                          "it there first (tfds build ... --file_format=array_record), or set "
                          "data.data_dir to where it was prepared.") from None
    if not builder.is_prepared():
        raise DataMissing(f"data.dataset={dataset!r} is not prepared in {builder.data_dir}; "
                        f"prepare it first: tfds build {dataset} --data_dir "
                        f"{data_dir or '~/tensorflow_datasets'} --file_format=array_record")
    return builder


def _close_names(tfds, dataset: str, data_dir: str) -> str:
    """``"; prepared there: ... . Did you mean ...?"``: the datasets prepared in ``data_dir``,
    and the names of those and of TFDS's own catalogue close to ``dataset``'s (without its
    config or version)."""
    name = dataset.split("/")[0].split(":")[0]
    folder = os.path.expanduser(data_dir)
    here = sorted(n for n in os.listdir(folder) if os.path.isdir(os.path.join(folder, n))) \
        if data_dir else []
    known = tfds.list_builders(with_community_datasets=False)
    close = dict.fromkeys(difflib.get_close_matches(name, [*here, *known], n=3, cutoff=0.7))
    prepared = f"; prepared there: {', '.join(here)}" if here else ""
    return prepared + (f". Did you mean {' or '.join(map(repr, close))}?" if close else ".")


def describe(settings, model, batching) -> DataSpec:
    """``data.name=tfds``: ``data.dataset`` from ``data.data_dir`` (module doc)."""
    if not settings.dataset:
        raise DataMissing("data.name=tfds needs data.dataset: the dataset's TFDS name (e.g. "
                        "imdb_reviews), prepared in data.data_dir.")
    builder = open_prepared(settings.dataset, settings.data_dir)
    kind = "corpus" if model.task == "causal_lm" else "text"
    features = builder.info.features
    fields = (settings.text_field,) + ((settings.label_field,) if kind == "text" else ())
    for field in fields:
        if field not in features:
            raise DataError(f"TFDS dataset {settings.dataset} has no feature {field!r} "
                            f"(features: {', '.join(features)}); set data.text_field / "
                            "data.label_field to the ones holding the text and the label.")
    names = None
    if kind == "text":
        names = getattr(features[settings.label_field], "names", None)
        names = tuple(names) if names else None
    splits = tuple(builder.info.splits)
    counts = {s: builder.info.splits[s].num_examples for s in splits} if kind == "text" else {}
    reader = TfdsRecords(settings.dataset, settings.data_dir,
                         functools.partial(open_prepared, settings.dataset, settings.data_dir),
                         settings.text_field, settings.label_field if kind == "text" else None)
    return DataSpec("tfds", kind, reader, settings, batching, model, splits, counts,
                    "the dataset's split sizes" if counts else "", names,
                    labels_are_ids=names is not None)


__all__ = ["TfdsRecords", "describe", "open_prepared", "shipped"]
