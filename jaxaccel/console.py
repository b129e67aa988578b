"""Where a command's output goes: its result on stdout, everything else on stderr.

A script runs ``jaxaccel train ... > result.json`` and parses what it gets, so stdout carries the
command's result alone (its JSON, or the documented text). Libraries print to stdout on first
use (TensorFlow Datasets' "Downloading and preparing dataset ..." through ``termcolor``, a
download's progress, a C library's own lines), so within ``results_only`` Python's
``sys.stdout`` is stderr, and so is file descriptor 1 where stdout is a real file or pipe (what a
C library or a child process writes), while ``result`` is the one stream to the real stdout::

    with console.results_only():
        ...                                   # any library's prints land on stderr
        print(json.dumps(record), file=console.result())
"""
from __future__ import annotations

import contextlib
import io
import os
import sys

_result: io.TextIOBase | None = None


def result():
    """The stream a command writes its result to: the real stdout inside ``results_only``,
    ``sys.stdout`` elsewhere (a library caller's own)."""
    return _result if _result is not None else sys.stdout


def _descriptor(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):      # pytest's capture, StringIO, closed
        return None


@contextlib.contextmanager
def results_only():
    """Within the block, stdout is the result's alone (``result()``): ``sys.stdout`` is
    ``sys.stderr``, and where the real stdout is file descriptor 1 that descriptor points at
    stderr too (the real one is kept on a duplicate, which ``result()`` writes to, a line at a
    time). Restored at the end."""
    global _result
    real = sys.stdout
    saved = None
    if _descriptor(real) == 1 and _descriptor(sys.stderr) is not None:
        real.flush()
        saved = os.dup(1)
        os.dup2(_descriptor(sys.stderr), 1)
        stream = os.fdopen(os.dup(saved), "w", encoding=real.encoding, errors=real.errors,
                           buffering=1)
    else:
        stream = real
    outer, _result, sys.stdout = _result, stream, sys.stderr
    try:
        yield stream
    finally:
        stream.flush()
        sys.stdout, _result = real, outer
        if saved is not None:
            sys.stderr.flush()
            os.dup2(saved, 1)
            os.close(saved)
            stream.close()
