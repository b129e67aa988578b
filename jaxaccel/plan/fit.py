"""Whether a step fits a device: the memory a device can give it (``capacity``), the errors of a
step that does not fit or cannot be built, and the does-not-fit message with what would fix it."""
from __future__ import annotations

import os

from jaxaccel.models import remat
from jaxaccel.plan import topology
from jaxaccel.plan.report import gb
from jaxaccel.plan.result import Plan

GPU_MEMORY_FRACTION = 0.75      # JAX's default GPU preallocation (XLA_PYTHON_CLIENT_MEM_FRACTION)
EXIT_DOES_NOT_FIT = 4


class StepRefused(ValueError):
    """The step cannot be built at the configured shapes (tracing refused it: e.g. a dropout
    mask larger than its counters); a smaller micro-batch may help. ``step``: train or eval."""

    def __init__(self, message: str, step: str):
        super().__init__(message)
        self.step = step


class DoesNotFit(RuntimeError):
    """The step needs more memory per device than the device has: the message says by how
    much and what would fix it; ``plan`` holds the numbers (None when the compiler itself
    refused the step, as the TPU compiler does: its own numbers are in the message)."""

    def __init__(self, message: str, plan: Plan | None = None, step: str = "train"):
        super().__init__(message)
        self.plan = plan
        self.step = step            # the step that does not fit: "train" or "eval"


def capacity(target: topology.Target) -> tuple[float | None, str]:
    """Bytes one device can give the step, and where that number comes from."""
    if target.name == "local":
        stats = target.devices[0].memory_stats() or {}
        if "bytes_limit" in stats:
            return float(stats["bytes_limit"]), "the device's allocator limit (memory_stats)"
        if target.platform == "cpu":
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            return ram / len(target.devices), "host RAM / CPU devices"
    if target.hbm_per_device is None:
        return None, f"unknown: {target.device_kind!r} is not in jaxaccel/devices.py"
    share = f" / {target.devices_per_chip} devices per chip" if target.devices_per_chip > 1 \
        else ""
    if target.platform == "gpu":
        return target.hbm_per_device * GPU_MEMORY_FRACTION, \
            f"{GPU_MEMORY_FRACTION:.0%} of HBM (JAX's default GPU preallocation)"
    return target.hbm_per_device, f"HBM per chip{share}"


def does_not_fit(target, cfg, mesh: dict, step: str, numbers: str) -> str:
    """The message of a step ("train" or "eval") that does not fit: the numbers and what
    would fix it."""
    t = cfg.train
    rows = max(mesh["data"] * mesh["fsdp"], 1)
    fixes = []
    if step == "eval":
        if t.eval_batch_size // rows > 1:
            fixes.append(f"a smaller eval batch (--set train.eval_batch_size="
                         f"{t.eval_batch_size // 2})")
    else:
        if mesh["fsdp"] == 1 and len(target.devices) > 1:
            fixes.append(f"shard parameters and optimizer state with an FSDP axis (--set "
                         f"mesh.fsdp={len(target.devices)} --set mesh.data=1)")
        if not remat.of(cfg.model.remat).on:
            fixes.append("recompute activations in the backward pass (--set model.remat=true)")
        micro = t.batch_size // t.grad_accum // rows
        if micro > 1:
            fixes.append(f"a smaller micro-batch per device (now {micro}) by accumulating "
                         f"gradients over more of them, the same optimizer batch (--set "
                         f"train.grad_accum={2 * t.grad_accum})")
    fixes.append("a target with more memory per chip or more chips")
    name = "training" if step == "train" else "eval"
    return (f"the {name} step does not fit on {target.name} ({target.device_kind}): "
            f"{numbers}. Try: " + "; ".join(fixes) + "; or let --fit search these by "
            "compiling.")


def check(plan: Plan) -> Plan:
    """``plan``, or ``DoesNotFit`` with its numbers when a step needs more than the device has."""
    if plan.fits is False:
        m, e = plan.memory, plan.eval_memory
        step = "train" if m["total"] > plan.capacity else "eval"
        raise DoesNotFit(does_not_fit(
            plan.target, plan.cfg, plan.mesh, step,
            f"it needs {gb(max(m['total'], e['total']))} per device (parameters "
            f"{gb(m['params'])}, optimizer state {gb(m['opt_state'])}, temporaries "
            f"{gb(m['temp'])}; eval step {gb(e['total'])}) but a device has "
            f"{gb(plan.capacity)} ({plan.capacity_source})"), plan, step)
    return plan
