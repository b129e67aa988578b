"""Batches made ahead in a background thread, so the step never waits for the loader.

    for batch in prefetch(data.batches(epoch, start_step), depth=2): ...

The thread runs the batch iterator (numpy slicing, token-cache reads: both release the GIL
for most of their time) while the main thread dispatches steps; at most ``depth`` batches wait
made. The order is the iterator's; an error in it is raised where the batch would have come;
closing the generator (or leaving a ``for`` over it) stops the thread.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator

_DONE = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def prefetch(items: Iterable, depth: int = 2) -> Iterator:
    """``items``, each made up to ``depth`` ahead in a background thread (module doc)."""
    made: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                made.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            for item in items:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as e:      # noqa: BLE001 (raised again in the consumer)
            put(_Failed(e))

    thread = threading.Thread(target=work, name="jaxaccel-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = made.get()
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join()


__all__ = ["prefetch"]
