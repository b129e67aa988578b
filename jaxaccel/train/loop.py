"""The training loop: a resolved and assembled run (``jaxaccel.train.run``) stepped through its
data, with the services it talks to (``Services``: checkpoints, metrics, the stop signal)
handed in.

``train(cfg)`` fine-tunes and evaluates, resuming from the newest readable checkpoint of its run
folder (model, optimizer, RNG and data position, so losses equal an uninterrupted run's). The
run folder's rules (one writer, no mixed runs, which config changes a resume allows) are in
``jaxaccel.train.rundir``. ``_loop`` is the loop; after each train step come its events, in
this order, each done by ``Events`` (the stop question by the stop signal) when its rule (a
function here, or in ``steplog``) says:

* **log** every step, one step late (the device runs the next step meanwhile): the metrics are
  checked (``steplog.check_step``: a non-finite loss under every policy; under fp16 a step
  whose gradients alone are non-finite is an overflow, skipped, and
  ``precision.max_consecutive_skips`` of them in a row stop the run) and written every
  ``train.log_every`` steps (``steplog.StepLog``);
* **checkpoint** every ``train.checkpoint_every`` steps (``checkpoint_due``);
* **stop?** asked once after every step (``preemption.Preemption.reached``: SIGTERM, a first
  Ctrl-C; a second Ctrl-C aborts);
* **epoch end** (``epoch_ends``, the run's end included): checkpoint, then **evaluate** under
  ``train.eval_every_epoch`` (``eval_due``);
* **stop**: if asked, checkpoint and return ``outcome.Preempted``.

The run ends ``outcome.Completed`` (after the final evaluation), ``Preempted`` or
``Diverged`` (``DIVERGENCE``: a non-finite loss or parameters, too many skipped fp16 steps).

A checkpoint is *good* when its parameters are finite and the loss computed from them (the
next step's loss) is finite too. A step is checkpointed only after its own loss is checked
(``Events.checkpoint``), so nothing is saved after a non-finite loss, and non-finite
parameters never are; a checkpoint is kept as good only once the next step's loss is finite:
when that loss is not, the checkpoint is set aside to ``skipped_checkpoints/``
(``keep_good``).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import sys
import time
from typing import Callable

import jax
from tqdm.auto import tqdm

from jaxaccel import flops, storage
from jaxaccel.config import Config
from jaxaccel.data.prefetch import prefetch
from jaxaccel.train import rundir
from jaxaccel.train.checkpoint import Checkpointer, NonFiniteState, on_disk, restore_state
from jaxaccel.train.metrics import MetricsWriter
from jaxaccel.train.outcome import Completed, Diverged, Outcome, Preempted
from jaxaccel.train.preemption import Preemption
from jaxaccel.train.runlock import RunLock
from jaxaccel.train.run import Run, assemble, resolve
from jaxaccel.train.state import TrainState
from jaxaccel.train.steplog import NonFiniteLoss, StepLog, TooManySkippedSteps, learning_rate

log = logging.getLogger("jaxaccel")


@dataclasses.dataclass(frozen=True)
class Services:
    """What the loop talks to besides the devices, handed in (tests and benchmarks hand their
    own; the defaults are the real ones):

    * ``checkpointer(directory, keep=...)`` -> a ``checkpoint.Checkpointer``;
    * ``metrics(run_dir)`` -> a ``metrics.MetricsWriter``;
    * ``stop()`` -> a context manager whose ``reached()`` is asked after every step whether to
      save and stop, with ``stop`` and ``requested`` (``preemption.Preemption``: SIGTERM, a
      first Ctrl-C, a coordinated notice across processes).
    """

    checkpointer: Callable[..., Checkpointer] = Checkpointer
    metrics: Callable[[str], MetricsWriter] = MetricsWriter
    stop: Callable[[], Preemption] = Preemption


def train(cfg: Config, services: Services = Services(), devices=None) -> Outcome:
    """Fine-tune as configured over ``devices`` (default all: ``sharding.make_mesh``); returns
    how the run ended (``outcome``: completed, preempted or diverged). Process 0 holds the run
    folder's lock for the whole run. The run is resolved (and so checked) before its folder is
    touched."""
    resolved = resolve(cfg, devices)
    run_dir = resolved.run_dir
    main = jax.process_index() == 0
    fresh = main and not storage.exists(run_dir)
    if main:
        rundir.make_run_dir(run_dir)
    try:
        with RunLock(run_dir) if main else contextlib.nullcontext(), \
                rundir.library_log(run_dir) if main else contextlib.nullcontext():
            changes = rundir.prepare(run_dir, resolved.cfg.to_dict()) if main else {}
            _sync("jaxaccel_run_dir_ready")
            run = assemble(resolved)
            with jax.set_mesh(run.mesh):      # the one mesh of every step and evaluation
                return _train(run, changes, services)
    except BaseException as e:
        # refused (the data, a resume) before the run wrote anything: no folder; unless the
        # bucket is what failed (asking it again would only wait through its retries again)
        if fresh and not isinstance(e, storage.StorageError):
            with _second_failure_warned(f"the run folder {run_dir} was not removed"):
                rundir.remove_if_unused(run_dir)
        raise


def _train(run: Run, changes: dict, services: Services) -> Outcome:
    """Resume, write the run folder's files, then step (``_loop``); the checkpointer, the
    metrics writer and the progress bar are closed however the run ends."""
    with contextlib.ExitStack() as stack:
        ckpt = stack.enter_context(_closing(services.checkpointer(
            storage.join(run.run_dir, "checkpoints"), keep=run.cfg.train.keep_checkpoints)))
        state, start = _resume(run, ckpt, changes)
        if jax.process_index() == 0:    # only now: a refused resume leaves the folder as it was
            rundir.write_files(run.run_dir, run.cfg.to_dict(), run.tokenizer,
                               _training_data(run), run.resolved.data.run_files())
        writer = stack.enter_context(_closing(services.metrics(run.run_dir)))
        bar = stack.enter_context(_closing(_progress_bar(run, start)))
        return _loop(run, state, start, Events(run, ckpt, writer, bar), services.stop)


def _loop(run: Run, state: TrainState, start: int, on: Events, stop_signal) -> Outcome:
    """Step from ``start`` to the run's end. After each step, its events in this order: log
    (the step before: one step late), checkpoint (every ``train.checkpoint_every`` steps), ask
    whether to stop, the epoch's end (checkpoint, evaluate); then stop if asked. The run ends
    completed, preempted (saved) or diverged (at the first of ``DIVERGENCE``)."""
    t, per_epoch, step = run.cfg.train, run.train_data.steps_per_epoch, start
    try:
        with stop_signal() as stop:     # a signal while compiling: saved after the first step
            t0 = time.perf_counter()
            log.info("compiled %d programs ahead in %.1f s", compile_ahead(run, state, start),
                     time.perf_counter() - t0)
            _sync("jaxaccel_compiled")      # the first step's collectives meet within gloo's 30 s
            with contextlib.closing(_steps(run, start)) as steps:
                for step, batch in steps:
                    state, metrics = run.train_step(state, run.put_batch(batch))
                    on.log.add(step, metrics, batch)    # the step before's, one step late
                    if checkpoint_due(t, step):
                        on.checkpoint(step, state)
                    stopping = stop.reached()       # once after every step, on every process
                    if epoch_ends(step, per_epoch, run.total_steps):
                        on.epoch_end(step, state)   # checkpoint, evaluate
                    if stopping:
                        break
            if stop.stop:
                return on.preempted(step, state, stop.requested)
        return on.completed(step, state)
    except DIVERGENCE as e:
        return on.diverged(step, e)


def _steps(run: Run, start: int):
    """``(step, batch)`` of each step after ``start`` to the run's end, epoch by epoch, the
    batches made ahead in a thread (``data.prefetch``) that stops with the epoch or the run."""
    per_epoch, step = run.train_data.steps_per_epoch, start
    while step < run.total_steps:
        epoch, at = divmod(step, per_epoch)
        batches = itertools.islice(run.train_data.batches(epoch, at), run.total_steps - step)
        with contextlib.closing(prefetch(batches)) as ahead:
            for batch in ahead:
                step += 1
                yield step, batch


# ---- the events ----

class Events:
    """What the loop does after its steps: ``log`` (a ``steplog.StepLog``: each step's metrics
    checked and written, one step late), ``checkpoint`` (by the rule that keeps it good),
    ``epoch_end`` (checkpoint, evaluate) and the three endings (``outcome``)."""

    def __init__(self, run: Run, ckpt: Checkpointer, writer: MetricsWriter, bar: tqdm):
        self.run, self.ckpt, self.writer, self.bar = run, ckpt, writer, bar
        self.log = StepLog(run, writer, bar, _throughput(run))

    def checkpoint(self, step: int, state: TrainState) -> None:
        """Checkpoint step ``step`` once its own loss is checked (``StepLog.flush``), so that
        nothing is saved after a non-finite loss. It is kept as good once the next step's loss,
        computed from its parameters, is finite too (else ``keep_good`` sets it aside)."""
        self.log.flush()
        epoch, in_epoch = divmod(step, self.run.train_data.steps_per_epoch)
        self.ckpt.save(step, on_disk(state), _record(self.run, epoch, in_epoch))
        self.writer.flush()

    def epoch_end(self, step: int, state: TrainState) -> None:
        self.checkpoint(step, state)
        if eval_due(self.run.cfg.train, step, self.run.total_steps):
            ev = self.run.evaluate(state)
            self.writer.write_eval(step, ev)
            if jax.process_index() == 0:
                epoch = step // self.run.train_data.steps_per_epoch
                tqdm.write(f"epoch {epoch}: eval " + " ".join(
                    f"{k} {v:.4f}" for k, v in ev.items() if isinstance(v, (int, float))),
                    file=sys.stderr)
        self.log.restart_clock()        # the next step's time excludes save and eval

    def _paths(self) -> dict:
        return dict(run_dir=self.run.run_dir, checkpoint_dir=self.ckpt.directory,
                    metrics_file=self.writer.path)

    def preempted(self, step: int, state: TrainState, signal: str) -> Preempted:
        self.checkpoint(step, state)
        self.ckpt.wait()
        return Preempted(**self._paths(), signal=signal, step=step)

    def completed(self, step: int, state: TrainState) -> Completed:
        self.bar.close()
        final = self.run.evaluate(state)     # while the last save writes
        self.ckpt.wait()
        self.writer.write_eval(step, final)
        split = self.run.resolved.data.eval_split
        return Completed(**self._paths(), step=step, task=self.run.task.name,
                         summary=self.run.task.summary(final, split), eval_split=split,
                         eval=final)

    def diverged(self, step: int, error: Exception) -> Diverged:
        advice = None if isinstance(error, TooManySkippedSteps) else (  # names its own fix
            "The run diverged: lower train.learning_rate (or raise train.warmup_ratio) and "
            "train again.")
        return Diverged(**self._paths(), advice=advice, error=str(error), step=step,
                        last_good_checkpoint=keep_good(self.ckpt, error))


# ---- the rules: when each event comes, and which checkpoints are good ----

def checkpoint_due(t, step: int) -> bool:
    """Whether step ``step`` is checkpointed besides the epochs' ends: every
    ``train.checkpoint_every`` steps (0: never)."""
    return bool(t.checkpoint_every) and step % t.checkpoint_every == 0


def epoch_ends(step: int, steps_per_epoch: int, total_steps: int) -> bool:
    """Whether step ``step`` ends an epoch or the run: it is checkpointed, and may be
    evaluated."""
    return step % steps_per_epoch == 0 or step >= total_steps


def eval_due(t, step: int, total_steps: int) -> bool:
    """Whether the epoch ending at step ``step`` is evaluated: under ``train.eval_every_epoch``,
    except at the run's end, which the final evaluation covers."""
    return bool(t.eval_every_epoch) and step < total_steps


