"""Your files by glob (``data.name=files``): JSONL, CSV/TSV, Parquet, Arrow and plain text, for
classification (a text and a label each) and causal-LM pretraining (documents).

    data.name=files data.train_files="reviews/train-*.jsonl" data.eval_files="reviews/test.jsonl"
    data.text_field=review data.label_field=stars            # any field names
    data.name=files data.train_files="books/**/*.txt" data.holdout=0.05   # a corpus, 5% held out

* ``data.train_files`` / ``data.eval_files``: globs (several: comma-separated; a folder means
  every file under it), sorted, links followed (``filesplits``: each real folder searched and
  each file read once; an eval file that is a training file is refused); without
  ``eval_files`` the eval split is ``data.holdout`` of the training records, held out by a
  fixed permutation.
* ``data.format``: ``auto`` tells each file's format by its extension (``FORMATS``) and refuses
  a glob that mixes formats; or one of ``jsonl csv tsv parquet arrow text`` for every file.
* JSONL: one JSON object a line (blank lines skipped); CSV/TSV: a header row naming the
  fields; Parquet, Arrow (IPC file or stream, as Hugging Face ``datasets`` writes them):
  columns. The text is ``data.text_field``, the label ``data.label_field`` (class names or
  integers; the names are kept with the run).
* Plain text: ``data.documents=file`` makes each file one document (a classification
  example's label is its class folder, ``filesplits.folder_class``: ``reviews/pos/1.txt``),
  ``paragraph`` each block between blank lines of a file (lines stripped, empty ones dropped).

Compressed files (``compressed``: ``a.jsonl.gz``, ``.bz2``, ``.xz``) are read whole, one chunk
each. Large files are read in chunks of about ``CHUNK_BYTES`` cut at record boundaries (a line;
a blank line; a newline outside CSV quotes; a Parquet row group; an Arrow record batch), which
worker processes parse and tokenize (``tokencache``). Every record is checked as it is read; a
bad one stops the build with its file and line.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import re

from jaxaccel.data import columnar, compressed, filesplits
from jaxaccel.data.spec import DataError, DataMissing, DataSpec, Records

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv",
           ".tsv": "tsv", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text",
           ".text": "text"}
CHUNK_BYTES = 4 << 20
PARAGRAPH_BREAK = re.compile(rb"\n[ \t\r]*\n")


def _stat(path: str) -> list:
    """A file's size, modification time and inode change time: an edit moves the last even
    where the modification time is put back (``touch -r``, an editor keeping it)."""
    info = os.stat(path)
    return [info.st_size, info.st_mtime_ns, info.st_ctime_ns]


def expand(globs: str, key: str) -> tuple[str, ...]:
    """The files ``globs`` (comma-separated; a folder: every file under it) match, sorted;
    ``DataError`` where one matches nothing. Links are followed to files and folders, but no
    real folder is searched twice (a link to a folder above it adds nothing), and a file
    reached by several paths (links) is listed once, by its first path."""
    out = []
    for pattern in (g.strip() for g in globs.split(",") if g.strip()):
        pattern = os.path.expanduser(pattern)
        found = sorted(p for p in filesplits.search(pattern) if os.path.isfile(p))
        if not found:
            raise DataMissing(f"{key}={pattern!r} matches no file (from {os.getcwd()}); give a "
                            "glob of your files, e.g. data/train-*.jsonl.")
        out += found
    real = {}
    for path in map(os.path.abspath, out):
        real.setdefault(os.path.realpath(path), path)
    return tuple(real.values())


def format_of(files: tuple[str, ...], fmt: str, key: str) -> str:
    """The one format of ``files``: ``fmt``, or (``auto``) their extensions' (under a
    compression's: ``compressed``)."""
    return compressed.readable(files, _format_of(files, fmt, key))


def _format_of(files: tuple[str, ...], fmt: str, key: str) -> str:
    if fmt != "auto":
        if fmt not in set(FORMATS.values()):
            raise DataError(f"data.format={fmt!r} is not a format; known: auto, "
                            f"{', '.join(sorted(set(FORMATS.values())))}.")
        return fmt
    by = {}
    for path in files:
        ext = compressed.inner_extension(path)
        if ext not in FORMATS:
            raise DataError(f"{path}: cannot tell its format by the extension {ext!r} (known: "
                            f"{', '.join(FORMATS)}); set data.format.")
        by.setdefault(FORMATS[ext], []).append(path)
    if len(by) > 1:
        mix = "; ".join(f"{f}: {os.path.basename(p[0])}" for f, p in by.items())
        raise DataError(f"{key} matches files of several formats ({mix}); one format per run: "
                        "narrow the glob, or convert the files.")
    return next(iter(by))


