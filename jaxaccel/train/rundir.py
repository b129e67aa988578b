"""The run folder: one writer at a time, never two runs mixed, and everything eval needs.

The folder is a local path or a bucket URL (``gs://``, ``s3://``: ``jaxaccel.storage``), the
same layout in both; in a bucket the library log is kept locally (``library_log_path``) and
``metrics.jsonl`` and TensorBoard are uploaded at every checkpoint (``train.metrics``).

    {workdir}/{name}/
        lock                  {"pid", "host", "started"} of the trainer writing here
        config.json           the config of the run (written only after the checks below
                              and the resume's own: the checkpoint's step within the run)
        library.log           what Orbax, absl and TensorStore log (a failed read's
                              tracebacks); the console gets one line per problem (a reader
                              that cannot write the folder logs to ~/.cache/jaxaccel/logs/
                              instead, and says so: ``library_log_path``)
        tokenizer/            the tokenizer's files (predict needs nothing else)
        data.json             what the training split was read from (its files' paths, sizes
                              and modification times), so a resume says what changed
        checkpoints/STEP/     Orbax checkpoints; each one's JSON record holds the config, the
                              model architecture and the label names
        skipped_checkpoints/  checkpoints set aside (unreadable, or parameters that gave a
                              non-finite loss), with a .reason.txt each
        metrics.jsonl, tensorboard/

Rules:

* **One writer.** ``runlock.RunLock`` creates ``lock`` exclusively (``O_CREAT | O_EXCL``). A
  lock left by a process that no longer exists on this host is stale and is taken over (with a
  warning); one held by a live process, or by another host, is refused with its pid/host. In a
  bucket the lock is renewed by its trainer and stale once not renewed for a lease (a
  preempted VM's). Readers (eval, predict) take no lock.
* **Never mix runs.** ``train.resume=false`` on a folder that has checkpoints is refused
  unless ``train.overwrite=true``, which first deletes the folder's run files (checkpoints,
  metrics, config, tokenizer) so the new run starts clean. So is a resume of a folder that
  holds a run's metrics but no checkpoint step (it would start again at step 0 and append to
  the old run's metrics).
* **Resume only the same run.** Before anything is written, the new config is compared with
  the saved ``config.json`` (if it is missing, with the config recorded beside the newest
  checkpoint step). Keys that only change how the run is observed, stored or laid
  out on devices may change (``RESUMABLE``); so may the length of the run
  (``train.epochs``, ``train.max_steps``): the learning-rate schedule is always defined over
  the run's total steps (``max_steps``, else ``epochs x steps per epoch``; warm-up
  ``warmup_ratio x total``), so a longer run continues from the saved step on the schedule of
  the new total (the rate there is logged), exactly as a fresh run of the new length would be
  at that step. Any other change (model, optimizer, data, seed, precision) is refused with the
  list of differing keys.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import sys
import tempfile

from jaxaccel import storage
from jaxaccel.config import BASE
from jaxaccel.data.tokencache import source_changes

log = logging.getLogger("jaxaccel")

RESUMABLE = frozenset({
    "name", "workdir", "compilation_cache",
    "train.epochs", "train.max_steps", "train.eval_batch_size", "train.log_every",
    "train.checkpoint_every", "train.keep_checkpoints", "train.resume", "train.overwrite",
    "train.eval_every_epoch", "train.progress", "train.optimizer_impl", "train.flat_params",
    "train.unpad", "train.microbatches",
    "model.attention_impl", "model.remat", "model.checkpoint", "model.tokenizer",
    "model.pipeline_repeats", "model.scan_layers",
    "data.data_dir", "data.manual_dir", "data.eval_split", "data.cache_dir", "data.workers",
    "data.train_examples", "data.train_tokens",
    "mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.stage", "sharding.zero1",
})
"""Config keys a resumed run may change: run length, observation, storage, device layout,
kernel choice, unpadding (the same numbers up to summation order), where the token cache is
and how many processes build it, the counts a plan reads, trainer path
(``train.flat_params``: the flat-buffer and the optax Adan resume
each other's checkpoints, which hold the per-parameter form), the pipeline (``mesh.stage``,
``train.microbatches``, ``model.pipeline_repeats``: a pipelined step is the plain step, and its
checkpoint the per-layer form), scanned layers (``model.scan_layers``: likewise) and where
files are (checkpoints are portable across meshes and kernels)."""

RUN_FILES = ("checkpoints", "skipped_checkpoints", "metrics.jsonl", "tensorboard",
             "config.json", "tokenizer", "data.json")
LIBRARY_LOG = "library.log"     # kept by train.overwrite, like the lock: the folder's history
COMMIT_FILE = "commit_success.txt"  # Orbax's last file of a step saved where nothing is renamed


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
    """``{dotted key: (saved value, new value)}`` for every key that differs. A key the saved
    config lacks because it was added to the base config later stands for its base default
    (the value the run had before the key existed); any other key missing on one side shows
    as ``"<absent>"``."""
    b = _flat(new)
    a = {**{k: v for k, v in _flat(BASE).items() if k in b}, **_flat(saved)}
    absent = "<absent>"
    return {k: (a.get(k, absent), b.get(k, absent)) for k in sorted(a.keys() | b.keys())
            if a.get(k, absent) != b.get(k, absent)}


def check_resume_config(saved: dict, new: dict,
                        source: str = "config.json") -> dict[str, tuple]:
    """The changes of ``new`` against ``saved`` (read from ``source``) that a resume allows;
    ``RunFolderError`` listing the others if there are any."""
    changes = config_changes(saved, new)
    refused = {k: v for k, v in changes.items() if k not in RESUMABLE}
    if refused:
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in refused.items())
        raise RunFolderError(
            f"cannot resume: the config differs from the run's saved {source} in {listed}. "
            f"A resumed run may change only {sorted(RESUMABLE)}. Start a new run (another "
            "name=...), or train.resume=false train.overwrite=true to replace this one.")
    return changes


def _step_folders(run_dir: str, finished: bool = True) -> list[str]:
    """The checkpoint step folders of ``run_dir``, newest first: the finished ones, or with
    ``finished=False`` the unfinished ones too (Orbax's temporary ``STEP.orbax-checkpoint-tmp-*``
    on a local disk; in a bucket, a step folder without its commit file)."""
    ckpts = storage.join(run_dir, "checkpoints")
    names = storage.listdir(ckpts)
    steps = sorted((e for e in names if e.split(".")[0].isdigit()),
                   key=lambda e: int(e.split(".")[0]), reverse=True)
    if finished:
        steps = [e for e in steps if e.isdigit() and checkpoint_finished(storage.join(ckpts, e))]
    return steps


def checkpoint_finished(step_folder: str) -> bool:
    """Whether the checkpoint step folder ``step_folder`` was completely written: on a local
    disk every step folder is (Orbax renames it into place when complete); in a bucket, where
    nothing is renamed, Orbax writes ``commit_success.txt`` into it last."""
    return not storage.is_url(step_folder) or storage.exists(
        storage.join(step_folder, COMMIT_FILE))


def has_run(run_dir: str) -> bool:
    """Whether ``run_dir`` holds a run's outputs (a step folder, or metrics)."""
    return bool(_step_folders(run_dir, finished=False)) or storage.exists(
        storage.join(run_dir, "metrics.jsonl"))


