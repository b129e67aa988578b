"""Published facts per accelerator chip: HBM, HBM bandwidth, peak FLOP/s per dtype, interconnect
bandwidth. One table.

Keyed by jax's ``device_kind`` (what ``jax.devices()[0].device_kind`` and the compile-only
devices of ``jaxaccel.plan.topology`` report: v5e is "TPU v5 lite", v6e "TPU v6 lite", v5p
"TPU v5"). MFU (bench/, the training loop) and ``jaxaccel compile``'s estimates read it.

Peaks are dense (no sparsity) datasheet figures for one chip. ``float32`` is the rate XLA's
default matmul precision runs fp32 dots at: TF32 tensor cores on NVIDIA Ampere and newer,
one bf16 pass on TPU. ``float16`` and ``float8`` are given where the chip has matrix units for
them; elsewhere they run at the bf16 rate (``peak_rate`` says which figure it used), and MFU
(``jaxaccel.flops.mfu_peak``: ``own_units``) is left out rather than measured against another
dtype's peak.
"""
from __future__ import annotations

from typing import NamedTuple

GiB = 2 ** 30


class Chip(NamedTuple):
    kinds: tuple            # jax device_kind strings of this chip
    hbm_bytes: float        # memory per chip
    hbm_bandwidth: float    # bytes/s per chip
    flops: dict             # dtype ("bfloat16", "float32", "float8") -> dense FLOP/s per chip
    source: str
    interconnect: float | None = None   # chip-to-chip bytes/s, both directions (ICI, NVLink)
    dcn: float | None = None    # bytes/s per chip out of its slice (data-center network, one
                                # direction): the host's NICs' share per chip


_TPU_DOC = "https://cloud.google.com/tpu/docs/"
# Chip.dcn from the table of the v6e page (v5e beside v6e): NICs per 8-chip host 2 x 100 Gbps
# (v5e) and 4 x 200 Gbps (v6e), i.e. 6.4 and 25.6 Tbps of data-center network per 256-chip
# pod: 25 and 100 Gbps per chip. None here for v4 and v5p (a plan says so).
DCN_SOURCE = f"{_TPU_DOC}v6e: host NICs / 8 chips"
CHIPS = [
    Chip(("NVIDIA H100 80GB HBM3", "NVIDIA H100"), 80e9, 3.35e12,
         {"bfloat16": 989e12, "float16": 989e12, "float32": 494.7e12, "float8": 1979e12},
         "NVIDIA H100 SXM5 datasheet (dense; float32 = TF32; NVLink 900 GB/s)", 900e9),
    Chip(("NVIDIA H100 PCIe",), 80e9, 2.0e12,
         {"bfloat16": 756e12, "float16": 756e12, "float32": 378e12, "float8": 1513e12},
         "NVIDIA H100 PCIe datasheet (dense; float32 = TF32; NVLink only with a bridge)"),
    Chip(("NVIDIA H200", "NVIDIA H200 141GB HBM3e"), 141e9, 4.8e12,
         {"bfloat16": 989e12, "float16": 989e12, "float32": 494.7e12, "float8": 1979e12},
         "NVIDIA H200 SXM datasheet (dense; float32 = TF32; NVLink 900 GB/s)", 900e9),
    Chip(("NVIDIA A100-SXM4-80GB",), 80e9, 2.039e12,
         {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
         "NVIDIA A100 80GB SXM datasheet (dense; float32 = TF32; no fp8 units; NVLink 600 GB/s)",
         600e9),
    Chip(("NVIDIA A100-SXM4-40GB",), 40e9, 1.555e12,
         {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
         "NVIDIA A100 40GB SXM datasheet (dense; float32 = TF32; no fp8 units; NVLink 600 GB/s)",
         600e9),
    Chip(("TPU v4",), 32 * GiB, 1.2e12, {"bfloat16": 275e12, "float32": 275e12},
         f"{_TPU_DOC}v4 (per chip: 2 TensorCores; no per-chip ICI figure there)"),
    Chip(("TPU v5 lite", "TPU v5e"), 16 * GiB, 0.82e12, {"bfloat16": 197e12, "float32": 197e12},
         f"{_TPU_DOC}v5e (ICI 400 GB/s per chip, both directions)", 400e9, 25e9 / 8),
    Chip(("TPU v5", "TPU v5p"), 95 * GiB, 2.76e12, {"bfloat16": 459e12, "float32": 459e12},
         f"{_TPU_DOC}v5p (per chip: 2 TensorCores as one megacore device; ICI 1,200 GB/s, "
         "both directions)", 1200e9),
    Chip(("TPU v6 lite", "TPU v6e"), 32 * GiB, 1.64e12, {"bfloat16": 918e12, "float32": 918e12},
         f"{_TPU_DOC}v6e (ICI 800 GB/s per chip, both directions)", 800e9, 100e9 / 8),
]


def chip(device_kind: str) -> Chip | None:
    """The chip whose ``kinds`` hold ``device_kind`` exactly; None when the table lacks it."""
    return next((c for c in CHIPS if device_kind in c.kinds), None)


def peak_rate(device_kind: str, dtype: str = "bfloat16", *,
               own_units: bool = False) -> tuple[float, str] | None:
    """``(FLOP/s, which figure)`` of one chip for matmuls in ``dtype`` ("bfloat16", "float16",
    "float32", "float8"; a policy's ``matmul_dtype``). A dtype without its own figure runs at
    the bf16 rate, and the answer says so: the rate a step in it runs at (the planner's bound);
    with ``own_units``, None instead (MFU, a share of the dtype's own peak). None for a device
    kind not in the table. The one reading of ``CHIPS``' peaks."""
    c = chip(device_kind)
    if c is None:
        return None
    if dtype in c.flops:
        return c.flops[dtype], f"{dtype} peak"
    if own_units:
        return None
    return c.flops["bfloat16"], f"bf16 peak ({device_kind} has no separate {dtype} rate)"


def peak_bf16(device_kind: str) -> float | None:
    """Dense bf16 FLOP/s of one chip, None when unknown."""
    peak = peak_rate(device_kind)
    return peak[0] if peak else None


def peak_bandwidth(device_kind: str) -> float | None:
    """HBM bytes/s of one chip, None when unknown."""
    c = chip(device_kind)
    return c.hbm_bandwidth if c else None
