"""The collectives of a compiled step, read from its optimized HLO text (``compiled.as_text()``):
what each one writes on a device, over how many devices, and the least it must send.

    moved = collective_bytes(hlo)                       # result bytes per kind, per device
    sent = sum(c.sent for c in collectives(hlo, n))     # bytes one device must send

Each collective is counted once per execution: an async pair at its ``-done`` (a ``-start``
returns its operands too on GPU and TPU), one in a loop body (a ``scan`` over layers or
micro-batches, the TPU compiler's windowed FSDP matmuls) once per trip of every loop around it
(``jaxaccel.plan.loops``: XLA's ``known_trip_count``, else the loop's counter, signed or
unsigned, its start, bound and step). The TPU compiler overlaps a collective with other work
as a chain of fusions (start, the overlapped computation, done), each holding a clone of the
collective with the same ``channel_id``: a channel's collective is counted once in each
computation that runs such a chain (the fusions' caller: a loop body, the entry), as the
compiler repeats a loop's chains outside it (a peeled trip) with the same ids. It writes a
reduce-scatter as an all-reduce fused with the slice each device keeps (a fusion calling
``%all-reduce-scatter...``); that is counted as the reduce-scatter it is.

Across TPU slices (``jaxaccel.plan.topology``'s ``2xv5e-256``) libtpu compiles one slice's
program: its collectives' groups are within the slice (ICI), and each collective's part between
slices is a host transfer to the multi-slice runtime over the data-center network (DCN): a
``send``/``recv`` pair with ``_xla_megascale_transfer_type`` (ALL_REDUCE, ALL_GATHER, ...) and
``_xla_megascale_target`` (the groups of devices across slices, one per slice in each). Each
such ``recv`` is counted as the collective it is (``Collective.dcn``), its result the
``recv``'s array, its group the slices it joins.

``Collective.sent`` is a lower bound: the bytes a bandwidth-optimal algorithm (ring or
better) sends from each device of a group of n. Per byte of the result: all-reduce 2(n-1)/n,
all-gather and all-to-all (n-1)/n, reduce-scatter n-1 (its result is 1/n of the input),
collective-permute 1.
"""
from __future__ import annotations

import math
import re
from typing import NamedTuple

from jaxaccel.plan import loops
from jaxaccel.plan.hlo_cost import array_bytes

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

# A computation's header "%name (params) -> shape {" at the start of a line.
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
# An instruction "%name = <shape> <collective>[-start|-done](<operands>)...": a tuple shape may
# hold /*index=5*/ notes.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) (" + "|".join(KINDS) +
                          r")(-start|-done)?\(([^)]*)\)(.*)$")
# The replica-group notations of XLA's HLO text: explicit lists "{{0,1},{2,3}}", iota
# "[2,4]<=[8]" (2 groups of 4), and the mesh form "mesh['x'=4,'y'=2], device_ids=(...) {'x'}"
# (a group spans the named axes).
_LISTS = re.compile(r"replica_groups=\{(\{[\d,]*\})?")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[[\d,]*\]"
                   r"(?:T\([\d,]*\))?\))? \{([^}]*)\}")
_SUB_AXIS = re.compile(r":\(\d+\)(\d+)$")          # 'fsdp':(2)2: a sub-axis of size 2
_FUSED_REDUCE_SCATTER = "all-reduce-scatter"      # libtpu's fused reduce-scatter computations
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_CALLS = re.compile(r"\bcalls=%([\w.\-]+)")
# A transfer between slices: "%name = (<array>, u32[], token[]) recv(...), ... frontend_attributes=
# {..._xla_megascale_target={{100000,200000},...} or "{1,2}x{0:7}", ..._transfer_type="ALL_REDUCE"}"
_DCN_RECV = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = \((.*?)\) recv\(.*xla_megascale_runtime")
_DCN_TARGET = re.compile(r'_xla_megascale_target="?\{\{?([\d,]+)\}')
_DCN_TYPE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')


class Collective(NamedTuple):
    kind: str           # one of KINDS
    bytes: int          # its result on one device
    group: int          # devices in its replica group (slices, for one between slices)
    dcn: bool = False   # between TPU slices, over the data-center network (module docstring)

    @property
    def sent(self) -> float:
        """Bytes each device sends at least (bandwidth-optimal algorithm; module docstring)."""
        n = self.group
        if n <= 1 and self.kind != "collective-permute":
            return 0.0
        per_byte = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n,
                    "all-to-all": (n - 1) / n, "reduce-scatter": n - 1,
                    "collective-permute": 1.0}[self.kind]
        return per_byte * self.bytes


