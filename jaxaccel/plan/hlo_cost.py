"""FLOPs, transcendentals and bytes accessed of one device's optimized HLO program in one run,
its loops counted trip by trip.

    counted = count(compiled.as_text())     # None where jaxlib lacks XLA's cost analysis
    counted.flops, counted.bytes_accessed, counted.loops

XLA's cost analysis (``compiled.cost_analysis()``, and HloCostAnalysis under it) costs a while
loop as one run of its body and condition, however many trips it makes: a scanned model's layers
(one body run L times), gradient accumulation's micro-batches and the TPU compiler's windowed
FSDP matmuls are all such loops, so its figures for a scanned step are several times too low.
Here each computation that runs as a step of its own (the entry, every loop's body and
condition) is costed by XLA's HloCostAnalysis (the open-source cost model: 2 FLOPs per
multiply-add of a dot or convolution, one per element of an elementwise op; bytes = what each
instruction outside fusions reads and writes, a fusion's parameters as far as it reads them) on
a module made of that computation and what it calls, read back from the optimized HLO text; the
cost of the loops it holds (their bodies and conditions, once each) is taken out, and what is
left counts as many times as the computation runs (``jaxaccel.plan.loops``: a body once per
trip of every loop around it). A loop whose trips cannot be read counts once, as in XLA's own
figure, and is named in ``uncounted``.

One correction to HloCostAnalysis's bytes, for every program alike (``sliced_overcount``): a
fusion operand that the fusion only slices, or updates in place, is charged whole where it
does so through a ``bitcast`` (a scanned loop's slice of a stacked [layers, ...] array laid out
layer-minor, ``dynamic-slice(bitcast(parameter))``, or its write of one layer's residual into
the stack, ``dynamic-update-slice(bitcast(parameter), ...)``), though the kernel reads the
slice and writes the update; the analysis looks through no bitcast. It is charged what it is
when taken directly: the slices' bytes, nothing for the buffer updated in place.

Byte sizes are logical (elements x dtype width, no tile padding); the TPU compiler's own cost
analysis counts within a few percent of this on loop-free programs (tests/test_hlo_cost.py).
"""
from __future__ import annotations

import dataclasses
import math
import re

import jax

from jaxaccel.plan import loops as loops_lib

SOURCE = ("XLA HloCostAnalysis of each computation of the optimized HLO (loops taken out) x its "
          "runs per step (loop trips)")