DIVERGENCE = (NonFiniteLoss, NonFiniteState, TooManySkippedSteps)
"""What stops a run as diverged (``outcome.Diverged``)."""


def bad_checkpoint(error: Exception) -> int | None:
    """The checkpoint ``error`` (one of ``DIVERGENCE``) shows to be bad: the loss of step k is
    computed from the parameters saved as step k - 1, so a non-finite loss at step k makes
    checkpoint k - 1 bad. None for the others: non-finite parameters are never saved, and a
    skipped fp16 step leaves the parameters as they were."""
    return error.step - 1 if isinstance(error, NonFiniteLoss) else None


def keep_good(ckpt: Checkpointer, error: Exception) -> int | None:
    """After ``error``: set the checkpoint it shows to be bad aside (``skipped_checkpoints/``),
    if it was saved, and return the newest checkpoint kept as good (None: there is none)."""
    bad = bad_checkpoint(error)
    if bad in ckpt.all_steps():
        ckpt.set_aside(bad, f"its parameters give a non-finite loss ({error})")
    good = [s for s in ckpt.all_steps() if bad is None or s < bad]
    return good[-1] if good else None


# ---- the helpers ----

def _in_mesh(mesh, fn):
    with jax.set_mesh(mesh):          # the ambient mesh is per thread and part of jit's key
        return fn()


