"""How much of each kind of collective a scheduled HLO module overlaps with compute, read from
its optimized text (``compiled.as_text()``): the instructions of a computation are listed in the
order they run.

    summary = overlap(hlo, devices)     # kind -> {"bytes", "overlapped", "exposed", ...}

A collective runs asynchronously in one of three forms:

- an ``<kind>-start`` / ``<kind>-done`` pair (``collective-permute-start``), or a collective
  wrapped in ``async-start`` / ``async-done`` (its computation named by ``calls=``);
- the TPU compiler's async collective fusions: a chain of fusions in one computation, each
  calling a computation that holds a clone of the collective (same ``channel_id``): the first
  starts it (``%async-collective-start``), the last finishes it (``%async-collective-done``),
  those between do compute while it runs;
- any other collective instruction, or a fusion holding one alone (the TPU compiler's fused
  reduce-scatter), runs synchronously: nothing overlaps it.

An asynchronous collective is *overlapped* when at least one compute instruction (a fusion,
convolution, dot or custom call that is not itself the start or end of another collective) runs
between its start and its end, else *exposed*. Bytes are counted as ``jaxaccel.plan.collectives``
counts them (the result on one device; a fused reduce-scatter 1/n of its all-reduce), times the
runs of the computation holding the collective (``jaxaccel.plan.loops.runs``: loop trips).
Transfers between TPU slices (the multi-slice runtime's ``send``/``recv``) are left out.
"""
from __future__ import annotations

from typing import NamedTuple

from jaxaccel.plan import loops
from jaxaccel.plan.collectives import KINDS, group_size, result
from jaxaccel.plan.hlo_cost import array_bytes

COMPUTE = ("fusion", "convolution", "dot", "custom-call")
_PAIRED = tuple(k + "-start" for k in KINDS) + ("async-start",)


class Async(NamedTuple):
    kind: str           # one of KINDS
    bytes: int          # its result on one device, per run of its computation
    computation: str    # the computation that starts and ends it
    runs: int           # runs of that computation per run of the module
    between: int        # compute instructions scheduled between its start and its end
    synchronous: bool   # no start and end: nothing can run beside it


def _held(computations: dict, name: str, devices: int):
    """``(kind, bytes, channel)`` of the collective computation ``name`` holds, else None."""
    for i in computations.get(name, {}).values():
        if i.opcode in KINDS:
            kind, size = result(i.opcode, i.shape, name, group_size(i.attributes, devices))
            channel = i.attributes.partition("channel_id=")[2].partition(",")[0]
            return kind, size, channel
    return None


def _collective(computations: dict, i, devices: int):
    """``(kind, bytes, key, phase)`` of an instruction that starts, ends or is a collective:
    phase ``start`` or ``done`` (of a pair: ``key`` the start's name, ``kind`` and ``bytes``
    None where its start tells), ``fused`` (a fusion holding one: ``key`` its channel) or
    ``sync``; None for any other instruction."""
    if i.opcode in KINDS:
        return i.opcode, array_bytes(i.shape), i.name, "sync"
    held = _held(computations, dict(loops.callees(i)).get("calls", ""), devices)
    if i.opcode in _PAIRED:
        kind = held[0] if held else i.opcode[:-len("-start")]
        return (kind, held[1] if held else None, i.name, "start") if kind in KINDS else None
    if i.opcode.endswith(("-done", "-update")) and i.operands:
        return None, None, i.operands[0], "done" if i.opcode.endswith("-done") else "update"
    if i.opcode == "fusion" and held:
        return held[0], held[1], held[2] or i.name, "fused"     # no channel: a chain of one
    return None


def scheduled(hlo: str, devices: int = 1) -> list[Async]:
    """Every collective of the module with what runs beside it (module docstring)."""
    computations, _ = loops.parse(hlo)
    times = loops.runs(hlo)
    fused = {c for found in computations.values() for i in found.values()
             if i.opcode in ("fusion", "async-start") for _, c in loops.callees(i)}
    return [c for name, found in computations.items() if name not in fused
            for c in _in_order(computations, name, list(found.values()), times.get(name, 1),
                               devices)]


def _in_order(computations: dict, name: str, order: list, runs: int, devices: int) -> list:
    """The collectives of one scheduled computation, its instructions ``order``: each with the
    compute instructions between its start and its end (module docstring)."""
    seen, starts, spans, chains, out = [], {}, [], {}, []
    for at, i in enumerate(order):
        seen.append(c := _collective(computations, i, devices))
        kind, size, key, phase = c or (None, None, None, None)
        if phase == "sync":
            out.append(Async(kind, size, name, runs, 0, True))
        elif phase == "start":
            starts[key] = (at, kind, size)
        elif phase == "update" and key in starts:
            starts[i.name] = starts.pop(key)
        elif phase == "done" and key in starts:
            start, kind, size = starts.pop(key)
            spans.append((start, at, kind, array_bytes(i.shape) if size is None else size, None))
        elif phase == "fused":
            chains.setdefault(key, [at, at, kind, size])[1] = at
    spans += [(*chain, key) for key, chain in chains.items()]
    for s, e, kind, size, channel in spans:
        between = sum(1 for k in range(s + 1, e) if order[k].opcode in COMPUTE and (
            seen[k] is None or channel is not None and seen[k][2:] == (channel, "fused")))
        out.append(Async(kind, size, name, runs, between, s == e))
    return out


def overlap(hlo: str, devices: int = 1) -> dict:
    """Per kind of collective: bytes per run of the module (``bytes``), those of asynchronous
    collectives with compute between start and end (``overlapped``), of those with none
    (``exposed``), of synchronous ones (``synchronous``), and how many of each there are
    (``count``: per run of the module)."""
    out = {k: dict.fromkeys(("bytes", "overlapped", "exposed", "synchronous", "count"), 0)
           for k in KINDS}
    for c in scheduled(hlo, devices):
        row, size = out[c.kind], c.bytes * c.runs
        row["bytes"] += size
        row["count"] += c.runs
        row["synchronous" if c.synchronous else "overlapped" if c.between else "exposed"] += size
    return out
