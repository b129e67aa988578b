"""Stopping on SIGTERM or Ctrl-C after a step that every process agrees on.

A scheduler that preempts a job sends SIGTERM, to one process or to each at a slightly different
time; Ctrl-C sends SIGINT. The trainer then saves a checkpoint and returns. In a multi-process
run the save is collective, so every process must leave the loop after the *same* step: one that
stops a step early waits in the save forever while its peers wait in the next step's collectives.

*One process:* a Python handler turns SIGTERM or a first SIGINT into a flag that
``Preemption.reached`` reads after every step.

*Several processes* (``jax.distributed``): JAX's preemption sync manager, which
``jax.distributed.initialize`` creates, catches SIGTERM in C++ and posts a notice to the
coordination service. Every process then reports the counter it last passed to
``jax.experimental.multihost_utils.reached_preemption_sync_point`` (calls block while this runs,
so no counter moves meanwhile), and the sync point is

    sync = max over processes of counter_p + 1,

the first step no process has passed: each keeps stepping until its counter equals ``sync``, so
all stop after the same step. The counter is the number of steps this process has run since it
started (not the global step): it is the same on every process, since all resume from one
checkpoint, and a notice that comes before the first step (every counter 0) stops after step 1.
A first Ctrl-C raises SIGTERM in its own process, so it is coordinated the same way.

A second Ctrl-C raises ``KeyboardInterrupt`` at once, without saving, in both cases.
"""
from __future__ import annotations

import signal
import sys

import jax


class Preemption:
    """``with Preemption() as p: ... if p.reached(): save and stop``.

    ``reached()`` must be called exactly once after every training step, on every process; once
    it returns True it stays True. ``requested`` names the signal that asked for the stop
    (``"SIGTERM"`` in a multi-process run when the notice came through JAX, possibly to a peer).
    """

    def __init__(self):
        self.requested: str | None = None
        self.stop = False
        self.coordinated = jax.process_count() > 1
        self._steps = 0
        self._previous = {}

    def __enter__(self):
        if self.coordinated:
            from jax.experimental import multihost_utils
            try:        # counter 0: "no step yet", what the sync manager starts from
                multihost_utils.reached_preemption_sync_point(0)
            except RuntimeError as e:
                raise RuntimeError(
                    f"{e} Without it the processes of this run could stop at different steps "
                    "on SIGTERM and hang in the save: enable jax_enable_preemption_service "
                    "before jax.distributed.initialize (jaxaccel.distributed."
                    "initialize_from_env does).") from None
        # Multi-process: SIGTERM stays with JAX's C++ handler (installed at initialize).
        signals = (signal.SIGINT,) if self.coordinated else (signal.SIGTERM, signal.SIGINT)
        try:
            self._previous = {s: signal.signal(s, self._handle) for s in signals}
        except ValueError:          # not the main thread: no handler, nothing to restore
            self._previous = {}
        return self

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.requested == "SIGINT":
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        if signum == signal.SIGINT:
            print("\nCtrl-C: saving a checkpoint after this step and stopping (Ctrl-C again "
                  "aborts without saving).", file=sys.stderr, flush=True)
            if self.coordinated:
                signal.raise_signal(signal.SIGTERM)     # to JAX's handler: tell every process

    def reached(self) -> bool:
        """After each step: True if the loop should save and stop now."""
        if self.stop:
            return True
        self._steps += 1
        if self.coordinated:
            from jax.experimental import multihost_utils
            self.stop = multihost_utils.reached_preemption_sync_point(self._steps)
            if self.stop and self.requested is None:
                self.requested = "SIGTERM"
        else:
            self.stop = self.requested is not None
        return self.stop

    def __exit__(self, *exc):
        for s, previous in self._previous.items():
            signal.signal(s, previous)
