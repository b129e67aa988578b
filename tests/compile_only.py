"""Helpers of the tests that compile for TPU slices and NVIDIA GPUs on compile-only devices
(``jaxaccel.plan.topology``; the ``compile_target`` fixture in conftest.py resolves a target or
skips): meshes of a target's devices, abstract arguments placed on them, a timed compile, and a
training run moved onto a target.

Nothing runs on these devices: ``jax.jit(f).trace(*abstract).lower().compile()`` runs the
target's real compiler (libtpu with Mosaic for Pallas kernels; XLA's GPU pipeline with Triton,
without autotuning, so the GPU HLO is close to, not identical to, a real GPU's). The kernels
pick their implementation and Pallas target from the mesh of their operands
(``kernels_pallas.registry.platform``): nothing is patched."""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import math
import os
import re
import shutil
import subprocess
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxaccel.models.stack import Scan
from jaxaccel.train.checkpoint import abstract_like

# The custom call each platform's Pallas kernels compile to ("gpu": Triton), and the Mosaic GPU
# kernels' ("mosaic_gpu").
KERNEL_CALL = {"tpu": "tpu_custom_call", "gpu": "__gpu$xla.gpu.triton",
               "mosaic_gpu": "mosaic_gpu_v2"}


def kernel_calls(hlo: str, platform: str) -> list[str]:
    """The lines of an optimized HLO module's text that call ``platform``'s Pallas kernels."""
    return [line for line in hlo.splitlines() if KERNEL_CALL[platform] in line]


def assert_spills_at_most(name: str, report: str, most: int = 0, entry: str | None = None):
    """Kernel ``name``'s ptxas report (the ``ptxas_reports`` fixture, or ``ptxas_report``)
    says its entry function (``entry``; by default the Mosaic GPU kernel's,
    ``<name>_mosaic_gpu_kernel``) was compiled for sm_90a and spills at most ``most`` bytes of
    registers to local memory. An xfail, not a pass, where that ptxas ignored the kernel's
    register reallocation between warpgroups (C7504, "'setmaxnreg' ignored") and spilled:
    found on CI's second leg (torch's CUDA 13 packages beside jax's CUDA 12 plugin), a known
    defect of the Mosaic GPU kernels on that toolchain."""
    import pytest
    entry = entry or f"{name}_mosaic_gpu_kernel"
    assert f"Compiling entry function '{entry}' for 'sm_90a'" in report, report
    spilled = re.search(r"(\d+) bytes spill stores", report)
    assert spilled, (name, report)
    if int(spilled[1]) > most and "'setmaxnreg' ignored" in report:
        pytest.xfail(f"{name}: this ptxas ignores setmaxnreg (C7504) and spills "
                     f"{spilled[1]} bytes")
    assert int(spilled[1]) <= most, (name, report)


def ptxas_report(ptx: str, arch: str = "sm_90a") -> str:
    """ptxas's verbose report (registers and spills of each entry function) of the PTX file
    ``ptx`` assembled for ``arch``, by the assembler XLA's GPU compiler runs: a ptxas (under
    jax's CUDA path, ``CUDA_ROOT`` or the nvidia-cuda-nvcc package, else on PATH) that reads
    the file's PTX ISA, else libnvJitLink (jax 0.12's XLA writes PTX 9.4, which CUDA 13.0's
    ptxas cannot read, and hands it to libnvJitLink 13.5). A skip naming why where neither
    is here."""
    import pytest
    from jax._src import lib
    folders = [os.path.join(lib.cuda_path, "bin")] if lib.cuda_path else []
    found = shutil.which("ptxas", path=os.pathsep.join(folders + [os.environ.get("PATH", "")]))
    why = "no ptxas (the nvidia-cuda-nvcc package or a CUDA toolkit)"
    if found:
        done = subprocess.run([found, "-v", f"-arch={arch}", ptx, "-o", os.devnull],
                              capture_output=True, text=True)
        if "Unsupported .version" not in done.stderr:
            assert done.returncode == 0, done.stderr
            return done.stdout + done.stderr
        why = f"{found}: {done.stderr.splitlines()[0]}"
    with open(ptx, "rb") as f:
        report = _nvjitlink_report(f.read(), arch)
    if report is None:
        pytest.skip(f"nothing here assembles the PTX XLA wrote ({why}; no libnvJitLink)")
    return report


