"""Where a jitted program's device time goes: a profiler trace read back per HLO op and category.

    from bench.hlo_profile import profile_ops
    report = profile_ops(jitted_fn, *args, steps=5)      # fn already compiled for these args
    print(report.table(top=25))

``profile_ops`` runs the function under ``jax.profiler.trace``, reads the Perfetto trace it
writes (the device's "XLA Ops" line, or its kernel streams), sums the time of every HLO op
and puts each op in a category read off the optimized HLO (matmul, attention, scatter,
reduction, rng, copy/transpose, elementwise, ...). Times are per call (total / steps).
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import tempfile

import jax

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def hlo_index(hlo_text: str) -> tuple[dict, dict]:
    """``(instructions, computations)``: instruction name -> (opcode, rest of line), and
    computation name -> opcodes used in it (called computations included)."""
    instrs, comps, calls, current = {}, collections.defaultdict(set), {}, None
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("{")[0]:
            current = m.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, _, op, rest = m.groups()
        instrs[name] = (op, rest)
        if current is not None:
            comps[current].add(op)
            for c in re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", rest):
                calls.setdefault(current, set()).add(c)

    def closure(c, seen=()):
        ops = set(comps.get(c, ()))
        for d in calls.get(c, ()):
            if d not in seen:
                ops |= closure(d, seen + (c,))
        return ops
    return instrs, {c: closure(c) for c in comps}


def categorize(name: str, instrs: dict, comps: dict) -> str:
    """The category of HLO instruction ``name`` (a fusion is judged by what it contains)."""
    if name not in instrs:
        return "other"
    op, rest = instrs[name]
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        target = target.group(1) if target else ""
        if "fmha" in target or "cudnn$fmha" in target:
            return "attention (cuDNN)"
        if "triton" in target.lower() or "tpu_custom_call" in target or "mosaic" in target:
            return "pallas kernel"
        if "gemm" in target.lower() or "cublas" in target.lower() or "matmul" in target:
            return "matmul"
        if "threefry" in target:
            return "rng"
        return f"custom-call {target}"
    inner = set()
    for c in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", rest):
        inner |= comps.get(c, set())
    ops = inner | {op}
    if "__triton_gemm" in rest or "dot" in ops or "convolution" in ops:
        return "matmul"
    if "scatter" in ops:
        return "scatter"
    if "rng-bit-generator" in ops or "rng" in ops:
        return "rng"
    if "reduce" in ops or "reduce-window" in ops:
        return "reduction"
    if ops <= {"copy", "transpose", "bitcast", "parameter", "tuple", "get-tuple-element",
               "fusion", "slice", "concatenate", "pad", "dynamic-slice",
               "dynamic-update-slice", "reshape", "broadcast"}:
        return "copy/transpose/slice"
    if op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
              "collective-permute"):
        return "collective"
    return "elementwise"


@dataclasses.dataclass
class OpProfile:
    steps: int
    per_op: dict          # op name -> (seconds per step, calls per step, category)
    source: str           # which trace line the times came from

    @property
    def total_s(self) -> float:
        return sum(t for t, _, _ in self.per_op.values())

    def by_category(self) -> dict:
        out = collections.defaultdict(lambda: [0.0, 0])
        for t, n, c in self.per_op.values():
            out[c][0] += t
            out[c][1] += n
        return dict(sorted(out.items(), key=lambda kv: -kv[1][0]))

    def rows(self) -> list[dict]:
        total = self.total_s or 1.0
        return [{"category": c, "ms": t * 1e3, "share": t / total, "kernels": n}
                for c, (t, n) in self.by_category().items()]

    def table(self, top: int = 20) -> str:
        lines = [f"device time {self.total_s * 1e3:.2f} ms per call ({self.source})",
                 "| category | ms | share | kernels |", "|---|---|---|---|"]
        lines += [f"| {r['category']} | {r['ms']:.2f} | {r['share']:.1%} | {r['kernels']:.0f} |"
                  for r in self.rows()]
        lines += ["", "| op | ms | calls | category |", "|---|---|---|---|"]
        ranked = sorted(self.per_op.items(), key=lambda kv: -kv[1][0])[:top]
        lines += [f"| {k} | {t * 1e3:.3f} | {n:.0f} | {c} |" for k, (t, n, c) in ranked]
        return "\n".join(lines)


def _all_events(trace) -> list:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _device_events(trace: dict):
    """(events by thread name) for device processes of a Perfetto/Chrome trace."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pnames, tnames = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pnames[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            tnames[(e["pid"], e["tid"])] = e["args"]["name"]
    threads = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        pname = pnames.get(e["pid"], "")
        if "/device:" not in pname or "CPU" in pname.upper() and "GPU" not in pname.upper():
            continue
        threads[tnames.get((e["pid"], e["tid"]), str(e["tid"]))].append(e)
    return threads


def _trace(fn, args, steps: int, trace_dir: str) -> dict:
    """The Perfetto trace (parsed JSON) of ``steps`` calls of ``fn(*args)``, written under
    ``trace_dir``."""
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(steps):
            out = fn(*args)
        jax.block_until_ready(out)
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    if not files:
        raise RuntimeError(f"the profiler wrote no Perfetto trace under {trace_dir}.")
    with gzip.open(files[-1], "rt") as f:
        return json.load(f)


def profile_ops(fn, *args, steps: int = 5, hlo_text: str | None = None,
                trace_dir: str | None = None) -> OpProfile:
    """Per-op device time of ``fn(*args)`` (a jitted function; compiled before the trace)."""
    if hlo_text is None:
        hlo_text = fn.lower(*args).compile().as_text()
    instrs, comps = hlo_index(hlo_text)
    jax.block_until_ready(fn(*args))
    if trace_dir is None:      # nobody asked to keep the trace: read it, then remove it
        with tempfile.TemporaryDirectory(prefix="jaxaccel-trace-") as tmp:
            trace = _trace(fn, args, steps, tmp)
    else:
        trace = _trace(fn, args, steps, trace_dir)
    threads = _device_events(trace)
    ops_line = [t for t in threads if t == "XLA Ops"]
    if ops_line:
        chosen, source = threads[ops_line[0]], "XLA Ops line"
    elif any("Stream" in t for t in threads):
        chosen = [e for t, ev in threads.items() if "Stream" in t for e in ev]
        source = "kernel streams"
    else:                      # CPU: the host threads that execute the program's ops
        chosen = [e for e in _all_events(trace) if e["name"].lstrip("%") in instrs]
        source = "host threads"
    per_op = collections.defaultdict(lambda: [0.0, 0])
    for e in chosen:
        name = (e.get("args") or {}).get("hlo_op") or e["name"]
        name = name.lstrip("%")
        per_op[name][0] += e["dur"] * 1e-6 / steps
        per_op[name][1] += 1 / steps
    return OpProfile(steps, {k: (t, n, categorize(k, instrs, comps))
                             for k, (t, n) in per_op.items()}, source)