def compile_ahead(run: Run, state: TrainState, start: int) -> int:
    """Compile the train step for every padded length of the steps ``start`` to the run's end
    and the eval step for every eval length, in parallel threads (XLA compiles a program on
    one core), before the first step; the jitted steps then find them compiled (or read them
    from the persistent compilation cache). Returns how many programs were compiled."""
    def specs(data, start, stop):
        """Global batches as put_batch makes them, of each length of steps start..stop: the
        keys, dtypes and row shapes of the iterator's own first batch (the task's batch), its
        global rows (the iterator's: an LM eval batch may be clamped to its split)."""
        first, rows = next(data.batches(0)), data.global_batch_size
        return [{k: jax.ShapeDtypeStruct((rows, n, *v.shape[2:]) if v.ndim > 1 else (rows,),
                                         v.dtype, sharding=run.batch_sharding)
                 for k, v in first.items()} for n in sorted(data.batch_lengths(start, stop))]
    jobs = [functools.partial(run.train_step.lower, state, batch)
            for batch in specs(run.train_data, start, run.total_steps)]
    jobs += [functools.partial(run.eval_step.lower, state.params, batch, state.fp8)
             for batch in specs(run.eval_data, 0, run.eval_data.steps_per_epoch)]
    with concurrent.futures.ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
        list(pool.map(lambda lower: _in_mesh(run.mesh, lambda: lower().compile()), jobs))
    return len(jobs)


