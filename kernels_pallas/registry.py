"""Implementation registries for the kernels, and where a Pallas kernel runs.

Every kernel file (``attention.py``, ``adan.py``) holds one ``Registry``: its implementations
by name, the plain-XLA reference among them (``"xla"``, the base every other implementation is
tested against), and a default order per platform. A kernel's public function takes
``impl``, one of ``registry.names``:

* ``"auto"``: the first implementation of ``registry.order[platform(*operands)]`` that accepts
  the inputs (an implementation that cannot handle them raises ``NotImplementedError`` and the
  next one is tried; the reference accepts everything, and is last);
* a name: that implementation, and its ``NotImplementedError`` (which says why) if it cannot;
* a tuple of names: the first of them that accepts the inputs.

"xla" means the kernel's reference everywhere; "pallas" means the Pallas kernel on the
platform it runs on (``pallas_target``): Mosaic on TPU, Triton on GPU, the Pallas interpreter
on CPU; "mosaic_gpu" the kernel written for Hopper GPUs on Mosaic GPU (jax's Mosaic GPU
interpreter on CPU).

Which GPU backends a default may use depends on the installed jax (``gpu_order``): jax 0.11
and later deprecate Pallas Triton (lowering a Triton kernel warns that the backend will be
removed), and there "auto" leaves the Triton kernels out; naming them still runs them. The
first time "auto" picks an implementation for a kernel and platform it is logged
(``logging``, logger "kernels_pallas", INFO), with the order it came from.

The platform is where the operands live (``platform``), not where this process's default
backend is: a step jitted over a mesh of TPU topology devices or compile-only CUDA devices
(``jax.experimental.topologies``) traces the TPU or GPU kernels on a CPU-only machine, and
``.lower(...).compile()`` runs that platform's compiler on them.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import logging
from typing import Callable, Mapping, Sequence

import jax

PALLAS_TARGETS = ("interpret", "tpu", "gpu")
REFERENCE = "xla"
TRITON = "pallas"                          # the name of the Triton kernels on a GPU
TRITON_DEPRECATION = "jax-pallas-triton"   # jax's id of the Pallas Triton deprecation
log = logging.getLogger("kernels_pallas")


_PLATFORMS = {"cpu": "cpu", "tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}


def _known(name: str) -> str:
    if name not in _PLATFORMS:
        raise ValueError(f"platform {name!r} is not one of {sorted(_PLATFORMS)}.")
    return _PLATFORMS[name]


def _mesh_platform(mesh) -> str | None:
    device = None if mesh.empty else mesh.abstract_device
    return None if device is None else _known(device.platform)


def _operand_platform(x) -> str | None:
    """What one operand says about where it lives: the mesh in its type (kept inside ``jit``),
    or the device a concrete array is committed to; None for unplaced operands (numpy, Python
    scalars, uncommitted arrays)."""
    if not isinstance(x, jax.Array):
        return None
    found = _mesh_platform(jax.typeof(x).sharding.mesh)
    if found is None and not isinstance(x, jax.core.Tracer) and x.committed:
        found = _known(next(iter(x.devices())).platform)
    return found


def platform(*operands) -> str:
    """Where a computation on ``operands`` runs: "cpu", "gpu" or "tpu". The first of these
    that says:

    1. the ambient mesh (``jax.set_mesh``; inside ``shard_map``, the mapped mesh);
    2. the operands (pytrees): the mesh in an operand's type, which ``jit`` keeps for arguments
       placed on a mesh (``jax.device_put`` or a ``ShapeDtypeStruct`` with a
       ``NamedSharding``), or the device a concrete array is committed to;
    3. the default device (``jax.default_device``), else the default backend.

    So a function traced for a TPU topology's or compile-only CUDA devices' mesh gets that
    platform's kernels on a machine with only a CPU."""
    said = itertools.chain([_mesh_platform(jax.sharding.get_abstract_mesh())],
                           map(_operand_platform, jax.tree_util.tree_leaves(operands)))
    found = next((p for p in said if p is not None), None)
    if found is not None:
        return found
    default = jax.config.jax_default_device
    if default is None:
        return _known(jax.default_backend())
    return _known(default if isinstance(default, str) else default.platform)


