"""The training loop's rules, one function each (``jaxaccel.train.loop``, ``train.steplog``),
and its typed result (``train.outcome``), checked without training: when each event comes,
which steps diverge, and which checkpoints are kept as good. ``test_train.py`` runs them
through whole runs."""
import math
import types

import jax
import numpy as np
import pytest
from tqdm.auto import tqdm

from jaxaccel import config, optim
from jaxaccel.models import model_spec
from jaxaccel.precision import policy_of
from jaxaccel.train import loop
from jaxaccel.train.checkpoint import NonFiniteState
from jaxaccel.train.outcome import Completed, Diverged, Preempted
from jaxaccel.train.state import TrainState
from jaxaccel.train.steplog import (NonFiniteLoss, TooManySkippedSteps, check_step,
                                    learning_rate, log_due, window_mean)
from support import TINY

T = types.SimpleNamespace


def test_when_each_event_comes():
    t = T(checkpoint_every=3, eval_every_epoch=True)
    assert [s for s in range(1, 11) if loop.checkpoint_due(t, s)] == [3, 6, 9]
    assert not any(loop.checkpoint_due(T(checkpoint_every=0), s) for s in range(1, 11))
    # 4 steps an epoch, 10 steps in all: epochs end at 4 and 8, the run at 10.
    assert [s for s in range(1, 11) if loop.epoch_ends(s, 4, 10)] == [4, 8, 10]
    # The run's end is evaluated by the final evaluation, not as an epoch's.
    assert [s for s in (4, 8, 10) if loop.eval_due(t, s, 10)] == [4, 8]
    assert not loop.eval_due(T(eval_every_epoch=False), 4, 10)
    assert [s for s in range(1, 11) if log_due(4, s, 10)] == [4, 8, 10]


def test_a_step_diverges_at_a_non_finite_loss_or_too_many_skips():
    cfg = config.build(sets=TINY + ["precision.max_consecutive_skips=3"])
    check_step(cfg, 5, {"loss": 0.7})
    check_step(cfg, 5, {"loss": 0.7, "consecutive_skips": 2.0, "loss_scale": 2.0 ** 15})
    for loss in (math.nan, math.inf, -math.inf):
        with pytest.raises(NonFiniteLoss, match="at step 5") as e:
            check_step(cfg, 5, {"loss": loss, "consecutive_skips": 3.0, "loss_scale": 1.0})
        assert e.value.step == 5
    with pytest.raises(TooManySkippedSteps, match="3 steps in a row up to step 5"):
        check_step(cfg, 5, {"loss": 0.7, "consecutive_skips": 3.0, "loss_scale": 2.0 ** 17})


def test_the_logged_window_averages_values_and_keeps_the_latest_state():
    window = [{"loss": 1.0, "loss_scale": 4.0, "fp8/x_amax": 1.0},
              {"loss": 3.0, "loss_scale": 2.0, "fp8/x_amax": 5.0}]
    assert window_mean(window) == {"loss": 2.0, "loss_scale": 2.0, "fp8/x_amax": 5.0}


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant"])
def test_the_logged_learning_rate_is_the_schedule_s_own_number_under_the_run_s_mesh(kind):
    """Computed outside the mesh (one device, not every device's dispatch): the same float
    the schedule gives eagerly under the mesh: in the warm-up, at its end, in the decay, at
    the run's end and past it."""
    schedule, steps = optim.make_schedule(kind, 3e-3, 40, 4), (0, 1, 3, 4, 5, 17, 39, 40, 41)
    with jax.set_mesh(jax.make_mesh((jax.device_count(),), ("data",))):
        assert [learning_rate(schedule, s) for s in steps] == [float(schedule(s)) for s in steps]


class FakeCheckpoints:
    """The part of ``checkpoint.Checkpointer`` the loop's events use, in memory."""

    directory = "checkpoints"

    def __init__(self, *steps):
        self.steps, self.aside = list(steps), []

    def all_steps(self):
        return sorted(self.steps)

    def save(self, step, state, meta):
        self.steps.append(step)

    def set_aside(self, step, reason):
        self.steps.remove(step)
        self.aside.append(step)

    def wait(self):
        pass


