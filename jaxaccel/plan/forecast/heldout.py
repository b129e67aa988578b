"""The forecast on runs it has not seen: leave-one-out and leave-one-source-out (every run of
one publisher's chip held out together), the 80% range those held-out errors give a forecast
(``band``, ``published_range``), and the backtest that measures the range's coverage on
sources the range itself had not seen."""
from __future__ import annotations

import statistics

import numpy as np

from jaxaccel.plan.forecast.model import Model, fit
from jaxaccel.plan.forecast.points import Point, load

QUANTILES = (0.1, 0.9)
MIN_BAND_POINTS = 8


def _error(model: Model, p: Point) -> dict:
    terms = model.terms(p.step)
    s = None if terms is None else sum(terms.values())
    return {"id": p.id, "source_group": p.source_group, "platform": p.step.platform,
            "forecast_s": s,
            "error": None if s is None else s / p.published_s - 1,
            "calibrated": model.calibrated(p.step), "how": model.efficiency(p.step)[1]}


def sources(points) -> list[str]:
    return sorted({p.source_group for p in points})


def leave_one_source_out(points) -> list[dict]:
    """Every point forecast by a fit without any point of its source."""
    out = []
    for s in sources(points):
        model = fit(p for p in points if p.source_group != s)
        out += [_error(model, p) for p in points if p.source_group == s]
    return out


def leave_one_out(points) -> list[dict]:
    return [_error(fit(q for q in points if q.id != p.id), p) for p in points]


def _weighted_quantile(values, weights, q: float) -> float:
    order = np.argsort(values)
    v, w = np.asarray(values)[order], np.asarray(weights)[order]
    cum = (np.cumsum(w) - 0.5 * w) / w.sum()
    return float(np.interp(q, cum, v))


def _like(rows: list[dict], key: str, value) -> list[dict]:
    """The rows whose ``key`` is ``value``, or all where those are fewer than
    ``MIN_BAND_POINTS``."""
    like = [r for r in rows if r[key] == value]
    return like if len(like) >= MIN_BAND_POINTS else rows


def band(held_out: list[dict], calibrated: bool, platform: str) -> tuple[float, float, int]:
    """(10th, 90th percentile, points) of held-out errors of steps like this one, each source
    weighing one: of its platform's steps (a TPU's range from TPU runs: GPU runs' errors are
    wider, and a TPU range from both held 96% of the TPU runs), and of those the calibrated or
    the extrapolated ones as this step is; at each narrowing, all where those are fewer than
    ``MIN_BAND_POINTS``."""
    rows = [r for r in held_out if r["error"] is not None]
    rows = _like(_like(rows, "platform", platform), "calibrated", calibrated)
    count = {}
    for r in rows:
        count[r["source_group"]] = count.get(r["source_group"], 0) + 1
    errors = [r["error"] for r in rows]
    weights = [1.0 / count[r["source_group"]] for r in rows]
    lo, hi = (_weighted_quantile(errors, weights, q) for q in QUANTILES)
    return lo, hi, len(rows)


def published_range(forecast_s: float, held_out: list[dict], calibrated: bool,
                    platform: str) -> tuple[float, float]:
    """The published step's 80% range for a forecast: errors are forecast / published - 1."""
    lo, hi, _ = band(held_out, calibrated, platform)
    return forecast_s / (1 + hi), forecast_s / (1 + lo)


def summary(rows: list[dict], key: str = "error") -> dict:
    """Median absolute ``key`` error, and the range's coverage where the rows carry it."""
    rows = [r for r in rows if r.get(key) is not None]
    out = {"points": len(rows), "sources": len({r["source_group"] for r in rows}),
           "median_abs_error": statistics.median(abs(r[key]) for r in rows) if rows else None}
    if rows and rows[0].get("within_range") is not None:
        out["within_range"] = sum(bool(r["within_range"]) for r in rows)
        out["coverage"] = out["within_range"] / len(rows)
    return out


def backtest(points: list[Point] | None = None) -> list[dict]:
    """Every point against its published step: the roofline's error, leave-one-out's, and
    leave-one-source-out's with the range the forecast would print for it, from the held-out
    errors of the other sources only (so its coverage is measured on unseen sources)."""
    points = load() if points is None else points
    loo = {r["id"]: r for r in leave_one_out(points)}
    rows = {}
    for s in sources(points):
        rest = [p for p in points if p.source_group != s]
        model, inner = fit(rest), leave_one_source_out(rest)
        for p in (p for p in points if p.source_group == s):
            r = _error(model, p)
            low, high = (None, None) if r["forecast_s"] is None else \
                published_range(r["forecast_s"], inner, r["calibrated"], p.step.platform)
            rows[p.id] = {
                "id": p.id, "source_group": s, "chip": p.step.chip,
                "chip_family": p.chip_family, "platform": p.step.platform,
                "precision": p.step.precision, "size_class": p.size_class, "task": p.task,
                "published_step_s": p.published_s, "efficiency": p.efficiency,
                "roofline_error": p.step.compute_s / p.published_s - 1,
                "loo_forecast_s": loo[p.id]["forecast_s"], "loo_error": loo[p.id]["error"],
                "forecast_s": r["forecast_s"], "error": r["error"],
                "forecast_low_s": low, "forecast_high_s": high,
                "within_range": None if low is None else low <= p.published_s <= high,
                "calibrated": r["calibrated"], "efficiency_from": r["how"]}
    return [rows[p.id] for p in points]
