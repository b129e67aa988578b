"""Paths that are local folders or bucket URLs (``gs://``, ``s3://``; ``memory://`` in tests).

A run lives where its hosts can all reach it: on a Cloud TPU pod slice the hosts share no disk
and a preempted VM loses its own, so the run folder, a model to start from, data files and every
output may be a URL. Checkpoints go through Orbax and TensorStore's own ``gcs``/``s3`` drivers
(``train/checkpoint.py``); everything else goes through this module, over fsspec (``gcsfs``,
``s3fs``: the ``gcs`` and ``s3`` extras, imported only when such a path is used) for URLs and the
``os`` module for local paths, so callers never test which it is.

* ``check(path, what)`` before anything is written: an unknown scheme, or a missing extra, is a
  one-line error naming the pip command (never a traceback, never a local folder named ``gs:``).
* Every bucket error is one ``StorageError`` line: the URL, what failed (no such bucket, no
  credentials and where they were looked for, permission denied, the endpoint unreachable after
  its retries) and what to do.
* Writes of whole files are atomic on both: a local file is written beside its name and
  renamed; an object is one upload, visible complete or not at all.
"""
from __future__ import annotations

import contextlib
import functools
import glob as globlib
import hashlib
import importlib.util
import json
import os
import posixpath
import shutil
import tempfile

# scheme -> (the fsspec implementation's module, the jaxaccel extra that installs it)
SCHEMES = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3"), "memory": ("fsspec", None)}
# How often a failing S3 request is retried before its error is reported (botocore's standard
# retries with backoff: 5 tries); gcsfs tries a GCS request 6 times (fixed in gcsfs), TensorStore
# (checkpoints) by its own context (``train/orbax_buckets.py``).
RETRIES = 4
RETRIES_ENV = "JAXACCEL_BUCKET_RETRIES"
"""Where set, how many times botocore and TensorStore retry a failing bucket request instead of
their defaults (gcsfs's count is fixed): fewer end a run whose bucket stopped answering sooner
(the tests' servers), 0 reports the first failure."""


def retries(default: int) -> int:
    """``$JAXACCEL_BUCKET_RETRIES`` (``RETRIES_ENV``) where set, else ``default``."""
    raw = os.environ.get(RETRIES_ENV, "").strip()
    if not raw:
        return default
    if not raw.isdigit():
        raise ValueError(f"{RETRIES_ENV}={raw!r} is not a whole number of retries; set it to "
                         f"0 or more (e.g. {RETRIES_ENV}=1) or unset it.")
    return int(raw)


class StorageError(OSError):
    """A bucket could not be read or written; the message says which, why and what to do."""


def is_url(path) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and "://" in path


def scheme(path: str) -> str | None:
    return path.split("://", 1)[0].lower() if is_url(path) else None


def check(path: str, what: str) -> None:
    """Refuse ``path`` (the value of ``what``, e.g. ``workdir``) if it is a URL this installation
    cannot use: an unknown scheme, or one whose extra is not installed (the pip command)."""
    s = scheme(path)
    if s is None:
        return
    if s not in SCHEMES:
        raise ValueError(f"{what}={path!r}: the scheme {s}:// is not supported; use a local "
                         f"path or one of {', '.join(f'{k}://' for k in SCHEMES if k != 'memory')}.")
    module, extra = SCHEMES[s]
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"{what}={path!r}: {s}:// paths need {module}, which is not installed: "
                         f"pip install 'jaxaccel[{extra}]'")
    if not path.split("://", 1)[1].strip("/"):
        raise ValueError(f"{what}={path!r} names no bucket: give {s}://BUCKET[/FOLDER].")


def absolute(path: str) -> str:
    """``path`` made absolute (local), or the URL without a trailing slash."""
    if is_url(path):
        head, rest = path.split("://", 1)
        return f"{head}://{rest.rstrip('/')}"
    return os.path.abspath(os.path.expanduser(path))


def join(path: str, *parts: str) -> str:
    return posixpath.join(path, *parts) if is_url(path) else os.path.join(path, *parts)


def parent(path: str) -> str:
    return posixpath.dirname(path) if is_url(path) else os.path.dirname(path)


def basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/")) if is_url(path) else os.path.basename(path)


@functools.lru_cache(maxsize=None)
def _filesystem(protocol: str):
    import fsspec
    options = {"s3": {"config_kwargs": {"retries": {"max_attempts": retries(RETRIES) + 1,
                                                    "mode": "standard"}}}}.get(protocol, {})
    return fsspec.filesystem(protocol, **options)


def filesystem(url: str):
    """The fsspec filesystem of ``url``'s scheme (one per process)."""
    check(url, "path")
    return _filesystem(scheme(url))


@contextlib.contextmanager
def errors(url: str, doing: str):
    """Bucket errors of ``doing`` on ``url`` as one ``StorageError`` line."""
    try:
        yield
    except (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
            StorageError):
        raise
    except Exception as e:      # noqa: BLE001 -- each client raises its own types
        raise StorageError(_explain(url, doing, e)) from None


