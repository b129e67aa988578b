"""Named accelerator targets -> compile-only devices, on any machine (no TPU or GPU needed).

``resolve(name)`` gives the devices of a TPU slice or of NVIDIA GPU hosts as the real compilers
see them: ``jax.jit(f).lower(...).compile()`` with shardings on a mesh of them runs libtpu's
TPU compiler (Mosaic for Pallas kernels) or XLA's GPU pipeline (Triton for Pallas kernels),
and ``memory_analysis()`` gives per-device bytes. Nothing runs on them.

Names:
- TPU ``<generation>:<chip grid>`` as libtpu spells slices (``v5e:2x4``, ``v5p:2x2x1``), or
  the Cloud names of the common slices (``v5e-8``; ``ALIASES``). Cloud counts v4 and v5p
  slices in TensorCores (v5p-8 is 4 chips), v5e and v6e in chips. A v5p chip is one device
  (its two cores as one megacore); libtpu's deviceless v4 gives one device per TensorCore
  (2 per chip): ``Target.devices_per_chip`` says which, and per-device HBM is the chip's
  share. Their wraparound links are the real slice's (``wraparound``: a v5p-128's 4x4x4 is
  a torus). Needs libtpu (``pip install "jax[tpu]==<jax>"``, the ``jaxaccel[aot]`` extra).
- Several TPU slices: ``<N>x<slice>`` (``2xv5e-256``, ``2xv5e:2x4``): N slices joined by the
  data-center network (DCN; MaxText's ``compile_topology_num_slices``); each device carries
  its ``slice_index``, and ``mesh.dcn_data`` / ``mesh.dcn_fsdp`` (``jaxaccel.sharding``) say
  which mesh axes run between them.
- NVIDIA ``<gpu>:<hosts>x<gpus per host>`` (``h100:1x8`` = one 8-GPU host), from the target
  configs in ``jaxaccel/plan/targets/`` (GpuTargetConfigProto text; their header names the
  openxla/xla file and commit). Needs the CUDA plugin (``pip install
  "jax[cuda12-local]==<jax>"``) and no GPU; run with ``JAX_PLATFORMS=cpu`` on a machine
  without one. No autotuning happens without a device: the compiled HLO is close to, not
  identical to, what a real GPU runs.
- ``local``: the devices at hand (``jax.devices()``).
"""
from __future__ import annotations

import functools
import importlib.util
import math
import os
import re
from typing import NamedTuple

import jax

from jaxaccel import devices as devices_lib

TPU_GENERATIONS = ("v4", "v5e", "v5p", "v6e")
# Slices known to compile with libtpu 0.0.42 (jax 0.10.2); other grids of these generations
# are passed to libtpu, which says whether it knows them.
TPU_SLICES = ("v4:2x2x1", "v5e:1x1", "v5e:2x2", "v5e:2x4", "v5e:4x4", "v5e:16x16", "v5p:2x2x1",
              "v5p:2x2x4", "v5p:4x4x4", "v5p:4x4x8", "v5p:4x8x8", "v5p:8x8x8", "v6e:1x1",
              "v6e:2x2", "v6e:2x4", "v6e:4x8", "v6e:8x8", "v6e:16x16")
ALIASES = {"v4-8": "v4:2x2x1", "v5e-1": "v5e:1x1", "v5e-4": "v5e:2x2", "v5e-8": "v5e:2x4",
           "v5e-16": "v5e:4x4", "v5e-256": "v5e:16x16", "v5p-8": "v5p:2x2x1",
           "v5p-32": "v5p:2x2x4", "v5p-128": "v5p:4x4x4", "v5p-256": "v5p:4x4x8",
           "v5p-512": "v5p:4x8x8", "v5p-1024": "v5p:8x8x8", "v6e-1": "v6e:1x1",
           "v6e-4": "v6e:2x2", "v6e-8": "v6e:2x4", "v6e-32": "v6e:4x8", "v6e-64": "v6e:8x8",
           "v6e-256": "v6e:16x16"}
