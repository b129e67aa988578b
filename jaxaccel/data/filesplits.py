"""Which files each split of a folder source reads (``data.name=files``, ``audio``): a glob's
search (links followed, each real folder once), where each glob searches from (its root), a
file's class by its folder, and the refusal of an eval file that is a training file too."""
from __future__ import annotations

import filecmp
import fnmatch
import glob
import logging
import os

from jaxaccel.data.spec import DataError, DataMissing

log = logging.getLogger("jaxaccel")


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
    named: where a file's class folder is counted from (``folder_class``)."""
    pattern = os.path.abspath(os.path.expanduser(pattern))
    if os.path.isdir(pattern):
        return pattern
    parts = pattern.split(os.sep)
    fixed = next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts) - 1)
    return os.sep.join(parts[:fixed]) or os.sep


def roots(globs: str) -> tuple[str, ...]:
    """Each glob's ``glob_root``."""
    return tuple(glob_root(g.strip()) for g in globs.split(",") if g.strip())


def folder_class(path: str, roots_: tuple[str, ...]) -> str:
    """The class of a file labelled by its folder: the first folder level under the root it was
    found from (ImageFolder's rule: ``calls/bird/day0/1.wav`` is a ``bird``), or the root's own
    name for a file directly in it (a glob naming the class folder: ``reviews/pos/*.txt``)."""
    root = max((r for r in roots_ if path.startswith(r.rstrip(os.sep) + os.sep)), key=len,
               default=os.path.dirname(path))
    parts = os.path.relpath(path, root).split(os.sep)
    return parts[0] if len(parts) > 1 else os.path.basename(root)


def _split_globs(settings) -> dict[str, str]:
    return {"train": settings.train_files,
            **({settings.eval_split: settings.eval_files} if settings.eval_files else {})}


def split_roots(settings) -> dict[str, tuple[str, ...]]:
    """Each split's glob roots (``folder_class``)."""
    return {split: roots(globs) for split, globs in _split_globs(settings).items()}


def split_files(settings, find, train_gone_ok: bool = False) -> tuple[dict, str]:
    """``(files, gone)``: each split's files, ``find(globs, key)``: ``data.train_files``, and
    ``data.eval_files`` as ``data.eval_split`` (``refuse_shared`` checks them against the
    training files). ``train_gone_ok``: training files that match nothing beside eval files
    leave the training split out, ``gone`` saying why (a run's eval reads its eval files
    alone)."""
    files, gone = {}, ""
    for split, globs in _split_globs(settings).items():
        try:
            files[split] = find(globs, f"data.{'train' if split == 'train' else 'eval'}_files")
        except DataMissing as e:
            if not (train_gone_ok and split == "train" and settings.eval_files):
                raise
            gone = str(e)
    return files, gone


def refuse_shared(files: dict, settings, examples_are_files: bool) -> None:
    """``DataError`` naming the eval files (of ``split_files``'s ``files``) that are training
    files too: the same file (by its real path, whatever links lead to it), or a byte-identical
    copy where a file holds many examples. Where each file is one example (a text document, a
    clip) copies are warned of: the same example in both splits, a duplicate in the data
    rather than a file given twice."""
    if not settings.eval_files or "train" not in files:
        return
    train, evals = files["train"], files[settings.eval_split]
    real = {os.path.realpath(p) for p in train}
    same = [p for p in evals if os.path.realpath(p) in real]
    copies = [] if same else _copies(train, evals)
    if copies and examples_are_files:
        log.warning("data.eval_files: %d eval file(s) hold the bytes of training files (%s%s): "
                    "the same examples in both splits; remove them from one for a held-out "
                    "score.", len(copies), "; ".join(copies[:3]), " ..." if len(copies) > 3 else "")
        return
    same = same or copies
    if same:
        raise DataError(
            f"data.eval_files: {'; '.join(same[:3])}{' ...' if len(same) > 3 else ''}: "
            f"{len(same)} eval file(s) also in data.train_files (by real path or identical "
            "bytes), so the eval split would score examples the model trained on. Give "
            "data.eval_files held-out files, or drop it and hold some out with data.holdout.")


def _copies(train, evals) -> list[str]:
    """``"<eval file> (a copy of <training file>)"`` for each eval file whose bytes a training
    file holds (only files of the same size are compared)."""
    by_size = {}
    for p in train:
        by_size.setdefault(os.path.getsize(p), []).append(p)
    out = []
    for p in evals:
        size = os.path.getsize(p)
        twin = next((q for q in by_size.get(size, ()) if size and
                     filecmp.cmp(p, q, shallow=False)), None)
        if twin is not None:
            out.append(f"{p} (a copy of {twin})")
    return out


__all__ = ["folder_class", "glob_root", "refuse_shared", "roots", "search", "split_files",
           "split_roots"]
