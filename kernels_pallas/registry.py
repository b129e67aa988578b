"""Implementation registries for the kernels, and where a Pallas kernel runs.

Every kernel file (``attention.py``, ``adan.py``) holds one ``Registry``: its implementations
by name, the plain-XLA reference among them (``"xla"``, the base every other implementation is
tested against), and a default order per platform. A kernel's public function takes
``impl``, one of ``registry.names``:

* ``"auto"``: the first implementation of ``registry.order[platform()]`` that accepts the
  inputs (an implementation that cannot handle them raises ``NotImplementedError`` and the next
  one is tried; the reference accepts everything, and is last);
* a name: that implementation, and its ``NotImplementedError`` (which says why) if it cannot;
* a tuple of names: the first of them that accepts the inputs.

"xla" means the kernel's reference everywhere; "pallas" means the Pallas kernel on the
platform it runs on (``pallas_target``): Mosaic on TPU, Triton on GPU, the Pallas interpreter
on CPU. Naming a ``target`` explicitly lets a CPU machine *lower* (not run) a TPU or GPU
kernel: ``jax.jit(f).trace(*args).lower(lowering_platforms=(lowering_platform("tpu"),))``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import jax

PALLAS_TARGETS = ("interpret", "tpu", "gpu")
REFERENCE = "xla"


def platform() -> str:
    """The platform of the default device: "cpu", "gpu" or "tpu"."""
    p = jax.default_backend()
    if p in ("cuda", "rocm", "gpu"):
        return "gpu"
    return p


def pallas_target(target: str | None = None) -> str:
    """Where a Pallas kernel runs: ``target`` if given, else the default device's platform
    (the interpreter on CPU)."""
    if target is None:
        return {"gpu": "gpu", "tpu": "tpu"}.get(platform(), "interpret")
    if target not in PALLAS_TARGETS:
        raise ValueError(f"Pallas target={target!r} is not one of {PALLAS_TARGETS}; leave it "
                         "None to run on the default device ('interpret' on CPU).")
    return target


def interpret(target: str) -> bool:
    """Whether a Pallas target runs in the interpreter."""
    return target == "interpret"


def lowering_platform(target: str) -> str:
    """The XLA platform name used to lower a kernel for ``target`` ("tpu" or "cuda")."""
    return {"tpu": "tpu", "gpu": "cuda"}[target]


@dataclasses.dataclass(frozen=True)
class Registry:
    """One kernel's implementations: ``impls`` (name -> function, all with one signature),
    ``order`` (platform -> the names ``"auto"`` tries, best first, ending with the reference)."""

    kernel: str
    impls: Mapping[str, Callable]
    order: Mapping[str, tuple[str, ...]]

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

    def candidates(self, impl: str | Sequence[str]) -> tuple[str, ...]:
        """The implementations ``impl`` stands for, in the order they are tried."""
        if impl == "auto":
            return self.order[platform()]
        names = (impl,) if isinstance(impl, str) else tuple(impl)
        bad = [n for n in names if n not in self.impls]
        if bad or not names:
            raise ValueError(f"{self.kernel} impl={impl!r} is unknown; expected one of "
                             f"{self.names} (or a tuple of names, tried in order).")
        return names

    def __call__(self, *args, impl: str | Sequence[str] = "auto", **kwargs):
        """The first candidate of ``impl`` that accepts the inputs, applied to them."""
        names = self.candidates(impl)
        reasons = []
        for name in names:
            try:
                return self.impls[name](*args, **kwargs)
            except NotImplementedError as e:
                if len(names) == 1:
                    raise
                reasons.append(f"{name}: {e}")
        raise NotImplementedError(f"{self.kernel}: no implementation of {names} accepts these "
                                  "inputs; " + "; ".join(reasons))
