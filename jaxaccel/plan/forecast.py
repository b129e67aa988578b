"""From bound to forecast: a plan's step time as real runs of its kind reach it.

The roofline (``jaxaccel.plan.estimate_step``) is a lower bound: the analytic FLOPs at the
chip's peak, the bytes XLA moves at the HBM bandwidth, the collectives at the link bandwidth.
Real steps reach a fraction of the compute peak, and that fraction is what
``calibration.json`` measures: published training throughputs (MaxText, tpu-recipes,
torchtitan, NeMo, and this project's own H100 step), each with its model's shape, tokens per
chip per step, chips, precision and source (docs/calibration.md).

For every point the same FLOP formula the planner uses (``jaxaccel.flops``: 6N per token plus
causal-halved attention, plus the recomputed forward where the point ran with full remat) at
the same peak (``jaxaccel.devices``, the point's matmul dtype) gives its **efficiency**: FLOPs
per second per chip / peak. A plan's forecast is its compute bound divided by the efficiency
of the ``NEAREST`` calibration points on the same chip (the whole platform where the chip has
none), nearest meaning closest in FLOPs per chip per step (log scale), with a penalty for
another model family or matmul dtype, and within a decade of the nearest: the median gives the
forecast; their lowest and highest, widened to the backtest's 10th-90th percentile error
(``band``), give its range. No forecast goes below the plan's estimate (the roofline, or XLA's
cost model where it is higher). Points are named in the plan.

What this leaves out, said in every plan: the efficiencies are those of large, tuned runs
(MaxText, torchtitan); a small model, a short row, or a step bound by memory or collectives
rather than matmuls reaches less, so the forecast is optimistic there; the calibration set
has few points per chip. ``backtest()`` measures the error: each point forecast from the
others (leave-one-out) against what was published.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics

from jaxaccel import devices as devices_lib
from jaxaccel import flops as flops_lib

CALIBRATION_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.json")
NEAREST = 3
WITHIN = 1.0                # ... of those, only the ones within a decade of the nearest
OTHER_FAMILY = 0.5          # distance added for another model family (decades of work)
OTHER_DTYPE = 0.5           # ... and for another matmul dtype
DTYPES = {"bf16": "bfloat16", "fp8": "float8", "fp16": "float16", "fp32": "float32"}
CAVEAT = ("the forecast divides the compute bound by the efficiency published runs reached on "
          "the same chip (calibration.json, nearest in work per chip); those are large, tuned "
          "runs, so a small or memory-bound step is likely slower than forecast")


@dataclasses.dataclass(frozen=True)
class Point:
    id: str
    device: str
    platform: str               # "tpu" or "gpu"
    family: str                 # "llama" (decoders) or "bert"
    dtype: str                  # matmul dtype of the peak: bfloat16, float8, ...
    flops_per_token: float      # the planner's formula (+ the remat forward where full)
    tokens_per_step: float      # per chip
    tokens_per_s: float         # per chip, as published (or derived, said in the point)
    efficiency: float           # flops_per_token * tokens_per_s / peak
    source: str

    @property
    def work(self) -> float:
        """FLOPs per chip per step."""
        return self.flops_per_token * self.tokens_per_step

    @property
    def step_s(self) -> float:
        return self.tokens_per_step / self.tokens_per_s

    @property
    def roofline_s(self) -> float:
        """The compute bound a plan of this step has: its work at the chip's peak."""
        return self.work / devices_lib.peak_flops(self.device, self.dtype)[0]


def shape_of(point: dict) -> flops_lib.Shape:
    """The published model's shape as ``jaxaccel.flops`` reads an architecture."""
    d = point["d_model"]
    return flops_lib.Shape(
        hidden=d, layers=point["layers"], heads=point["heads"], kv_heads=point["kv_heads"],
        head_dim=point.get("head_dim") or d // point["heads"], intermediate=point["d_ff"],
        mlp_matrices=3 if point["gated_mlp"] else 2,
        head_weights=point.get("head_weights") or point["vocab"] * d,
        causal=point["family"] == "llama")


def _platform(device: str) -> str:
    return "tpu" if device.startswith("TPU") else "gpu"


def to_point(p: dict) -> Point:
    shape = shape_of(p)
    seq = p["seq"]
    per_token = flops_lib.train_flops(shape, 1, seq) / seq
    if p.get("remat") == "full":
        per_token += flops_lib.recompute_flops(shape, 1, seq) / seq
    if p.get("global_batch"):
        tokens_per_step = p["global_batch"] * seq / p["chips"]
    else:
        tokens_per_step = p["per_device_batch"] * seq
    dtype = DTYPES[p["precision"]]
    peak, _ = devices_lib.peak_flops(p["device"], dtype)
    tps = p["tokens_per_s_per_chip"]
    return Point(p["id"], p["device"], _platform(p["device"]), p["family"], dtype, per_token,
                 tokens_per_step, tps, per_token * tps / peak, p["source"])


def load(path: str = CALIBRATION_FILE) -> list[Point]:
    with open(path) as f:
        return [to_point(p) for p in json.load(f)["points"]]


def _distance(p: Point, work: float, family: str, dtype: str) -> float:
    return (abs(math.log10(p.work / work)) + OTHER_FAMILY * (p.family != family)
            + OTHER_DTYPE * (p.dtype != dtype))


