"""Building the token cache's files (``tokencache``, whose module doc gives the layout): a
source's chunks tokenized in spawned worker processes (``encoded``), their ids appended to
token shards and the index, labels and meta written (``Writer``).
"""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os

import numpy as np

from jaxaccel.data import encode
from jaxaccel.data.spec import DataError, Records

SHARD_TOKENS = 1 << 28          # 512 MiB of uint16 ids a shard, 1 GiB of uint32


@dataclasses.dataclass
class Encoded:
    """One chunk of records, tokenized."""

    ids: np.ndarray
    lengths: np.ndarray
    labels: list | None
    firsts: dict            # label -> place of its first example in the chunk
    size: int


def _encode(reader, enc: encode.Encoder, chunk) -> Encoded:
    records: Records = reader.read(chunk)
    what = "document" if enc.kind == "corpus" else "text"
    for i, text in enumerate(records.texts):
        if not text.strip():
            raise DataError(f"{records.place(i)}: empty {what}; remove the record or give it "
                            "text.")
    ids, lengths = enc(records.texts)
    labels, firsts = None, {}
    if enc.kind == "text":
        labels = [_label(v, records, i) for i, v in enumerate(records.labels)]
        for i, v in enumerate(labels):
            firsts.setdefault(v, records.place(i))
    return Encoded(ids, lengths, labels, firsts, reader.size(chunk))


def _label(value, records: Records, i: int):
    """A label as an int (integers, and strings of one) or a str."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, (bool, float)) or not isinstance(value, (int, np.integer, str)):
        raise DataError(f"{records.place(i)}: label {value!r} is a {type(value).__name__}; "
                        "labels are class names (strings) or integers.")
    if isinstance(value, str):
        value = value.strip()
        if not value:
            raise DataError(f"{records.place(i)}: empty label; give every example its class.")
        if value.lstrip("-").isdigit():
            return int(value)
        return value
    return int(value)


_WORKER: dict = {}


def _start_worker(enc: encode.Encoder) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"     # the processes are the parallelism
    _WORKER["enc"] = enc


def _work(task) -> Encoded:
    reader, chunk = task
    return _encode(reader, _WORKER["enc"], chunk)


def encoded(reader, enc, chunks, workers: int):
    """Each chunk's ``Encoded``, in order: in ``workers`` spawned processes (none before the
    first result is asked for), or here where the source is small."""
    if workers <= 1:
        for chunk in chunks:
            yield _encode(reader, enc, chunk)
        return
    ctx = multiprocessing.get_context("spawn")   # never fork a process that runs JAX threads
    with ctx.Pool(workers, initializer=_start_worker, initargs=(enc,)) as pool:
        yield from pool.imap(_work, [(reader, c) for c in chunks])


class Writer:
    """Appends encoded chunks to shards in a folder; ``finish`` writes the index and meta."""

    def __init__(self, folder: str, dtype):
        self.folder, self.dtype = folder, np.dtype(dtype)
        self.shards: list[list] = []
        self.file, self.in_shard = None, SHARD_TOKENS
        self.lengths: list[np.ndarray] = []
        self.label_ids: list[np.ndarray] = []
        self.values: dict = {}          # label -> [index, count, first place]

    def add(self, part: Encoded) -> None:
        ids = part.ids
        while len(ids):
            if self.in_shard >= SHARD_TOKENS:
                self._next_shard()
            take = ids[:SHARD_TOKENS - self.in_shard]
            self.file.write(np.ascontiguousarray(take, self.dtype).tobytes())
            self.in_shard += len(take)
            self.shards[-1][1] += len(take) * self.dtype.itemsize
            ids = ids[len(take):]
        self.lengths.append(part.lengths)
        if part.labels is not None:
            ids = np.empty(len(part.labels), np.int32)
            for i, v in enumerate(part.labels):
                entry = self.values.get(v)
                if entry is None:
                    entry = self.values[v] = [len(self.values), 0, part.firsts[v]]
                entry[1] += 1
                ids[i] = entry[0]
            self.label_ids.append(ids)

    def _next_shard(self) -> None:
        if self.file is not None:
            self.file.close()
        name = f"tokens-{len(self.shards):05d}.bin"
        self.file = open(os.path.join(self.folder, name), "wb")
        self.shards.append([name, 0])
        self.in_shard = 0

    def finish(self, meta: dict) -> dict:
        if self.file is None:
            self._next_shard()
        self.file.close()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        np.save(os.path.join(self.folder, "offsets.npy"), offsets)
        files = {name: size for name, size in self.shards}
        if self.label_ids:
            np.save(os.path.join(self.folder, "labels.npy"), np.concatenate(self.label_ids))
            meta["labels"] = [{"value": v, "count": c, "first": where}
                              for v, (_, c, where) in self.values.items()]
            files["labels.npy"] = os.path.getsize(os.path.join(self.folder, "labels.npy"))
        files["offsets.npy"] = os.path.getsize(os.path.join(self.folder, "offsets.npy"))
        meta.update(documents=len(lengths), tokens=int(offsets[-1]), dtype=self.dtype.name,
                    shards=self.shards, files=files)
        with open(os.path.join(self.folder, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        return meta


__all__ = ["Encoded", "SHARD_TOKENS", "Writer", "encoded"]
