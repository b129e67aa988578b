"""Multi-process start-up: ``jax.distributed.initialize`` from the environment.

Called by the CLI before anything touches a device. Recognised, in this order:

* ``JAXACCEL_COORDINATOR=host:port`` with ``JAXACCEL_NUM_PROCESSES`` and ``JAXACCEL_PROCESS_ID``
  (GPU nodes, or several processes on one machine): explicit initialisation. On CPU the
  processes talk through gloo collectives.
* SLURM with more than one task (``SLURM_NTASKS`` > 1) and Cloud TPU pod slices
  (``TPU_WORKER_HOSTNAMES`` with several hosts): JAX's own cluster auto-detection.
* Anything else: a single process, nothing to do.

Each process then loads only its rows of every global batch (``BatchIterator`` takes the process
index and count); metrics are written by process 0; Orbax checkpoints are written by all
processes together, each its own shards.
"""
from __future__ import annotations

import os

import jax


def multi_process_env(env=os.environ) -> str | None:
    """Which kind of multi-process job the environment describes, if any."""
    if env.get("JAXACCEL_COORDINATOR"):
        return "explicit"
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        return "slurm"
    if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        return "tpu"
    return None


def initialize_from_env(env=os.environ) -> bool:
    """Initialise jax.distributed if the environment asks for it; True if it did."""
    kind = multi_process_env(env)
    if kind is None:
        return False
    if kind == "explicit":
        missing = [k for k in ("JAXACCEL_NUM_PROCESSES", "JAXACCEL_PROCESS_ID") if k not in env]
        if missing:
            raise ValueError(f"JAXACCEL_COORDINATOR={env['JAXACCEL_COORDINATOR']!r} is set but "
                             f"{missing} are not; set all three for a multi-process run.")
        if env.get("JAX_PLATFORMS", "").startswith("cpu") or not _has_accelerator_plugin():
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=env["JAXACCEL_COORDINATOR"],
                                   num_processes=int(env["JAXACCEL_NUM_PROCESSES"]),
                                   process_id=int(env["JAXACCEL_PROCESS_ID"]))
    else:
        jax.distributed.initialize()
    return True


def _has_accelerator_plugin() -> bool:
    import importlib.util
    return any(importlib.util.find_spec(m) is not None
               for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu", "jax_rocm60_plugin"))