def nearest(points: list[Point], device: str, family: str, dtype: str, work: float,
            exclude: tuple = ()) -> list[Point]:
    """The ``NEAREST`` points that calibrate a step of ``work`` FLOPs per chip (module doc)."""
    pool = [p for p in points if p.id not in exclude]
    same = [p for p in pool if p.device == device] or \
        [p for p in pool if p.platform == _platform(device)]
    ranked = sorted(same, key=lambda p: (_distance(p, work, family, dtype), p.id))[:NEAREST]
    if not ranked:
        return []
    first = _distance(ranked[0], work, family, dtype)
    return [p for p in ranked if _distance(p, work, family, dtype) <= first + WITHIN]


def _core(compute_s: float, floor_s: float, work: float, device: str, family: str,
          dtype: str, points: list[Point], exclude: tuple = ()) -> dict:
    near = nearest(points, device, family, dtype, work, exclude)
    if not near:
        return {"forecast_s": None, "forecast_source": f"none: no calibration point on a "
                                                       f"{_platform(device).upper()}"}
    effs = [p.efficiency for p in near]
    mid = statistics.median(effs)
    on = "this chip" if near[0].device == device else f"other {near[0].platform.upper()}s"
    floored = "" if compute_s / mid >= floor_s else \
        f"; the plan's estimate, {floor_s * 1e3:.4g} ms, is higher and is used"
    return {"forecast_s": max(compute_s / mid, floor_s),
            "forecast_low_s": max(compute_s / max(effs), floor_s),
            "forecast_high_s": max(compute_s / min(effs), floor_s),
            "forecast_efficiency": mid,
            "forecast_source": f"estimate:forecast (compute bound / {mid:.1%}, the median "
                               f"efficiency of {len(near)} published run(s) on {on}"
                               f"{floored})",
            "calibration": [p.id for p in near]}


def band(points: list[Point]) -> tuple[float, float]:
    """The 10th and 90th percentile of the leave-one-out forecast errors (forecast / published
    - 1) over the calibration set: how far off a forecast has been."""
    errors = sorted(r["forecast_error"] for r in _loo(points) if r["forecast_error"] is not None)
    q = statistics.quantiles(errors, n=10, method="inclusive")
    return q[0], q[-1]


def forecast(compute_s: float, floor_s: float, work: float, device: str, family: str,
             dtype: str, points: list[Point] | None = None, exclude: tuple = ()) -> dict:
    """The forecast of a step whose compute bound is ``compute_s`` (``work`` FLOPs per chip)
    and whose roofline is ``floor_s``: ``forecast_s`` with its range ``forecast_low_s`` -
    ``forecast_high_s`` (the nearest points' spread, widened to the backtest's 10th-90th
    percentile error), the points used and the method. ``forecast_s`` None where no point
    calibrates the device's platform."""
    points = load() if points is None else points
    out = _core(compute_s, floor_s, work, device, family, dtype, points, exclude)
    if out["forecast_s"] is not None:
        under, over = band([p for p in points if p.id not in exclude])
        out["forecast_low_s"] = max(min(out["forecast_low_s"], out["forecast_s"] / (1 + over)),
                                    floor_s)
        out["forecast_high_s"] = max(out["forecast_high_s"], out["forecast_s"] / (1 + under))
    return out


def _loo(points: list[Point]) -> list[dict]:
    """Each point forecast from the others by the nearest points alone (no band)."""
    rows = []
    for p in points:
        roofline = p.roofline_s
        f = _core(roofline, roofline, p.work, p.device, p.family, p.dtype, points, (p.id,))
        rows.append({"point": p, "roofline_s": roofline, **f,
                     "forecast_error": None if f["forecast_s"] is None
                     else f["forecast_s"] / p.step_s - 1.0})
    return rows


def backtest(points: list[Point] | None = None) -> list[dict]:
    """Each point forecast from the others (leave-one-out: neither its efficiency nor its error
    in the band), against its published step time: the roofline's error and the forecast's."""
    points = load() if points is None else points
    rows = []
    for p in points:
        roofline = p.roofline_s
        f = forecast(roofline, roofline, p.work, p.device, p.family, p.dtype, points, (p.id,))
        rows.append({
            "id": p.id, "device": p.device, "family": p.family, "dtype": p.dtype,
            "published_step_s": p.step_s, "tokens_per_s_per_chip": p.tokens_per_s,
            "efficiency": p.efficiency, "roofline_s": roofline,
            "roofline_error": roofline / p.step_s - 1.0,
            "forecast_s": f["forecast_s"], "forecast_low_s": f.get("forecast_low_s"),
            "forecast_high_s": f.get("forecast_high_s"),
            "forecast_error": None if f["forecast_s"] is None else f["forecast_s"] / p.step_s
            - 1.0,
            "within_range": None if f["forecast_s"] is None else
            f["forecast_low_s"] <= p.step_s <= f["forecast_high_s"],
            "calibration": f.get("calibration", [])})
    return rows


def summary(rows: list[dict]) -> dict:
    """Median absolute error of the roofline and of the forecast over the rows with both."""
    both = [r for r in rows if r["forecast_error"] is not None]
    return {"points": len(rows), "forecast_points": len(both),
            "median_abs_roofline_error": statistics.median(
                abs(r["roofline_error"]) for r in both),
            "median_abs_forecast_error": statistics.median(
                abs(r["forecast_error"]) for r in both),
            "within_range": sum(bool(r["within_range"]) for r in both),
            "closer_than_roofline": sum(abs(r["forecast_error"]) < abs(r["roofline_error"])
                                        for r in both),
            "devices": sorted({r["device"] for r in rows})}