def pallas_target(target: str | None = None, *operands) -> str:
    """Where a Pallas kernel runs: ``target`` if given, else ``platform(*operands)``'s (the
    interpreter on CPU)."""
    if target is None:
        return {"gpu": "gpu", "tpu": "tpu"}.get(platform(*operands), "interpret")
    if target not in PALLAS_TARGETS:
        raise ValueError(f"Pallas target={target!r} is not one of {PALLAS_TARGETS}; leave it "
                         "None to run where the operands live ('interpret' on CPU).")
    return target


def interpret(target: str) -> bool:
    """Whether a Pallas target runs in the interpreter."""
    return target == "interpret"


def triton_shipped() -> bool:
    """Whether this jax has the Pallas Triton backend at all."""
    return importlib.util.find_spec("jax._src.pallas.triton") is not None


def check_triton() -> None:
    """NotImplementedError, saying what to use instead, where this jax has no Pallas Triton."""
    if not triton_shipped():
        raise NotImplementedError(f"jax {jax.__version__} has no Pallas Triton backend; use "
                                  "impl 'mosaic_gpu' (Hopper GPUs) or 'xla'.")


def triton_default() -> bool:
    """Whether a default may use Pallas Triton: this jax ships it and does not deprecate it
    (jax 0.10 does; jax >= 0.11 registers the deprecation ``TRITON_DEPRECATION``)."""
    if not triton_shipped():
        return False
    from jax._src import deprecations
    return TRITON_DEPRECATION not in getattr(deprecations, "_registered_deprecations", {})


def gpu_order(measured: Sequence[str]) -> tuple[str, ...]:
    """A GPU order, ``measured`` best first on a GPU, without the Triton kernels (``TRITON``)
    where a default may not use them (``triton_default``)."""
    return tuple(n for n in measured if n != TRITON or triton_default())


@dataclasses.dataclass(frozen=True)
class Registry:
    """One kernel's implementations: ``impls`` (name -> function, all with one signature),
    ``order`` (platform -> the names ``"auto"`` tries, best first, ending with the reference)."""

    kernel: str
    impls: Mapping[str, Callable]
    order: Mapping[str, tuple[str, ...]]
    _logged: set = dataclasses.field(default_factory=set, compare=False, repr=False)

    def __post_init__(self):
        if REFERENCE not in self.impls:
            raise ValueError(f"{self.kernel}: a registry needs its reference {REFERENCE!r}.")
        for p, names in self.order.items():
            if names[-1] != REFERENCE or set(names) - set(self.impls):
                raise ValueError(f"{self.kernel}: order[{p!r}]={names} must name registered "
                                 f"implementations and end with {REFERENCE!r}.")

    @property
    def names(self) -> tuple[str, ...]:
        """What ``impl`` (and the config key that sets it) accepts."""
        return ("auto",) + tuple(self.impls)

    def candidates(self, impl: str | Sequence[str], *operands) -> tuple[str, ...]:
        """The implementations ``impl`` stands for, in the order they are tried (for
        ``"auto"``: the order of the platform the ``operands`` live on, see ``platform``)."""
        if impl == "auto":
            return self.order[platform(*operands)]
        names = (impl,) if isinstance(impl, str) else tuple(impl)
        bad = [n for n in names if n not in self.impls]
        if bad or not names:
            raise ValueError(f"{self.kernel} impl={impl!r} is unknown; expected one of "
                             f"{self.names} (or a tuple of names, tried in order).")
        return names

    def _log_choice(self, impl, names, name, reasons):
        """Log what "auto" picked, once per platform and pick."""
        if impl != "auto" or (names, name) in self._logged:
            return
        self._logged.add((names, name))
        declined = "".join(f"; {r}" for r in reasons)
        log.info("%s: impl='auto' runs %r (order %s for jax %s%s)", self.kernel, name,
                 ", ".join(names), jax.__version__, declined)

    def __call__(self, *args, impl: str | Sequence[str] = "auto", **kwargs):
        """The first candidate of ``impl`` that accepts the inputs, applied to them."""
        names = self.candidates(impl, *args)
        reasons = []
        for name in names:
            try:
                out = self.impls[name](*args, **kwargs)
            except NotImplementedError as e:
                if len(names) == 1:
                    raise
                reasons.append(f"{name}: {e}")
                continue
            self._log_choice(impl, names, name, reasons)
            return out
        raise NotImplementedError(f"{self.kernel}: no implementation of {names} accepts these "
                                  "inputs; " + "; ".join(reasons))