def _explain(url: str, doing: str, e: Exception) -> str:
    """One line on why ``doing`` on ``url`` failed, and what to do."""
    s, text = scheme(url), f"{type(e).__name__}: {e}".splitlines()[0][:300]
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    lowered = text.lower()
    denied = isinstance(e, PermissionError) or any(
        w in lowered for w in ("403", "forbidden", "access denied", "401"))
    if denied and not _anonymous(s):
        why = (f"permission denied on {s}://{bucket} ({text}); grant the credentials in use "
               "write access (e.g. roles/storage.objectAdmin) or use another bucket")
    elif denied or any(w in lowered for w in ("credential", "token", "unable to locate")):
        why = (f"no credentials for {s}:// ({text}); " + (
            "set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, run `gcloud auth "
            "application-default login`, or run on a VM whose service account has access "
            "(the metadata server)" if s == "gs" else
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or run where an "
            "instance role gives them"))
    elif any(w in lowered for w in ("connect", "timeout", "timed out", "unreachable",
                                    "name resolution", "refused")):
        why = (f"the storage endpoint could not be reached, tried again with backoff ({text}); "
               "check the network (and STORAGE_EMULATOR_HOST / AWS_ENDPOINT_URL if set)")
    else:
        why = text
    return f"{doing} {url}: {why}."


def _anonymous(protocol: str) -> bool:
    """Whether this process's ``gs://`` client found no credentials: gcsfs then goes on
    anonymously (after GOOGLE_APPLICATION_CREDENTIALS, gcloud's login and the metadata server),
    and a bucket's refusal means credentials are missing, not that they lack a role."""
    if protocol != "gs":
        return False
    credentials = getattr(_filesystem(protocol), "credentials", None)
    return getattr(credentials, "method", None) == "anon"


def _missing_bucket(url: str) -> StorageError:
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    return StorageError(f"{url}: the bucket {scheme(url)}://{bucket} does not exist (or these "
                        f"credentials cannot see it); create it first (gcloud storage buckets "
                        f"create gs://{bucket} / aws s3 mb s3://{bucket}) or fix the name.")


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    with errors(path, "checking"):
        return filesystem(path).exists(path)


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    with errors(path, "checking"):
        return filesystem(path).isdir(path)


def listdir(path: str) -> list[str]:
    """The names in folder ``path`` (``[]`` if it does not exist)."""
    if not is_url(path):
        return os.listdir(path) if os.path.isdir(path) else []
    fs = filesystem(path)
    with errors(path, "listing"):
        try:
            fs.invalidate_cache(path)
            entries = fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
    return sorted({posixpath.basename(e.rstrip("/")) for e in entries} - {""})


def makedirs(path: str) -> None:
    """Make folder ``path`` (a bucket has no folders: only the bucket must exist)."""
    if not is_url(path):
        os.makedirs(path, exist_ok=True)
        return
    bucket = f"{scheme(path)}://{path.split('://', 1)[1].split('/', 1)[0]}"
    fs = filesystem(path)
    with errors(path, "opening"):
        try:
            fs.ls(bucket, detail=False)
        except FileNotFoundError:
            raise _missing_bucket(path) from None


def remove(path: str) -> None:
    if not is_url(path):
        os.remove(path)
        return
    with errors(path, "removing"):
        filesystem(path).rm_file(path)


def rmtree(path: str) -> None:
    """Remove folder ``path`` and everything under it (nothing if it does not exist)."""
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    fs = filesystem(path)
    with errors(path, "removing"):
        try:
            fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        fs.invalidate_cache(path)


def move(source: str, dest: str) -> None:
    """Move a file or folder (a bucket's: copied, then removed)."""
    if not is_url(source):
        os.rename(source, dest)
        return
    fs = filesystem(source)
    with errors(source, "moving"):
        fs.mv(source, dest, recursive=True)
        fs.invalidate_cache(parent(source))


def read_bytes(path: str) -> bytes:
    if not is_url(path):
        with open(path, "rb") as f:
            return f.read()
    with errors(path, "reading"):
        return filesystem(path).cat_file(path)


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


def write_bytes(path: str, data: bytes) -> None:
    """Write the whole file ``path`` atomically: complete, or the old one (or none)."""
    if not is_url(path):
        folder = os.path.dirname(path) or "."
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        return
    fs = filesystem(path)
    with errors(path, "writing"):
        fs.pipe_file(path, data)
        fs.invalidate_cache(parent(path))


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def read_json(path: str):
    return json.loads(read_text(path))


def write_json(path: str, obj) -> None:
    write_text(path, json.dumps(obj, indent=2))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def bytes_under(folder: str) -> int:
    """The size of the files under ``folder``."""
    if not is_url(folder):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder)
                   for f in files)
    with errors(folder, "listing"):
        return int(filesystem(folder).du(folder, total=True))


