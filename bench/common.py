"""Shared benchmark plumbing: timing by the measuring rules, energy, result JSON, Markdown.

Every row gets energy and utilisation: ``time_fn`` reads NVML's energy counter and samples
``utilization.gpu`` around its timed loop where NVML exists (jaxaccel/compare/energy.py);
``write_results`` fills every row still without an ``energy_source`` with the labelled TDP
estimate (utilisation = the row's MFU when known, else 1).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import subprocess
import sys
import sysconfig
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxaccel import storage  # noqa: E402
from jaxaccel.compare import energy  # noqa: E402

def device_kind() -> str:
    return jax.devices()[0].device_kind


def time_fn(fn, *args, warmup: int = 3, n: int = 20) -> dict:
    """Median/min/max seconds of ``fn(*args)`` after warm-up (compile excluded); with NVML also
    energy per call (``energy_j`` = counter difference / n), average power and GPU utilisation
    over the timed loop."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    with energy.Meter(jax.default_backend(), jax.local_device_count()) as meter:
        for _ in range(n):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
    out = {"median_s": float(np.median(times)), "min_s": float(np.min(times)),
           "max_s": float(np.max(times)), "n": n}
    return {**out, **per_call(meter, n)}


def per_call(meter: energy.Meter, n: int) -> dict:
    """What ``meter`` read over ``n`` calls, its energy per call."""
    got = {k: v for k, v in meter.result.items() if k != "seconds"}
    if "energy_j" in got:
        got["energy_j"] /= n
    return got


def timed(step):
    """An ``interleave`` side that runs in this process: ``run(indices)`` calls ``step(i)``
    (which returns once batch ``i``'s step is done: block on its outputs) per index and
    returns its ``(wall, process CPU)`` seconds per call."""
    def run(indices):
        out = []
        for i in indices:
            t0, c0 = time.perf_counter(), time.process_time()
            step(i)
            out.append((time.perf_counter() - t0, time.process_time() - c0))
        return out
    return run


def interleave(sides: dict, rounds: int, steps: int, warmup: int = 2) -> tuple[dict, dict]:
    """``(samples, first_call_s)`` of train steps of several sides on the same batches, timed
    in interleaved rounds. ``sides``: name -> ``run(indices) -> [(wall_s, cpu_s), ...]`` (one
    pair per batch index, each step timed on its own: ``timed``, or a child process that
    times its own steps). Each side first runs batches ``0 .. warmup - 1`` (compilation: the
    first call's wall time is ``first_call_s[name]``); then ``rounds`` rounds of ``steps``
    steps per side, round ``r`` on batches ``warmup + r * steps`` onwards, the sides in
    order on even rounds and in reverse on odd ones (no side always runs first, or right
    after the same neighbour, on a shared CPU)."""
    samples, first = {name: [] for name in sides}, {}
    for name, run in sides.items():
        first[name] = run(range(warmup))[0][0]
    for r in range(rounds):
        indices = range(warmup + r * steps, warmup + (r + 1) * steps)
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            samples[name] += sides[name](indices)
    return samples, first


def step_row(name: str, samples: list, first_call_s: float, tokens: int, work: dict) -> dict:
    """A result row of per-step ``(wall, cpu)`` samples: median/min/max wall seconds, the
    median process CPU seconds (``cpu_median_s``: the work done, less sensitive to other
    processes on a shared CPU than wall time), tokens/s at the median and ``work`` (what
    ``jaxaccel compare`` joins rows by)."""
    wall = [w for w, _ in samples]
    med = statistics.median(wall)
    return {"name": name, "median_s": med, "min_s": min(wall), "max_s": max(wall),
            "n": len(wall), "tokens_per_s": tokens / med, "first_call_s": first_call_s,
            "cpu_median_s": statistics.median(c for _, c in samples), "work": work}


def cache_dir() -> str:
    """``$XDG_CACHE_HOME/jaxaccel``, else ``~/.cache/jaxaccel``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxaccel")


def ensure_venv(version: str) -> str:
    """The python of a virtual environment with transformers ``version`` that sees this
    interpreter's packages (``cache_dir()/hf-flax-transformers-<version>``); made (with pip,
    from PyPI) when missing: pip installs transformers and its pins there, every other
    package comes from this interpreter's site-packages through a ``.pth``."""
    venv = os.path.join(cache_dir(), f"hf-flax-transformers-{version}")
    python = os.path.join(venv, "bin", "python")
    done = os.path.join(venv, ".installed")
    if not os.path.exists(done):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                                  "['purelib'])"], check=True, capture_output=True,
                                 text=True).stdout.strip()
        with open(os.path.join(purelib, "jaxaccel-shared.pth"), "w") as f:
            f.write(sysconfig.get_paths()["purelib"] + "\n")
        subprocess.run([python, "-m", "pip", "install", "-q", f"transformers=={version}"],
                       check=True)
        open(done, "w").close()
    return python


