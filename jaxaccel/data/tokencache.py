"""The token cache: a text source tokenized once, in worker processes, into flat token shards with
an index; training then reads rows from it without holding the corpus in memory.

    cache = tokens(spec, "train", tokenizer)      # built on first use, else opened
    cache.lengths()                               # int64 [documents]
    cache.read(i)                                 # the ids of document (example) i
    cache.span(start, stop)                       # ids of positions start..stop of the stream

A cache is a folder ``<cache dir>/<source>-<split>-<slot>-<key>/`` (nanoGPT's and levanter's
layout: flat binary token shards and an offsets index) holding

* ``tokens-00000.bin`` ...: every document's ids laid end to end (uint16 where the vocabulary
  fits, else uint32), at most ``tokenwriter.SHARD_TOKENS`` a shard;
* ``offsets.npy``: int64 [documents + 1], where each document starts in that stream;
* ``labels.npy`` (labelled texts): int32, each example's index into ``labels.json``'s
  ``values`` (the labels as the source gave them, first seen first, with counts and the file
  and line of each one's first example);
* ``meta.json``, written last: the format version, what the key was made of, the counts and
  each file's size.

The key is a digest of the source's identity (its files' paths, sizes and times,
or a dataset's name, version and files), the tokenizer (``encode.fingerprint``), the row length
of labelled texts and ``FORMAT``: a changed file, tokenizer or format builds a new cache, and
the log says what changed (``<slot>.last`` remembers the previous build). A build writes into
a ``.partial-<pid>`` folder renamed into place when complete, so a killed build leaves no
cache, only a partial folder that the next build removes; a cache whose files do not match its
``meta.json`` is rebuilt, never read. A source file that changes while it is tokenized fails
the build, and nothing is kept.

Reads use ``os.pread`` on the shards: the page cache holds what was read, not the trainer's
memory, so its resident size does not grow with the corpus (bench/README.md).
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import secrets
import shutil
import sys
import tempfile
import time

import numpy as np

from jaxaccel import processes
from jaxaccel.data import encode
from jaxaccel.data.spec import DataError, DataSpec
from jaxaccel.data.tokenwriter import Writer, encoded

FORMAT = 1
SMALL_SOURCE = 8 << 20          # bytes (or records x 256) below which one process tokenizes
CACHE_ENV = "JAXACCEL_DATA_CACHE"

log = logging.getLogger("jaxaccel")


def cache_root(settings) -> str:
    """The folder caches live in: ``data.cache_dir``, else ``$JAXACCEL_DATA_CACHE``, else
    ``$XDG_CACHE_HOME/jaxaccel/data`` (``~/.cache/jaxaccel/data``)."""
    if settings.cache_dir:
        return os.path.abspath(os.path.expanduser(settings.cache_dir))
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxaccel", "data")


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where a split's cache lives and what its key is made of."""

    root: str
    slot: str            # the source, split and settings, without file states
    key: dict            # what the records and ids depend on

    @property
    def folder(self) -> str:
        return os.path.join(self.root, f"{self.slot}-{digest(self.key)[:16]}")

    @property
    def last(self) -> str:
        return os.path.join(self.root, f"{self.slot}.last")


def plan(spec: DataSpec, split: str, tokenizer_fp: str) -> Plan:
    """The cache of ``split`` of ``spec`` for a tokenizer of fingerprint ``tokenizer_fp``."""
    reader = spec.reader
    settings = {"kind": spec.kind, "reader": _settings(reader),
                "max_len": spec.max_len if spec.kind == "text" else None}
    slot = f"{spec.name}-{split}-{digest(settings)[:8]}"
    key = {"format": FORMAT, "tokenizer": tokenizer_fp, "source": reader.identity(split),
           **settings}
    return Plan(cache_root(spec.settings), slot, key)


def _settings(reader) -> str:
    """A reader's settings (its dataclass fields but the files it reads)."""
    fields = {f.name: getattr(reader, f.name) for f in dataclasses.fields(reader)
              if f.repr and f.name != "files"}
    return f"{type(reader).__name__}{fields}"


