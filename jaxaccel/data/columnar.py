"""Parquet and Arrow files of ``data.name=files``, read in their own pieces: a Parquet row
group, an Arrow record batch (``files.FileRecords`` reads each piece's columns)."""
from __future__ import annotations

import json

from jaxaccel.data.spec import DataError


def class_names(path: str, fmt: str, field: str) -> tuple[str, ...] | None:
    """The class names Hugging Face ``datasets`` keeps in a Parquet or Arrow file's schema
    metadata for ``field`` (a ``ClassLabel``, as ``save_to_disk`` and ``to_parquet`` write it),
    else None."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    if fmt == "parquet":
        schema = pq.read_schema(path)
    else:
        with pa.memory_map(path) as source:
            schema = arrow_reader(source).schema
    meta = json.loads((schema.metadata or {}).get(b"huggingface", b"{}"))
    feature = meta.get("info", {}).get("features", {}).get(field, {})
    names = feature.get("names") if feature.get("_type") == "ClassLabel" else None
    return tuple(names) if names else None


def parquet_chunks(path: str, check) -> list[tuple]:
    import pyarrow.parquet as pq
    meta = pq.ParquetFile(path).metadata
    check(meta.schema.to_arrow_schema().names, path)
    out, first = [], 0
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        out.append(("parquet", path, i, first, group.total_byte_size))
        first += group.num_rows
    return out


def parquet_group(path: str, index: int, fields):
    import pyarrow.parquet as pq
    return pq.ParquetFile(path).read_row_group(index, columns=fields)


def arrow_reader(source):
    """An Arrow IPC file's reader (random access), else its stream's batches."""
    import pyarrow as pa
    try:
        return pa.ipc.open_file(source)
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_stream(source)


def arrow_chunks(path: str, check) -> list[tuple]:
    import pyarrow as pa
    out, first = [], 0
    with pa.memory_map(path) as source:
        reader = arrow_reader(source)
        check(reader.schema.names, path)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) \
            if hasattr(reader, "get_batch") else reader
        for i, batch in enumerate(batches):
            out.append(("arrow", path, i, first, batch.nbytes))
            first += batch.num_rows
    return out


def arrow_batch(path: str, index: int):
    import pyarrow as pa
    with pa.memory_map(path) as source:
        reader = arrow_reader(source)
        if hasattr(reader, "get_batch"):
            return reader.get_batch(index)
        for i, batch in enumerate(reader):
            if i == index:
                return batch
    raise DataError(f"{path}: record batch {index} is gone; the file changed.")


__all__ = ["arrow_batch", "arrow_chunks", "arrow_reader", "class_names", "parquet_chunks",
           "parquet_group"]