def energy_devices() -> int:
    """What the TDP table's watts multiply: local devices, or the usable cores of a CPU."""
    return energy.cpu_cores() if jax.default_backend() == "cpu" else jax.local_device_count()


def fill_energy(rows: list[dict], kind: str, devices: int) -> None:
    """Give every row without a measured energy the labelled TDP estimate (never a zero); a
    row without a time (a plan on a device without a peak) gets none."""
    for r in rows:
        seconds = r.get("time_s", r.get("median_s"))
        if "energy_source" not in r and seconds is not None:
            r.update(energy.estimate(kind, devices, seconds, r.get("mfu")))


def environment() -> dict:
    """Host, device kind and count, software versions: what makes two result files comparable."""
    import flax
    import jaxlib
    import optax
    return {"host": platform.node(), "platform": platform.platform(),
            "python": platform.python_version(), "device_count": jax.device_count(),
            "process_count": jax.process_count(), "energy_devices": energy_devices(),
            "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                         "flax": flax.__version__, "optax": optax.__version__}}


def git_sha() -> str:
    """The checkout's commit (``JAXACCEL_SHA`` where the copy has no .git, e.g. a device)."""
    if os.environ.get("JAXACCEL_SHA"):
        return os.environ["JAXACCEL_SHA"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        return "unknown"


DEFAULT_OUT = os.path.join("runs", "bench")
"""Where a measurement goes unless ``--out`` says: under the current folder, beside the runs
(``workdir``'s default); never ``bench/results/``, whose files are committed and change only
on purpose (``--out bench/results``)."""


def out_dir(path: str) -> str:
    """``--out``'s type: a folder that can be made and written
    (``jaxaccel.storage.check_out_dir``), checked when the flags are read, before any
    measurement."""
    from jaxaccel.storage import check_out_dir
    try:
        check_out_dir(path)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return path


def add_out_argument(parser) -> None:
    """Every suite's ``--out DIR``."""
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", type=out_dir,
                        help=f"folder for the result JSON (default: {DEFAULT_OUT}/ under the "
                        "current folder; bench/results only to update the committed results "
                        "on purpose)")


def write_results(bench: str, rows: list[dict], extra: dict | None = None,
                  stem: str | None = None, *, out: str) -> str:
    """Write ``<out>/<stem or bench>-<device>.json`` and return its absolute path. Rows without
    a measured energy get the labelled estimate first; ``energy_source`` at the top says
    ``nvml``, ``estimate:tdp`` or ``mixed``."""
    kind = device_kind()
    fill_energy(rows, kind, energy_devices())
    sources = sorted({r["energy_source"] for r in rows if "energy_source" in r})
    result = {"bench": bench, "device": kind, "backend": jax.default_backend(),
              "jax": jax.__version__, "jaxaccel": git_sha(),
              "date": datetime.date.today().isoformat(), **environment(),
              "energy_source": sources[0] if len(sources) == 1 else "mixed",
              **(extra or {}), "rows": rows}
    slug = re.sub(r"[^A-Za-z0-9]+", "_", kind).strip("_").lower()
    path = storage.join(storage.absolute(out), f"{stem or bench}-{slug}.json")
    storage.makedirs(storage.parent(path))
    storage.write_json(path, result)
    return path


def seconds_per_step(run, batches: list, warmup: int = 5) -> float:
    """Mean seconds of the trainer's step (``run``: a ``train.run.Run``) over ``batches`` (put
    on its devices) after the first ``warmup`` of them, the state carried from step to step."""
    state = run.state
    with jax.set_mesh(run.mesh):
        for b in batches[:warmup]:
            state, m = run.train_step(state, b)
        jax.block_until_ready(m)
        t0 = time.perf_counter()
        for b in batches[warmup:]:
            state, m = run.train_step(state, b)
        jax.block_until_ready(m)
    return (time.perf_counter() - t0) / (len(batches) - warmup)


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