MULTI_SLICE_EXAMPLES = ("2xv5e-8", "2xv5e-256", "2xv6e-256")
# Chips of the largest one-host VM: v5e/v6e slices up to 8 chips are one host (ct5lp-hightpu-8t,
# ct6e-standard-8t), v4/v5p hosts have 4; libtpu's default host is 2x2x1 chips (so 1 chip or
# 2x4 would not divide it).
MAX_CHIPS_PER_HOST = {"v4": 4, "v5p": 4, "v5e": 8, "v6e": 8}
GPU_CONFIGS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb", "a100": "a100_sxm_80.txtpb"}
GPU_EXAMPLES = ("h100:1x1", "h100:1x8", "h100:2x8", "h200:1x8", "a100:1x8")
TARGETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")


class TopologyError(ValueError):
    """A target name that cannot be resolved, or a compiler that is not installed."""


class Target(NamedTuple):
    name: str                   # canonical: "v5e:2x4", "h100:1x8", "local"
    platform: str               # jax's platform of the devices: "tpu", "gpu", "cpu"
    devices: tuple              # compile-only devices (or the local ones)
    chip: devices_lib.Chip | None   # published facts; None when the table lacks the kind
    devices_per_chip: int       # 2 for libtpu's deviceless v4 (one device per TensorCore)
    hosts: int
    slices: int = 1             # TPU slices joined by the data-center network (DCN)

    @property
    def device_kind(self) -> str:
        return self.devices[0].device_kind

    @property
    def chips(self) -> int:
        return len(self.devices) // self.devices_per_chip

    @property
    def hbm_per_device(self) -> float | None:
        return self.chip.hbm_bytes / self.devices_per_chip if self.chip else None


def known() -> list[str]:
    """Names to show a user: the TPU slices, their Cloud aliases, GPU examples, ``local``."""
    return [*TPU_SLICES, *ALIASES, *MULTI_SLICE_EXAMPLES, *GPU_EXAMPLES, "local"]


def _unknown(name: str, why: str) -> TopologyError:
    return TopologyError(
        f"unknown topology {name!r} ({why}); known: {', '.join(known())}. TPU names are "
        f"<generation>:<chip grid> with generation in {TPU_GENERATIONS} (<N>x before one: N "
        f"slices); GPU names "
        f"<gpu>:<hosts>x<gpus per host> with gpu in {tuple(GPU_CONFIGS)}.")


def _needs(package: str, pip: str, name: str) -> TopologyError:
    return TopologyError(
        f"topology {name!r} needs {package}, which is not installed: pip install "
        f"\"{pip}=={jax.__version__}\" (or pip install \"jaxaccel[aot]\"), then run again.")


def cuda_plugin_installed() -> bool:
    """Whether jax's CUDA plugin (12 or 13) is installed, without importing it."""
    try:
        return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))
    except ModuleNotFoundError:         # no jax_plugins package at all
        return False


def _with_chip(name, platform, devs, hosts, devices_per_chip=1) -> Target:
    return Target(name, platform, tuple(devs), devices_lib.chip(devs[0].device_kind),
                  devices_per_chip, hosts)


def _one_worker_host(environ=os.environ) -> None:
    """On a machine without a TPU, tell libtpu that this host is the one worker of a one-host
    slice: without a TPU VM's metadata it otherwise prints its failure to find them when it
    starts ("Failed to find host bounds for accelerator type: WARNING: could not determine TPU
    accelerator type ...", "E0000 ... unexpected worker hostname 'WARNING: could not determine
    TPU worker hostnames ...'"). The compile-only devices do not depend on it: their grid and
    hosts come from the target name (the same devices, coordinates and process indices either
    way, for every slice in TPU_SLICES). Variables already set are kept; on a TPU VM nothing is
    set."""
    from jax._src import hardware_utils
    if hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0:
        environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")


def wraparound(generation: str, dims: list[int]) -> tuple[bool, bool, bool]:
    """Which dimensions of a TPU slice's chip grid ``dims`` (x, y, z) close into rings, as on
    the real slice: v4 and v5p slices of whole 4x4x4 cubes are 3D tori, v5e and v6e rows and
    columns of 16 chips are rings; smaller grids are open meshes. libtpu's compile-only
    devices otherwise have no wraparound links, and its compiler then turns an all-gather over
    all the chips of a v5p-128 or v5p-256 into a zero-padded all-reduce (twice the bytes sent,
    full-size buffers), where with them it compiles a 3D all-gather (docs/reports/maxtext.md,
    "At scale"). The rule gives MaxText's ``wrap`` for every TPU slice of its
    ``accelerator_to_spec_map`` (0.2.5)."""
    if generation in ("v4", "v5p"):
        return (all(d % 4 == 0 for d in dims),) * 3
    return (dims[0] == 16, dims[1] == 16, False)