def saved_config(run_dir: str) -> tuple[dict, str] | None:
    """``(config, where it was read)``: the run's ``config.json``, else the config recorded
    beside its newest checkpoint step that has a readable record (every save writes one);
    ``None`` if neither exists. ``RunFolderError`` if ``config.json`` exists but is not
    readable."""
    path = storage.join(run_dir, "config.json")
    if storage.exists(path):
        try:
            return storage.read_json(path), path
        except (OSError, ValueError) as e:
            raise RunFolderError(f"cannot read {path} to compare configs before resuming: "
                                 f"{e}. Restore the file or start a new run.") from None
    for step in _step_folders(run_dir):
        record = storage.join(run_dir, "checkpoints", step, "meta", "metadata")
        try:
            return storage.read_json(record)["config"], f"checkpoint record {record}"
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def run_folder(path: str) -> str:
    """The absolute run folder ``path`` names (the folder itself, or its checkpoints/ folder),
    or ``FileNotFoundError`` if it has no checkpoints/ folder: the form every command that
    reads a run (eval, predict, generate, ``model.init_from``) takes."""
    storage.check(path, "--checkpoint")
    path = storage.absolute(path)
    if storage.basename(path) == "checkpoints":
        path = storage.parent(path)
    if not storage.isdir(storage.join(path, "checkpoints")):
        raise FileNotFoundError(f"{path!r} is not a run folder: it has no checkpoints/ "
                                "folder. Pass the folder `jaxaccel train` printed.")
    return path