def _record(run: Run, epoch: int, step_in_epoch: int) -> dict:
    """The JSON saved beside each checkpoint: data position and what rebuilds the model (its
    spec, under "architecture"; which of its layers run fp8, under "fp8_min_width")."""
    return {"epoch": epoch, "step_in_epoch": step_in_epoch,
            "step": epoch * run.train_data.steps_per_epoch + step_in_epoch,
            "config": run.cfg.to_dict(),
            "architecture": run.spec.to_dict(), "label_names": list(run.label_names),
            "fp8_min_width": run.resolved.policy.fp8_min_width}


BARRIER_TIMEOUT_S = 3600
"""How long a process waits at ``_sync`` for the others: as long as one may compile longer than
another (a process that died is reported sooner, by the heartbeats it no longer sends)."""


@contextlib.contextmanager
def _second_failure_warned(what: str):
    """Clean-up after a failed run: its own failure (the bucket unreachable by then, say) is a
    warning line, and the run's error stays the one reported."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 -- whatever it is, the first error is the one to see
        log.warning("%s: %s", what, e)


@contextlib.contextmanager
def _closing(thing):
    """``thing``, closed at the end; closed after an error too, where a failure to close is a
    warning and the error stays the one reported."""
    try:
        yield thing
    except BaseException:
        with _second_failure_warned(f"after the error below, closing {type(thing).__name__} "
                                    "failed"):
            thing.close()
        raise
    thing.close()


def _sync(name: str) -> None:
    """Wait until every process reaches ``name``: the coordination service's barrier, not a
    collective (on CPUs, gloo gives a collective's first meeting of the processes 30 s, and a
    process that compiled slower under load arrived later than that: "Gloo context
    initialization failed: DEADLINE_EXCEEDED")."""
    if jax.process_count() > 1:
        from orbax.checkpoint import multihost
        multihost.get_barrier_sync_fn()(key=name, timeout_ms=BARRIER_TIMEOUT_S * 1000)


def _resume(run: Run, ckpt: Checkpointer, changes: dict) -> tuple[TrainState, int]:
    """``(state, step)``: the run's state from the newest readable checkpoint of its folder
    (under ``train.resume``), else its initial state; refused where the config now ends
    before that step (``_resume_note``)."""
    state = run.state
    if run.cfg.train.resume and ckpt.latest_step() is not None:
        restored = restore_state(ckpt, state, run.state_shardings)
        if restored is not None:
            state = restored[0]
    start = int(jax.device_get(state.step))
    _resume_note(run, start, changes)       # may refuse: then nothing says "resumed"
    if start:
        log.info("resumed from %s at step %d", ckpt.directory, start)
    return state, start


def _resume_note(run: Run, start: int, changes: dict) -> None:
    """Say how a resumed run continues; refuse one whose new length ends before ``start``."""
    if start > run.total_steps:
        raise rundir.RunFolderError(
            f"the run's checkpoint is at step {start} but the config now ends at step "
            f"{run.total_steps} (train.epochs={run.cfg.train.epochs}, train.max_steps="
            f"{run.cfg.train.max_steps}); give at least as many steps, or a new name=...")
    changed = rundir.data_changes(run.run_dir, _training_data(run)) if start else ""
    if changed:
        log.warning("resuming at step %d on training data other than the run trained on: %s",
                    start, changed)
    if changes:
        log.info("resuming with config changes: %s",
                 "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items()))
    if {"train.epochs", "train.max_steps"} & changes.keys():
        t = run.cfg.train
        log.info("the learning-rate schedule (%s) is defined over the run's total of %d steps "
                 "(warm-up %d); continuing at step %d with learning rate %.3g", t.schedule,
                 run.total_steps, int(t.warmup_ratio * run.total_steps), start,
                 learning_rate(run.schedule, start))


def _training_data(run: Run) -> dict | None:
    """The training split's identity (``RecordReader.identity``: files, sizes, modification
    times), where its source has one."""
    identity = getattr(run.resolved.data.reader, "identity", None)
    return None if identity is None else identity("train")


def _throughput(run: Run) -> flops.Throughput:
    """The tokens/s, TFLOP/s and MFU meter of the run's train steps (``jaxaccel.flops``)."""
    kind, policy = jax.devices()[0].device_kind, run.resolved.policy
    meter = flops.Throughput(flops.model_shape(run.spec), policy, kind, jax.device_count(),
                             jax.process_count())
    if meter.peak is None:
        log.info("MFU: no peak FLOP/s known for device %r under policy %s (jaxaccel.flops."
                 "mfu_peak, jaxaccel/devices.py); metrics carry tokens/s and model TFLOP/s "
                 "only", kind, policy.name)
    return meter


def _progress_bar(run: Run, start: int) -> tqdm:
    shown = run.cfg.train.progress and jax.process_index() == 0
    return tqdm(total=run.total_steps, initial=start, disable=not shown, unit="step",
                dynamic_ncols=True, file=sys.stderr)
