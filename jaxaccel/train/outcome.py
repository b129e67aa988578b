"""How a training run ended (``jaxaccel.train.loop.train``'s result): ``Completed``,
``Preempted`` (saved and stopped on a signal: resumable) or ``Diverged`` (a non-finite loss or
parameters, or too many skipped fp16 steps). Each is a frozen dataclass with its own fields;
``status`` names the kind.

Each also reads as its JSON record (a read-only mapping: ``result["status"]``,
``result["eval_accuracy"]``, ``dict(result)``), the record ``jaxaccel train`` prints: the
status, the run's paths, then the kind's fields in order, the final evaluation's metrics as
``eval_<name>``; an optional field (``advice``) is left out where it has no value.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outcome(Mapping):
    """What every ending has: the run folder, its checkpoints folder and metrics file."""

    status: ClassVar[str]
    run_dir: str
    checkpoint_dir: str
    metrics_file: str

    def record(self) -> dict:
        """The JSON record (what the mapping reads)."""
        out = {"status": self.status}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "eval":
                out.update({f"eval_{k}": v for k, v in value.items()})
            elif value is not None or not field.metadata.get("optional"):
                out[field.name] = value
        return out

    def __getitem__(self, key):
        return self.record()[key]

    def __iter__(self):
        return iter(self.record())

    def __len__(self) -> int:
        return len(self.record())


@dataclasses.dataclass(frozen=True, kw_only=True)
class Completed(Outcome):
    """Trained to the end: ``eval`` is the final evaluation (``Task.report``), ``summary``
    its line (``Task.summary``)."""

    status: ClassVar[str] = "completed"
    step: int
    task: str
    summary: str
    eval_split: str
    eval: dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preempted(Outcome):
    """Saved at ``step`` and stopped on ``signal`` (``"SIGTERM"``, ``"SIGINT"``): the same
    command resumes it."""

    status: ClassVar[str] = "preempted"
    signal: str
    step: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Diverged(Outcome):
    """Stopped at ``step`` by ``error``; ``last_good_checkpoint`` is the newest checkpoint
    kept as good (None: none was), ``advice`` the fix where the error does not name its own."""

    status: ClassVar[str] = "nonfinite"
    advice: str | None = dataclasses.field(default=None, metadata={"optional": True})
    error: str
    step: int
    last_good_checkpoint: int | None


__all__ = ["Completed", "Diverged", "Outcome", "Preempted"]
