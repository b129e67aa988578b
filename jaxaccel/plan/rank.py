"""Several targets planned for one config, ranked: ``jaxaccel compile --topology a,b,c``
(``plan_targets``: each target planned, or fit-searched, its report printed and its result file
written, then the ranking).

Each target's row is its plan (made to fit by ``--fit`` where asked): fits or not, the step
time (the forecast where the plan has one, else the estimate), tokens/s, the time and price of
an epoch (or of the run, for a corpus) at the shipped on-demand prices. Targets that fit are
ranked by time, then price; the rest follow, with why.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import Callable

from jaxaccel import console, storage
from jaxaccel.plan import search as search_lib
from jaxaccel.plan import topology
from jaxaccel.plan.compile import make_plan
from jaxaccel.plan.fit import DoesNotFit
from jaxaccel.plan.report import duration, report, usd_text
from jaxaccel.plan.result import Plan, result, slug


@dataclasses.dataclass
class Entry:
    topology: str               # as the user wrote it
    plan: Plan | None           # the plan that fits, or the one that does not (None: none made)
    fits: bool
    changes: tuple = ()         # --set KEY=VALUE the fit search added
    why: str = ""               # why it does not fit, or the error
    refused: bool = False       # the target refused the config: nothing was compiled

    def seconds(self) -> float:
        """The epoch's (or run's) time: forecast where the plan has one, else the bound."""
        c = self.plan.cost if self.plan else None
        return c.get("forecast_seconds", c["seconds"]) if c else math.inf

    def usd(self) -> float:
        c = self.plan.cost if self.plan else None
        if not c or c.get("usd") is None:
            return math.inf
        return c.get("forecast_usd", c["usd"])

    def step(self) -> tuple[float | None, float | None, float | None]:
        """(step, low, high) seconds: the forecast and its range, else the estimate alone."""
        if self.plan is None:
            return None, None, None
        e = self.plan.estimate
        return self.plan.time_s, e.get("forecast_low_s"), e.get("forecast_high_s")


def ordered(entries: list[Entry]) -> list[Entry]:
    return sorted(entries, key=lambda e: (not e.fits, e.seconds(), e.usd(), e.topology))


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.4g}"


def table(entries: list[Entry]) -> str:
    """A Markdown table of the targets, fastest that fits first (module doc)."""
    rows = ordered(entries)
    unit = next((e.plan.cost["unit"] for e in rows if e.plan and e.plan.cost), "epoch")
    cheapest = min((e.usd() for e in rows if e.fits), default=math.inf)
    head = ["rank", "target", "chips", "fits", "step ms (range)", "tokens/s",
            f"{unit} time", f"{unit} cost", "source"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, e in enumerate(rows, 1):
        p = e.plan
        step, low, high = e.step()
        span = f"{_ms(step)} ({_ms(low)}-{_ms(high)})" if low is not None else _ms(step)
        fits = ("yes" + (" with " + " ".join(e.changes) if e.changes else "")) if e.fits \
            else f"no: {e.why}" if e.why else "no"
        tps = f"{p.batch * p.seq / step:.4g}" if p and step else "-"
        secs = e.seconds()
        usd = e.usd()
        cost = "-" if usd == math.inf else usd_text(usd) + (" (cheapest)" if e.fits and
                                                             usd == cheapest else "")
        source = p.estimate.get("forecast_source") or p.estimate.get("source", "") if p else ""
        out.append("| " + " | ".join([
            str(i) if e.fits else "-", e.topology, str(p.target.chips) if p else "-", fits, span,
            tps, "-" if secs == math.inf else duration(secs), cost, source]) + " |")
    return "\n".join(out)


def _show(*parts) -> None:
    """A line of the command's result: the plans, the ranking, the files written."""
    print(*parts, file=console.result(), flush=True)


def plan_targets(config: str | None, sets: list[str], names: list[str], *,
                 memory: float | None = None, fit: int | None = None, out: str | None = None,
                 error_text: Callable[[Exception], str] = str) -> list[Entry]:
    """Each target of ``names`` planned (made to fit by the ``--fit`` search when ``fit`` gives
    its compile limit), its report printed and, where it fits, its result file written into
    ``out``; several targets are then ranked (``table``). ``memory``: bytes per device to plan
    against; ``error_text``: the line an input error prints as."""
    for name in names:      # before anything compiles: a bad name refuses the command
        topology.resolve(name)
    many = len(names) > 1
    entries = []
    for name in names:
        if many:
            _show(f"== {name} ==")
        entry = _entry(config, sets, name, memory, fit, many, error_text)
        entries.append(entry)
        if entry.fits and out:
            storage.makedirs(out)
            p = entry.plan
            path = storage.join(out, f"plan-{p.cfg.name}-{slug(p.target.name)}.json")
            storage.write_json(path, result(p))
            _show(f"wrote {path}")
        if many:
            _show()
    if many:
        _show("targets ranked (estimates):")
        _show(table(entries))
    return entries


def _entry(config, sets, name: str, memory, fit: int | None, many: bool, error_text) -> Entry:
    """One target's ranking entry, as given or searched (``fit``); among several targets a
    config the target refuses is reported, nothing compiled (alone, it is raised)."""
    try:
        return _search_one(config, sets, name, memory, fit) if fit else \
            _plan_one(config, sets, name, memory)
    except ValueError as e:
        if not many:
            raise
        print(f"error: {name}: {error_text(e)}", file=sys.stderr)
        return Entry(name, None, False, why=error_text(e).split(";")[0], refused=True)


def _search_one(config, sets, name: str, memory, limit: int) -> Entry:
    """One target made to fit by the ``--fit`` search, as a ranking entry."""
    found = search_lib.search(config, sets, name, device_memory=memory, limit=limit,
                              progress=lambda line: print(line, file=sys.stderr, flush=True))
    if len(found.tried) > 1:
        _show(found.summary())
    best = found.best
    if best is None:
        last = found.tried[-1]
        if last.plan is not None:
            _show(report(last.plan))
        why = search_lib.why_none(found)
        print(f"error: {name}: nothing tried fits: {why}", file=sys.stderr)
        return Entry(name, last.plan, False, why="nothing tried fits")
    if best.changes:
        _show(f"\nthe fastest configuration that fits: {best.describe()}\n")
    _show(report(best.plan))
    return Entry(name, best.plan, True, tuple(best.sets))


def _plan_one(config, sets, name: str, memory) -> Entry:
    """One target's plan as a ranking entry: a run that does not fit is reported (its error on
    stderr)."""
    try:
        p = make_plan(config, sets, name, device_memory=memory)
    except DoesNotFit as e:
        if e.plan is not None:
            _show(report(e.plan))
        print(f"error: {e}", file=sys.stderr)
        return Entry(name, e.plan, False, why=f"{e.step} step")
    _show(report(p))
    return Entry(name, p, True)
