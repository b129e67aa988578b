"""The pipeline (``mesh.stage``) through the ``jaxaccel`` command (issue 49, what the fourth
probe did not cover): a run stopped by SIGTERM exits 75 and the same command resumes it
exactly, pipelined and not; fp8 and tensor parallelism on a pipelined run train, save and
evaluate; the signal sent from outside to the command's process, and a two-process pipelined
run whose process is killed mid-step.

All under -m slow: each run compiles the unrolled 8-device schedule (70 to 120 s a test on the
loaded 2-core CPU). The default suite has the same mechanics below the command: a pipelined
run stopped by a real SIGTERM and resumed unpipelined and back (test_pipeline.py,
``resumes_both_ways``), fp8 and tensor parallelism with the pipeline (test_pipeline.py), and
exit 75 from the command (test_probe.py).

The in-process runs use the session's 8 CPU devices (conftest); a real SIGTERM is delivered to
this process after a given step (``support.sigterm_at``), so the stop does not race the
run."""
import json
import os
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

from jaxaccel import cli, config
from jaxaccel.train import loop
from support import (CLI, LONG_WAIT_S, TINY, TINY_CONFIG, cpu_env, logged_losses, run_cli,
                     sigterm_at)

PIPELINED = ("mesh.stage=2", "mesh.data=4")

pytestmark = pytest.mark.slow


def args(sets):
    return [a for s in sets for a in ("--set", s)]


@pytest.mark.parametrize("mesh", [PIPELINED, ("mesh.data=8",)],
                         ids=["pipelined", "unpipelined"])
def test_a_run_stopped_by_sigterm_exits_75_and_resumes_exactly(tmp_path, capsys, mesh):
    """Stopped after step 3 of 6 (dropout on), the same command finishes the run: the losses
    of the run that never stopped at every step, and its final eval."""
    sets = [*TINY, f"workdir={tmp_path}", "train.max_steps=6", *mesh]
    full = loop.train(config.build(sets=[*sets, "name=full"]))
    stopped = loop.train(config.build(sets=[*sets, "name=part"]), sigterm_at(3))
    assert cli.train_outcome(stopped) == cli.EXIT_PREEMPTED == 75
    out = capsys.readouterr()
    assert json.loads(out.out)["step"] == 3 and "SIGTERM: saved step 3" in out.err
    assert cli.main(["train", *args([*sets, "name=part"])]) == 0
    result = json.JSONDecoder().raw_decode(capsys.readouterr().out)[0]
    assert result["status"] == "completed" and result["step"] == 6
    lf, lp = logged_losses(full["run_dir"]), logged_losses(stopped["run_dir"])
    assert sorted(lp) == sorted(lf) == list(range(1, 7))
    np.testing.assert_allclose([lp[s] for s in lf], [lf[s] for s in lf], rtol=1e-6)
    assert result["eval_loss"] == pytest.approx(full["eval_loss"], rel=1e-6)


@pytest.mark.parametrize("extra", [("precision.policy=fp8",), ("mesh.tensor=2", "mesh.data=2")],
                         ids=["fp8", "tensor"])
def test_a_pipelined_run_with_fp8_or_tensor_parallelism_trains_saves_and_evaluates(
        tmp_path, capsys, extra):
    """``jaxaccel train`` on 2 stages with fp8's scaling state, or with the heads and MLP split
    over a tensor axis; ``jaxaccel eval`` of its folder (data parallel over the devices at
    hand, from the per-layer checkpoint) gives the loss the run's own final eval gave."""
    sets = [*TINY, f"workdir={tmp_path}", "train.max_steps=2", *PIPELINED, *extra]
    code, out, err = run_cli(capsys, "train", *args(sets))
    assert code == 0, err
    trained = json.JSONDecoder().raw_decode(out)[0]
    assert np.isfinite(trained["eval_loss"])
    code, out, err = run_cli(capsys, "eval", "--checkpoint", trained["run_dir"])
    assert code == 0, err
    assert json.loads(out)["loss"] == pytest.approx(trained["eval_loss"], rel=1e-5)


# ---- the command's own process, signalled or killed from outside ----

# A run that only a signal ends: long, at a constant learning rate, so that it can be resumed
# to end a few steps after its stop and compared with a reference run of that length.
UNTIL_STOPPED = ("train.max_steps=1000", "train.schedule=constant", "train.warmup_ratio=0.0",
                 "train.log_every=1", "train.progress=false")


