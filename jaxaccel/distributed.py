"""Process start-up: the backend this process uses (``cpu_without_accelerator``) and, for a
run of several processes, ``jax.distributed.initialize`` from the environment.

Both are called by the CLI (``start``) before anything touches a device, after jax and its
plugins are loaded with their known start-up lines kept off stderr (``native_noise_filtered``):
with the ``aot`` extra on a machine without a GPU, the CUDA plugin's libraries each print
"cudart_stub.cc ... Could not find cuda drivers on your machine, GPU will not be used." (with
absl's "All log messages before absl::InitializeLog() ..." preamble) when they load, at
``import jax`` and when jax discovers its plugins; no environment variable turns those lines
off (``TF_CPP_MIN_LOG_LEVEL`` does not reach them), so exactly those lines are dropped and any
other line is passed on as it comes. (libtpu's start-up complaints are avoided at their source,
by the environment ``plan.topology`` gives it.) Processes are recognised, in this order:

* ``JAXACCEL_COORDINATOR=host:port`` with ``JAXACCEL_NUM_PROCESSES`` and ``JAXACCEL_PROCESS_ID``
  (GPU nodes, or several processes on one machine): explicit initialisation. On CPU the
  processes talk through gloo collectives. ``JAXACCEL_NUM_PROCESSES`` > 1 without a coordinator
  is a single process, with a warning.
* A SLURM job step with more than one task (``SLURM_NTASKS`` > 1 with the ``SLURM_JOB_ID``,
  ``SLURM_PROCID`` and ``SLURM_STEP_NODELIST`` that ``srun`` sets) and Cloud TPU pod slices
  (``TPU_WORKER_HOSTNAMES`` with several hosts): JAX's own cluster auto-detection. A stray
  ``SLURM_NTASKS`` without the rest (an exported variable, a batch script not run by ``srun``)
  is a single process, with a warning.
* Anything else: a single process, nothing to do.

Joining waits at most ``JAXACCEL_INIT_TIMEOUT`` seconds (default 300) for every process to
reach the coordinator; then it fails with a message naming the coordinator, instead of hanging.

Each process then loads only its rows of every global batch (``BatchIterator`` takes the process
index and count); metrics are written by process 0; Orbax checkpoints are written by all
processes together, each its own shards. JAX's preemption service is switched on (its default):
it catches SIGTERM so that all processes stop and save after the same step
(``jaxaccel.train.preemption``).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading

log = logging.getLogger("jaxaccel")
EXIT_NO_PEERS = 2
SLURM_STEP_VARS = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_STEP_NODELIST")


# What the native libraries print on stderr while they load on a machine without a GPU, and
# which says only that: the CUDA runtime stub of the CUDA plugin's libraries (INFO), and absl's
# preamble to a library's first log line. Matched against whole lines; nothing else is dropped.
NATIVE_NOISE = (
    re.compile(rb"I\d{4} [\d:. ]+\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your "
               rb"machine, GPU will not be used\.\r?\n?"),
    re.compile(rb"WARNING: All log messages before absl::InitializeLog\(\) is called are written "
               rb"to STDERR\r?\n?"),
)
_started = False


@contextlib.contextmanager
def native_noise_filtered(noise=NATIVE_NOISE):
    """Within the block, what is written to file descriptor 2 (native libraries' logs, Python's
    stderr) goes through a pipe: lines that match one of ``noise`` whole are dropped, every
    other line is passed on to the real stderr as it comes. Without a usable descriptor 2,
    nothing is filtered."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
        read, write = os.pipe()
    except OSError:
        yield
        return

    def forward():
        with os.fdopen(read, "rb") as lines:
            for line in lines:
                if not any(p.fullmatch(line) for p in noise):
                    os.write(saved, line)
    os.dup2(write, 2)
    os.close(write)
    pump = threading.Thread(target=forward, name="jaxaccel-stderr-filter", daemon=True)
    pump.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)           # the pipe's last writer closed: the pump reads to the end
        pump.join()
        os.close(saved)


def start(environ=os.environ, attached=None) -> None:
    """The process's start-up, before anything touches a device: jax's plugins loaded (the
    first time) with ``NATIVE_NOISE`` kept off stderr, the CPU backend chosen where no
    accelerator is attached (``cpu_without_accelerator``: before the plugins load, so that the
    CUDA plugin does not check a CUDA it will not use), then ``initialize_from_env``."""
    global _started
    with contextlib.nullcontext() if _started else native_noise_filtered():
        cpu_without_accelerator(environ, attached or accelerator_attached)
        if not _started:
            from jax._src import xla_bridge     # jax's plugin discovery (no backend starts)
            getattr(xla_bridge, "_discover_and_register_pjrt_plugins", lambda: None)()
    _started = True
    initialize_from_env(environ)


