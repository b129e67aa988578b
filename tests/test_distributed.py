import pytest

from jaxaccel.distributed import initialize_from_env, multi_process_env


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
