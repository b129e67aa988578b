"""Shared benchmark plumbing: timing by the measuring rules, peaks, result JSON, Markdown."""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import time

import jax
import numpy as np

# Peak HBM bandwidth (bytes/s) and dense bf16 FLOP/s by jax device_kind (datasheet leads).
PEAK_BANDWIDTH = {"NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H100": 3.35e12,
                  "NVIDIA H200": 4.8e12, "NVIDIA A100-SXM4-80GB": 2.0e12,
                  "NVIDIA A100-SXM4-40GB": 1.55e12, "TPU v4": 1.2e12, "TPU v5 lite": 0.82e12,
                  "TPU v5e": 0.82e12, "TPU v5p": 2.76e12, "TPU v6 lite": 1.64e12,
                  "TPU v6e": 1.64e12}
PEAK_BF16_FLOPS = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100": 989e12,
                   "NVIDIA H200": 989e12, "NVIDIA A100-SXM4-80GB": 312e12,
                   "NVIDIA A100-SXM4-40GB": 312e12, "TPU v4": 275e12, "TPU v5 lite": 197e12,
                   "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12,
                   "TPU v6e": 918e12}


def device_kind() -> str:
    return jax.devices()[0].device_kind


def time_fn(fn, *args, warmup: int = 3, n: int = 20) -> dict:
    """Median/min/max seconds of ``fn(*args)`` after warm-up (compile excluded)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return {"median_s": float(np.median(times)), "min_s": float(np.min(times)),
            "max_s": float(np.max(times)), "n": n}


def git_sha() -> str:
    """The checkout's commit (``JAXACCEL_SHA`` where the copy has no .git, e.g. a device)."""
    if os.environ.get("JAXACCEL_SHA"):
        return os.environ["JAXACCEL_SHA"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        return "unknown"


def write_results(bench: str, rows: list[dict], extra: dict | None = None) -> str:
    """Write ``bench/results/<bench>-<device>.json`` and return its path."""
    kind = device_kind()
    out = {"bench": bench, "device": kind, "backend": jax.default_backend(),
           "jax": jax.__version__, "jaxaccel": git_sha(),
           "date": datetime.date.today().isoformat(), **(extra or {}), "rows": rows}
    slug = re.sub(r"[^A-Za-z0-9]+", "_", kind).strip("_").lower()
    path = os.path.join(os.path.dirname(__file__), "results", f"{bench}-{slug}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    return path


def markdown(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def count_kernels(compiled) -> dict:
    """Kernels in a compiled executable's entry computation: fusions and custom calls (what a
    GPU launches), and every non-trivial entry instruction."""
    text = compiled.as_text()
    entry = text[text.index("ENTRY"):]
    entry = entry[:entry.index("\n}")]
    ops = re.findall(r"=\s*\S+\s+([a-z\-]+)\(", entry)
    trivial = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}
    return {"fusions_and_custom_calls": sum(o in ("fusion", "custom-call") for o in ops),
            "entry_ops": sum(o not in trivial for o in ops)}