# ----------------------------------------------------------------------------- chunking


def _cut_line(block: bytes, at: int, state: dict) -> int:
    """The end (exclusive) of the first record ending at or after ``at``: a newline."""
    pos = block.find(b"\n", at)
    return -1 if pos < 0 else pos + 1


def _cut_paragraph(block: bytes, at: int, state: dict) -> int:
    m = PARAGRAPH_BREAK.search(block, max(at - 1, 0))
    return -1 if m is None else m.end()


def _cut_csv(block: bytes, at: int, state: dict) -> int:
    """A newline outside quotes (RFC 4180 doubles quotes inside a field, so the parity of the
    quotes before a newline says whether it is inside one)."""
    pos = block.find(b"\n", at)
    while pos >= 0:
        if (state["quotes"] + block.count(b'"', 0, pos)) % 2 == 0:
            return pos + 1
        pos = block.find(b"\n", pos + 1)
    return -1


CUTS = {"jsonl": _cut_line, "text": _cut_paragraph, "csv": _cut_csv, "tsv": _cut_line}


def byte_chunks(path: str, fmt: str, start: int = 0, line: int = 1) -> list[tuple]:
    """``(path, start, stop, first line)`` pieces of about ``CHUNK_BYTES`` covering the file
    from byte ``start`` (line ``line``), each ending at a record boundary of ``fmt``. One pass
    over the file counts lines (so errors name them) and quotes (CSV)."""
    if compressed.compression(path):
        return [(path, start, None, line)]          # one chunk (``compressed``)
    cut, out, state = CUTS[fmt], [], {"quotes": 0}
    with open(path, "rb") as f:
        f.seek(start)
        buf, at, eof = b"", start, False          # buf: the bytes from ``at`` not yet cut
        while buf or not eof:
            end = cut(buf, CHUNK_BYTES, state) if len(buf) > CHUNK_BYTES else -1
            if end < 0 and not eof:
                more = f.read(CHUNK_BYTES)
                eof, buf = not more, buf + more
                continue
            end = len(buf) if end < 0 else end
            out.append((path, at, at + end, line))
            line += buf.count(b"\n", 0, end)
            state["quotes"] += buf.count(b'"', 0, end)
            buf, at = buf[end:], at + end
    return out


def _read_bytes(path: str, start: int, stop: int | None) -> bytes:
    """Bytes ``start`` to ``stop`` (None: the end) of ``path``, decompressed."""
    with compressed.open_bytes(path) as f:
        f.seek(start)
        return f.read(-1 if stop is None else stop - start)


def _decoded(data: bytes, path: str, line: int) -> str:
    """``data`` from line ``line`` of ``path`` as text; at line 1 (a file's start) without a
    UTF-8 byte order mark (Excel's "CSV UTF-8" writes one), as Python's ``utf-8-sig`` reads."""
    data = data.removeprefix(b"\xef\xbb\xbf") if line == 1 else data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        at = line + data.count(b"\n", 0, e.start)
        column = e.start - data.rfind(b"\n", 0, e.start)       # 1-based
        raise DataError(f"{path}:{at}: not valid UTF-8 ({e.reason} at byte {column} of the "
                        "line); save the file as UTF-8.") from None


def _header(path: str, fmt: str) -> tuple[tuple[str, ...], int, int]:
    """A CSV/TSV file's field names, and the byte and line where its records start."""
    with compressed.open_bytes(path) as f:
        head = f.read(CHUNK_BYTES)
    end = CUTS[fmt](head, 0, {"quotes": 0})
    end = len(head) if end < 0 else end
    rows = list(_csv_rows(_decoded(head[:end], path, 1), fmt))
    if not rows or not any(rows[0][1]):
        raise DataError(f"{path}:1: no header row; a {fmt.upper()} file starts with a row "
                        "naming its fields (e.g. text,label).")
    names = tuple(f.strip() for f in rows[0][1])
    _check_header(names, path, fmt)
    return names, end, 1 + head.count(b"\n", 0, end)


def _check_header(names: tuple[str, ...], path: str, fmt: str) -> None:
    """``DataError`` for a header row that is a JSON object (a JSONL file read as CSV) or that
    names a field twice (its records would keep the last column of that name)."""
    if names[0].startswith(("{", "[")):
        raise DataError(f"{path}:1: starts {names[0][:40]!r}, a JSON line, not a {fmt.upper()} "
                        "header row; set data.format=jsonl (or auto: by the extension).")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DataError(f"{path}:1: the header row names {', '.join(map(repr, twice))} more "
                        "than once; give each column its own name.")