KEYS = {"flops": "flops", "transcendentals": "transcendentals",
        "bytes_accessed": "bytes accessed"}
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) ")
_NAME = re.compile(r"%([\w.\-]+)")
# An attribute the GPU compiler prints on async collectives (jax >= 0.12: all-reduce-start's
# buffer aliasing) that jaxlib's HLO parser takes only on custom calls and fusions; it has no
# bearing on FLOPs or bytes, so it is dropped from other instructions before parsing.
_ALIASING = re.compile(r", output_to_operand_aliasing=\{(?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*\}")
_OPCODE = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = .*? ([\w\-]+)\(")
# dtype[dims] in a (tuple) shape, the dtype's bits from its name (f8e4m3fn: 8; pred: none)
_ARRAY = re.compile(r"\b(pred|[a-z]+(\d+)\w*)\[([\d,]*)\]")
_PARAMETER = re.compile(r"^\s*%([\w.\-]+) = .*? parameter\((\d+)\)", re.M)


@dataclasses.dataclass(frozen=True)
class Counted:
    flops: float
    transcendentals: float
    bytes_accessed: float
    once: dict              # XLA's HloCostAnalysis of the whole module: each loop once
    loops: tuple            # (body, trips or None, runs per step) of every loop
    source: str = SOURCE

    @property
    def uncounted(self) -> tuple:
        """Bodies of loops whose trips could not be read (counted once)."""
        return tuple(body for body, trips, _ in self.loops if trips is None)

    @property
    def totals(self) -> dict:
        """The counted figures under cost_analysis()'s keys ("flops", "bytes accessed", ...)."""
        return {key: getattr(self, field) for field, key in KEYS.items()}

    def as_dict(self) -> dict:
        return {**self.totals, "once": self.once, "loops": [list(x) for x in self.loops],
                "uncounted": list(self.uncounted), "source": self.source}


def _analysis():
    """``(parse, analyse, client)``: jaxlib's HLO text parser and XLA's cost analysis, or None
    where this jaxlib has them not (private API, present in jaxlib 0.10 to 0.12)."""
    try:
        from jaxlib import _hlo, _jax
        parse, analyse = _hlo.hlo_module_from_text, _jax.hlo_module_cost_analysis
    except (ImportError, AttributeError):
        return None
    try:
        client = jax.local_devices(backend="cpu")[0].client
    except RuntimeError:
        client = jax.local_devices()[0].client
    return parse, analyse, client


def _blocks(hlo: str) -> tuple[str, dict]:
    """``(preamble, {computation: its text})``: the module's text cut at computation headers
    (the preamble holds the stack-frame tables that instructions' metadata refer to)."""
    lines = [_ALIASING.sub("", line) if (m := _OPCODE.match(line))
             and m.group(1) not in ("custom-call", "fusion") else line
             for line in hlo.splitlines()]
    starts = [i for i, line in enumerate(lines) if _HEADER.match(line)]
    preamble = "\n".join(lines[1:starts[0]]) if starts else ""
    blocks = {}
    for a, b in zip(starts, [*starts[1:], len(lines)]):
        name = _HEADER.match(lines[a]).group(2)
        head = lines[a][len("ENTRY "):] if lines[a].startswith("ENTRY ") else lines[a]
        blocks[name] = "\n".join([head, *lines[a + 1:b]])
    return preamble, blocks


def _reachable(name: str, blocks: dict) -> list[str]:
    """``name`` and every computation its instructions name, in the module's order."""
    seen, todo = {name}, [name]
    while todo:
        for callee in _NAME.findall(blocks[todo.pop()]):
            if callee in blocks and callee not in seen:
                seen.add(callee)
                todo.append(callee)
    return [n for n in blocks if n in seen]


def count(hlo: str) -> Counted | None:
    """The module's cost per run, loops counted trip by trip (module docstring); None where
    this jaxlib cannot parse or cost HLO, ValueError where XLA refuses a computation."""
    tools = _analysis()
    if tools is None:
        return None
    parse, analyse, client = tools
    preamble, blocks = _blocks(hlo)
    computations, entry = loops_lib.parse(hlo)
    found = loops_lib.loops(hlo)
    times = loops_lib.runs(hlo)
    step_names = {entry, *(x.body for x in found), *(x.condition for x in found)}
    owner = _owners(hlo, step_names)

    def once(name: str) -> dict:
        text = "\n\n".join(("ENTRY " if n == name else "") + blocks[n]
                           for n in _reachable(name, blocks))
        try:
            cost = analyse(client, parse(f"HloModule {name}\n{preamble}\n\n{text}\n"))
        except jax.errors.JaxRuntimeError as e:
            raise ValueError(f"XLA could not cost computation {name!r} on its own: "
                             f"{str(e).splitlines()[0]}") from e
        return {key: float(cost.get(key, 0.0)) for key in KEYS.values()}

    steps = {name: once(name) for name in step_names}
    self_cost = {name: dict(c) for name, c in steps.items()}
    for name in step_names:
        self_cost[name]["bytes accessed"] -= sum(
            sum(sliced_overcount(i, computations, blocks).values())
            for i in computations[name].values() if i.opcode == "fusion")
    for loop in found:
        for part in (loop.body, loop.condition):
            for key in KEYS.values():
                self_cost[owner[loop.caller]][key] -= steps[part][key]
    total = {key: sum(times[name] * c[key] for name, c in self_cost.items())
             for key in KEYS.values()}
    return Counted(*(total[k] for k in KEYS.values()), once=steps[entry],
                   loops=tuple((x.body, x.trips, times[x.body]) for x in found))


_SKIP = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while",
         "after-all", "partition-id"}
_CONTROL = re.compile(r",\s*control-predecessors=\{[^}]*\}")
_LINE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")


