"""The run folder's lock: one trainer writes a run folder at a time, on a local disk or in a
bucket (``RunLock``; the rules are in ``train/rundir.py``'s module doc)."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid

from jaxaccel import processes, storage
from jaxaccel.train.rundir import RunFolderError

log = logging.getLogger("jaxaccel")


LEASE_S = 120.0
"""How long a run folder's lock in a bucket stays valid without being renewed (its trainer renews
it every quarter of that): a lock older than this is stale, its trainer's VM preempted or
lost, and the next trainer takes it over."""


@dataclasses.dataclass
class RunLock:
    """``with RunLock(run_dir):`` -- the one writer of ``run_dir`` (see the module doc).

    On a local disk the lock file is created exclusively, and a lock of a process that no longer
    runs on this host is stale. In a bucket, which the hosts of a pod slice share and which
    outlives their VMs, the lock object records a token and when it was last renewed: the
    trainer renews it every ``lease_s / 4`` seconds, so a lock not renewed for ``lease_s`` (or
    one of a process gone from this host) is stale. An object cannot be created exclusively
    through every client, so a trainer reads the lock back after writing it and gives way if
    another trainer's token is there."""

    run_dir: str
    lease_s: float = LEASE_S
    _renewal: threading.Event | None = dataclasses.field(default=None, init=False, repr=False)
    _renewer: threading.Thread | None = dataclasses.field(default=None, init=False, repr=False)
    _token: str | None = dataclasses.field(default=None, init=False, repr=False)

    @property
    def path(self) -> str:
        return storage.join(self.run_dir, "lock")

    def _holder(self) -> dict | None:
        try:
            return storage.read_json(self.path)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def _stale(self, holder: dict, me: dict) -> bool:
        """Whether ``holder``'s lock may be taken over: its process is gone from this host, or
        (in a bucket) it was not renewed for ``lease_s``."""
        gone = (holder.get("host") == me["host"] and isinstance(holder.get("pid"), int)
                and not processes.alive(holder["pid"]))
        renewed = holder.get("renewed")
        expired = (storage.is_url(self.run_dir) and isinstance(renewed, (int, float))
                   and time.time() - renewed > self.lease_s)
        return gone or expired

    def _refuse(self, holder: dict) -> RunFolderError:
        lease = ""
        if storage.is_url(self.run_dir) and isinstance(holder.get("renewed"), (int, float)):
            lease = (f", renewed {time.time() - holder['renewed']:.0f} s ago; taken over once "
                     f"not renewed for {self.lease_s:.0f} s")
        return RunFolderError(
            f"run folder {self.run_dir!r} is in use by another trainer (pid "
            f"{holder.get('pid', '?')} on host {holder.get('host', '?')}, lock {self.path}"
            f"{lease}). Wait for it, or use another name=...; if that process is gone (e.g. "
            "its node died), delete the lock file.")

    def acquire(self) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        if storage.is_url(self.run_dir):
            self._acquire_object(me)
            return
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue                    # released meanwhile: try again
                if not self._stale(holder, me):
                    raise self._refuse(holder) from None
                log.warning("taking over the stale lock of pid %s (no longer running on %s)",
                            holder["pid"], holder["host"])
                os.remove(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            return
        raise RunFolderError(f"could not take the lock {self.path}; try again.")

    def _acquire_object(self, me: dict) -> None:
        holder = self._holder()
        if holder is not None:
            if not self._stale(holder, me):
                raise self._refuse(holder)
            log.warning("taking over the stale lock of pid %s on %s (%s)", holder.get("pid"),
                        holder.get("host"), self.path)
        self._token = uuid.uuid4().hex
        storage.write_json(self.path, {**me, "token": self._token, "renewed": time.time()})
        if (self._holder() or {}).get("token") != self._token:
            self._token = None
            raise RunFolderError(f"another trainer took the lock {self.path} at the same "
                                 "moment; try again, or use another name=....")
        self._renewal = threading.Event()
        self._renewer = threading.Thread(target=self._renew, args=(me, self._renewal),
                                         daemon=True, name="jaxaccel-run-lock")
        self._renewer.start()

    def _renew(self, me: dict, stop: threading.Event) -> None:
        """Renew the bucket lock every quarter lease until ``stop``; a failed renewal is tried
        again at the next one (the lease leaves three)."""
        while not stop.wait(self.lease_s / 4):
            try:
                if (self._holder() or {}).get("token") == self._token:
                    storage.write_json(self.path, {**me, "token": self._token,
                                                   "renewed": time.time()})
            except OSError as e:
                log.warning("could not renew the run folder's lock %s: %s", self.path, e)

    def release(self) -> None:
        if self._renewal is not None:
            # a renewal under way would write the lock again after it is removed: let it end
            self._renewal.set()
            self._renewer.join()
            self._renewal = self._renewer = None
        holder = self._holder()
        ours = (holder.get("token") == self._token if storage.is_url(self.run_dir)
                else holder.get("pid") == os.getpid()) if holder else False
        if ours:
            try:
                storage.remove(self.path)
            except FileNotFoundError:
                pass
        self._token = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