def upload(local_folder: str, url: str) -> None:
    """Copy the files under ``local_folder`` to the folder ``url``."""
    fs = filesystem(url)
    with errors(url, "uploading to"):
        for d, _, files in os.walk(local_folder):
            for f in files:
                rel = os.path.relpath(os.path.join(d, f), local_folder).replace(os.sep, "/")
                fs.put_file(os.path.join(d, f), posixpath.join(url, rel))
        fs.invalidate_cache(url)


@functools.lru_cache(maxsize=None)
def local_copy(url: str) -> str:
    """A local copy of the folder or file ``url`` (a model checkpoint, a tokenizer, a run's
    tokenizer/, a data file), for readers that take only local paths (``transformers``,
    ``tokenizers``, safetensors, the data readers): downloaded once into
    ``$XDG_CACHE_HOME/jaxaccel/remote/KEY/NAME`` (``~/.cache`` without XDG_CACHE_HOME; NAME the
    URL's last part, KEY a digest of the URL and of every object's size and version, so a
    changed object is downloaded again; a process asks the bucket once per URL: a run reads
    its model's checkpoint at several places). A local path is returned as it is."""
    if not is_url(url):
        return url
    fs = filesystem(url)
    with errors(url, "listing"):
        fs.invalidate_cache(url)
        objects = fs.find(url, detail=True)
    if not objects:
        raise FileNotFoundError(f"{url}: no such file or folder (no object under it).")
    single = fs._strip_protocol(url).rstrip("/") in objects and len(objects) == 1
    folder = _mirrored(url, objects, url if single else None)
    return os.path.join(folder, basename(url))


def mirror(pattern: str) -> str:
    """The local glob that matches the local copies of what the bucket glob ``pattern``
    matches (``gs://b/data/**/*.jsonl``; a URL without wildcards: ``local_copy``), laid out as
    under the glob's root (its leading folders without wildcards), so that folder names (a
    file's class folder) are the bucket's. A local pattern is returned as it is."""
    if not is_url(pattern) or not globlib.has_magic(pattern):
        return local_copy(pattern)
    head, rest = pattern.split("://", 1)
    parts = rest.split("/")
    fixed = next(i for i, p in enumerate(parts) if globlib.has_magic(p))
    root = f"{head}://{'/'.join(parts[:fixed])}"
    fs = filesystem(pattern)
    with errors(pattern, "listing"):
        fs.invalidate_cache()
        objects = {p: i for p, i in fs.glob(pattern, detail=True).items()
                   if i.get("type") == "file"}
    if not objects:
        raise FileNotFoundError(f"{pattern} matches no object in the bucket.")
    folder = _mirrored(root, objects)
    return os.path.join(folder, basename(root), *parts[fixed:])


def _mirrored(url: str, objects: dict, single: str | None = None) -> str:
    """The local folder holding ``objects`` (fsspec paths with their info) below ``url``,
    downloaded unless a copy of these same versions is there (``local_copy``)."""
    fs = filesystem(url)
    versions = sorted((name, info.get("size"), str(info.get("generation") or info.get("ETag")
                                                   or info.get("mtime") or ""))
                      for name, info in objects.items())
    key = hashlib.sha256(json.dumps([url, versions]).encode()).hexdigest()[:16]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(base, "jaxaccel", "remote", key)
    if os.path.isdir(folder):
        return folder
    staging = tempfile.mkdtemp(prefix=f".{key}-", dir=_made(os.path.dirname(folder)))
    try:
        name = basename(url)
        top = fs._strip_protocol(url).rstrip("/")
        with errors(url, "downloading"):
            for path in objects:
                rel = name if single else posixpath.join(name, path[len(top):].lstrip("/"))
                dest = os.path.join(staging, *rel.split("/"))
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                fs.get_file(path, dest)
        os.chmod(staging, 0o777 & ~_umask())
        os.replace(staging, folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not os.path.isdir(folder):      # else another process downloaded it first
            raise
    return folder


def _made(folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    return folder


def writable(url: str) -> None:
    """Raise ``StorageError`` unless this process can create and delete an object under the
    folder ``url`` (its bucket exists, credentials are found, writes are allowed)."""
    makedirs(url)
    probe = join(url, f".write_test_{os.getpid()}")
    fs = filesystem(url)
    with errors(url, "writing to"):
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)


def check_out_dir(path: str) -> None:
    """Refuse an output folder that cannot be made or written, before any work: a file of that
    name (or above it), or a folder without write permission (``compile --out``, and every
    ``bench`` suite's ``--out``); a bucket URL that cannot be written (``writable``)."""
    check(path, "--out")
    if is_url(path):
        try:
            writable(path)
        except OSError as e:
            raise ValueError(f"--out {path!r}: {e}") from None
        return
    here = os.path.abspath(path)
    while not os.path.exists(here):
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        raise ValueError(f"--out {path!r}: {here!r} is a file, not a folder; --out names the "
                         "folder the result file is written into (made if missing).")
    if not os.access(here, os.W_OK | os.X_OK):
        raise ValueError(f"--out {path!r}: the folder {here!r} is not writable; name a folder "
                         "you can write to.")