def _nvjitlink_report(ptx: bytes, arch: str) -> str | None:
    """libnvJitLink's info log (ptxas's report within it) of linking ``ptx`` alone for
    ``arch``, by the library of CUDA 13 or 12 that this process can load (XLA loads it when
    it uses it); None where there is none."""
    for major in (13, 12):
        try:
            nvjitlink = ctypes.CDLL(f"libnvJitLink.so.{major}")
        except OSError:
            continue
        call = lambda name, *args: getattr(nvjitlink, f"__nvJitLink{name}_{major}_0")(*args)
        handle, size = ctypes.c_void_p(), ctypes.c_size_t()
        options = (ctypes.c_char_p * 2)(f"-arch={arch}".encode(), b"-verbose")
        assert call("Create", ctypes.byref(handle), 2, options) == 0
        try:
            assert call("AddData", handle, 2, ptx, ctypes.c_size_t(len(ptx)), b"ptx") == 0  # 2: PTX
            done = call("Complete", handle)
            call("GetInfoLogSize", handle, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            call("GetInfoLog", handle, log)
        finally:
            call("Destroy", ctypes.byref(handle))
        assert done == 0, (done, log.value.decode())
        return log.value.decode()
    return None


def mesh(target, shape=(1,), axis_names=("x",)) -> Mesh:
    """A mesh over ``target``'s first prod(``shape``) devices."""
    return Mesh(np.asarray(target.devices[:math.prod(shape)]).reshape(shape), axis_names)


def placed(x, sharding) -> jax.ShapeDtypeStruct:
    """``x``'s shape and dtype (an array or a ShapeDtypeStruct) placed as ``sharding``."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def replicated(m: Mesh, *xs):
    """Each of ``xs`` abstract and replicated on mesh ``m``."""
    return tuple(placed(x, NamedSharding(m, P())) for x in xs)


def compile_timed(fn, *args, mesh: Mesh, compiler_options: dict | None = None, **jit_kwargs):
    """``(compiled, seconds)``: ``jax.jit(fn, **jit_kwargs)`` traced, lowered and compiled for
    ``args`` (placed on ``mesh``; XLA's debug options ``compiler_options`` set for this
    compile alone) under ``jax.set_mesh(mesh)``, as the trainer runs its steps
    (on jax 0.12 Pallas Triton reads its GPU from the ambient mesh when lowering); the CPU
    seconds this process spent in the compile alone (not the trace or lowering): not wall
    time, which on a machine loaded by other work counts the others' time too."""
    with jax.set_mesh(mesh):
        lowered = jax.jit(fn, **jit_kwargs).trace(*args).lower()
        start = time.process_time()
        compiled = lowered.compile(compiler_options)
    return compiled, time.process_time() - start


def move_run(run, m: Mesh):
    """``(run', state, batch)``: ``run`` (built on CPU devices) with its mesh replaced by
    ``m`` (same axis names and sizes) and its state shardings re-based onto it; its abstract
    state and first batch placed there. ``run'.train_step`` is a fresh jit over ``m``."""
    if dict(m.shape) != dict(run.mesh.shape):
        raise ValueError(f"mesh {dict(m.shape)} must have the run's axes {dict(run.mesh.shape)}")
    shardings = jax.tree_util.tree_map(lambda s: NamedSharding(m, s.spec), run.state_shardings)
    state = abstract_like(run.state, shardings)
    moved = dataclasses.replace(run, resolved=dataclasses.replace(run.resolved, mesh=m),
                                state_shardings=shardings)
    batch = next(run.train_data.batches(0))
    batch = {k: placed(v, moved.batch_sharding) for k, v in batch.items()}
    return moved, state, batch


def compile_step(run, m: Mesh):
    """``(compiled, seconds)``: ``run``'s training step compiled for mesh ``m``
    (``move_run``, ``compile_timed``)."""
    moved, state, batch = move_run(run, m)
    return compile_timed(moved.train_step, state, batch, mesh=m)


_DEFINED = re.compile(r"%([\w.\-]+) = (\w+)\[")          # %name = dtype[shape] ...
_PARAMETER = re.compile(r"([\w.\-]+): (\w+)\[")         # a computation's (name: dtype[shape], ...)
_DOT = re.compile(r" dot\(%([\w.\-]+), %([\w.\-]+)\).*op_name=\"([^\"]*)\"")


def dots(hlo: str) -> list[tuple[str, str, bool]]:
    """Every ``dot`` of an optimized HLO module's text (GEMM fusions included):
    ``(lhs dtype, rhs dtype, backward)``, backward meaning it comes from autodiff's transpose.
    Operand dtypes are those of the instructions (or computation parameters) feeding it."""
    found, dtypes = [], {}
    for line in hlo.splitlines():
        if not line.startswith(" "):                   # a computation's header: its parameters
            dtypes = dict(_PARAMETER.findall(line))
            continue
        defined = _DEFINED.search(line)
        if defined:
            dtypes[defined[1]] = defined[2]
        dot = _DOT.search(line)
        if dot:
            found.append((dtypes.get(dot[1]), dtypes.get(dot[2]), "transpose(" in dot[3]))
    return found


# The encoder's Dense layers per layer (query, key, value, attention output, intermediate,
# output): the GEMMs a precision policy's dtypes must reach.
ENCODER_DENSE = 6


def layer_bodies(run) -> int:
    """How many layer bodies ``run``'s compiled step holds: one where its layers are scanned
    (``models.stack.Scan``: one body run by the loop), else one per layer."""
    return 1 if isinstance(run.resolved.stacking, Scan) else \
        run.spec.architecture.num_hidden_layers


def assert_gemm_dtypes(hlo: str, policy: str, layers: int):
    """What a GPU target's optimized HLO says of the encoder's GEMMs under ``policy``, for
    ``layers`` layer bodies in the program (``layer_bodies``).

    fp8: fp8 operands reach them: forward E4M3 x E4M3 (one per Dense) and backward GEMMs with
    E5M2 gradients (two per Dense). bf16: every GEMM, backward ones included, takes bf16
    operands; XLA merges GEMMs that share an input (query, key and value become one: BERT-base
    compiles to 4 forward GEMMs per layer), so there are at least 4 per layer and at least one
    backward GEMM per forward one."""
    found = dots(hlo)
    counts = collections.Counter(found)
    dense = ENCODER_DENSE * layers
    if policy == "fp8":
        assert counts["f8e4m3fn", "f8e4m3fn", False] >= dense, counts
        assert sum(n for d, n in counts.items() if d[2] and "f8e5m2" in d[:2]) >= 2 * dense, \
            counts
    elif policy == "bf16":
        assert set(d[:2] for d in counts) == {("bf16", "bf16")}, counts
        forward = sum(not d[2] for d in found)
        assert forward >= (ENCODER_DENSE - 2) * layers and len(found) >= 2 * forward, counts
    else:
        raise ValueError(f"policy {policy!r}: GEMM dtypes are checked for 'fp8' and 'bf16'")
