"""Orbax checkpoints of the train state plus a small JSON record (data position, config).

Writes are atomic: Orbax writes into a temporary folder and renames it when complete, so an
interrupted write leaves the previous checkpoint as the latest readable one, and no reader ever
sees a step before it is complete. Only the writer (the trainer holding the run folder's lock)
cleans unfinished temporary folders up: the one of a save that failed for lack of space at once
(it takes the space the disk lacks), any other as it opens the folder, saying so; readers
(eval, predict, generate) open the folder read-only and never delete, clean or create anything,
so they can run while the trainer saves. A failed read or write leaves nothing that reports
itself later (``orbax_failures.quiet_leftovers``).

Saves are asynchronous: ``save`` checks that the parameters are all finite (a state that is not
is never saved), copies the state to host memory (after which the caller may donate or
overwrite its arrays) and returns; the files are written by a background thread while training
goes on. Everything that reads or changes the folder (``all_steps``, ``latest_step``,
``restore*``, ``set_aside``), ``wait`` and ``close`` first wait for that write to be complete,
and so do exit paths (a preempted or finished run returns with its checkpoint on disk). Restores
go straight to the shardings of the abstract state given, so a checkpoint saved on one mesh
restores onto another; a checkpoint that cannot be read is skipped for the newest one that can
(a writer moves the unreadable ones to ``skipped_checkpoints/`` beside ``checkpoints/`` so that
their steps can be written again).

A train state is saved as ``on_disk(state)``: every parameter form in it (flat buffers of
Adan's state or of the parameters, stacked layers of a pipeline or a scan) in the per-layer
form (``jaxaccel.forms.portable``), which no mesh, device count, optimizer impl, trainer path
or layer stacking shapes; ``restore_state`` reads it back into the forms and shardings of a
target state.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import time

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxaccel import forms, storage
from jaxaccel.train import orbax_buckets
from jaxaccel.train.orbax_failures import details, is_disk_full, one_line, quiet_leftovers
from jaxaccel.train.rundir import checkpoint_finished

log = logging.getLogger("jaxaccel")
# Orbax warns "Given directory is read only" (and that read_only=True sets save_interval_steps
# to 0) for every read-only manager: that is the point.
logging.getLogger("absl").addFilter(lambda r: "is read only" not in r.getMessage()
                                    and "read_only=True" not in r.getMessage())


# How often a reader lists the steps again when the trainer deletes one under it.
_LISTING_ATTEMPTS = 5
# What Orbax calls the folder of a save in progress: STEP.orbax-checkpoint-tmp[-...], renamed to
# STEP when the save is complete.
_UNFINISHED = ".orbax-checkpoint-tmp"


class NonFiniteState(RuntimeError):
    """Raised instead of saving a state whose parameters are not all finite."""


class DiskFull(OSError):
    """A checkpoint could not be written for lack of space; the message names the folder, the
    space one checkpoint needs and the steps still intact."""


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2 ** 20:.1f} MiB"


@jax.jit
def all_finite(tree) -> jax.Array:
    """True iff every element of every leaf of ``tree`` is finite (one fused reduction)."""
    leaves = jax.tree_util.tree_leaves(tree)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


class Manager(ocp.CheckpointManager):
    """Orbax's manager, minus its own calls to JAX's preemption sync point.

    Orbax calls ``reached_preemption_sync_point(step)`` in ``save`` and again from its
    background finalize thread, with the (older) step it is finishing. The sync manager keeps one
    counter per process, the last value it was given, and sets the sync point from the largest:
    a counter moved back by that thread could make the sync point one this process has already
    passed, and the run would hang. The trainer's ``Preemption`` is the only caller."""

    def reached_preemption(self, step: int) -> bool:
        return False


def _bucket_options(directory: str) -> dict:
    """Orbax's options for a checkpoint folder in a bucket: a step is written in place and
    marked complete by its commit file (``rundir.COMMIT_FILE``: nothing is renamed, which a
    bucket cannot do atomically), its arrays through TensorStore's own driver (``s3://``:
    ``orbax_buckets``), a failing request retried a bounded number of times, old steps
    deleted in the background (a step is many objects there, each its own request, which would
    hold the save), each step's folder created before ``save`` returns (Orbax otherwise
    creates it in a thread whose signal its other save threads wait for: a bucket failing then
    held them, and the run's exit, for Orbax's 300 s coordination time-out; created in ``save``,
    the failure is the save's own error at once). {} for a local folder."""
    if not storage.is_url(directory):
        return {}
    orbax_buckets.enable(storage.scheme(directory))
    commit_file = ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)
    return {"atomicity_options": commit_file, "enable_background_delete": True,
            "async_options": ocp.options.AsyncOptions(create_directories_asynchronously=False)}


