"""Multi-process start-up: environment detection, and two real processes on localhost that stop
together when one of them gets SIGTERM.

The processes are CPU processes on every machine (``JAX_PLATFORMS=cpu`` in each subprocess; the
one-process reference and the one-device eval run in the test's own process on its CPU
devices): the test is about the multi-process machinery (gloo collectives, per-process data, a
checkpoint written by both), and all of its runs must share one platform for their losses to be
compared."""
import json
import signal
import socket
import subprocess
import time

import jax
import numpy as np
import pytest

from jaxaccel import cli, config
from jaxaccel.distributed import initialize_from_env, multi_process_env
from jaxaccel.train import loop
from jaxaccel.train.inference import evaluate_run
from jaxaccel.train.metrics import read_metrics
from support import ADAN, CLI, LONG_WAIT_S, TINY_CONFIG, cpu_env


@pytest.mark.parametrize("env,kind", [
    ({}, None),
    ({"JAXACCEL_COORDINATOR": "h:1234", "JAXACCEL_NUM_PROCESSES": "2",
      "JAXACCEL_PROCESS_ID": "0"}, "explicit"),
    ({"SLURM_NTASKS": "4", "SLURM_JOB_ID": "7", "SLURM_PROCID": "0",
      "SLURM_STEP_NODELIST": "n1"}, "slurm"),
    ({"SLURM_NTASKS": "4"}, None),
    ({"SLURM_NTASKS": "1"}, None),
    ({"TPU_WORKER_HOSTNAMES": "a,b"}, "tpu"),
    ({"TPU_WORKER_HOSTNAMES": "a"}, None),
])
def test_environment_detection(env, kind):
    assert multi_process_env(env) == kind


def test_incomplete_explicit_environment_is_named():
    with pytest.raises(ValueError, match="JAXACCEL_PROCESS_ID"):
        initialize_from_env({"JAXACCEL_COORDINATOR": "h:1", "JAXACCEL_NUM_PROCESSES": "2"})


@pytest.mark.parametrize("bad", [{"JAXACCEL_NUM_PROCESSES": "two"},
                                 {"JAXACCEL_PROCESS_ID": "first"},
                                 {"JAXACCEL_INIT_TIMEOUT": "abc"}])
def test_non_integer_variables_are_named(bad):
    """Fault probe 2, item 8: "invalid literal for int()" named no variable."""
    env = {"JAXACCEL_COORDINATOR": "h:1", "JAXACCEL_NUM_PROCESSES": "2",
           "JAXACCEL_PROCESS_ID": "0", **bad}
    (name, value), = bad.items()
    with pytest.raises(ValueError, match=f"{name}='{value}' is not an integer"):
        initialize_from_env(env)


def test_process_count_without_a_coordinator_warns(caplog):
    """Fault probe 2, item 8: it ran as one process silently (the SLURM case warns)."""
    assert multi_process_env({"JAXACCEL_NUM_PROCESSES": "2", "JAXACCEL_PROCESS_ID": "0"}) is None
    assert "JAXACCEL_COORDINATOR is not set: running as a single process" in caplog.text


