"""Metrics sinks: JSON lines and TensorBoard event files, written by process 0 only (on a local
disk, or staged locally and uploaded to a bucket)."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import jax

from jaxaccel import storage
from jaxaccel.train import confusion


UNUSED_BY_TENSORBOARDX = ("torch", "boto3", "google.cloud.storage")
"""What tensorboardX imports at its own import where installed, and never uses here: torch
(to accept torch tensors: over a second with torch the size it is; the values written here are
floats and numpy arrays), boto3 and Google's storage client (its writers of ``s3://`` and
``gs://`` event files: 0.4-0.8 s; a run in a bucket writes its events locally and uploads
them)."""


def _summary_writer():
    """tensorboardX's ``SummaryWriter``, imported without ``UNUSED_BY_TENSORBOARDX`` (each
    ``import`` of them raises ImportError, which tensorboardX catches). What is imported
    already stays; where tensorboardX is, nothing changes."""
    blocked = [] if "tensorboardX" in sys.modules else [
        m for m in UNUSED_BY_TENSORBOARDX if m not in sys.modules]
    for module in blocked:
        sys.modules[module] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        for module in blocked:
            del sys.modules[module]
    return SummaryWriter


class MetricsWriter:
    """Append ``{"step", "time", **metrics}`` records to ``metrics.jsonl`` and TensorBoard (its
    scalars; a list, e.g. per-class F1, only in ``metrics.jsonl``).

    In a bucket (``run_dir`` a URL), where an object cannot be appended to, both are written
    in a local folder and uploaded whole at every ``flush`` (the loop's checkpoints) and at
    ``close``; a resumed run first takes the bucket's ``metrics.jsonl`` back. A run killed
    without warning loses the lines since its last checkpoint, which its resume writes again;
    one whose bucket fails keeps the local folder and names it."""

    def __init__(self, run_dir: str, tensorboard: bool = True):
        self.enabled = jax.process_index() == 0
        self.run_dir, self.path = run_dir, storage.join(run_dir, "metrics.jsonl")
        self._tb, self._staging = None, None
        if not self.enabled:
            return
        local = run_dir
        if storage.is_url(run_dir):
            local = self._staging = tempfile.mkdtemp(prefix="jaxaccel-metrics-")
            if storage.exists(self.path):
                with open(os.path.join(local, "metrics.jsonl"), "wb") as f:
                    f.write(storage.read_bytes(self.path))
        else:
            os.makedirs(run_dir, exist_ok=True)
        self._file = os.path.join(local, "metrics.jsonl")
        if tensorboard:
            self._tb = _summary_writer()(os.path.join(local, "tensorboard"))

    def write(self, step: int, metrics: dict, prefix: str = "") -> None:
        if not self.enabled:
            return
        record = {"step": int(step), "time": time.time()}
        record.update({f"{prefix}{k}": float(v) if _scalar(v) else v
                       for k, v in metrics.items()})
        with open(self._file, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if _scalar(v):
                    self._tb.add_scalar(f"{prefix}{k}", float(v), int(step))

    def write_eval(self, step: int, report: dict) -> None:
        """An evaluation's report under ``eval/``; a classifier's confusion matrix also drawn,
        as ``confusion.PNG_NAME`` in the run folder (the latest evaluation's) and as the
        TensorBoard image ``eval/confusion_matrix`` at ``step``."""
        self.write(step, report, prefix="eval/")
        if not self.enabled or "confusion_matrix" not in report:
            return
        fig = confusion.figure(report["confusion_matrix"], report["label_names"],
                               f"step {step}: accuracy {report['accuracy']:.3f}, "
                               f"macro-F1 {report['macro_f1']:.3f}")
        storage.write_bytes(storage.join(self.run_dir, confusion.PNG_NAME), confusion.png(fig))
        if self._tb is not None:
            self._tb.add_image("eval/confusion_matrix", confusion.rgb(fig), int(step),
                               dataformats="HWC")

    def flush(self) -> None:
        """Upload what was written to the run folder in a bucket (local files are written
        through already)."""
        if self._staging is None:
            return
        if self._tb is not None:
            self._tb.flush()
        if os.path.exists(self._file):
            with open(self._file, "rb") as f:
                storage.write_bytes(self.path, f.read())
        events = os.path.join(self._staging, "tensorboard")
        if os.path.isdir(events):
            storage.upload(events, storage.join(self.run_dir, "tensorboard"))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._staging is None:
            return
        staging = self._staging
        try:
            self.flush()
        except storage.StorageError as e:     # the local copy is kept, and named
            raise storage.StorageError(f"{e} What was not uploaded is kept in {staging} "
                                       "(metrics.jsonl, tensorboard/).") from None
        finally:
            self._staging = None
        shutil.rmtree(staging, ignore_errors=True)


def _scalar(value) -> bool:
    """Whether a metric is one number (a TensorBoard scalar), not a list (per-class values,
    label names, a confusion matrix: kept as they are in ``metrics.jsonl``)."""
    return not isinstance(value, (list, tuple, str))


def read_metrics(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in
            storage.read_text(storage.join(run_dir, "metrics.jsonl")).splitlines()
            if line.strip()]
