"""Several targets planned for one config, ranked: ``jaxaccel compile --topology a,b,c``.

Each target's row is its plan (made to fit by ``--fit`` where asked): fits or not, the step
time (the forecast where the plan has one, else the estimate), tokens/s, the time and price of
an epoch (or of the run, for a corpus) at the shipped on-demand prices. Targets that fit are
ranked by time, then price; the rest follow, with why.
"""
from __future__ import annotations

import dataclasses
import math

from jaxaccel.plan import Plan, duration, usd_text


@dataclasses.dataclass
class Entry:
    topology: str               # as the user wrote it
    plan: Plan | None           # the plan that fits, or the one that does not (None: none made)
    fits: bool
    changes: tuple = ()         # --set KEY=VALUE the fit search added
    why: str = ""               # why it does not fit, or the error

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