def _csv_rows(text: str, fmt: str):
    """``(line offset of the row's first line, fields)`` of each row of CSV/TSV text."""
    reader = csv.reader(io.StringIO(text, newline=""),
                        **({"delimiter": "\t", "quoting": csv.QUOTE_NONE} if fmt == "tsv"
                           else {}))
    before = 0
    for row in reader:
        yield before, row
        before = reader.line_num


@dataclasses.dataclass(frozen=True)
class FileRecords:
    """The ``RecordReader`` of ``data.name=files`` (module doc).

    files: split -> its files; fmt: their format; text_field, label_field: the fields read
    (``label_field`` None for a corpus); documents: plain text's ``file`` or ``paragraph``;
    roots: split -> its glob roots (``filesplits.folder_class``); gone: why a split is missing
    (``filesplits.split_files``), raised as ``DataMissing`` when it is read.
    """

    files: tuple[tuple[str, tuple[str, ...]], ...]
    fmt: str
    text_field: str
    label_field: str | None
    documents: str = "file"
    roots: tuple[tuple[str, tuple[str, ...]], ...] = dataclasses.field(default=(), repr=False)
    gone: str = dataclasses.field(default="", repr=False)
    unit = "B"

    def _files(self, split: str) -> tuple[str, ...]:
        if split not in dict(self.files):
            raise DataMissing(self.gone or f"data.name=files has no split {split!r}.")
        return dict(self.files)[split]

    def _by_folder(self) -> bool:
        """Whether each file is a document labelled by its folder (``folder_class``)."""
        return self.fmt == "text" and self.documents == "file" and self.label_field is not None

    def identity(self, split: str) -> dict:
        out = {"format": self.fmt, "files": [[p, *_stat(p)] for p in self._files(split)]}
        return {**out, "roots": list(dict(self.roots)[split])} if self._by_folder() else out

    def chunks(self, split: str) -> list:
        files = self._files(split)
        if self.fmt == "text" and self.documents == "file":
            by_folder = self._by_folder()
            labels = [filesplits.folder_class(p, dict(self.roots)[split]) if by_folder
                      else None for p in files]
            return _file_groups(files, labels)
        if self.fmt == "parquet":
            return [c for p in files
                    for c in columnar.parquet_chunks(p, self._check_fields)]
        if self.fmt == "arrow":
            return [c for p in files for c in columnar.arrow_chunks(p, self._check_fields)]
        out = []
        for path in files:
            header, start, line = (), 0, 1
            if self.fmt in ("csv", "tsv"):
                header, start, line = _header(path, self.fmt)
                self._check_fields(header, path)
            out += [("bytes", *c, header) for c in byte_chunks(path, self.fmt, start, line)]
        return out

    def _check_fields(self, names, path: str) -> None:
        """A file's fields (a CSV header, a Parquet or Arrow schema) must hold the text and
        label fields."""
        if not names:
            return
        for field in (self.text_field, self.label_field):
            if field is not None and field not in names:
                raise DataError(f"{path}: no field {field!r} (fields: {', '.join(names)}); set "
                                "data.text_field / data.label_field to the fields holding the "
                                "text and the label.")

    def size(self, chunk) -> int:
        if chunk[0] == "files":
            return sum(os.path.getsize(p) for p in chunk[1])
        if chunk[0] in ("parquet", "arrow"):
            return chunk[4]
        return os.path.getsize(chunk[1]) if chunk[3] is None else chunk[3] - chunk[2]

    def read(self, chunk) -> Records:
        if chunk[0] == "files":
            return self._read_files(chunk[1], chunk[2])
        if chunk[0] in ("parquet", "arrow"):
            return self._read_columns(chunk)
        _, path, start, stop, line, header = chunk
        data = _read_bytes(path, start, stop)
        if self.fmt == "jsonl":
            return self._read_jsonl(data, path, line)
        if self.fmt == "text":
            return self._read_paragraphs(data, path, line)
        return self._read_csv(data, path, line, header)

    def _value(self, record, field: str, place: str):
        if field not in record:
            raise DataError(f"{place}: no field {field!r} (fields: "
                            f"{', '.join(map(str, record)) or 'none'}); set data.text_field / "
                            "data.label_field to the fields holding the text and the label.")
        value = record[field]
        if value is None:
            raise DataError(f"{place}: field {field!r} is empty (null); give every record "
                            "its text and label.")
        if field == self.text_field and not isinstance(value, str):
            kind = type(value).__name__
            raise DataError(f"{place}: field {field!r} holds {'an' if kind[0] in 'aeiou' else 'a'}"
                            f" {kind}, not text.")
        return value

    def _records(self, rows, path: str) -> Records:
        """Records of ``(line, record dict)`` pairs."""
        texts, labels, numbers = [], [], []
        for n, record in rows:
            place = f"{path}:{n}"
            texts.append(self._value(record, self.text_field, place))
            if self.label_field is not None:
                labels.append(self._value(record, self.label_field, place))
            numbers.append(n)
        return Records(texts, labels if self.label_field is not None else None, path, numbers)

    def _read_jsonl(self, data: bytes, path: str, line: int) -> Records:
        def rows():
            for n, raw in enumerate(data.split(b"\n"), line):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(_decoded(raw, path, n))
                except ValueError as e:
                    raise DataError(f"{path}:{n}: not a JSON object ({e}); JSONL holds one "
                                    "object a line.") from None
                if not isinstance(record, dict):
                    raise DataError(f"{path}:{n}: a JSON {type(record).__name__}, not an "
                                    "object with named fields.")
                yield n, record
        return self._records(rows(), path)

    def _read_csv(self, data: bytes, path: str, line: int, header) -> Records:
        def rows():
            for offset, fields in _csv_rows(_decoded(data, path, line), self.fmt):
                if not any(fields):
                    continue
                if len(fields) != len(header):
                    raise DataError(f"{path}:{line + offset}: {len(fields)} fields, the header "
                                    f"has {len(header)} ({', '.join(header)}).")
                yield line + offset, dict(zip(header, fields))
        return self._records(rows(), path)

    def _read_paragraphs(self, data: bytes, path: str, line: int) -> Records:
        texts, numbers, at = [], [], 0
        for m in [*PARAGRAPH_BREAK.finditer(data), None]:
            end = len(data) if m is None else m.start()
            block = data[at:end]
            lines = [x.strip() for x in _decoded(block, path, line).split("\n")]
            first = next((i for i, x in enumerate(lines) if x), None)
            if first is not None:
                texts.append("\n".join(x for x in lines if x))
                numbers.append(line + first)
            if m is not None:
                line += data.count(b"\n", at, m.end())
                at = m.end()
        return Records(texts, None, path, numbers)

    def _read_files(self, paths, labels) -> Records:
        texts = [_decoded(_read_bytes(p, 0, None), p, 1) for p in paths]
        labels = list(labels) if self.label_field is not None else None
        return Records(texts, labels, "", list(paths), unit="file")

    def _read_columns(self, chunk) -> Records:
        kind, path, index, first, _ = chunk
        fields = [f for f in (self.text_field, self.label_field) if f is not None]
        table = columnar.parquet_group(path, index, fields) if kind == "parquet" else \
            columnar.arrow_batch(path, index)
        columns = {f: table.column(f).to_pylist() for f in fields}
        rows = ((first + i, {f: columns[f][i] for f in fields})
                for i in range(table.num_rows))
        records = self._records(rows, path)
        return dataclasses.replace(records, unit="row")


