"""From bound to forecast: a plan's step time as published runs of its kind reached it.

The roofline (``jaxaccel.plan.estimate_step``) is a lower bound. The forecast adds what real
steps spend beyond it, in five terms per chip, fitted to published training runs
(``calibration.json``; docs/calibration.md says how each was fitted):

    step = (dense + alpha * attention + kappa * recomputed) / efficiency[chip, precision]
         + rho * tokens * (layers * width * (1 + r/3) + head) / HBM bandwidth
         + tau[platform] * passes * layers
         + optimizer bytes / HBM bandwidth

``dense``, ``attention`` and ``recomputed`` are the planner's compute bound split in three:
the model's FLOPs but attention's, attention's (QK^T and AV), and the forward a remat policy
runs again, each at the peak of the step's matmul precision (fp8 against the fp8 peak; bf16
and fp16 one class; fp32 at the chip's fp32 rate) and divided by ``1 - idle`` for a pipeline.
The published fp8 runs have every block matmul in fp8; a step with a share of them in fp8
(``precision.fp8_layers=paying``) has that share of its first term as an fp8 step and the
rest as a bf16 one, each over its own efficiency.
So remat counts in the bound, not in the efficiency; ``alpha`` and ``kappa`` (one each) say
what an attention or recomputed FLOP costs beside a dense one. The second term is the
elementwise work between the matmuls (norms, activations, residuals, the softmax over the
head), which grows with the width rather than its square: ``r`` is the share of the forward
recomputed, ``head`` the output head's width (an LM's vocabulary). The third is a fixed cost
per layer per pass (a micro-batch, or a pipeline's) and per step, what small steps pay most.
The update reads and writes the parameters and optimizer state once (not fitted).

A chip and precision without published runs borrows its efficiency (``Model.efficiency``) and
the plan says so. Collectives count where the plan's collective bytes at the link bandwidth
take longer than the forecast step (they are taken to overlap compute otherwise: the published
runs cannot test it, being compute-bound). No forecast goes below the plan's estimate.

Fit: ``alpha`` and ``kappa`` on a grid, the rest by non-negative least squares on relative
error, over every published run. Range: the 10th-90th percentile of the errors the method made
on runs of sources it had not seen (leave-one-source-out: all runs of one publisher's chip held
out together), each source weighing one, taken on runs of the step's platform (GPU or TPU),
and of those separately for steps whose chip and precision have their own runs within 2x of
their width ("calibrated") and the rest ("extrapolated").
``backtest`` measures leave-one-out, leave-one-source-out, and the coverage of exactly that
range on sources the range itself had not seen.

The parts: ``points`` (a step as the forecast reads it; the published runs as steps), ``model``
(the fit, and the fitted model applied to a step), ``heldout`` (leave-one-(source-)out, the
range, the backtest); this module joins them into a plan's forecast.
"""
from __future__ import annotations

import functools

from jaxaccel.plan.forecast.heldout import (backtest, band, leave_one_out, leave_one_source_out,
                                            sources, summary)
from jaxaccel.plan.forecast.heldout import published_range as _range
from jaxaccel.plan.forecast.model import Model, fit
from jaxaccel.plan.forecast.points import (CALIBRATION_FILE, DTYPES, Point, Step, load,
                                           recompute_flops, shape_of, step_of)

CAVEAT = ("the forecast is the compute bound over the efficiency published runs reached on the "
          "chip plus fitted elementwise and per-layer costs (calibration.json); its range is "
          "the spread of its errors on published runs of sources it had not seen")


@functools.lru_cache(maxsize=4)
def calibration(path: str = CALIBRATION_FILE) -> tuple:
    """(the fit on every point, the leave-one-source-out errors the range comes from)."""
    points = load(path)
    return fit(points), leave_one_source_out(points)


def forecast(step: Step, floor_s: float, interconnect_s: float = 0.0,
             path: str = CALIBRATION_FILE) -> dict:
    """The forecast of ``step`` whose estimate (roofline, or XLA's cost model) is ``floor_s``
    and whose collectives take ``interconnect_s`` at the link bandwidth: ``forecast_s`` with
    its 80% range, the terms, where the efficiency came from and how sure the range is."""
    model, held_out = calibration(path)
    eff, how, runs = model.efficiency(step)
    terms = model.terms(step)
    if terms is None:
        return {"forecast_s": None, "forecast_source": how}
    modelled = sum(terms.values())
    total = max(modelled, interconnect_s)
    calibrated = model.calibrated(step)
    low, high = _range(total, held_out, calibrated, step.platform)
    n = band(held_out, calibrated, step.platform)[2]
    shown = ", ".join(f"{k.replace('_', ' ')} {v * 1e3:.3g} ms" for k, v in terms.items() if v)
    notes = []
    if step.precision == "fp8" and step.fp8_share < 1.0:
        rest, rest_how, _ = model.efficiency(step.fp8_rest)
        notes.append(f"compute: the fp8 layers' {step.fp8_share:.0%} of the block matmuls' "
                     f"FLOPs as an fp8 step, the rest as a bf16 one (bf16 efficiency "
                     f"{rest:.1%}: {rest_how})")
    if interconnect_s > modelled:
        notes.append(f"collectives {interconnect_s * 1e3:.4g} ms, longer, used")
    if total < floor_s:
        notes.append(f"the plan's estimate, {floor_s * 1e3:.4g} ms, is higher and is used")
    return {"forecast_s": max(total, floor_s), "forecast_low_s": max(low, floor_s),
            "forecast_high_s": max(high, floor_s), "forecast_efficiency": eff,
            "forecast_terms": terms, "forecast_calibrated": calibrated,
            "forecast_source": f"estimate:forecast ({step.precision} efficiency {eff:.1%} on "
                               f"{step.chip}: {how}; {shown}"
                               + "".join(f"; {n_}" for n_ in notes) + ")",
            "forecast_confidence": (
                f"80% range: the spread of the method's errors on {n} "
                f"{step.platform.upper()} runs of sources it had not seen"
                + ("" if calibrated else ", of steps like this one with no run of their own "
                   "chip and precision at this width (range widened)")),
            "calibration": [p.id for p in runs]}


__all__ = ["CALIBRATION_FILE", "CAVEAT", "DTYPES", "Model", "Point", "Step", "backtest", "band",
           "calibration", "fit", "forecast", "leave_one_out", "leave_one_source_out", "load",
           "recompute_flops", "shape_of", "sources", "step_of", "summary"]