class Checkpointer:
    """The checkpoints of one run folder. ``read_only=True`` (eval, predict) never creates,
    cleans or deletes anything; the writer keeps the newest ``keep`` steps and saves in the
    background unless ``async_save=False``. ``manager``: what opens the folder (``Manager``'s
    signature; a test hands one that fails as a disk or a concurrent writer would)."""

    def __init__(self, directory: str, keep: int = 2, read_only: bool = False,
                 async_save: bool = True, manager=Manager):
        self.directory = storage.absolute(directory)
        self.read_only = read_only
        self._writing = None        # (step, bytes) of the save in progress
        where = _bucket_options(self.directory)
        if read_only:
            if not storage.isdir(self.directory):
                raise FileNotFoundError(f"no checkpoint folder {self.directory}.")
            options = ocp.CheckpointManagerOptions(read_only=True, create=False,
                                                   cleanup_tmp_directories=False,
                                                   enable_async_checkpointing=False, **where)
        else:
            self._remove_earlier_unfinished()
            options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                   enable_async_checkpointing=async_save,
                                                   cleanup_tmp_directories=True, **where)
        self._mngr = self._listing(lambda: manager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()}))

    def _unfinished(self, step: int | None = None) -> list[str]:
        """The folders of saves that did not complete (of ``step``, or of any step)."""
        names = storage.listdir(self.directory)
        return sorted(n for n in names if (step is None or n.split(".")[0] == str(step)) and (
            _UNFINISHED in n or n.isdigit() and not checkpoint_finished(
                storage.join(self.directory, n))))

    def _remove_earlier_unfinished(self) -> None:
        """Remove the folders of saves that did not complete (a run stopped, or out of disk
        space, while saving) as the writer opens the folder, and say so (Orbax's own clean-up
        of them runs in the background, unannounced)."""
        unfinished = self._unfinished() if jax.process_index() == 0 else []
        for name in unfinished:
            storage.rmtree(storage.join(self.directory, name))
        if unfinished:
            log.warning("removed %s in %s: unfinished save(s) of an earlier run (stopped, or "
                        "out of disk space, while saving); the finished checkpoints are "
                        "untouched", ", ".join(unfinished), self.directory)

    def _remove_unfinished(self, step: int) -> str:
        """Remove the folder(s) of the failed save of ``step`` (the writer's process 0: the
        space they take is what the disk lacks) and say so. A TensorStore write of that save
        may still be ending (``quiet_leftovers`` waited for it), so a removal that finds a new
        file is tried again."""
        if jax.process_index() != 0:
            return "process 0 removes its unfinished folder"
        names = self._unfinished(step)
        if not names:
            return "no unfinished folder of it is left"
        left = []
        for name in names:
            path = storage.join(self.directory, name)
            for _ in range(5):
                storage.rmtree(path)
                if not storage.exists(path):
                    break
                time.sleep(0.2)
            else:
                left.append(path)
        if left:
            return f"its unfinished folder could not be removed: delete {', '.join(left)}"
        return f"its unfinished folder {', '.join(names)} was removed"

    def _listing(self, list_steps):
        """``list_steps()``, listed again if a step folder vanished while it ran.

        A reader lists the steps (Orbax stats each step folder) while the trainer may delete the
        oldest one (``train.keep_checkpoints``): that raises FileNotFoundError for a folder
        that was there a moment before, or NotADirectoryError when it vanishes between Orbax's
        ``exists()`` and ``is_dir()``. The writer owns its folder (the run lock), so for it the
        error is real."""
        for attempt in range(_LISTING_ATTEMPTS):
            try:
                return list_steps()
            except (FileNotFoundError, NotADirectoryError):
                if not self.read_only or attempt == _LISTING_ATTEMPTS - 1 \
                        or not storage.isdir(self.directory):
                    raise
                log.info("a checkpoint step in %s was removed while listing; listing again",
                         self.directory)

    @contextlib.contextmanager
    def _disk_full_is_one_error(self):
        """Turn a save failing for lack of space (Orbax raises it in ``save``, ``wait`` or
        ``close``, after logging pages of it) into one ``DiskFull`` naming what to do, and a
        save in a bucket failing otherwise into one ``StorageError`` line (why: unreachable,
        permission, ...) naming the step; the traceback goes to ``details``."""
        failed = None
        try:
            yield
        except Exception as e:  # noqa: BLE001 -- Orbax/TensorStore raise many types
            quiet_leftovers()
            disk_full = is_disk_full(e)
            if self._writing is None or not (disk_full or storage.is_url(self.directory)):
                raise
            failed, self._writing = self._writing, None
            details.error("saving checkpoint step %d in %s failed", failed[0], self.directory,
                          exc_info=True)
            if not disk_full:
                with storage.errors(self.directory, f"saving checkpoint step {failed[0]} in"):
                    raise
        if failed is None:
            return
        step, nbytes = failed
        unfinished = self._remove_unfinished(step)
        intact = sorted(int(n) for n in storage.listdir(self.directory)
                        if n.isdigit() and int(n) != step)
        kept = (f"the earlier step(s) {intact} are intact (resume continues from step "
                f"{intact[-1]})" if intact else "no earlier step was saved")
        need = (f"about {_mib(storage.bytes_under(storage.join(self.directory, str(intact[-1]))))} "
                f"free (step {intact[-1]}'s size on disk)" if intact else
                f"up to {_mib(nbytes)} free (its arrays' size in memory)")
        raise DiskFull(
            errno.ENOSPC,
            f"no space left on the device of {self.directory} to save checkpoint step {step} "
            f"({unfinished}): one checkpoint needs {need}; {kept}. Free "
            "that much space (or give workdir=... on a disk with room, copying the run folder "
            "there) and run the same command again.") from None

    def latest_step(self) -> int | None:
        self.wait()
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        """The steps on disk (after any save in progress is complete)."""
        self.wait()
        return sorted(self._mngr.all_steps())

    def save(self, step: int, state, meta: dict) -> None:
        """Start saving ``state`` as ``step`` (``wait`` for it to be on disk); raises
        ``NonFiniteState`` (saving nothing) if its parameters are not all finite. Returns once
        ``state`` is copied to host memory; a previous save still writing is waited for first."""
        if step in self._mngr.all_steps():
            return
        if not bool(all_finite(state.params)):
            raise NonFiniteState(f"parameters at step {step} are not all finite; not saved")
        self.wait()
        self._writing = (step, sum(x.nbytes for x in jax.tree_util.tree_leaves(state)))
        with self._disk_full_is_one_error():
            self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                          meta=ocp.args.JsonSave(meta)))

    def wait(self) -> None:
        """Block until the save in progress, if any, is complete on disk (raising its error
        if it failed: ``DiskFull`` for lack of space)."""
        with self._disk_full_is_one_error():
            self._mngr.wait_until_finished()
        self._writing = None

    def set_aside(self, step: int, reason: str) -> str:
        """Move checkpoint ``step`` out of the way (to ``skipped_checkpoints/STEP`` beside the
        checkpoints folder), keeping it for inspection; the writer only. Returns where."""
        if self.read_only:
            raise RuntimeError("a read-only Checkpointer never moves checkpoints.")
        self.wait()
        dest = storage.join(storage.parent(self.directory), "skipped_checkpoints", str(step))
        if jax.process_index() == 0:
            storage.rmtree(dest)
            storage.makedirs(storage.parent(dest))
            storage.move(storage.join(self.directory, str(step)), dest)
            storage.write_text(dest + ".reason.txt", reason + "\n")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"jaxaccel_set_aside_{step}")
        self._mngr.reload()
        log.warning("checkpoint step %d moved to %s: %s", step, dest, reason)
        return dest

    def _first_readable(self, read, step: int | None):
        """``(step, read(step))`` for ``step``, or by default for the newest step that can be
        read, warning about each newer one skipped (and, as the writer, setting it aside).
        ``None`` if there is no checkpoint; ``ValueError`` naming every reason if none reads."""
        self.wait()
        for attempt in range(_LISTING_ATTEMPTS):
            steps = [step] if step is not None else sorted(self._mngr.all_steps(), reverse=True)
            if not steps:
                return None
            found = self._first_of(read, steps, last=step is not None
                                   or attempt == _LISTING_ATTEMPTS - 1)
            if found is not None:
                return found
            # A reader's newest listed step was deleted by the trainer while being read, so
            # newer steps exist: list them and start again.
            self._listing(self._mngr.reload)

    def _first_of(self, read, steps, last):
        """``_first_readable`` over one listing of ``steps``; ``None`` if a reader should list
        again (a step folder vanished under it, unless ``last``). One warning line per step
        skipped (the writer sets it aside); the tracebacks go to ``details``."""
        skipped, vanished = [], False
        for s in steps:
            try:
                out = read(s)
            except Exception as e:  # noqa: BLE001 -- Orbax/TensorStore/JSON raise many types
                if self.read_only and not last and not storage.isdir(
                        storage.join(self.directory, str(s))):
                    vanished = True
                    break
                details.warning("checkpoint step %d in %s cannot be read", s, self.directory,
                                exc_info=True)
                skipped.append((s, one_line(e)))
                continue
            if skipped:
                quiet_leftovers()
            for k, reason in skipped:
                if self.read_only:
                    log.warning("checkpoint step %d in %s cannot be read, skipped (using step "
                                "%d): %s", k, self.directory, s, reason)
                else:
                    self.set_aside(k, f"unreadable at resume, skipped (using step {s}): "
                                      f"{reason}")
            return s, out
        quiet_leftovers()       # of the reads that failed (every step's, or a vanished one's)
        if vanished:
            return None
        raise ValueError(f"no checkpoint in {self.directory} can be read: "
                         + "; ".join(f"step {k}: {r}" for k, r in skipped)
                         + ". If the config changed since they were saved (model, optimizer, "
                           "precision), run with the config they were saved with (their "
                           "record has it); else restore the folder from a copy, or train "
                           "again (train.resume=false train.overwrite=true deletes them).")

    def restore(self, abstract_state, step: int | None = None):
        """``(state, meta)`` of ``step`` (default the newest readable), or ``None`` if there is
        none.

        ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` with shardings (e.g. from
        ``jax.eval_shape`` plus the target shardings)."""
        def read(s):
            out = self._mngr.restore(s, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
            return out.state, out.meta
        found = self._first_readable(read, step)
        return None if found is None else found[1]

    def restore_items(self, items=("params",), step: int | None = None):
        """``({item: tree}, meta)``: only the named parts of the train state (``params``, and
        ``fp8`` for fp8 runs; an item the checkpoint does not hold is left out) of checkpoint
        ``step`` (default the newest readable), as nested dicts with string keys on this
        process's first device, whatever mesh and device count wrote them: what evaluation and
        prediction need."""
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

        def read(s):
            saved = self._mngr.item_metadata(s)["state"]
            target = {k: jax.tree_util.tree_map(
                lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved[k])
                for k in items if saved.get(k)}
            restore_args = jax.tree_util.tree_map(
                lambda _: ocp.ArrayRestoreArgs(sharding=device), target)
            state = ocp.PyTreeCheckpointer().restore(
                storage.join(self.directory, str(s), "state"),
                args=ocp.args.PyTreeRestore(target, restore_args=restore_args,
                                            partial_restore=True))
            meta = self._mngr.restore(s, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            return state, meta.meta
        found = self._first_readable(read, step)
        if found is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}: the run saved none "
                                    "yet (or its only ones were set aside).")
        return found[1]

    def restore_params(self, step: int | None = None):
        """``(params, meta)``: ``restore_items(("params",), step)`` for the parameters alone."""
        items, meta = self.restore_items(("params",), step)
        return items["params"], meta

    def close(self) -> None:
        with self._disk_full_is_one_error():
            self._mngr.close()


