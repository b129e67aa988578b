"""Backend names for the Pallas kernels: resolving "auto", interpret mode on CPU, lowering platforms.

Every kernel's public function takes ``backend`` in ``BACKENDS``:

* ``"auto"``: the Pallas kernel on GPU/TPU, the plain XLA reference on CPU;
* ``"pallas"``: the Pallas kernel wherever it runs: GPU/TPU, or the interpreter on CPU;
* ``"xla"``: the plain jnp/XLA reference, any platform;
* ``"interpret"``: the Pallas kernel run by the Pallas interpreter (CPU tests);
* ``"tpu"`` / ``"gpu"``: the Pallas kernel lowered for that platform. Naming the
  platform explicitly lets a CPU machine *lower* (not run) a TPU or GPU kernel:
  ``jax.jit(f).trace(*args).lower(lowering_platforms=(lowering_platform("tpu"),))``.
"""
from __future__ import annotations

import jax

BACKENDS = ("auto", "pallas", "xla", "interpret", "tpu", "gpu")
PALLAS_BACKENDS = ("interpret", "tpu", "gpu")


def platform() -> str:
    """The platform of the default device: "cpu", "gpu" or "tpu"."""
    p = jax.default_backend()
    if p in ("cuda", "rocm", "gpu"):
        return "gpu"
    return p


def resolve(backend: str) -> str:
    """Map a user-facing backend name to a concrete one ("xla", "interpret", "tpu", "gpu")."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}; pick one of them "
                         "('auto' chooses Pallas on GPU/TPU and XLA on CPU).")
    if backend not in ("auto", "pallas"):
        return backend
    p = platform()
    if p in ("tpu", "gpu"):
        return p
    return "xla" if backend == "auto" else "interpret"


def interpret(backend: str) -> bool:
    """Whether a concrete Pallas backend runs in the interpreter."""
    return backend == "interpret"


def lowering_platform(backend: str) -> str:
    """The XLA platform name used to lower a kernel for ``backend`` ("tpu" or "cuda")."""
    return {"tpu": "tpu", "gpu": "cuda"}[backend]
