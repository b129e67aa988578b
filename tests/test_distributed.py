"""Multi-process start-up: environment detection, and two real processes on localhost.

The processes are CPU processes on every machine (``JAX_PLATFORMS=cpu`` in each subprocess, the
one-process reference and the one-device eval included): the test is about the multi-process
machinery (gloo collectives, per-process data, a checkpoint written by both), and all of its
runs must share one platform for their losses to be compared."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from jaxaccel.distributed import initialize_from_env, multi_process_env
from jaxaccel.train.metrics import read_metrics

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_synthetic.py")
# Multi-tensor Adan through the fused Pallas kernel (interpreted on CPU).
ADAN = ("train.optimizer=adan", "train.optimizer_impl=pallas")


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


def _cpu_env(devices=None, **extra):
    """This process's environment for a CPU-only subprocess with ``devices`` fake devices
    (None: one, XLA's default)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return dict(env, JAX_PLATFORMS="cpu", **extra)


def test_two_processes_on_localhost_match_one_process(tmp_path):
    """Two real processes (4 CPU devices each, gloo collectives) == one process, 8 devices, with
    FSDP over both processes and the fused Adan state split across them; the checkpoint they
    write together evaluates on one device to the accuracy the one-process run reached."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]

    def cmd(workdir):
        return [sys.executable, "-m", "jaxaccel.cli", "train", "--config", CONFIG,
                "--set", f"workdir={workdir}", "--set", "train.max_steps=4",
                "--set", "train.log_every=1", "--set", "train.progress=false",
                "--set", "mesh.fsdp=2", *(f"--set={x}" for x in ADAN)]
    procs = []
    for i in range(2):
        env = _cpu_env(4, JAXACCEL_COORDINATOR=f"localhost:{port}", JAXACCEL_NUM_PROCESSES="2",
                       JAXACCEL_PROCESS_ID=str(i))
        procs.append(subprocess.Popen(cmd(tmp_path / "two"), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    one = subprocess.run(cmd(tmp_path / "one"), env=_cpu_env(8), capture_output=True, text=True,
                         timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    losses = {name: [r["train/loss"] for r in read_metrics(str(tmp_path / name /
                                                               "tiny_synthetic"))
                     if "train/loss" in r] for name in ("one", "two")}
    assert len(losses["two"]) == 4        # metrics written once, by process 0
    np.testing.assert_allclose(losses["two"], losses["one"], rtol=1e-5)
    final = [r["eval/accuracy"] for r in read_metrics(str(tmp_path / "one" / "tiny_synthetic"))
             if "eval/accuracy" in r][-1]
    ev = subprocess.run([sys.executable, "-m", "jaxaccel.cli", "eval", "--checkpoint",
                         str(tmp_path / "two" / "tiny_synthetic")], env=_cpu_env(),
                        capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert json.loads(ev.stdout)["accuracy"] == pytest.approx(final, abs=1e-6)
