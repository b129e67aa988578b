"""The run folder: one writer at a time, never two runs mixed, and everything eval needs.

    {workdir}/{name}/
        lock                  {"pid", "host", "started"} of the trainer writing here
        config.json           the config of the run (written only after the checks below)
        tokenizer/            the tokenizer's files (predict needs nothing else)
        checkpoints/STEP/     Orbax checkpoints; each one's JSON record holds the config, the
                              model architecture and the label names
        skipped_checkpoints/  checkpoints set aside (unreadable, or parameters that gave a
                              non-finite loss), with a .reason.txt each
        metrics.jsonl, tensorboard/

Rules:

* **One writer.** ``RunLock`` creates ``lock`` exclusively (``O_CREAT | O_EXCL``). A lock
  left by a process that no longer exists on this host is stale and is taken over (with a
  warning); one held by a live process, or by another host, is refused with its pid/host.
  Readers (eval, predict) take no lock.
* **Never mix runs.** ``train.resume=false`` on a folder that has checkpoints is refused
  unless ``train.overwrite=true``, which first deletes the folder's run files (checkpoints,
  metrics, config, tokenizer) so the new run starts clean.
* **Resume only the same run.** Before anything is written, the new config is compared with
  the saved ``config.json``. Keys that only change how the run is observed, stored or laid
  out on devices may change (``RESUMABLE``); so may the length of the run
  (``train.epochs``, ``train.max_steps``): the learning-rate schedule is always defined over
  the run's total steps (``max_steps``, else ``epochs x steps per epoch``; warm-up
  ``warmup_ratio x total``), so a longer run continues from the saved step on the schedule of
  the new total (the rate there is logged), exactly as a fresh run of the new length would be
  at that step. Any other change (model, optimizer, data, seed, precision) is refused with the
  list of differing keys.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import socket
import time

log = logging.getLogger("jaxaccel")

RESUMABLE = frozenset({
    "name", "workdir", "compilation_cache",
    "train.epochs", "train.max_steps", "train.eval_batch_size", "train.log_every",
    "train.checkpoint_every", "train.keep_checkpoints", "train.resume", "train.overwrite",
    "train.eval_every_epoch", "train.progress", "train.optimizer_impl",
    "model.attention_impl", "model.remat", "model.checkpoint", "model.tokenizer",
    "data.data_dir", "data.manual_dir", "data.eval_split",
    "mesh.data", "mesh.fsdp", "mesh.tensor", "sharding.zero1",
})
"""Config keys a resumed run may change: run length, observation, storage, device layout,
kernel choice and where files are (checkpoints are portable across meshes and kernels)."""

RUN_FILES = ("checkpoints", "skipped_checkpoints", "metrics.jsonl", "tensorboard",
             "config.json", "tokenizer")


class RunFolderError(ValueError):
    """The run folder cannot be used as asked; the message says why and what to do."""


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def config_changes(saved: dict, new: dict) -> dict[str, tuple]:
    """``{dotted key: (saved value, new value)}`` for every key that differs (a key missing on
    one side, e.g. added to the base config later, shows as ``"<absent>"``)."""
    a, b = _flat(saved), _flat(new)
    absent = "<absent>"
    return {k: (a.get(k, absent), b.get(k, absent)) for k in sorted(a.keys() | b.keys())
            if a.get(k, absent) != b.get(k, absent)}


def check_resume_config(saved: dict, new: dict) -> dict[str, tuple]:
    """The changes of ``new`` against ``saved`` that a resume allows; ``RunFolderError``
    listing the others if there are any."""
    changes = config_changes(saved, new)
    refused = {k: v for k, v in changes.items() if k not in RESUMABLE}
    if refused:
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in refused.items())
        raise RunFolderError(
            f"cannot resume: the config differs from the run's saved config.json in {listed}. "
            f"A resumed run may change only {sorted(RESUMABLE)}. Start a new run (another "
            "name=...), or train.resume=false train.overwrite=true to replace this one.")
    return changes


def has_run(run_dir: str) -> bool:
    """Whether ``run_dir`` holds a run's outputs (a step folder, or metrics)."""
    ckpts = os.path.join(run_dir, "checkpoints")
    steps = os.path.isdir(ckpts) and any(e.split(".")[0].isdigit() for e in os.listdir(ckpts))
    return steps or os.path.exists(os.path.join(run_dir, "metrics.jsonl"))


def make_run_dir(run_dir: str) -> None:
    """Create ``run_dir``, or raise ``RunFolderError`` saying why it cannot be written."""
    try:
        os.makedirs(run_dir, exist_ok=True)
        probe = os.path.join(run_dir, f".write_test_{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise RunFolderError(f"cannot write the run folder {run_dir!r}: {e.strerror} "
                             f"({e.filename}). Choose a writable folder with workdir=... "
                             "(or another name=...).") from None


def prepare(run_dir: str, cfg: dict) -> dict[str, tuple]:
    """Apply the resume/overwrite rules to ``run_dir`` (held under its lock) before the run
    writes anything; returns the config changes a resume accepted (empty otherwise)."""
    t = cfg["train"]
    saved_path = os.path.join(run_dir, "config.json")
    if not has_run(run_dir):
        return {}
    if t["overwrite"]:
        for name in RUN_FILES:
            path = os.path.join(run_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
        log.warning("train.overwrite=true: deleted the previous run's files in %s", run_dir)
        return {}
    if not t["resume"]:
        raise RunFolderError(
            f"run folder {run_dir!r} already holds a run (checkpoints/metrics) and "
            "train.resume=false: pass a new name=... (or workdir=...) for a new run, "
            "train.resume=true to continue it, or train.overwrite=true to replace it.")
    if not os.path.exists(saved_path):
        return {}
    try:
        with open(saved_path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise RunFolderError(f"cannot read {saved_path} to compare configs before resuming: "
                             f"{e}. Restore the file or start a new run.") from None
    return check_resume_config(saved, cfg)


def write_files(run_dir: str, cfg: dict, tokenizer) -> None:
    """``config.json`` and the tokenizer's files, so eval/predict need only the run folder."""
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(run_dir, "tokenizer"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclasses.dataclass
class RunLock:
    """``with RunLock(run_dir):`` -- the one writer of ``run_dir`` (see the module doc)."""

    run_dir: str

    @property
    def path(self) -> str:
        return os.path.join(self.run_dir, "lock")

    def _holder(self) -> dict | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def acquire(self) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue                    # released meanwhile: try again
                stale = (holder.get("host") == me["host"] and isinstance(holder.get("pid"), int)
                         and not _alive(holder["pid"]))
                if not stale:
                    raise RunFolderError(
                        f"run folder {self.run_dir!r} is in use by another trainer (pid "
                        f"{holder.get('pid', '?')} on host {holder.get('host', '?')}, lock "
                        f"{self.path}). Wait for it, or use another name=...; if that process "
                        "is gone (e.g. its node died), delete the lock file.") from None
                log.warning("taking over the stale lock of pid %s (no longer running on %s)",
                            holder["pid"], holder["host"])
                os.remove(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            return
        raise RunFolderError(f"could not take the lock {self.path}; try again.")

    def release(self) -> None:
        holder = self._holder()
        if holder and holder.get("pid") == os.getpid():
            try:
                os.remove(self.path)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