def _port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow   # 60-70 s; test_buckets.py's two hosts without a shared disk hold these rules
def test_two_processes_stop_together_on_sigterm_to_one_and_resume_like_one_process(tmp_path):
    """Two real processes (2 CPU devices each, gloo collectives) on a (data=2, fsdp=2) mesh with
    the fused Adan state sharded over it, against one process with 4 devices run without a
    break.

    SIGTERM to process 1 alone, once process 0 has logged a step: both stop after the same step
    (JAX's preemption sync point), save it together and exit 75; started again, they resume and
    finish. Their losses equal the one-process run's at every step (metrics written once, by
    process 0), and the checkpoint they wrote evaluates on one device to the accuracy the
    one-process run reached.

    The stop waits on events, not on time: JAX's notifier looks for the signal once a second,
    so the run is long enough never to end first (it ended first, exit 0, when its 6 steps
    outran the signal), and the learning rate constant, so that the resumed run, ended two
    steps after the stop, and the reference of that length take the same steps. The reference
    runs in this process (no third start-up of jax, transformers and torch) on 4 of its CPU
    devices while the two resume."""
    cpu = jax.devices("cpu")
    if len(cpu) < 4:
        pytest.skip(f"the one-process reference needs 4 CPU devices; this process has {len(cpu)} "
                    "(conftest forces 8 unless XLA_FLAGS is set)")
    sets = ("train.max_steps=1000", "train.schedule=constant", "train.warmup_ratio=0.0",
            "train.log_every=1", "train.progress=false", "mesh.fsdp=2", *ADAN)

    def cmd(workdir, *extra):
        return [*CLI, "train", "--config", TINY_CONFIG, f"--set=workdir={workdir}",
                *(f"--set={x}" for x in (*sets, *extra))]

    def start_two(*extra):
        port = _port()
        return [subprocess.Popen(cmd(tmp_path / "two", *extra), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True,
                                 env=cpu_env(2, JAXACCEL_COORDINATOR=f"localhost:{port}",
                                             JAXACCEL_NUM_PROCESSES="2",
                                             JAXACCEL_PROCESS_ID=str(i)))
                for i in range(2)]

    def finish(procs, status=0):
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=LONG_WAIT_S)
            assert p.returncode == status, err[-3000:]
            outs.append(json.JSONDecoder().raw_decode(out[out.index("{"):])[0])
        return outs

    two = tmp_path / "two" / "tiny_synthetic"
    procs = start_two()
    while not ((two / "metrics.jsonl").exists() and (two / "metrics.jsonl").read_text()):
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    stopped = finish(procs, cli.EXIT_PREEMPTED)      # stopped, resumable
    assert [r["status"] for r in stopped] == ["preempted"] * 2, stopped
    step = stopped[0]["step"]
    assert stopped[1]["step"] == step < 1000, stopped
    steps = step + 2
    two_resume = start_two(f"train.max_steps={steps}")
    with jax.default_device(cpu[0]):
        one = loop.train(config.load(TINY_CONFIG, [f"workdir={tmp_path / 'one'}", *sets,
                                                   f"train.max_steps={steps}"], device_count=4),
                         devices=cpu[:4])
    resumed = finish(two_resume)
    assert [r["status"] for r in resumed] == ["completed"] * 2, resumed
    assert one["status"] == "completed"

    rows = {name: [r for r in read_metrics(str(tmp_path / name / "tiny_synthetic"))
                   if "train/loss" in r] for name in ("one", "two")}
    assert [r["step"] for r in rows["two"]] == list(range(1, steps + 1))
    np.testing.assert_allclose([r["train/loss"] for r in rows["two"]],
                               [r["train/loss"] for r in rows["one"]], rtol=1e-5)
    final = [r["eval/accuracy"] for r in read_metrics(str(tmp_path / "one" / "tiny_synthetic"))
             if "eval/accuracy" in r][-1]
    # In this process (no second start-up of jax, transformers and torch), on one CPU device.
    with jax.default_device(cpu[0]):
        ev = evaluate_run(str(two), devices=cpu[:1])
    assert ev["accuracy"] == pytest.approx(final, abs=1e-6)
    # The confusion matrix counted over both processes' shares of the eval split: exact.
    gathered = [r for r in read_metrics(str(two)) if "eval/confusion_matrix" in r][-1]
    assert gathered["eval/confusion_matrix"] == ev["confusion_matrix"]
    assert sum(map(sum, ev["confusion_matrix"])) == ev["examples"]


@pytest.mark.slow   # 60-95 s; tests/test_pipeline_cli.py's killed two-process run is slow too
def test_a_pipeline_whose_stages_are_two_processes_trains_like_one_process(tmp_path):
    """``mesh.stage=2`` over two processes of 2 CPU devices each (the stage axis is outermost:
    process 0 holds stage 0, process 1 stage 1; the stage-to-stage permutes cross processes)
    with dropout on: the losses of one process with 4 devices, unpipelined."""
    steps = 3
    sets = (f"train.max_steps={steps}", "train.log_every=1", "train.progress=false",
            "train.eval_every_epoch=false", "model.hidden_dropout=0.1")

    def start(workdir, env, *extra):
        return subprocess.Popen([*CLI, "train", "--config", TINY_CONFIG,
                                 f"--set=workdir={workdir}",
                                 *(f"--set={x}" for x in (*sets, *extra))],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)

    port = _port()
    procs = [start(tmp_path / "two", cpu_env(2, JAXACCEL_COORDINATOR=f"localhost:{port}",
                                             JAXACCEL_NUM_PROCESSES="2",
                                             JAXACCEL_PROCESS_ID=str(i)),
                   "mesh.stage=2", "mesh.data=2", "train.microbatches=4")
             for i in range(2)]
    procs.append(start(tmp_path / "one", cpu_env(4)))
    for p in procs:
        _, err = p.communicate(timeout=LONG_WAIT_S)
        assert p.returncode == 0, err[-3000:]
    losses = {name: [r["train/loss"] for r in read_metrics(str(tmp_path / name / "tiny_synthetic"))
                     if "train/loss" in r] for name in ("one", "two")}
    assert len(losses["two"]) == steps
    np.testing.assert_allclose(losses["two"], losses["one"], rtol=1e-5)
