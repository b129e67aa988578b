"""The training loop: a resolved and assembled run (``jaxaccel.train.run``) stepped through its
data, with the services it talks to (``Services``: checkpoints, metrics, the stop signal)
handed in.

``train(cfg)`` fine-tunes and evaluates; it checkpoints every ``train.checkpoint_every`` steps,
at each epoch end and at the end, resumes from the newest readable checkpoint of its run folder
(model, optimizer, RNG and data position, so losses equal an uninterrupted run's), saves and
returns on SIGTERM or a first Ctrl-C (a second Ctrl-C aborts), and stops at the first
non-finite loss, under every policy, keeping the last good checkpoint (under fp16 a step whose
gradients are non-finite but whose loss is finite is an overflow: it is skipped, and
``precision.max_consecutive_skips`` of them in a row stop the run). The
run folder's rules (one writer, no mixed runs, which config changes a resume allows) are in
``jaxaccel.train.rundir``.

A checkpoint is *good* when its parameters are finite and the loss computed from them (the
next step's loss) is finite too: non-finite parameters are never saved, and when a loss turns
non-finite the checkpoint of the step just before it, whose parameters gave that loss, is set
aside to ``skipped_checkpoints/``.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import os
import sys
import time
from typing import Callable

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxaccel import flops
from jaxaccel.config import Config
from jaxaccel.data.prefetch import prefetch
from jaxaccel.train import rundir
from jaxaccel.train.checkpoint import Checkpointer, NonFiniteState, on_disk, restore_state
from jaxaccel.train.metrics import MetricsWriter
from jaxaccel.train.preemption import Preemption
from jaxaccel.train.run import Run, assemble, resolve
from jaxaccel.train.state import TrainState
from jaxaccel.train.step import is_state_metric

log = logging.getLogger("jaxaccel")


class NonFiniteLoss(RuntimeError):
    """Raised when the training loss of ``step`` (computed from step ``step - 1``'s
    parameters) is NaN or infinite."""

    def __init__(self, step: int, loss: float):
        super().__init__(f"loss is {loss} at step {step}")
        self.step = step


class TooManySkippedSteps(RuntimeError):
    """fp16: ``precision.max_consecutive_skips`` steps in a row had non-finite gradients (and
    finite losses: a non-finite loss is ``NonFiniteLoss``). Skipped steps never touch the
    parameters, so every saved checkpoint stays good."""


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
    spec, under "architecture")."""
    return {"epoch": epoch, "step_in_epoch": step_in_epoch,
            "step": epoch * run.train_data.steps_per_epoch + step_in_epoch,
            "config": run.cfg.to_dict(),
            "architecture": run.spec.to_dict(), "label_names": list(run.label_names)}


BARRIER_TIMEOUT_S = 3600
"""How long a process waits at ``_sync`` for the others: as long as one may compile longer than
another (a process that died is reported sooner, by the heartbeats it no longer sends)."""


def _sync(name: str) -> None:
    """Wait until every process reaches ``name``: the coordination service's barrier, not a
    collective (on CPUs, gloo gives a collective's first meeting of the processes 30 s, and a
    process that compiled slower under load arrived later than that: "Gloo context
    initialization failed: DEADLINE_EXCEEDED")."""
    if jax.process_count() > 1:
        from orbax.checkpoint import multihost
        multihost.get_barrier_sync_fn()(key=name, timeout_ms=BARRIER_TIMEOUT_S * 1000)


def train(cfg: Config, services: Services = Services()) -> dict:
    """Fine-tune as configured; returns the final metrics (and ``status``). Process 0 holds
    the run folder's lock for the whole run. The run is resolved (and so checked) before its
    folder is touched."""
    resolved = resolve(cfg)
    run_dir = resolved.run_dir
    main = jax.process_index() == 0
    fresh = main and not os.path.exists(run_dir)
    if main:
        rundir.make_run_dir(run_dir)
    try:
        with rundir.RunLock(run_dir) if main else contextlib.nullcontext(), \
                rundir.library_log(run_dir) if main else contextlib.nullcontext():
            changes = rundir.prepare(run_dir, cfg.to_dict()) if main else {}
            _sync("jaxaccel_run_dir_ready")
            run = assemble(resolved)
            with jax.set_mesh(run.mesh):      # the one mesh of every step and evaluation
                return _train(run, changes, services)
    except BaseException:
        if fresh:       # refused (the data, a resume) before the run wrote anything: no folder
            rundir.remove_if_unused(run_dir)
        raise