class TokenCache:
    """A complete cache, opened for reading (module doc)."""

    def __init__(self, folder: str, meta: dict):
        self.folder, self.meta = folder, meta
        self.offsets = np.load(os.path.join(folder, "offsets.npy"), mmap_mode="r")
        self.dtype = np.dtype(meta["dtype"])
        self._shards = [os.path.join(folder, name) for name, _ in meta["shards"]]
        self._starts = np.cumsum([0] + [size // self.dtype.itemsize
                                        for _, size in meta["shards"]])
        self._fds: list[int] | None = None
        labelled = os.path.isfile(os.path.join(folder, "labels.npy"))
        self.labels = np.load(os.path.join(folder, "labels.npy")) if labelled else None
        self.label_values = meta.get("labels")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])

    def lengths(self) -> np.ndarray:
        return np.diff(np.asarray(self.offsets))

    def _fd(self, shard: int) -> int:
        if self._fds is None:
            self._fds = [os.open(path, os.O_RDONLY) for path in self._shards]
        return self._fds[shard]

    def span(self, start: int, stop: int) -> np.ndarray:
        """int32 ids of stream positions [start, stop) (documents laid end to end)."""
        out, size = [], self.dtype.itemsize
        shard = int(np.searchsorted(self._starts, start, "right")) - 1
        while start < stop:
            end = min(stop, int(self._starts[shard + 1]))
            local = start - int(self._starts[shard])
            raw = os.pread(self._fd(shard), (end - start) * size, local * size)
            out.append(np.frombuffer(raw, self.dtype))
            start, shard = end, shard + 1
        return np.concatenate(out).astype(np.int32) if out else np.zeros(0, np.int32)

    def read(self, i: int) -> np.ndarray:
        return self.span(int(self.offsets[i]), int(self.offsets[i + 1]))

    def close(self) -> None:
        for fd in self._fds or ():
            os.close(fd)
        self._fds = None

    def __del__(self):
        self.close()

    def __getstate__(self):
        return {"folder": self.folder, "meta": self.meta}

    def __setstate__(self, state):
        self.__init__(state["folder"], state["meta"])


# ----------------------------------------------------------------------------- opening


