"""Compressed text files of ``data.name=files``: gzip (``.gz``), bzip2 (``.bz2``) and xz
(``.xz``), read through Python's own modules; the format is the extension under the
compression's (``reviews.jsonl.gz`` is JSONL). Compressions without a reader here (Zstandard:
``zstandard`` is no dependency) are refused by name. A compressed file cannot be cut at a byte
offset without decompressing all before it, so it is read as one chunk."""
from __future__ import annotations

import bz2
import gzip
import lzma
import os

from jaxaccel.data.spec import DataError

READERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
REFUSED = {".zst": "Zstandard", ".zstd": "Zstandard", ".lz4": "LZ4", ".zip": "zip",
           ".7z": "7-Zip"}


def compression(path: str) -> str | None:
    """The compression extension of ``path`` (None: not compressed); ``DataError`` for one
    without a reader."""
    ext = os.path.splitext(path)[1].lower()
    if ext in REFUSED:
        raise DataError(f"{path}: compressed with {REFUSED[ext]} ({ext}), which data.name=files "
                        f"does not read (it reads {', '.join(READERS)}); decompress it, or "
                        "recompress it with gzip.")
    return ext if ext in READERS else None


def inner_extension(path: str) -> str:
    """The extension that says a file's format: under its compression's, if any."""
    if compression(path):
        path = os.path.splitext(path)[0]
    return os.path.splitext(path)[1].lower()


def readable(files, fmt: str) -> str:
    """``fmt``, once no file of ``files`` is of a compression without a reader, nor a compressed
    Parquet or Arrow file; else ``DataError``."""
    packed = next((p for p in files if compression(p)), None)
    if packed is not None and fmt in ("parquet", "arrow"):
        raise DataError(f"{packed}: a compressed {fmt} file; {fmt} files are read in place "
                        "(they compress their own columns): decompress it.")
    return fmt


def open_bytes(path: str):
    """``path`` opened for reading bytes, decompressed where it is compressed."""
    ext = compression(path)
    return READERS[ext](path, "rb") if ext else open(path, "rb")


__all__ = ["READERS", "REFUSED", "compression", "inner_extension", "open_bytes", "readable"]