@pytest.mark.parametrize("saved,error,aside,good", [
    # The loss of step 7 came from checkpoint 6's parameters: 6 is set aside.
    ((2, 4, 6), NonFiniteLoss(7, math.nan), [6], 4),
    # Step 5's parameters (which gave the loss of step 6) were never saved.
    ((2, 4, 6), NonFiniteLoss(6, math.nan), [], 4),
    # Non-finite parameters are never saved; skipped steps leave the parameters as they were.
    ((2, 4, 6), NonFiniteState("parameters at step 7 are not all finite"), [], 6),
    ((2, 4, 6), TooManySkippedSteps("fp16: ..."), [], 6),
    # No checkpoint before the bad one: none is good.
    ((2,), NonFiniteLoss(3, math.nan), [2], None),
])
def test_a_checkpoint_is_kept_as_good_only_when_its_next_loss_is_finite(saved, error, aside,
                                                                        good):
    ckpt = FakeCheckpoints(*saved)
    assert loop.keep_good(ckpt, error) == good
    assert ckpt.aside == aside


def events(ckpt):
    """The loop's events on a tiny run that is not built (4 steps an epoch, 8 in all), writing
    its metrics to a list."""
    cfg = config.build(sets=TINY)
    run = T(cfg=cfg, spec=model_spec(cfg.model), total_steps=8, schedule=lambda s: 1e-3,
            train_data=T(steps_per_epoch=4), run_dir="run", label_names=(),
            resolved=T(policy=policy_of(cfg.precision), data=T(eval_split="test")),
            task=T(name="classification", summary=lambda ev, split: "done"),
            evaluate=lambda state: {"accuracy": 0.5})
    written = []
    writer = T(path="metrics.jsonl", write=lambda step, m, prefix: written.append((step, prefix)),
               write_eval=lambda step, m: written.append((step, "eval/")), flush=lambda: None)
    return loop.Events(run, ckpt, writer, tqdm(disable=True)), written


STATE = TrainState(step=0, params={"w": np.ones(2, np.float32)}, opt_state=(), rng=None,
                   fp8=None)
BATCH = {"input_ids": np.ones((2, 4), np.int32), "attention_mask": np.ones((2, 4), np.int32)}


def test_a_step_is_checkpointed_only_after_its_own_loss_is_checked():
    """Metrics are fetched one step late; a checkpoint first fetches its step's: a step whose
    loss is non-finite is never saved, and its loss is logged before its checkpoint."""
    ckpt = FakeCheckpoints()
    on, written = events(ckpt)
    on.log.add(1, {"loss": np.float32(0.7)}, BATCH)
    on.log.add(2, {"loss": np.float32(0.6)}, BATCH)
    assert written == [(1, "train/")]
    on.checkpoint(2, STATE)
    assert written == [(1, "train/"), (2, "train/")] and ckpt.steps == [2]
    on.log.add(3, {"loss": np.float32(np.nan)}, BATCH)
    with pytest.raises(NonFiniteLoss, match="at step 3"):
        on.checkpoint(3, STATE)
    assert ckpt.steps == [2]
    # Checkpoint 2's parameters gave that loss: it is set aside, and no good one is left.
    ended = on.diverged(3, NonFiniteLoss(3, math.nan))
    assert isinstance(ended, Diverged) and ckpt.aside == [2]
    assert (ended.step, ended.last_good_checkpoint) == (3, None)
    assert "lower train.learning_rate" in ended.advice


def test_the_result_is_typed_and_reads_as_its_json_record():
    paths = dict(run_dir="r", checkpoint_dir="r/checkpoints", metrics_file="r/metrics.jsonl")
    done = Completed(**paths, step=8, task="classification", summary="final accuracy: 0.5",
                     eval_split="test", eval={"accuracy": 0.5, "examples": 64})
    assert dict(done) == {"status": "completed", **paths, "step": 8, "task": "classification",
                          "summary": "final accuracy: 0.5", "eval_split": "test",
                          "eval_accuracy": 0.5,
                          "eval_examples": 64}
    assert list(done) == list(done.record())      # the record's order: what train prints
    assert done["status"] == done.status == "completed" and done["eval_accuracy"] == 0.5
    stopped = Preempted(**paths, signal="SIGTERM", step=3)
    assert list(stopped) == ["status", *paths, "signal", "step"]
    # ``advice`` is left out where there is none; ``last_good_checkpoint`` is always there.
    skipped = Diverged(**paths, error="fp16: ...", step=5, last_good_checkpoint=None)
    assert list(skipped) == ["status", *paths, "error", "step", "last_good_checkpoint"]
    assert skipped["last_good_checkpoint"] is None and "advice" not in skipped
    assert "advice" in Diverged(**paths, advice="lower it", error="e", step=5,
                                last_good_checkpoint=4)