def _resume_note(run: Run, start: int, changes: dict) -> None:
    """Say how a resumed run continues; refuse one whose new length ends before ``start``."""
    if start > run.total_steps:
        raise rundir.RunFolderError(
            f"the run's checkpoint is at step {start} but the config now ends at step "
            f"{run.total_steps} (train.epochs={run.cfg.train.epochs}, train.max_steps="
            f"{run.cfg.train.max_steps}); give at least as many steps, or a new name=...")
    if changes:
        log.info("resuming with config changes: %s",
                 "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items()))
    if {"train.epochs", "train.max_steps"} & changes.keys():
        t = run.cfg.train
        log.info("the learning-rate schedule (%s) is defined over the run's total of %d steps "
                 "(warm-up %d); continuing at step %d with learning rate %.3g", t.schedule,
                 run.total_steps, int(t.warmup_ratio * run.total_steps), start,
                 float(run.schedule(start)))


def _skips_message(cfg: Config, skips: int, scale: float, step: int) -> str:
    """Why ``skips`` fp16 steps in a row up to ``step`` had non-finite gradients with finite
    losses, the last at loss scale ``scale``, and which knob to turn: while the scale is still
    above fp16's largest value (65504) the scale itself (``precision.loss_scale_init``) is the
    suspect; below it, gradients that overflow are the run diverging."""
    p = cfg.precision
    head = (f"fp16: {skips} steps in a row up to step {step} had non-finite gradients "
            f"(finite losses; loss scale {scale:g} at the last, started at "
            f"precision.loss_scale_init={p.loss_scale_init:g})")
    fp16_max = float(np.finfo(np.float16).max)
    if scale > fp16_max:
        return (f"{head}: the scaled gradients overflow fp16 (max {fp16_max:g}) and the scale "
                f"did not halve below that within precision.max_consecutive_skips="
                f"{p.max_consecutive_skips} steps. Lower precision.loss_scale_init (default "
                "32768).")
    return (f"{head}: the gradients overflow even at a scale fp16 holds, so the run is "
            "diverging, not overflowing: lower train.learning_rate or use "
            "precision.policy=bf16.")


def _throughput(run: Run) -> flops.Throughput:
    """The tokens/s, TFLOP/s and MFU meter of the run's train steps (``jaxaccel.flops``)."""
    kind, policy = jax.devices()[0].device_kind, run.cfg.precision.policy
    meter = flops.Throughput(flops.model_shape(run.spec), policy, kind, jax.device_count(),
                             jax.process_count())
    if meter.peak is None:
        log.info("MFU: no peak FLOP/s known for device %r under policy %s (jaxaccel.flops."
                 "peak_flops, jaxaccel/devices.py); metrics carry tokens/s and model TFLOP/s only", kind, policy)
    return meter


def _train(run: Run, changes: dict, services: Services) -> dict:
    cfg, t = run.cfg, run.cfg.train
    main = jax.process_index() == 0
    ckpt = services.checkpointer(os.path.join(run.run_dir, "checkpoints"),
                                 keep=t.keep_checkpoints)
    state = run.state
    try:
        if t.resume and ckpt.latest_step() is not None:
            restored = restore_state(ckpt, state, run.state_shardings)
            if restored is not None:
                state = restored[0]
        start = int(jax.device_get(state.step))
        _resume_note(run, start, changes)       # may refuse: then nothing says "resumed"
        if start:
            log.info("resumed from %s at step %d", ckpt.directory, start)
    except BaseException:
        ckpt.close()
        raise
    # Only now: a refused resume leaves the saved config and the metrics as they were.
    if main:
        rundir.write_files(run.run_dir, cfg.to_dict(), run.tokenizer)
    writer = services.metrics(run.run_dir)
    steps_per_epoch = run.train_data.steps_per_epoch

    def save(step):
        e, s = divmod(step, steps_per_epoch)
        ckpt.save(step, on_disk(state), _record(run, e, s))

    result = {"status": "completed", "run_dir": run.run_dir,
              "checkpoint_dir": ckpt.directory, "metrics_file": writer.path}
    bar = tqdm(total=run.total_steps, initial=start, disable=not (t.progress and main),
               unit="step", dynamic_ncols=True, file=sys.stderr)
    window, pending, step = [], None, start
    meter = _throughput(run)
    t_last = time.perf_counter()

    def drain(pending):
        """Fetch one step's metrics (one step late, so the device stays busy)."""
        nonlocal t_last
        step_no, metrics, batch = pending
        rows = len(next(iter(batch.values()))) * jax.process_count()
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        # A non-finite loss is divergence under every policy, fp16 included (there a step
        # whose gradients alone are non-finite is an overflow, and is skipped).
        if not math.isfinite(m["loss"]):
            raise NonFiniteLoss(step_no, m["loss"])
        skips = m.get("consecutive_skips", 0)      # fp16: this step was skipped, not applied
        if skips >= cfg.precision.max_consecutive_skips:
            raise TooManySkippedSteps(_skips_message(cfg, int(skips), m["loss_scale"], step_no))
        now = time.perf_counter()
        dt, t_last = now - t_last, now
        window.append(m)
        meter.add(batch, dt)
        bar.update(1)
        bar.set_postfix(loss=f"{m['loss']:.4f}", step_ms=f"{dt * 1e3:.0f}",
                        ex_s=f"{rows / dt:.0f}")
        if step_no % t.log_every == 0 or step_no == run.total_steps:
            mean = {k: window[-1][k] if is_state_metric(k)
                    else float(np.mean([w[k] for w in window])) for k in window[0]}
            mean["learning_rate"] = float(run.schedule(step_no - 1))
            mean["examples_per_s"] = rows / dt
            mean.update(meter.flush())
            writer.write(step_no, mean, prefix="train/")
            window.clear()

    try:
        with services.stop() as preempt:     # a signal while compiling: saved right after
            t0 = time.perf_counter()
            log.info("compiled %d programs ahead in %.1f s", compile_ahead(run, state, start),
                     time.perf_counter() - t0)
            _sync("jaxaccel_compiled")      # the first step's collectives meet within gloo's 30 s
            epoch = start // steps_per_epoch
            while step < run.total_steps and not preempt.stop:
                ahead = prefetch(run.train_data.batches(epoch, step - epoch * steps_per_epoch))
                with contextlib.closing(ahead) as batches:
                    for batch in batches:
                        state, metrics = run.train_step(state, run.put_batch(batch))
                        step += 1
                        if pending is not None:
                            drain(pending)
                        pending = (step, metrics, batch)
                        if t.checkpoint_every and step % t.checkpoint_every == 0:
                            drain(pending)
                            pending = None
                            save(step)
                        if preempt.reached() or step >= run.total_steps:
                            break
                if pending is not None:
                    drain(pending)
                    pending = None
                epoch += 1
                if step % steps_per_epoch == 0 or step >= run.total_steps:
                    save(step)
                    if t.eval_every_epoch and step < run.total_steps:
                        ev = run.evaluate(state)
                        writer.write(step, ev, prefix="eval/")
                        if main:
                            tqdm.write(f"epoch {epoch}: eval " + " ".join(
                                f"{k} {v:.4f}" for k, v in ev.items()), file=sys.stderr)
                t_last = time.perf_counter()    # the next step's time excludes save and eval
            if preempt.stop:
                save(step)
                ckpt.wait()
                result.update(status="preempted", signal=preempt.requested, step=step)
                return result
        bar.close()
        final = run.evaluate(state)     # while the last save writes
        ckpt.wait()
        writer.write(step, final, prefix="eval/")
        split = run.resolved.data.eval_split
        result.update(step=step, task=run.task.name, summary=run.task.summary(final, split),
                      eval_split=split, **{f"eval_{k}": v for k, v in final.items()})
        return result
    except (NonFiniteLoss, NonFiniteState, TooManySkippedSteps) as e:
        # The loss of step k is computed from the parameters saved as step k - 1.
        bad = e.step - 1 if isinstance(e, NonFiniteLoss) else None
        if bad in ckpt.all_steps():
            ckpt.set_aside(bad, f"its parameters give a non-finite loss ({e})")
        good = [s for s in ckpt.all_steps() if bad is None or s < bad]
        if not isinstance(e, TooManySkippedSteps):     # whose message names its own fix
            result["advice"] = ("The run diverged: lower train.learning_rate (or raise "
                                "train.warmup_ratio) and train again.")
        result.update(status="nonfinite", error=str(e), step=step,
                      last_good_checkpoint=good[-1] if good else None)
        return result
    finally:
        bar.close()
        writer.close()
        ckpt.close()
