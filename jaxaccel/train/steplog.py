"""Each train step's metrics, fetched one step late (the device runs the next step meanwhile),
checked by the divergence rules, shown on the progress bar, averaged over ``train.log_every``
steps and written (``jaxaccel.train.loop``'s *log* event).

The divergence rules (``check_step``): a non-finite loss is divergence under every precision
policy (``NonFiniteLoss``); under fp16 a step whose gradients are non-finite but whose loss is
finite is an overflow, skipped by the step itself, and ``precision.max_consecutive_skips`` of
them in a row stop the run (``TooManySkippedSteps``).
"""
from __future__ import annotations

import math
import time

import jax
import numpy as np

from jaxaccel.config import Config
from jaxaccel.train.step import is_state_metric


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


def skips_message(cfg: Config, skips: int, scale: float, step: int) -> str:
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


def check_step(cfg: Config, step: int, metrics: dict) -> None:
    """Raise if step ``step``'s fetched ``metrics`` say the run diverged: ``NonFiniteLoss``
    for a NaN or infinite loss (under every policy, fp16 included), ``TooManySkippedSteps``
    when this fp16 step was the ``precision.max_consecutive_skips``-th skipped in a row."""
    if not math.isfinite(metrics["loss"]):
        raise NonFiniteLoss(step, metrics["loss"])
    skips = metrics.get("consecutive_skips", 0)      # fp16: this step was skipped, not applied
    if skips >= cfg.precision.max_consecutive_skips:
        raise TooManySkippedSteps(skips_message(cfg, int(skips), metrics["loss_scale"], step))


def log_due(log_every: int, step: int, total_steps: int) -> bool:
    """Whether the window of train metrics is written after ``step``: every ``log_every``
    steps, and at the run's last step."""
    return step % log_every == 0 or step == total_steps


def window_mean(window: list[dict]) -> dict:
    """The logged value of each metric over the window's steps: the mean, or for a state
    (``step.is_state_metric``: the loss scale, skip counters, fp8 amaxes) the latest."""
    return {k: window[-1][k] if is_state_metric(k) else float(np.mean([w[k] for w in window]))
            for k in window[0]}


def learning_rate(schedule, step: int) -> float:
    """``schedule(step)``, computed outside the ambient mesh: the same eager operations on one
    device, the same number (under the run's mesh each operation took a dispatch to every
    device: 25 ms a call on 8 CPU devices, 1.2 ms outside)."""
    with jax.set_mesh(None):
        return float(schedule(step))


class StepLog:
    """``add(step, metrics, batch)`` after each dispatched step holds its metrics and fetches,
    checks and logs the step held before (``flush`` does so at once: before a checkpoint is
    written, at an epoch's end). ``restart_clock()``: the next step's time starts now (after
    a save or an evaluation). ``writer`` is a ``metrics.MetricsWriter``, ``bar`` a tqdm bar,
    ``meter`` a ``flops.Throughput``, ``schedule`` the learning rate by step."""

    def __init__(self, run, writer, bar, meter):
        self.cfg, self.total_steps, self.schedule = run.cfg, run.total_steps, run.schedule
        self.writer, self.bar, self.meter = writer, bar, meter
        self._held, self._window = None, []
        self.restart_clock()

    def restart_clock(self) -> None:
        self._t_last = time.perf_counter()

    def add(self, step: int, metrics: dict, batch: dict) -> None:
        self.flush()
        self._held = (step, metrics, batch)

    def flush(self) -> None:
        if self._held is None:
            return
        (step, metrics, batch), self._held = self._held, None
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        check_step(self.cfg, step, m)
        now = time.perf_counter()
        dt, self._t_last = now - self._t_last, now
        rows = len(next(iter(batch.values()))) * jax.process_count()
        self._window.append(m)
        self.meter.add(batch, dt)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{m['loss']:.4f}", step_ms=f"{dt * 1e3:.0f}",
                             ex_s=f"{rows / dt:.0f}")
        if log_due(self.cfg.train.log_every, step, self.total_steps):
            mean = window_mean(self._window)
            mean["learning_rate"] = learning_rate(self.schedule, step - 1)
            mean["examples_per_s"] = rows / dt
            mean.update(self.meter.flush())
            self.writer.write(step, mean, prefix="train/")
            self._window.clear()


__all__ = ["NonFiniteLoss", "StepLog", "TooManySkippedSteps", "check_step", "learning_rate",
           "log_due", "skips_message", "window_mean"]