def group_size(attributes: str, devices: int) -> int:
    """Devices per replica group from an instruction's attributes; ``devices`` (all of the
    module's) where the groups are empty ("{}": one group of everyone) or not given. In the
    mesh notation a group's axis may be a sub-axis, ``'fsdp':(2)2`` (Shardy's: the ways of
    ``fsdp`` after the first 2, 2 of them): it counts its own size."""
    if m := _MESH.search(attributes):
        axes = {k.strip("'"): int(v) for k, v in
                (a.split("=") for a in m.group(1).split(",") if a)}
        return math.prod(int(sub.group(1)) if (sub := _SUB_AXIS.search(a.strip()))
                         else axes[a.strip().strip("'")]
                         for a in m.group(2).split(",") if a.strip())
    if m := _IOTA.search(attributes):
        return int(m.group(1).split(",")[-1])
    if (m := _LISTS.search(attributes)) and m.group(1):
        return m.group(1).count(",") + 1
    return devices


def collectives(hlo: str, devices: int = 1) -> list[Collective]:
    """The collectives of an optimized HLO module, one per execution (module docstring);
    ``devices``: the module's device count, the group of a collective whose groups are
    empty."""
    out, groups, channels, computation, times = [], {}, set(), "", loops.runs(hlo)
    runner = _runners(hlo)
    for line in hlo.splitlines():
        if c := _COMPUTATION.match(line):
            computation = c.group(1)
            continue
        if dcn := _dcn_transfer(line):
            out += [dcn] * times.get(computation, 1)
            continue
        if not (m := _INSTRUCTION.match(line)):
            continue
        name, shape, kind, phase, operands, attributes = m.groups()
        if phase == "-start":
            groups[name] = group_size(attributes, devices)
            continue
        if (channel := _CHANNEL.search(attributes)) and phase is None:
            key = (runner(computation), channel.group(1))
            if key in channels:
                continue                # a clone of a channel's collective (docstring)
            channels.add(key)
        n = groups.get(operands.strip().lstrip("%"), devices) if phase == "-done" \
            else group_size(attributes, devices)
        kind, size = result(kind, shape, computation, n)
        out += [Collective(kind, size, n)] * times.get(computation, 1)
    return out


def result(kind: str, shape: str, computation: str, group: int) -> tuple[str, int]:
    """``(kind, bytes)`` one device's result of a collective of ``kind`` and ``shape`` in
    ``computation`` over ``group`` devices: an all-reduce in the TPU compiler's fused
    reduce-scatter computation is that reduce-scatter, 1/n of its bytes (module docstring)."""
    size = array_bytes(shape)
    if kind == "all-reduce" and computation.startswith(_FUSED_REDUCE_SCATTER):
        return "reduce-scatter", size // max(group, 1)
    return kind, size


def _runners(hlo: str):
    """computation -> the computation that runs it: for a fused (``calls=``) computation its
    caller's, up to one no fusion calls (a loop body, a branch, the entry)."""
    caller, computation = {}, ""
    for line in hlo.splitlines():
        if c := _COMPUTATION.match(line):
            computation = c.group(1)
        elif m := _CALLS.search(line):
            caller[m.group(1)] = computation

    def runner(name: str) -> str:
        seen = {name}
        while (name := caller.get(name, name)) not in seen:
            seen.add(name)
        return name
    return runner


def _dcn_transfer(line: str) -> Collective | None:
    """The collective between slices one ``recv`` of the multi-slice runtime completes (module
    docstring), or None for any other line."""
    if not (m := _DCN_RECV.match(line)):
        return None
    kind = _DCN_TYPE.search(line)
    kind = kind.group(1).lower().replace("_", "-") if kind else "collective-permute"
    target = _DCN_TARGET.search(line)
    slices = target.group(1).count(",") + 1 if target else 2
    array = m.group(1).split("]", 1)[0] + "]"        # the tuple's first element: the data
    return Collective(kind if kind in KINDS else "collective-permute", array_bytes(array),
                      slices, dcn=True)


def dcn_sent(found: list[Collective]) -> float:
    """Bytes a device sends at least between slices (``Collective.sent`` of those over DCN)."""
    return sum(c.sent for c in found if c.dcn)


def ici_sent(found: list[Collective]) -> float:
    """Bytes a device sends at least within its slice (or over its chip's interconnect, NVLink
    on a GPU host): ``Collective.sent`` of the collectives not over DCN."""
    return sum(c.sent for c in found if not c.dcn)


def by_kind(found: list[Collective]) -> dict:
    """Result bytes per kind of collective (tuples summed), every kind present as a key."""
    moved = dict.fromkeys(KINDS, 0)
    for c in found:
        moved[c.kind] += c.bytes
    return moved


def collective_bytes(hlo: str, devices: int = 1) -> dict:
    """Bytes each kind of collective writes per device in one run of the module."""
    return by_kind(collectives(hlo, devices))