def by_instruction(hlo: str):
    """``(instruction, computation, runs, cost)`` of each instruction of the module's step
    computations (entry, loop bodies) that does work, costed alone (XLA's HloCostAnalysis of a
    module of just it, its operands as parameters): where a program's bytes and FLOPs go.
    The ``-done`` half of an async pair is left out (its cost is its ``-start``'s), and so is
    an instruction the parser cannot take alone (e.g. an operand of a kind only its producer
    may feed); ``count`` stays the total. ``cost["hbm bytes"]`` is its bytes accessed less
    those of operands and results the TPU compiler placed in on-chip memory (``on_chip``):
    the cost analysis's per-operand and result figures that are not on chip, at most the
    bytes accessed (those figures number a fusion's constants as operands, which its bytes
    accessed leave out)."""
    tools = _analysis()
    if tools is None:
        return
    parse, analyse, client = tools
    preamble, blocks = _blocks(hlo)
    computations, entry = loops_lib.parse(hlo)
    times = loops_lib.runs(hlo)
    for name in [entry, *(x.body for x in loops_lib.loops(hlo))]:
        instructions = computations[name]
        for line in blocks[name].splitlines()[1:]:
            if not (m := _LINE.match(line)):
                continue
            i = instructions[m.group(1)]
            if i.opcode in _SKIP or i.opcode.endswith("-done"):
                continue
            operands = [o for o in dict.fromkeys(i.operands) if o in instructions]
            params = [f"  %{o} = {instructions[o].shape} parameter({k})"
                      for k, o in enumerate(operands)]
            called = []
            for callee in _NAME.findall(line.split("(", 1)[1]):
                if callee in blocks and callee not in instructions:
                    called += [n for n in _reachable(callee, blocks) if n not in called]
            text = "\n\n".join(blocks[n] for n in called) + "\n\nENTRY %e {\n" + "\n".join(
                [*params, "  ROOT " + _CONTROL.sub("", line).replace("ROOT ", "").strip()])
            try:
                cost = analyse(client, parse(f"HloModule e\n{preamble}\n\n{text}\n}}\n"))
            except jax.errors.JaxRuntimeError:
                continue
            cost = _less(cost, sliced_overcount(i, computations, blocks))
            hbm = sum(v for k, v in cost.items() if (part := _PART.fullmatch(k)) and not on_chip(
                _element(i.shape if part.group(1) == "out" else _shape_of(
                    instructions, i.operands, int(part.group(1))), part.group(2))))
            accessed = float(cost.get("bytes accessed", 0.0))
            yield i, name, times[name], {**{key: float(cost.get(key, 0.0))
                                            for key in KEYS.values()},
                                         "hbm bytes": min(hbm, max(accessed, 0.0))}