def wait_for_steps(metrics, n, procs):
    """Until process 0 has logged ``n`` steps (an event, however long start-up takes)."""
    deadline = time.monotonic() + LONG_WAIT_S
    while not (metrics.exists() and metrics.read_text().count("\n") >= n):
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        assert time.monotonic() < deadline, f"no step {n} in {LONG_WAIT_S} s"
        time.sleep(0.05)


def train_command(workdir, *sets):
    return [*CLI, "train", "--config", TINY_CONFIG, f"--set=workdir={workdir}",
            *(f"--set={x}" for x in sets)]


def test_sigterm_from_outside_stops_a_pipelined_command_that_resumes_exactly(tmp_path, capsys):
    """SIGTERM to `jaxaccel train` on 2 stages once it has logged 2 steps: exit 75 after
    saving; the same command, ended 2 steps later, resumes it: the losses of a run of that
    length that never stopped."""
    sets = (*UNTIL_STOPPED, *PIPELINED)
    proc = subprocess.Popen(train_command(tmp_path, *sets), env=cpu_env(8),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "tiny_synthetic"
    wait_for_steps(run_dir / "metrics.jsonl", 2, [proc])
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=LONG_WAIT_S)
    assert proc.returncode == cli.EXIT_PREEMPTED, err[-3000:]
    step = json.JSONDecoder().raw_decode(out)[0]["step"]
    assert 2 <= step < 1000 and f"SIGTERM: saved step {step}" in err
    more = [*sets, f"workdir={tmp_path}", f"train.max_steps={step + 2}"]
    assert cli.main(["train", "--config", TINY_CONFIG, *args(more)]) == 0
    capsys.readouterr()
    full = loop.train(config.load(TINY_CONFIG, [*more, "name=full"]))
    lf, lp = logged_losses(full["run_dir"]), logged_losses(str(run_dir))
    assert sorted(lp) == sorted(lf) == list(range(1, step + 3))
    np.testing.assert_allclose([lp[s] for s in lf], [lf[s] for s in lf], rtol=1e-6)


def test_a_two_process_pipelined_run_killed_mid_step_resumes_from_its_last_checkpoint(tmp_path):
    """Two processes, each one stage of 2 devices, saving every step; process 1 killed
    (SIGKILL) while they step. Process 0 does not hang: JAX's coordination service, missing
    the peer's heartbeats, ends it (about 100 s) saying another task died. The checkpoints
    saved are intact, and the pair started again with the same command resumes from the
    newest: every step's loss is that of one process with 4 devices run without a break."""
    sets = (*UNTIL_STOPPED, "train.checkpoint_every=1", "mesh.stage=2", "mesh.data=2",
            "train.microbatches=4")

    def start_two(*extra):
        port = _port()
        return [subprocess.Popen(train_command(tmp_path / "two", *sets, *extra),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=cpu_env(2, JAXACCEL_COORDINATOR=f"localhost:{port}",
                                             JAXACCEL_NUM_PROCESSES="2",
                                             JAXACCEL_PROCESS_ID=str(i)))
                for i in range(2)]

    run_dir = tmp_path / "two" / "tiny_synthetic"
    procs = start_two()
    wait_for_steps(run_dir / "metrics.jsonl", 3, procs)
    procs[1].kill()
    _, err = procs[0].communicate(timeout=LONG_WAIT_S)
    procs[1].communicate()
    assert procs[0].returncode != 0
    assert "another task died" in err or "stopped sending heartbeats" in err, err[-3000:]
    saved = sorted(int(s) for s in os.listdir(run_dir / "checkpoints") if s.isdigit())
    assert saved and saved[-1] >= 2, saved
    steps = saved[-1] + 2
    resumed = start_two(f"train.max_steps={steps}")
    for p in resumed:
        out, err = p.communicate(timeout=LONG_WAIT_S)
        assert p.returncode == 0, err[-3000:]
        assert f"at step {saved[-1]}" in err, err[-3000:]
    one = subprocess.run(train_command(tmp_path / "one", *UNTIL_STOPPED,
                                       f"train.max_steps={steps}"),
                         env=cpu_env(4), capture_output=True, text=True, timeout=LONG_WAIT_S)
    assert one.returncode == 0, one.stderr[-3000:]
    lone, ltwo = (logged_losses(str(tmp_path / n / "tiny_synthetic")) for n in ("one", "two"))
    assert sorted(ltwo) == sorted(lone) == list(range(1, steps + 1))
    np.testing.assert_allclose([ltwo[s] for s in lone], [lone[s] for s in lone], rtol=1e-5)


def _port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]
