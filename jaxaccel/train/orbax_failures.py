"""What a failed Orbax read or write leaves, made short and quiet: one line for the console
(``one_line``), the tracebacks to ``details`` (the run folder's library.log while
``rundir.library_log`` is active), a disk-full error recognised in whatever type carries it
(``is_disk_full``), and nothing that reports itself later (``quiet_leftovers``).
"""
from __future__ import annotations

import asyncio
import errno
import gc
import logging
import sys
import time

# Tracebacks of failed reads and writes: kept out of the console; the run folder's library.log
# while ``rundir.library_log`` is active (the CLI's train, eval, predict, generate).
details = logging.getLogger("jaxaccel.details")
details.propagate = False
details.addHandler(logging.NullHandler())


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` (or an exception it was raised from) is ENOSPC, as an OSError or in the
    text of a TensorStore error."""
    while e is not None:
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def one_line(e: Exception) -> str:
    """One line saying why a checkpoint could not be read (Orbax errors run to pages)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0].split(" See full TensorStore details")[0] if lines else ""
    return f"{type(e).__name__}: {text[:200]}"


# How long ``quiet_leftovers`` waits for the TensorStore reads and writes of a failed Orbax
# operation that are still going on.
_IN_FLIGHT_WAIT_S = 10.0


def _dropped(*args, **kwargs) -> None:
    """``call_soon_threadsafe`` of a closed event loop (``quiet_leftovers``)."""
    details.debug("a result handed to a closed Orbax event loop was dropped: %r", args[:1])


def _unraisable_to_details(u) -> None:
    details.warning("%s: %r", u.err_msg or "Exception ignored in", u.object,
                    exc_info=(u.exc_type, u.exc_value, u.exc_traceback))


def quiet_leftovers() -> None:
    """After a failed Orbax read or write: settle what it left behind, so that nothing prints
    after the command's error line, and nothing writes into the checkpoint folder any more.

    Orbax runs each operation on an event loop of its own and closes that loop as soon as the
    operation raises, while TensorStore is still reading or writing the operation's other
    arrays, and its tasks and coroutines wait in reference cycles. Each of these printed a
    traceback when it finished at some later moment (a garbage collection, the interpreter's
    exit): a TensorStore thread handing its result to the closed loop ("RuntimeError: Event
    loop is closed"), "Task exception was never retrieved", "Task was destroyed but it is
    pending!", "Exception ignored in: <coroutine ...>". Here a closed loop drops what is handed
    to it (nothing runs on a closed loop again), the TensorStore operations still going on are
    waited for (up to ``_IN_FLIGHT_WAIT_S``), the closed loops' futures and tasks are marked
    as reported, and the leftovers are collected now with their reports going to ``details``
    (the run folder's ``library.log`` under ``rundir.library_log``)."""
    import tensorstore as ts
    # type(obj), not isinstance: that reads obj.__class__, which some objects (deprecated
    # aliases of other libraries) answer with a warning.
    in_flight = []
    for obj in gc.get_objects():
        if issubclass(type(obj), asyncio.BaseEventLoop) and obj.is_closed():
            obj.call_soon_threadsafe = _dropped
        elif issubclass(type(obj), ts.Future) and not obj.done():
            in_flight.append(obj)
    deadline = time.monotonic() + _IN_FLIGHT_WAIT_S
    for future in in_flight:
        try:
            future.exception(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 -- its error is the failure already reported
            pass
    del in_flight
    for obj in gc.get_objects():
        if issubclass(type(obj), asyncio.Future) and obj.get_loop().is_closed():
            if not obj.done():
                if issubclass(type(obj), asyncio.Task):
                    obj._log_destroy_pending = False   # asyncio's own switch for this
            elif not obj.cancelled():
                obj.exception()                        # retrieved: not reported again

    def to_details(record):
        details.handle(record)
        return False
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.addFilter(to_details)
    hook, sys.unraisablehook = sys.unraisablehook, _unraisable_to_details
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook
        asyncio_log.removeFilter(to_details)


__all__ = ["details", "is_disk_full", "one_line", "quiet_leftovers"]