def array_bytes(shape: str, leave_out: tuple = ()) -> int:
    """The logical bytes (elements x dtype width, no tile padding; a pred or a sub-byte type
    one byte) of the arrays in a (tuple) shape, those of the dtypes in ``leave_out`` left
    out."""
    return sum(max(int(bits or 8) // 8, 1) * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, bits, dims in _ARRAY.findall(shape) if dtype not in leave_out)


def sliced_overcount(fusion: loops_lib.Instruction, computations: dict, blocks: dict) -> dict:
    """``{operand number: bytes}`` XLA's HloCostAnalysis charges ``fusion`` beyond what it
    reads (module docstring): of each fused parameter used only as the array that ``slice``,
    ``dynamic-slice`` or ``dynamic-update-slice`` instructions slice or update in place, one
    or more of them through bitcasts, the analysis charges the whole size once for its bitcast
    users (its FusionParameterReadBytes takes a bitcast for an ordinary user), the slices
    taken directly their sizes and an update in place nothing; the overcount is the
    parameter's size less the slices taken through bitcasts."""
    found = {}
    for callee in (c for kind, c in loops_lib.callees(fusion) if kind == "calls"):
        fused = computations.get(callee, {})
        users: dict = {}
        for j in fused.values():
            for o in dict.fromkeys(j.operands):
                users.setdefault(o, []).append(j)
        for name, k in _PARAMETER.findall(blocks.get(callee, "")):
            sliced = _sliced_through_bitcasts(name, users)
            if sliced is not None and array_bytes(fused[name].shape) > sliced:
                found[int(k)] = array_bytes(fused[name].shape) - sliced
    return found


def _sliced_through_bitcasts(value: str, users: dict) -> int | None:
    """The bytes of the slices taken of ``value`` through bitcasts where it is used only by
    slices of it and updates of it in place, directly or through bitcasts (one at least);
    else None."""
    total, bitcast, todo = 0, False, [(value, False)]
    while todo:
        name, through = todo.pop()
        for j in users.get(name, []):
            if j.opcode == "bitcast" and not j.root and users.get(j.name):
                bitcast = True
                todo.append((j.name, True))
            elif j.opcode in ("slice", "dynamic-slice", "dynamic-update-slice") and \
                    j.operands[0] == name and name not in j.operands[1:]:
                total += array_bytes(j.shape) if through and j.opcode != \
                    "dynamic-update-slice" else 0
            else:
                return None
    return total if bitcast else None


def _less(cost: dict, overcount: dict) -> dict:
    """One instruction's cost figures less the bytes ``overcount`` says its operands were
    charged beyond what it reads (``{operand number: bytes}``)."""
    cost = dict(cost)
    for k, extra in overcount.items():
        cost["bytes accessed"] = cost.get("bytes accessed", 0.0) - extra
        cost[f"bytes accessed{k}{{}}"] = cost.get(f"bytes accessed{k}{{}}", 0.0) - extra
    return cost


def hbm_bytes(parts) -> float:
    """The bytes a program moves to or from HBM per run: the ``"hbm bytes"`` of
    ``by_instruction``'s parts times their runs. On a TPU program about half its counted bytes
    (XLA's cost analysis counts a VMEM access like an HBM one; docs/reports/maxtext.md)."""
    return sum(runs * cost["hbm bytes"] for _, _, runs, cost in parts)


# HloCostAnalysis's bytes of one operand or of the result, at a shape index:
# "bytes accessed0{}", "bytes accessedout{1}".
_PART = re.compile(r"bytes accessed(\d+|out)\{([\d,]*)\}")


def on_chip(shape: str) -> bool:
    """Whether a value of this (optimized HLO, laid out) shape lives in on-chip memory: the
    TPU compiler's memory-space assignment marks VMEM buffers memory space 1 (``S(1)``), e.g.
    ``bf16[2048,5632]{1,0:T(8,128)(2,1)S(1)}``; their reads and writes move no HBM bytes
    (the copies that fill them read HBM, and count)."""
    return "S(1)" in shape


def _shape_of(instructions: dict, operands: tuple, k: int) -> str:
    """The shape of an instruction's k-th operand ("" where it is not an instruction: a
    fusion's constants are numbered as operands by the cost analysis)."""
    return instructions[operands[k]].shape if k < len(operands) and \
        operands[k] in instructions else ""


def _element(shape: str, index: str) -> str:
    """The part of a (tuple) shape at a shape index such as "1" or "0,2"."""
    for k in (int(x) for x in index.split(",") if x):
        if not shape.startswith("("):
            return shape
        depth, start, parts = 0, 1, []
        for at, ch in enumerate(shape[1:-1], 1):
            depth += ch in "([{"
            depth -= ch in ")]}"
            if ch == "," and depth == 0:
                parts.append(shape[start:at].strip())
                start = at + 1
        parts.append(shape[start:-1].strip())
        shape = parts[k] if k < len(parts) else ""
    return shape


def _owners(hlo: str, steps: set) -> dict:
    """Each computation -> the step computation (entry, loop body or condition) it runs within:
    itself for a step, else its caller's."""
    computations, _ = loops_lib.parse(hlo)
    caller = {}
    for name, instructions in computations.items():
        for i in instructions.values():
            for _, callee in loops_lib.callees(i):
                caller.setdefault(callee, name)

    def find(name):
        while name not in steps and name in caller:
            name = caller[name]
        return name
    return {name: find(name) for name in computations}