def make_run_dir(run_dir: str) -> None:
    """Create ``run_dir``, or raise ``RunFolderError`` saying why it cannot be written (in a
    bucket: it does not exist, no credentials, no permission to write, not reachable)."""
    if storage.is_url(run_dir):
        try:
            storage.writable(run_dir)
        except OSError as e:
            raise RunFolderError(f"cannot write the run folder: {e}") from None
        return
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


def remove_if_unused(run_dir: str) -> None:
    """Remove ``run_dir`` if it holds no run (``has_run``: no checkpoint step, no metrics), as
    a command that created it and then was refused leaves it (only its lock, log, tokenizer
    or an empty checkpoints folder): a refused command changes nothing."""
    if storage.isdir(run_dir) and not has_run(run_dir):
        storage.rmtree(run_dir)


def prepare(run_dir: str, cfg: dict) -> dict[str, tuple]:
    """Apply the resume/overwrite rules to ``run_dir`` (held under its lock) before the run
    writes anything; returns the config changes a resume accepted (empty otherwise)."""
    t = cfg["train"]
    if not has_run(run_dir):
        return {}
    if t["overwrite"]:
        for name in RUN_FILES:
            path = storage.join(run_dir, name)
            if storage.isdir(path):
                storage.rmtree(path)
            elif storage.exists(path):
                storage.remove(path)
        log.warning("train.overwrite=true: deleted the previous run's files in %s", run_dir)
        return {}
    if not t["resume"]:
        raise RunFolderError(
            f"run folder {run_dir!r} already holds a run (checkpoints/metrics) and "
            "train.resume=false: pass a new name=... (or workdir=...) for a new run, "
            "train.resume=true to continue it, or train.overwrite=true to replace it.")
    if not _step_folders(run_dir):
        raise RunFolderError(
            f"run folder {run_dir!r} holds a run's outputs (metrics, or an unfinished save) but "
            "no finished checkpoint to resume from: resuming would start again at step 0 and "
            "append to the old run's metrics.jsonl. Pass train.overwrite=true to replace that run, or a new "
            "name=... (or workdir=...).")
    saved = saved_config(run_dir)
    return {} if saved is None else check_resume_config(saved[0], cfg, source=saved[1])


def write_files(run_dir: str, cfg: dict, tokenizer, data: dict | None = None,
                data_files: dict | None = None) -> None:
    """``config.json``, the tokenizer's files and the data's (``data_files``, ``{name: JSON
    object}``: an images run's ``preprocessor_config.json``), so eval/predict/export need only
    the run folder; ``data.json``: the training split's identity ``data``, where the source has
    one."""
    storage.write_json(storage.join(run_dir, "config.json"), cfg)
    if data is not None:
        storage.write_text(storage.join(run_dir, "data.json"), json.dumps(data, default=str))
    for name, obj in (data_files or {}).items():
        storage.write_json(storage.join(run_dir, name), obj)
    if tokenizer is None:
        return
    if not storage.is_url(run_dir):
        tokenizer.save_pretrained(os.path.join(run_dir, "tokenizer"))
        return
    with tempfile.TemporaryDirectory(prefix="jaxaccel-tokenizer-") as local:
        tokenizer.save_pretrained(local)
        storage.upload(local, storage.join(run_dir, "tokenizer"))


def data_changes(run_dir: str, data: dict | None) -> str:
    """How the training split's identity ``data`` differs from the one ``data.json`` recorded
    ("" where it does not, or either is unknown)."""
    try:
        old = storage.read_json(storage.join(run_dir, "data.json"))
    except (OSError, ValueError):
        return ""
    new = None if data is None else json.loads(json.dumps(data, default=str))
    return "" if new is None or old == new else source_changes(old, new)


