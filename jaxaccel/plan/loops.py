"""The while loops of an optimized HLO module (``compiled.as_text()``) and how many times each of
its computations runs in one run of the module.

    for loop in loops(hlo): loop.body, loop.trips     # trips None: not readable
    times = runs(hlo)                                   # computation name -> runs

A loop's trips are XLA's ``known_trip_count`` where the compiler writes one (GPU, CPU), else
read off the loop as XLA's own trip-count analysis reads it: the condition compares one element
of the loop state with an integer constant (``i < N``, ``i <= N``, ``N > i``, ``i != N``; any
width, signed or unsigned), that element starts at a constant in the tuple the loop is given and
the body adds a constant to it. jax's loops (``scan``, ``fori_loop``) count from 0 by 1 in s32;
the TPU compiler's own loops do not always: its windowed FSDP matmuls count u32 from 0 to 4 by 2
(2 trips). Copies, bitcasts and converts between these instructions are looked through. A loop
whose trips cannot be read that way runs once here (as in XLA's cost analysis) and is listed
with ``trips`` None.

A computation runs as often as the instructions naming it run: a loop's body ``trips`` times and
its condition ``trips + 1`` times per run of the loop, any other callee (fusion, reducer, branch)
once per run of its caller, summed over its callers; the entry runs once.
"""
from __future__ import annotations

import functools
import math
import re
from typing import NamedTuple

# A computation's header "%name (params) -> shape {" at the start of a line.
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
# An instruction "[ROOT] %name = <shape> <opcode>(<operands>)<attributes>": the shape is the
# shortest text before " opcode(" (a tuple shape holds spaces and /*index=5*/ notes).
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_NAME = re.compile(r"%([\w.\-]+)")
_CALLEE = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation|"
                     r"select|scatter)=%([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_INTEGER = re.compile(r"^[su]\d+\[\]")
_INDEX = re.compile(r"\bindex=(\d+)")
_DIRECTION = re.compile(r"\bdirection=(\w+)")
_FLIP = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "EQ": "EQ", "NE": "NE"}
_THROUGH = ("copy", "bitcast", "convert", "reshape")   # the same value, looked through


class Instruction(NamedTuple):
    name: str
    shape: str
    opcode: str
    operands: tuple         # operand names
    attributes: str         # the text after the operands
    root: bool


class Loop(NamedTuple):
    body: str               # computation names
    condition: str
    caller: str             # the computation holding the while instruction
    trips: int | None       # None: not readable (counted once)
    how: str                # "known_trip_count", "i LT 6 from 0 by 1", or why not read


def _split(rest: str) -> tuple[str, str]:
    """``(operands, attributes)`` of the text after an opcode's "(": up to its matching ")"."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i], rest[i + 1:]
    return rest, ""


@functools.lru_cache(maxsize=2)
def parse(hlo: str) -> tuple[dict, str]:
    """``({computation: {instruction name: Instruction}}, entry name)`` of a module's text."""
    computations, entry, current = {}, "", None
    for line in hlo.splitlines():
        if c := _COMPUTATION.match(line):
            current = computations.setdefault(c.group(1), {})
            entry = c.group(1) if line.startswith("ENTRY ") else entry
            continue
        if current is None or not (m := _INSTRUCTION.match(line)):
            continue
        root, name, shape, opcode, rest = m.groups()
        operands, attributes = _split(rest)
        current[name] = Instruction(name, shape, opcode, tuple(_NAME.findall(operands)),
                                    attributes if opcode != "constant" else operands,
                                    bool(root))
    return computations, entry


def callees(instruction: Instruction) -> list[tuple[str, str]]:
    """``[(attribute, computation)]`` an instruction names (``calls``, ``body``, ...)."""
    found = _CALLEE.findall(instruction.attributes)
    for branches in _BRANCHES.findall(instruction.attributes):
        found += [("branch", b) for b in _NAME.findall(branches)]
    return found


def _value(computation: dict, name: str) -> Instruction | None:
    """The instruction whose value ``name`` is, through copies, bitcasts and converts."""
    seen = computation.get(name)
    while seen is not None and seen.opcode in _THROUGH and seen.operands:
        seen = computation.get(seen.operands[0])
    return seen