def _damage(folder: str) -> tuple[dict | None, str]:
    """``(meta, "")`` for a complete cache folder, else ``(None, why not)``."""
    try:
        with open(os.path.join(folder, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        return None, f"its meta.json cannot be read ({e})"
    for name, size in meta.get("files", {}).items():
        path = os.path.join(folder, name)
        have = os.path.getsize(path) if os.path.exists(path) else None
        if have != size:
            return None, f"{name} has {have} bytes, its meta.json says {size}"
    return meta, ""


def _mismatch(meta: dict, key: dict) -> str:
    """What differs between a cache's recorded key and the key wanted ("" if nothing)."""
    old = meta.get("key", {})
    if old.get("format") != key["format"]:
        return (f"it is of cache format version {old.get('format')}, this jaxaccel reads "
                f"version {key['format']}")
    if old.get("tokenizer") != key["tokenizer"]:
        return (f"it was built by another tokenizer (fingerprint {old.get('tokenizer')}, this "
                f"run's is {key['tokenizer']})")
    if old != key:
        return "it was built from other source files or settings"
    return ""


def _changes(plan_: Plan) -> str:
    """Why a new cache is built where an earlier one of the same slot exists ("" if none)."""
    try:
        with open(plan_.last) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return ""
    why = _mismatch({"key": old}, plan_.key)
    changed = source_changes(old.get("source", {}), plan_.key["source"])
    if not changed or why.startswith("it is of cache format"):
        return why
    other = old.get("tokenizer") != plan_.key["tokenizer"]
    return changed + ("; the tokenizer differs too (a corpus's own BPE is trained on it)"
                      if other else "")


def source_changes(old: dict, new: dict) -> str:
    """What differs between two identities of a source's split (``RecordReader.identity``):
    the files changed, new and gone (three of each), else that it changed ("" if not)."""
    was = {f[0]: f[1:] for f in old.get("files", [])}
    now = {f[0]: f[1:] for f in new.get("files", [])}
    changed = [p for p in now if p in was and was[p] != now[p]]
    notes = [f"{p} changed " + (f"(size {was[p][0]} -> {now[p][0]} bytes)"
                                if was[p][0] != now[p][0] else "(same size, modified since)")
             for p in changed[:3]]
    notes += [f"{p} is new" for p in list(now.keys() - was.keys())[:3]]
    notes += [f"{p} is gone" for p in list(was.keys() - now.keys())[:3]]
    return "; ".join(notes) or ("the source changed" if old != new else "")


def _nearest(root: str) -> str:
    """``root``, or the nearest path above it that exists."""
    while not os.path.exists(root):
        root = os.path.dirname(root)
    return root


def writable(root: str) -> bool:
    """Whether ``root`` (or the nearest folder above it that exists) takes a new file: tried,
    since permission bits do not say so for every user (root) or file system (read-only
    mounts, /proc)."""
    try:
        fd, path = tempfile.mkstemp(prefix=".jaxaccel-probe-", dir=_nearest(root))
    except OSError:
        return False
    os.close(fd)
    os.remove(path)
    return True


def require_writable(root: str, what: str, why: str = "") -> None:
    """``DataError`` naming ``data.cache_dir`` where ``what`` must be written to ``root`` but
    cannot be; a file where its folder should be is named as such."""
    here = _nearest(root)
    if not os.path.isdir(here):
        raise DataError(f"data.cache_dir {root!r}: {here} is a file, not a folder; set "
                        "data.cache_dir to a folder (or move the file away).")
    if not writable(root):
        raise DataError(
            f"data.cache_dir {root!r} is not writable, and {what} has no cache there"
            f"{' that fits: the one there ' + why.replace('it ', '', 1) if why else ''}. Set "
            "data.cache_dir to a writable folder, or build the cache where it can be written "
            "(jaxaccel data prepare --set data.cache_dir=...) and copy it.")


def lookup(plan_: Plan) -> TokenCache | None:
    """The complete cache of ``plan_``, or None; a folder there that is damaged, or records
    another key (a copied cache), is refused with what is wrong."""
    folder = plan_.folder
    if not os.path.isdir(folder):
        return None
    meta, why = _damage(folder)
    if meta is not None:
        why = _mismatch(meta, plan_.key)
        if not why:
            return TokenCache(folder, meta)
        raise DataError(f"the token cache {folder} does not belong to this run: {why}. Delete "
                        "the folder (it was copied or renamed there); the run rebuilds it.")
    if not writable(plan_.root):
        raise DataError(f"the token cache {folder} is incomplete ({why}) and data.cache_dir "
                        f"{plan_.root!r} is not writable; rebuild it where it can be written "
                        "(jaxaccel data prepare) or make the folder writable.")
    log.warning("the token cache %s is incomplete (%s), as a killed build leaves it: "
                "rebuilding it", folder, why)
    shutil.rmtree(folder)
    return None


def tokens(spec: DataSpec, split: str, tokenizer, *, workers: int | None = None,
           progress: bool = True) -> TokenCache:
    """The token cache of ``split``, built first where there is none (module doc), by
    ``workers`` processes (None: one a CPU; one for a source under ``SMALL_SOURCE``)."""
    enc = encode.encoder(tokenizer, spec.kind, spec.max_len)
    plan_ = plan(spec, split, encode.fingerprint(tokenizer))
    found = lookup(plan_)
    if found is not None:
        return found
    why = _changes(plan_)
    require_writable(plan_.root, f"split {split!r} of data.name={spec.name!r}", why)
    if why:
        log.info("rebuilding the token cache of %s split %r: %s", spec.name, split, why)
    return _build(spec, split, enc, plan_, workers, progress)


# ----------------------------------------------------------------------------- building


def _workers(total: int, unit: str, asked: int | None) -> int:
    """Processes to tokenize with: ``asked`` (None: one a CPU), one for a small source."""
    small = total < (SMALL_SOURCE if unit == "B" else SMALL_SOURCE // 256)
    return 1 if small else (asked or os.cpu_count() or 1)


def _progress(total: int, unit: str, what: str, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, unit=unit, unit_scale=True, desc=what, dynamic_ncols=True,
                file=sys.stderr, disable=None if enabled else True)


def _build(spec: DataSpec, split: str, enc: encode.Encoder, plan_: Plan, workers, progress):
    reader = spec.reader
    identity = plan_.key["source"]
    chunks = reader.chunks(split)
    unit = getattr(reader, "unit", "B")
    total = sum(reader.size(c) for c in chunks)
    workers = _workers(total, unit, workers)
    os.makedirs(plan_.root, exist_ok=True)
    _remove_partials(plan_)
    tmp = _partial_folder(plan_)
    what = f"{spec.name} {split}"
    log.info("tokenizing %s (%s %s) into %s with %d process%s", what, f"{total:,}",
             "bytes" if unit == "B" else "records", plan_.folder, workers,
             "" if workers == 1 else "es")
    t0, docs, toks = time.perf_counter(), 0, 0
    try:
        writer = Writer(tmp, enc.dtype)
        with _progress(total, unit, what, progress) as bar:
            for part in encoded(reader, enc, chunks, workers):
                writer.add(part)
                docs, toks = docs + len(part.lengths), toks + len(part.ids)
                bar.update(part.size)
                dt = max(time.perf_counter() - t0, 1e-9)
                bar.set_postfix_str(f"{docs / dt:,.0f} docs/s, {toks / dt:,.0f} tokens/s")
        if docs == 0:
            raise DataError(f"split {split!r} of data.name={spec.name!r} has no records "
                            f"({_sources(identity)}); give it data.")
        now = reader.identity(split)
        if now != identity:
            raise DataError(f"{source_changes(identity, now) or 'the source'} while its token "
                            "cache was built; nothing was kept. Build again once the files "
                            "are written.")
        meta = writer.finish({"key": plan_.key, "split": split, "source": spec.name})
        _install(tmp, plan_)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise _no_space(plan_, what, total, unit) from None
        raise
    dt = time.perf_counter() - t0
    log.info("cached %s documents, %s tokens in %.1f s (%s docs/s, %s tokens/s): %s",
             f"{docs:,}", f"{toks:,}", dt, f"{docs / dt:,.0f}", f"{toks / dt:,.0f}",
             plan_.folder)
    return TokenCache(plan_.folder, meta)


def _no_space(plan_: Plan, what: str, total: int, unit: str) -> DataError:
    """The error of a build that filled its disk: the folder, the space free and needed."""
    free = shutil.disk_usage(plan_.root).free
    need = f"up to about {total / 1e6:,.1f} MB, the source's size" if unit == "B" else \
        f"room for {total:,} records' tokens"
    return DataError(f"no space left on the device of data.cache_dir {plan_.root!r} while "
                     f"building the token cache of {what} ({free / 1e6:,.1f} MB free; it needs "
                     f"{need}); nothing was kept. Free space there, or set data.cache_dir to a "
                     "folder with room.")


def _partial_folder(plan_: Plan) -> str:
    """A new ``<cache>.partial-<pid>-<random>`` folder to build in, of the umask's mode (as
    ``os.makedirs`` makes the cache folder: a cache shared by a team is readable to it, where
    ``mkdtemp``'s 0700 was not)."""
    while True:
        path = f"{plan_.folder}.partial-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def _sources(identity: dict) -> str:
    files = identity.get("files")
    return f"{len(files)} file(s)" if files is not None else json.dumps(identity)[:200]


def _install(tmp: str, plan_: Plan) -> None:
    """Rename a complete build into place (another process's identical build may have won),
    and remember its key for the next build's message."""
    try:
        os.replace(tmp, plan_.folder)
    except OSError:
        if lookup(plan_) is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    with open(plan_.last + f".{os.getpid()}", "w") as f:
        json.dump(plan_.key, f)
    os.replace(plan_.last + f".{os.getpid()}", plan_.last)


def _remove_partials(plan_: Plan) -> None:
    """Remove partial folders of this cache whose build process is gone (a killed build)."""
    prefix = os.path.basename(plan_.folder) + ".partial-"
    for name in os.listdir(plan_.root):
        if not name.startswith(prefix):
            continue
        pid = int(name[len(prefix):].split("-")[0])
        if pid != os.getpid() and processes.alive(pid):
            continue
        log.warning("removing %s, left half-written by a build that did not finish",
                    os.path.join(plan_.root, name))
        shutil.rmtree(os.path.join(plan_.root, name), ignore_errors=True)


__all__ = ["FORMAT", "Plan", "TokenCache", "cache_root", "digest", "lookup", "plan",
           "require_writable", "source_changes", "tokens", "writable"]
