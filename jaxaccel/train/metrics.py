"""Metrics sinks: JSON lines and TensorBoard event files, written by process 0 only."""
from __future__ import annotations

import json
import os
import sys
import time

import jax


def _summary_writer():
    """tensorboardX's ``SummaryWriter``, imported without torch: tensorboardX imports torch
    where it is installed only to accept torch tensors (over a second at every run's start,
    with torch the size it is); the values written here are floats. Where torch or tensorboardX
    is already imported, nothing changes."""
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None         # `import torch` raises ImportError, which it catches
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """Append ``{"step", "time", **metrics}`` records to ``metrics.jsonl`` and TensorBoard."""

    def __init__(self, run_dir: str, tensorboard: bool = True):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._tb = None
        if self.enabled:
            os.makedirs(run_dir, exist_ok=True)
            if tensorboard:
                self._tb = _summary_writer()(os.path.join(run_dir, "tensorboard"))

    def write(self, step: int, metrics: dict, prefix: str = "") -> None:
        if not self.enabled:
            return
        record = {"step": int(step), "time": time.time()}
        record.update({f"{prefix}{k}": float(v) for k, v in metrics.items()})
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(f"{prefix}{k}", float(v), int(step))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