def abstract_like(tree, shardings):
    """ShapeDtypeStructs of ``tree`` carrying ``shardings`` (a matching pytree)."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def like(template, restored):
    """Re-key ``restored`` (string keys, as Orbax gives untyped trees back) like ``template``."""
    if isinstance(template, dict):
        return {k: like(v, restored[str(k)]) for k, v in template.items()}
    if restored.shape != template.shape:
        raise ValueError(f"checkpoint tensor of shape {restored.shape} where the model has "
                         f"{template.shape}.")
    return restored


def on_disk(state):
    """What a checkpoint holds: the train state with its forms in the mesh-independent
    per-layer form (the rest is saved as it is, without a copy)."""
    return forms.portable(state)


def restore_state(ckpt: Checkpointer, state, shardings, step: int | None = None):
    """``(state, meta)`` of checkpoint ``step`` (default latest) laid out and placed like
    ``state`` with ``shardings`` (the target run's train state and its shardings), whatever mesh
    and trainer path it was saved from; ``None`` if there is no checkpoint. The forms come
    back sharded like the parameters, then go into the target's forms."""
    saved = jax.eval_shape(on_disk, state)
    out = ckpt.restore(abstract_like(saved, forms.portable_shardings(state, shardings)), step)
    if out is None:
        return None
    restored, meta = out
    return forms.restore(restored, state), meta