def _file_groups(paths, labels) -> list[tuple]:
    """``("files", paths, their labels)``: plain-text files, one document each, in groups of
    about ``CHUNK_BYTES``."""
    out, start, size = [], 0, 0
    for i, p in enumerate(paths):
        size += os.path.getsize(p)
        if size >= CHUNK_BYTES or i == len(paths) - 1:
            out.append(("files", tuple(paths[start:i + 1]), tuple(labels[start:i + 1])))
            start, size = i + 1, 0
    return out


def describe(settings, model, batching) -> DataSpec:
    """``data.name=files`` (module doc): the files are found and their format told here (the
    records are read when the cache is built)."""
    kind = "corpus" if model.task == "causal_lm" else "text"
    if not settings.train_files:
        raise DataMissing("data.name=files needs data.train_files: a glob of your training "
                        "files (e.g. data/train-*.jsonl).")
    files, gone = filesplits.split_files(settings, expand, train_gone_ok=True)
    fmt = format_of(tuple(p for ps in files.values() for p in ps), settings.format,
                    "data.train_files" if not settings.eval_files else
                    "data.train_files / data.eval_files")
    filesplits.refuse_shared(files, settings, fmt == "text" and settings.documents == "file")
    if settings.documents not in ("file", "paragraph"):
        raise DataError(f"data.documents={settings.documents!r}: plain text is split into "
                        "documents by file or by paragraph (blank lines).")
    label = settings.label_field if kind == "text" else None
    reader = FileRecords(tuple(files.items()), fmt, settings.text_field, label,
                         settings.documents, tuple(filesplits.split_roots(settings).items()),
                         gone)
    names = columnar.class_names(next(iter(files.values()))[0], fmt, label) \
        if label is not None and fmt in ("parquet", "arrow") else None
    return DataSpec("files", kind, reader, settings, batching, model, tuple(files),
                    label_names=names, labels_are_ids=names is not None, absent=gone)


__all__ = ["FORMATS", "FileRecords", "byte_chunks", "describe", "expand", "format_of"]