LIBRARY_LOGGERS = ("absl", "orbax", "tensorstore", "asyncio", "jaxaccel.details", "gcsfs",
                   "s3fs", "aiobotocore", "botocore", "fsspec")
"""Loggers whose records go to ``library.log``: Orbax (through absl), TensorStore, asyncio
(Orbax's event loops), the bucket clients (gcsfs logs each request out of retries with its
traceback; jaxaccel's own line says what failed), and the tracebacks jaxaccel keeps out of the
console."""


def writable(folder: str) -> bool:
    """Whether this process may create files in ``folder`` (``library_log``): ``os.access``,
    which a read-only mount fails for every user, and permissions for all but root (a test
    running as root puts its own answer here)."""
    return os.access(folder, os.W_OK | os.X_OK)


def library_log_path(run_dir: str, environ=os.environ) -> str | None:
    """Where ``library_log`` appends for ``run_dir``: its ``library.log``; for a run folder
    this process cannot write (eval, predict or generate of a read-only copy),
    ``$XDG_CACHE_HOME/jaxaccel/logs/NAME-HASH.library.log`` (``~/.cache`` without
    XDG_CACHE_HOME; NAME the run folder's, HASH of its full path, so that two folders of one
    name do not share a log); None if that cannot be written either."""
    if not storage.is_url(run_dir) and writable(run_dir):
        return os.path.join(run_dir, LIBRARY_LOG)
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(base, "jaxaccel", "logs")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None
    if not writable(folder):
        return None
    run_dir = storage.absolute(run_dir)
    digest = hashlib.sha256(run_dir.encode()).hexdigest()[:8]
    return os.path.join(folder, f"{storage.basename(run_dir)}-{digest}.{LIBRARY_LOG}")


@contextlib.contextmanager
def library_log(run_dir: str):
    """Within the block, what ``LIBRARY_LOGGERS`` log (warnings and errors, with their
    tracebacks) is appended to ``library_log_path(run_dir)`` (the run folder's
    ``library.log``) instead of the console, where jaxaccel's own one-line messages stay; at
    the end one line says where the errors and tracebacks went, if there were any. A run
    folder this process cannot write is still read (eval, predict, generate): one line says
    where its log goes instead (or that logging stays on the console, if nowhere can be
    written)."""
    path = library_log_path(run_dir)
    if path != os.path.join(run_dir, LIBRARY_LOG):
        log.info("the run folder %s is %s: what Orbax/absl/TensorStore log goes to %s instead "
                 "of its %s", run_dir, "in a bucket" if storage.is_url(run_dir) else
                 "not writable", path or "the console", LIBRARY_LOG)
    if path is None:
        yield None
        return
    handler = logging.FileHandler(path, delay=True)      # created only if something is logged
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    count = [0]

    def counted(record):
        count[0] += record.levelno >= logging.ERROR or bool(record.exc_info)
        return True
    handler.addFilter(counted)
    loggers = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    before = [(lg.propagate, lg.level) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
        lg.setLevel(min(lg.getEffectiveLevel(), logging.WARNING))

    def unraisable(u):
        # Orbax's reads leave coroutines whose errors Python prints as "Exception ignored in"
        # (tens of lines each, TensorStore specs included): the log's too.
        logging.getLogger("jaxaccel.details").warning(
            "%s: %r", u.err_msg or "Exception ignored in", u.object,
            exc_info=(u.exc_type, u.exc_value, u.exc_traceback))
    hook, sys.unraisablehook = sys.unraisablehook, unraisable
    try:
        yield path
    finally:
        # A failed read's coroutines may still wait in reference cycles: finalise them while
        # the hook holds, so their reports come here, not on the console at some later GC.
        gc.collect()
        sys.unraisablehook = hook
        for lg, (propagate, level) in zip(loggers, before):
            lg.removeHandler(handler)
            lg.propagate = propagate
            lg.setLevel(level)
        handler.close()
        if count[0]:
            log.info("Orbax/absl/TensorStore logged %d error(s) or traceback(s), kept off the "
                     "console: they are in %s", count[0], path)