def _tpu(name: str, slices: int = 1) -> Target:
    if importlib.util.find_spec("libtpu") is None:
        raise _needs("libtpu (the TPU compiler)", "jax[tpu]", name)
    from jax.experimental import topologies
    # Compile-only: no TPU is opened, so libtpu's one-process-per-host lock (which makes a
    # second compiling process fail, e.g. a pytest worker) does not apply.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    _one_worker_host()
    generation, _, grid = name.partition(":")
    dims = [*map(int, grid.split("x")), 1][:3]
    one_host = math.prod(dims) <= MAX_CHIPS_PER_HOST[generation]
    kwargs = {"chips_per_host_bounds": dims} if one_host else {}
    kwargs["wrap"] = wraparound(generation, dims)
    if slices > 1:
        kwargs["num_slices"] = slices
    try:
        devs = topologies.get_topology_desc(platform="tpu", topology_name=name,
                                            **kwargs).devices
    except jax.errors.JaxRuntimeError as e:
        raise _unknown(name, f"libtpu: {str(e).splitlines()[0]}") from None
    # its chip's devices: the same coordinates in the same slice (one slice's have no index)
    where = lambda d: (d.coords, getattr(d, "slice_index", 0))
    per_chip = sum(where(d) == where(devs[0]) for d in devs)
    target = _with_chip(name, "tpu", devs, len({d.process_index for d in devs}), per_chip)
    return target._replace(name=f"{slices}x{name}", slices=slices) if slices > 1 else target


def _gpu(name: str, gpu: str, hosts: int, per_host: int) -> Target:
    if not cuda_plugin_installed():
        raise _needs("the CUDA plugin (XLA's GPU compiler)", "jax[cuda12-local]", name)
    from jax.experimental import topologies
    with open(os.path.join(TARGETS_DIR, GPU_CONFIGS[gpu])) as f:
        config = f.read()
    try:
        devs = topologies.get_topology_desc(platform="cuda", target_config=config,
                                            topology=f"1x{hosts}x{per_host}").devices
    except (NotImplementedError, jax.errors.JaxRuntimeError) as e:
        raise TopologyError(f"topology {name!r}: the CUDA plugin cannot make compile-only "
                            f"devices ({str(e).splitlines()[0]}); run with JAX_PLATFORMS=cpu "
                            "on a machine without a GPU.") from None
    return _with_chip(name, "gpu", devs, hosts)


@functools.lru_cache(maxsize=None)
def resolve(name: str) -> Target:
    """The target called ``name`` (see the module docstring); ``TopologyError`` naming the
    known names, or the pip command of a missing compiler."""
    name = name.strip().lower()
    if m := re.fullmatch(r"(\d+)x((v\d\w*)[-:].+)", name):
        slices, one = int(m[1]), ALIASES.get(m[2], m[2])
        if slices < 1 or m[3] not in TPU_GENERATIONS or not re.fullmatch(
                r"v\w+:\d+(x\d+){1,2}", one):
            raise _unknown(name, "several slices are <N>x<TPU slice>, e.g. 2xv5e-256")
        return _tpu(one, slices)
    name = ALIASES.get(name, name)
    if name == "local":
        devs = jax.devices()
        return _with_chip("local", devs[0].platform, devs, jax.process_count())
    generation, _, grid = name.partition(":")
    if generation == "local":
        raise TopologyError(
            f"topology {name!r}: 'local' takes no size: it is this machine's devices as they "
            "are (all of jax.devices()). Give --topology local, or a TPU slice or GPU hosts of "
            "the size wanted (e.g. v5e:2x4, h100:1x2).")
    if generation in TPU_GENERATIONS:
        if not re.fullmatch(r"\d+(x\d+){1,2}", grid):
            raise _unknown(name, "expected a chip grid like 2x4 or 2x2x1 after the colon")
        return _tpu(name)
    if generation in GPU_CONFIGS:
        m = re.fullmatch(r"(\d+)x(\d+)", grid)
        if not m or min(map(int, m.groups())) < 1:
            raise _unknown(name, "expected <hosts>x<gpus per host> after the colon, e.g. 1x8")
        return _gpu(name, generation, int(m[1]), int(m[2]))
    raise _unknown(name, f"no target {generation!r}")
