"""Test setup: 8 fake CPU devices (sharding tests), offline Hugging Face, shared fixtures,
compile-only TPU/GPU targets, and what changes on a GPU machine. Shared helpers that are not
fixtures are in support.py.

On a GPU machine the default backend is the GPU (one device, float32 matmuls at TF32 by
default) while the CPU backend still has the 8 fake devices forced below, so:

* tests marked ``gpu`` (real Triton / cuDNN runs) run only when the default backend is a GPU
  and are skipped elsewhere with the reason; ``gpu_smoke`` marks the quick selection of them
  that a GPU session runs first (``python -m pytest -m gpu_smoke``, meant to take under 3
  minutes), and a ``gpu_smoke`` test is a ``gpu`` test;
* tests that compare with an XLA reference compute it under
  ``jax.default_matmul_precision("highest")`` (see each module's tolerance table);
* tests that need 8 devices take them from the ``eight_devices`` fixture (``_module`` for a
  whole module; ``on_eight_devices`` also hands them to ``support.build``): the default
  backend's when it has 8, else the 8 fake CPU devices with everything the test builds placed
  on CPU, else they skip and say why.

* tests that compile for TPU slices or NVIDIA GPUs without one (``compile_target``) take
  compile-only devices from ``jaxaccel.plan.topology`` (libtpu, the CUDA plugin: the ``aot`` extra)
  and skip, naming the pip command, where those are not installed. Without an attached
  accelerator the session runs with ``JAX_PLATFORMS=cpu`` (set below), so neither plugin
  starts a backend of its own.

Without a GPU, two plugins emulate it: ``-p tests.emulate_tf32`` (float32 matmuls not at highest
precision round their inputs to TF32) and ``-p tests.emulate_one_gpu`` (one default device).
"""
import contextlib
import fcntl
import os
import shutil
import tempfile


_OWN_XLA_FLAGS = "XLA_FLAGS" not in os.environ
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# One persistent compilation cache for the session, this process and every subprocess a test
# starts (they inherit the environment): the many runs of the tiny model compile the same
# steps, and each Run jits its own closures, so only XLA's persistent cache can share the
# compiled code between them. A fresh folder per session, removed at the end (CI starts cold);
# a JAX_COMPILATION_CACHE_DIR already set is used as it is and kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _SESSION_CACHE = tempfile.mkdtemp(prefix="jaxaccel-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _SESSION_CACHE
else:
    _SESSION_CACHE = None
# transformers copies the model code of a folder loaded with trust_remote_code (the exports of
# mean-pooling classifiers) into HF_MODULES_CACHE: a session folder, not the user's ~/.cache.
if "HF_MODULES_CACHE" not in os.environ:
    _MODULES_CACHE = tempfile.mkdtemp(prefix="jaxaccel-tests-hf-modules-")
    os.environ["HF_MODULES_CACHE"] = _MODULES_CACHE
else:
    _MODULES_CACHE = None
# Token caches (jaxaccel.data.tokencache) likewise: one folder for the session, removed at the
# end, so tests never write to ~/.cache and share what they tokenized.
if "JAXACCEL_DATA_CACHE" not in os.environ:
    _DATA_CACHE = tempfile.mkdtemp(prefix="jaxaccel-tests-data-cache-")
    os.environ["JAXACCEL_DATA_CACHE"] = _DATA_CACHE
else:
    _DATA_CACHE = None
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxaccel.distributed import cpu_without_accelerator  # noqa: E402

# The compile tests' libtpu and CUDA plugin (the `aot` extra) make compile-only devices without
# an accelerator; left to themselves they would also try to start a TPU / GPU backend (seconds
# of TPU metadata probing, CUDA errors) in this process and every subprocess. Without an
# accelerator the session's backend is the CPU: say so before any backend starts.
cpu_without_accelerator()

from kernels_pallas import registry  # noqa: E402


# Local storage servers (GCS, S3) for the runs in buckets, started by the tests that ask.
pytest_plugins = ["storage_servers"]


def pytest_report_header(config):
    cpu = len(jax.devices("cpu"))
    return (f"jax {jax.__version__}: default backend {jax.default_backend()} with "
            f"{len(jax.devices())} device(s) ({jax.devices()[0].device_kind}); {cpu} CPU device(s)")