def _constant(computation: dict, name: str) -> int | None:
    i = _value(computation, name)
    if i is None or i.opcode != "constant" or not _INTEGER.match(i.shape):
        return None
    return int(i.attributes.strip())


def _element(computation: dict, name: str) -> int | None:
    """k where ``name`` is element k of the computation's (tuple) parameter."""
    i = _value(computation, name)
    if i is None or i.opcode != "get-tuple-element" or not i.operands:
        return None
    source = _value(computation, i.operands[0])
    if source is None or source.opcode != "parameter":
        return None
    return int(_INDEX.search(i.attributes).group(1))


def _root(computation: dict) -> Instruction | None:
    return next((i for i in computation.values() if i.root), None)


def _trips(computations: dict, caller: str, w: Instruction, body: str,
           condition: str) -> tuple[int | None, str]:
    """A while instruction's trip count and how it was read (module docstring)."""
    if known := _TRIP_COUNT.search(w.attributes):
        return int(known.group(1)), "known_trip_count"
    cond = computations.get(condition, {})
    test = _root(cond)
    if test is None or test.opcode != "compare" or len(test.operands) != 2:
        return None, "its condition is not a comparison"
    direction = _DIRECTION.search(test.attributes).group(1)
    a, b = test.operands
    k, bound = _element(cond, a), _constant(cond, b)
    if k is None or bound is None:
        k, bound, direction = _element(cond, b), _constant(cond, a), _FLIP[direction]
    if k is None or bound is None:
        return None, "its condition does not compare a loop counter with a constant"
    init = _value(computations[caller], w.operands[0]) if w.operands else None
    start = _constant(computations[caller], init.operands[k]) \
        if init is not None and init.opcode == "tuple" and k < len(init.operands) else None
    step = _step(computations.get(body, {}), k)
    if start is None or not step:
        return None, f"element {k}'s start or step is not a constant"
    return _count(start, step, direction, bound), f"i {direction} {bound} from {start} by {step}"


def _step(body: dict, k: int) -> int | None:
    """What the body adds to element k of the loop state each trip (None: not a constant)."""
    out = _root(body)
    if out is None or out.opcode != "tuple" or k >= len(out.operands):
        return None
    update = _value(body, out.operands[k])
    if update is None or update.opcode not in ("add", "subtract") or len(update.operands) != 2:
        return None
    x, y = update.operands
    sign = 1 if update.opcode == "add" else -1
    if _element(body, x) == k and (c := _constant(body, y)) is not None:
        return sign * c
    if update.opcode == "add" and _element(body, y) == k:
        return _constant(body, x)
    return None


def _count(start: int, step: int, direction: str, bound: int) -> int | None:
    """Trips of ``for (i = start; i <direction> bound; i += step)``."""
    span = bound - start
    if direction in ("LT", "LE") and step > 0:
        return max(0, math.ceil(span / step) + (direction == "LE" and span % step == 0))
    if direction in ("GT", "GE") and step < 0:
        return max(0, math.ceil(span / step) + (direction == "GE" and span % step == 0))
    if direction == "NE" and span % step == 0 and span / step >= 0:
        return span // step
    return None


def loops(hlo: str) -> list[Loop]:
    """Every while loop of the module, with its trips (module docstring)."""
    computations, _ = parse(hlo)
    found = []
    for caller, instructions in computations.items():
        for i in instructions.values():
            if i.opcode == "while":
                named = dict(callees(i))
                trips, how = _trips(computations, caller, i, named["body"], named["condition"])
                found.append(Loop(named["body"], named["condition"], caller, trips, how))
    return found


def runs(hlo: str) -> dict:
    """How many times each computation runs per run of the module (module docstring)."""
    computations, _ = parse(hlo)
    trips = {}
    for loop in loops(hlo):
        t = 1 if loop.trips is None else loop.trips
        trips[loop.body], trips[loop.condition] = t, t + 1
    sites = {}
    for caller, instructions in computations.items():
        for i in instructions.values():
            for _, callee in callees(i):
                sites.setdefault(callee, []).append(caller)

    @functools.lru_cache(maxsize=None)
    def count(name: str) -> int:
        if name not in sites:
            return 1
        return trips.get(name, 1) * sum(count(caller) for caller in sites[name])
    return {name: count(name) for name in computations}
