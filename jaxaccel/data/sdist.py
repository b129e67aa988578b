"""Source distributions fetched from PyPI with pip: where the packaged corpora come from."""

from __future__ import annotations

import os
import subprocess
import sys


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
