"""Which files a folder source reads (``data.name=files``, ``audio``): a glob's search (links
followed, each real folder once) and where each glob searches from (its root)."""
from __future__ import annotations

import fnmatch
import glob
import os


def search(pattern: str) -> list[str]:
    """The paths ``pattern`` matches: a folder's files; a recursive glob's (``**``) from a walk
    of its fixed leading folder (Python's recursive glob goes round a link loop); else glob's."""
    if os.path.isdir(pattern):
        return _walk(pattern)
    if "**" not in pattern:
        return glob.glob(pattern)
    root = glob_root(pattern)
    wanted = os.path.relpath(pattern, root).split(os.sep)
    return [p for p in _walk(root)
            if _glob_match(os.path.relpath(p, root).split(os.sep), wanted)]


def _walk(folder: str) -> list[str]:
    """The files under ``folder`` (hidden ones aside, as a glob's ``*`` leaves them), links
    followed, each real folder searched once."""
    seen, out = set(), []
    for top, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(top)
        dirs[:] = [] if real in seen else sorted(d for d in dirs if not d.startswith("."))
        if real not in seen:
            out += [os.path.join(top, n) for n in names if not n.startswith(".")]
        seen.add(real)
    return out


def _glob_match(parts: list[str], pattern: list[str]) -> bool:
    """Whether a relative path's ``parts`` match a glob's (``**``: any folders, or none)."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_glob_match(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and not (parts[0].startswith(".") and not pattern[0].startswith(".")) \
        and fnmatch.fnmatchcase(parts[0], pattern[0]) and _glob_match(parts[1:], pattern[1:])


def glob_root(pattern: str) -> str:
    """The folder a glob searches (its leading folders without wildcards), or the folder
    named."""
    pattern = os.path.abspath(os.path.expanduser(pattern))
    if os.path.isdir(pattern):
        return pattern
    parts = pattern.split(os.sep)
    fixed = next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts) - 1)
    return os.sep.join(parts[:fixed]) or os.sep


__all__ = ["glob_root", "search"]