def accelerator_attached() -> bool:
    """Whether a TPU, NVIDIA or AMD GPU is attached: jax's own probes (PCI ids, device files),
    which start no backend."""
    from jax._src import hardware_utils
    return (hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
            or hardware_utils.has_visible_nvidia_gpu()
            or hardware_utils.num_available_amd_gpus(stop_at=1) > 0)


def cpu_without_accelerator(environ=os.environ, attached=accelerator_attached) -> bool:
    """Choose the CPU backend where no platform is chosen (``JAX_PLATFORMS``) and no accelerator
    is attached, before any backend starts: with the ``aot`` extra installed, libtpu and the
    CUDA plugin would otherwise each try to start their own on a CPU-only machine (TPU metadata
    probing, a CUDA traceback). Compile-only targets work either way. Returns whether it chose.
    ``attached``: the probe (``accelerator_attached``)."""
    import jax      # imported here, not above: ``start`` loads jax inside its filter
    if environ.get("JAX_PLATFORMS") or attached():
        return False
    environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
    return True


def _int(env, name: str, default: int) -> int:
    """The integer environment variable ``name`` (``default`` if unset or empty)."""
    raw = env.get(name, "")
    try:
        return int(raw) if raw.strip() else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; set it to a whole number (e.g. "
                         f"{name}={default}) or unset it.") from None


def multi_process_env(env=os.environ) -> str | None:
    """Which kind of multi-process job the environment describes, if any."""
    if env.get("JAXACCEL_COORDINATOR"):
        return "explicit"
    if _int(env, "JAXACCEL_NUM_PROCESSES", 1) > 1:
        log.warning("JAXACCEL_NUM_PROCESSES=%s but JAXACCEL_COORDINATOR is not set: running as "
                    "a single process. For a multi-process run set JAXACCEL_COORDINATOR="
                    "host:port (process 0's address) for every process.",
                    env["JAXACCEL_NUM_PROCESSES"])
    if _int(env, "SLURM_NTASKS", 1) > 1:
        missing = [k for k in SLURM_STEP_VARS if k not in env]
        if not missing:
            return "slurm"
        log.warning("SLURM_NTASKS=%s but %s not set (not a task started by srun): running as "
                    "a single process. Start multi-process runs with srun.",
                    env["SLURM_NTASKS"], missing)
    if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        return "tpu"
    return None


def initialize_from_env(env=os.environ) -> bool:
    """Initialise jax.distributed if the environment asks for it; True if it did."""
    import jax
    kind = multi_process_env(env)
    if kind is None:
        return False
    timeout = _int(env, "JAXACCEL_INIT_TIMEOUT", 300)
    if kind == "explicit":
        missing = [k for k in ("JAXACCEL_NUM_PROCESSES", "JAXACCEL_PROCESS_ID") if k not in env]
        if missing:
            raise ValueError(f"JAXACCEL_COORDINATOR={env['JAXACCEL_COORDINATOR']!r} is set but "
                             f"{missing} are not; set all three for a multi-process run.")
        kwargs = dict(coordinator_address=env["JAXACCEL_COORDINATOR"],
                      num_processes=_int(env, "JAXACCEL_NUM_PROCESSES", 1),
                      process_id=_int(env, "JAXACCEL_PROCESS_ID", 0))
        where = (f"coordinator {kwargs['coordinator_address']} as process "
                 f"{kwargs['process_id']} of {kwargs['num_processes']}")
        if env.get("JAX_PLATFORMS", "").startswith("cpu") or not _has_accelerator_plugin():
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    else:
        where, kwargs = f"the {kind} cluster's coordinator (auto-detected)", {}
    advice = ("Check that every process was started with the same coordinator address and "
              "process count, that process 0 runs, and that its port is reachable "
              "(JAXACCEL_INIT_TIMEOUT sets the wait in seconds).")

    def give_up():
        # JAX's client aborts the whole process (C++ CHECK) when its own deadline passes, so
        # the wait is bounded here, a little earlier, with a message instead of a core dump.
        print(f"error: the multi-process run did not come together at {where} within "
              f"{timeout} s (a peer is missing or cannot reach the coordinator). {advice}",
              file=sys.stderr, flush=True)
        os._exit(EXIT_NO_PEERS)
    watchdog = threading.Timer(timeout, give_up)
    watchdog.daemon = True
    log.info("waiting up to %d s (JAXACCEL_INIT_TIMEOUT) for every process to join at %s",
             timeout, where)
    watchdog.start()
    jax.config.update("jax_enable_preemption_service", True)
    try:
        jax.distributed.initialize(initialization_timeout=timeout + 30, **kwargs)
    except (RuntimeError, ValueError) as e:
        first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
        raise ValueError(f"could not join the multi-process run at {where}: {first[:300]}. "
                         f"{advice}") from None
    finally:
        watchdog.cancel()
    return True


def _has_accelerator_plugin() -> bool:
    import importlib.util
    return any(importlib.util.find_spec(m) is not None
               for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu", "jax_rocm60_plugin"))
