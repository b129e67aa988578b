"""Energy and utilisation of a measured region: NVML where it exists, a labelled estimate elsewhere.

On NVIDIA GPUs ``Meter`` reads NVML's total-energy counter (``nvmlDeviceGetTotalEnergyConsumption``,
millijoules since the driver loaded) of every local device before and after the region and sums
the differences; a sampler thread reads ``utilization.gpu`` (percent of time a kernel ran) every
``interval`` seconds. Then::

    energy_j    = sum_d (E_d(after) - E_d(before))
    avg_power_w = energy_j / seconds

Where no counter exists (TPU, CPU, a GPU without NVML or nvidia-ml-py) nothing is measured and
``estimate`` fills in, labelled ``energy_source = "estimate:tdp"``::

    energy_j = TDP_W[device] x devices x seconds x utilisation

with utilisation = MFU when known, else 1 (an upper bound; recorded as ``energy_utilisation``).
An estimate is never reported as a measurement and never as zero.
"""
from __future__ import annotations

import os
import threading
import time

NVML = "nvml"
ESTIMATE = "estimate:tdp"
# The counter advances in steps (seen on an H200: regions of a few milliseconds read 0 mJ), so a
# short region can read no energy at all; it then gets the estimate, never a measured zero.
NO_READING = "no reading: the region was shorter than the energy counter's update interval"

# Board power / TDP per device (W), keyed by a substring of jax's device_kind (first match wins),
# with the source of each figure.
TDP_W = [
    ("H100 80GB HBM3", 700.0, "NVIDIA H100 SXM5 datasheet: max TDP 700 W"),
    ("H100 PCIe", 350.0, "NVIDIA H100 PCIe datasheet: max TDP 350 W"),
    ("H100", 700.0, "NVIDIA H100 SXM5 datasheet: max TDP 700 W"),
    ("H200", 700.0, "NVIDIA H200 SXM datasheet: max TDP 700 W"),
    ("A100-SXM4", 400.0, "NVIDIA A100 SXM4 datasheet: max TDP 400 W"),
    ("A100-PCIE", 300.0, "NVIDIA A100 PCIe 80GB datasheet: max TDP 300 W"),
    ("V100", 300.0, "NVIDIA V100 SXM2 datasheet: 300 W"),
    ("TPU v4", 192.0, "Jouppi et al., TPU v4, ISCA 2023, Table: 192 W mean per chip"),
    ("TPU v5 lite", 197.0, "no public per-chip TDP; assumed equal to v4's 192-197 W class"),
    ("TPU v5e", 197.0, "no public per-chip TDP; assumed equal to v4's 192-197 W class"),
    ("TPU v5", 300.0, "no public per-chip TDP for v5p; assumed 300 W"),
    ("TPU v6", 300.0, "no public per-chip TDP for v6e; assumed 300 W"),
    ("cpu", 6.25, "per core: Intel Xeon Platinum 8480+ 350 W / 56 cores (a server-CPU "
                  "assumption; the host's CPU model is not known to jax)"),
]


def tdp(device_kind: str) -> tuple[float, str]:
    """``(watts, source)`` for a device kind; KeyError naming the table when unknown."""
    for key, watts, source in TDP_W:
        if key.lower() in device_kind.lower():
            return watts, source
    raise KeyError(f"no TDP for device kind {device_kind!r}; known: "
                   f"{[k for k, _, _ in TDP_W]}. Add it to jaxaccel/compare/energy.py TDP_W.")


def cpu_cores() -> int:
    """Cores this process may run on (the CPU 'device count' for the TDP estimate)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def estimate(device_kind: str, devices: int, seconds: float, utilisation: float | None) -> dict:
    """The labelled TDP estimate for ``seconds`` on ``devices`` devices of one kind."""
    watts, source = tdp(device_kind)
    util = 1.0 if utilisation is None else float(utilisation)
    power = watts * devices * util
    return {"energy_j": power * seconds, "avg_power_w": power, "energy_source": ESTIMATE,
            "energy_utilisation": util, "tdp_w": watts, "tdp_source": source}


def _nvml_handles(count: int):
    """NVML handles of the first ``count`` visible GPUs, or None when NVML is unavailable."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:          # no nvidia-ml-py, no driver: fall back to the estimate
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    indices = ([int(i) for i in visible.split(",") if i.strip().isdigit()] if visible
               else list(range(pynvml.nvmlDeviceGetCount())))[:count]
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        for h in handles:                  # raises NotSupported on pre-Volta boards
            pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
    except Exception:
        return None
    return handles


class Meter:
    """Context manager around a measured region; ``result`` holds its energy and utilisation.

    ``result`` after exit: ``seconds``, and with NVML ``energy_j``, ``avg_power_w``,
    ``energy_source="nvml"``, ``gpu_util_pct`` (mean of the samples); without NVML, or where
    the counter did not advance over the region (``nvml`` says so), no energy (call
    ``estimate`` once the row's utilisation is known).
    """

    def __init__(self, backend: str, devices: int = 1, interval: float = 0.05):
        self.handles = _nvml_handles(devices) if backend in ("gpu", "cuda") else None
        self.interval = interval
        self.result: dict = {}
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread = None

    def _sample(self):
        import pynvml
        while True:               # at least one sample, however short the region
            self._samples.append(sum(pynvml.nvmlDeviceGetUtilizationRates(h).gpu
                                     for h in self.handles) / len(self.handles))
            if self._stop.wait(self.interval):
                return

    def _energy_mj(self) -> int:
        import pynvml
        return sum(pynvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self.handles)

    def __enter__(self):
        if self.handles:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
            self._e0 = self._energy_mj()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        seconds = time.perf_counter() - self._t0
        self.result = {"seconds": seconds}
        if self.handles:
            joules = (self._energy_mj() - self._e0) / 1e3
            self._stop.set()
            self._thread.join()
            if joules > 0:
                self.result.update(energy_j=joules, avg_power_w=joules / seconds,
                                   energy_source=NVML)
            else:
                self.result["nvml"] = NO_READING
            if self._samples:
                self.result["gpu_util_pct"] = sum(self._samples) / len(self._samples)