def pytest_configure(config):
    """The default suite compiles far more than it runs (tiny models, a few steps each): on a
    machine with only the CPU backend, XLA's LLVM code generation at optimisation level 0
    compiles the tiny BERT's train step ~2x faster (7.4 s -> 3.7 s on the 2-core CI CPU,
    measured under load). Not for ``-m slow`` (real training: MiniLM steps run 1.65x slower at
    level 0), nor where the default backend is a GPU or TPU, whose code generation is the one
    being tested there (only the CPU backend is started when ``jax_platforms`` is "cpu", set
    above when no accelerator is attached), nor when the caller set XLA_FLAGS. XLA reads the
    flags when the first backend is created, which happens after this hook (tested: the same
    compile and run times as set before import). And pytest-xdist hands files out in the order
    collected (``FILE_SECONDS``), not by their number of tests."""
    if hasattr(config.option, "loadscopereorder"):     # pytest-xdist: keep FILE_SECONDS' order
        config.option.loadscopereorder = False
    slow = "slow" in (config.getoption("markexpr") or "")
    if _OWN_XLA_FLAGS and not slow and jax.config.jax_platforms == "cpu":
        os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"


def pytest_sessionfinish(session, exitstatus):
    for folder in (_SESSION_CACHE, _MODULES_CACHE, _DATA_CACHE):
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


# Worker-seconds of the test files that take longest, in the default suite and in its long
# tests (``-m long``), measured at 64b25c3 on the idle 2-core VM (2026-11-29). The suite's
# command (README) hands whole files to two workers (``--dist loadfile``) in collection order;
# pytest-xdist would put the files with the most tests first, which left the few long ones for
# last, one worker running them while the other stood idle. Longest first (in the tiers being
# run), the short files fill in at the end.
FILE_SECONDS = {   # file: (default suite, long tests)
    "test_buckets.py": (35, 277), "test_faults.py": (88, 149), "test_sharding.py": (133, 61),
    "test_plan.py": (66, 117), "test_flat.py": (46, 110), "test_precision.py": (36, 116),
    "test_probe.py": (111, 36), "test_scan.py": (3, 125), "test_train.py": (30, 98),
    "test_pipeline.py": (0, 127), "test_attention.py": (106, 0),
    "test_fresh_machine.py": (10, 96), "test_vit.py": (55, 47), "test_export.py": (58, 33),
    "test_model.py": (79, 0), "test_adan.py": (42, 23), "test_probe5_runs.py": (13, 44),
    "test_bench.py": (1, 55), "test_unpad.py": (35, 20), "test_attention_mgpu.py": (36, 18),
    "test_cli.py": (0, 46), "test_llama_sharding.py": (45, 0), "test_loss_chunks.py": (32, 13),
    "test_llama.py": (44, 0), "test_probe5.py": (39, 0), "test_probe4.py": (38, 0),
    "test_predict_audio.py": (32, 0), "test_vit_hf.py": (28, 0), "test_data.py": (28, 0),
}


def longest_first(items, default=True, long=False) -> None:
    """Order ``items`` by ``FILE_SECONDS`` in the tiers run (then as collected), a file's tests
    together."""
    def seconds(item):
        default_s, long_s = FILE_SECONDS.get(item.path.name, (0, 0))
        return default * default_s + long * long_s
    items.sort(key=lambda item: -seconds(item))


def pytest_addoption(parser):
    parser.addoption("--with-long", action="store_true",
                     help="run the long tests (marker ``long``) with the default suite")


def pytest_collection_modifyitems(config, items):
    """The longest files first (``FILE_SECONDS``); ``long`` tests (over 12 s each on the
    2-core CI CPU: processes, servers, signals, whole-step compiles for accelerators) are left
    out of the default suite (the README's command, without ``-m``: under 15 minutes) and run
    with ``-m long`` (CI runs both) or ``--with-long``; any other ``-m`` selects as pytest does; ``slow`` tests (minutes of training each) run only when
    asked for (``-m slow``); ``gpu`` tests only where the default backend is a GPU."""
    markexpr = config.getoption("markexpr") or ""
    with_long = config.getoption("with_long")
    longest_first(items, default=markexpr != "long", long="long" in markexpr or with_long)
    if not markexpr and not with_long:           # the README's command: no -m expression
        long = [item for item in items if item.get_closest_marker("long")]
        if long:
            items[:] = [item for item in items if not item.get_closest_marker("long")]
            config.hook.pytest_deselected(items=long)
    if "slow" not in markexpr:
        slow = pytest.mark.skip(reason="slow: run with -m slow")
        for item in items:
            if item.get_closest_marker("slow"):
                item.add_marker(slow)
    if registry.platform() == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a GPU (default backend: {jax.default_backend()})")
    for item in items:
        if item.get_closest_marker("gpu") or item.get_closest_marker("gpu_smoke"):
            item.add_marker(skip)


@contextlib.contextmanager
def eight_device_placement(n=8):
    """``n`` devices to build meshes over, and the placement that goes with them.

    * The default backend has ``n`` devices (CPU CI: the fake devices above, or a multi-GPU
      machine): those, nothing else changes.
    * Otherwise (one GPU) the ``n`` fake CPU devices, and everything built inside the block is
      put on CPU as on CPU CI by the default device: arrays created outside jit, the kernels'
      ``registry.platform`` (it falls back to it for unplaced operands) and the meshes built
      without a device list (``sharding.make_mesh``'s default: a run that ``loop.train``, the
      CLI or ``inference`` builds over all devices).
    * Neither has ``n`` devices: skip, naming the devices there are.
    """
    if len(jax.devices()) >= n:
        yield jax.devices()[:n]
        return
    cpu = jax.devices("cpu")
    if len(cpu) < n:
        pytest.skip(f"needs {n} devices: the default backend ({jax.default_backend()}) has "
                    f"{len(jax.devices())} and the CPU backend {len(cpu)} (XLA_FLAGS="
                    f"{os.environ.get('XLA_FLAGS', '')!r}; conftest forces 8 CPU devices unless "
                    "XLA_FLAGS is set)")
    with jax.default_device(cpu[0]):
        yield cpu[:n]


@pytest.fixture
def eight_devices():
    """8 devices for one test (see ``eight_device_placement``)."""
    with eight_device_placement() as devices:
        yield devices


@pytest.fixture(scope="module")
def eight_devices_module():
    """8 devices for a whole module, its module-scoped fixtures included."""
    with eight_device_placement() as devices:
        yield devices


@pytest.fixture(scope="module")
def on_eight_devices(eight_devices_module):
    """For a module whose helpers build outside any fixture argument (``support.build``, its
    own module-scoped references): ``support.DEVICES`` holds the module's 8 devices while it
    runs. A module takes it with ``pytestmark = pytest.mark.usefixtures("on_eight_devices")``,
    which sets it up before the module's own module-scoped fixtures."""
    import support
    support.DEVICES[:] = eight_devices_module
    yield
    support.DEVICES.clear()


@pytest.fixture(scope="session")
def minilm_dir():
    from jaxaccel.models import packaged_minilm_dir
    return packaged_minilm_dir()


@pytest.fixture(scope="session")
def brotli_sdist():
    """The brotli sdist that holds the Canterbury corpus (``canterbury.pip_download``: pip,
    PyPI), downloaded once per session into the session's data-cache folder, which the
    pytest-xdist workers share: the first worker to ask downloads it (tens of seconds of
    network for 7 s of pip's CPU), the others wait on the lock and read it."""
    from jaxaccel.data import canterbury
    folder = os.path.join(os.environ["JAXACCEL_DATA_CACHE"], "brotli-sdist")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, canterbury.SDIST_NAME)
    with open(os.path.join(folder, "download.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(path):
            canterbury.pip_download(canterbury.SDIST_REQUIREMENT, canterbury.SDIST_NAME,
                                    canterbury.SDIST_SHA256, canterbury.SOURCE_ENV, folder)
    return path


@pytest.fixture(scope="session")
def compile_target():
    """``compile_target(name)``: the ``jaxaccel.plan.topology`` target ``name`` (compile-only TPU or
    GPU devices), or skip naming what to install."""
    from jaxaccel.plan import topology

    def resolve(name):
        try:
            return topology.resolve(name)
        except topology.TopologyError as e:
            if "is not installed" not in str(e):
                raise
            pytest.skip(str(e))
    return resolve


@pytest.fixture
def no_compilation_cache():
    """jax's persistent compilation cache off for the test: every program is compiled, so its
    compiler's dumps and checks run, none is read back from the cache."""
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)


@pytest.fixture
def ptxas_reports(tmp_path, monkeypatch, no_compilation_cache):
    """Mosaic GPU's ptxas reports of the kernels compiled in the test (``MOSAIC_GPU_DUMP_*``),
    ``[(kernel name, report)]``, with jax's persistent compilation cache off so that every
    kernel is compiled (``compile_only.assert_spills_at_most`` reads them)."""
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    return lambda: sorted((f.name.rsplit("_", 1)[0], f.read_text())
                          for f in tmp_path.iterdir() if f.name.endswith(".ptxas"))

