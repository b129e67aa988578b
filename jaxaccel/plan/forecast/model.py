"""The fit: the forecast's coefficients from published runs (``fit``), and the fitted model
applied to a step (``Model``: its efficiency, borrowed where the chip and precision have no run
of their own, and the seconds of each term). ``jaxaccel.plan.forecast``'s doc has the formula."""
from __future__ import annotations

import dataclasses
import statistics

import numpy as np
from scipy.optimize import nnls

from jaxaccel.plan.forecast.points import Step

ALPHAS = tuple(0.5 * i for i in range(1, 9))         # attention FLOP cost: 0.5 .. 4
KAPPAS = tuple(0.2 * i for i in range(7))            # recomputed FLOP cost: 0 .. 1.2
WIDTH_SPAN = 2.0                    # "calibrated": the chip's runs reach within 2x the width


@dataclasses.dataclass(frozen=True)
class Model:
    """The fitted coefficients, and the runs each chip and precision's efficiency came from."""

    coef: dict
    alpha: float
    kappa: float
    runs: dict      # Step.key -> [Point]

    def efficiency(self, step: Step) -> tuple[float | None, str, list]:
        """(efficiency, where it came from, the runs behind it): the chip and precision's own
        where it has runs; else the same chip at full power; else the chip's other precision
        times the ratio between the two on the platform's chips that have both; else the
        chip's bf16 efficiency; else the median of the platform's chips at this precision,
        then at bf16. Anything but the first is "borrowed"."""
        if self.coef.get(step.key):
            runs = self.runs[step.key]
            sources = len({p.source_group for p in runs})
            return 1 / self.coef[step.key], f"{len(runs)} run(s) from {sources} source(s)", runs
        chips = {}
        for key, c in self.coef.items():
            if key.startswith("efficiency:") and c > 0:
                chip, cls = key.split(":", 1)[1].rsplit("/", 1)
                chips.setdefault(chip, {})[cls] = 1 / c

        def runs(*pairs):
            return [p for chip, cls in pairs for p in self.runs[f"efficiency:{chip}/{cls}"]]

        if step.power_limited and step.precision in chips.get(step.generation, {}):
            return chips[step.generation][step.precision], \
                f"borrowed: {step.generation} at full power", \
                runs((step.generation, step.precision))
        platform = {c: e for c, e in chips.items()
                    if c.startswith("TPU") == (step.platform == "tpu") and c != step.chip}
        own = chips.get(step.chip, {})
        for other, eff in sorted(own.items()):
            ratios = {c: e[step.precision] / e[other] for c, e in platform.items()
                      if step.precision in e and other in e}
            if ratios:
                return eff * statistics.median(ratios.values()), \
                    f"borrowed: this chip's {other} efficiency x the {step.precision}/{other} " \
                    f"ratio of {len(ratios)} other chip(s)", runs((step.chip, other))
        if "bf16" in own:
            return own["bf16"], "borrowed: this chip's bf16 efficiency", \
                runs((step.chip, "bf16"))
        for cls in (step.precision, "bf16"):
            effs = {c: e[cls] for c, e in platform.items() if cls in e}
            if effs:
                return statistics.median(effs.values()), \
                    f"borrowed: the median {cls} efficiency of {len(effs)} other " \
                    f"{step.platform.upper()}(s)", runs(*((c, cls) for c in effs))
        return None, f"none: no calibration point on a {step.platform.upper()}", []

    def compute_s(self, step: Step) -> float | None:
        """The compute term: the step's FLOPs at the peak over the efficiency its chip and
        precision reached. An fp8 step with only a share of its block matmuls in fp8
        (``Step.fp8_share``; a published fp8 run has them all) is that share of the step as
        an fp8 one and the rest of it as a bf16 one, each at its own efficiency."""
        eff = self.efficiency(step)[0]
        if eff is None:
            return None
        compute = step.features(self.alpha, self.kappa)[step.key] / eff
        if step.precision != "fp8" or step.fp8_share >= 1.0:
            return compute
        rest = self.compute_s(step.fp8_rest)
        return None if rest is None else \
            step.fp8_share * compute + (1.0 - step.fp8_share) * rest

    def terms(self, step: Step) -> dict | None:
        """Seconds per term; None where no efficiency can be had."""
        compute = self.compute_s(step)
        if compute is None:
            return None
        f = step.features(self.alpha, self.kappa)
        plat = step.platform
        return {"compute": compute,
                "elementwise": self.coef.get("elementwise", 0.0) * f["elementwise"],
                "per_layer": self.coef.get(f"layer:{plat}", 0.0) * f[f"layer:{plat}"],
                "optimizer": step.optimizer_s}

    def calibrated(self, step: Step) -> bool:
        """Whether the chip and precision have their own runs within 2x of the step's width."""
        widths = [p.step.width for p in self.runs.get(step.key, ())]
        return bool(widths) and \
            min(widths) / WIDTH_SPAN <= step.width <= max(widths) * WIDTH_SPAN


def fit(points) -> Model:
    """``alpha`` and ``kappa`` by a grid search (``ALPHAS`` x ``KAPPAS``, then their halved
    steps around the best), the other coefficients by non-negative least squares on relative
    error at each."""
    points = list(points)
    rows = [p.step.features(0.0, 0.0) for p in points]
    columns = sorted({k for r in rows for k in r})
    published = np.array([p.published_s for p in points])
    a = np.array([[r.get(c, 0.0) for c in columns] for r in rows]) / published[:, None]
    b = 1.0 - np.array([p.step.optimizer_s for p in points]) / published
    col = np.array([columns.index(p.step.key) for p in points])
    attention, recompute = (np.array([getattr(p.step, k) for p in points]) / published
                            for k in ("attention_s", "recompute_s"))

    def solve(alpha, kappa):
        a[np.arange(len(points)), col] = np.array([p.step.dense_s for p in points]) \
            / published + alpha * attention + kappa * recompute
        x, residual = nnls(a, b)
        return residual, alpha, kappa, x

    best = min((solve(al, ka) for al in ALPHAS for ka in KAPPAS), key=lambda t: t[0])
    da, dk = (ALPHAS[1] - ALPHAS[0]) / 2, (KAPPAS[1] - KAPPAS[0]) / 2
    best = min((solve(best[1] + i * da, max(best[2] + j * dk, 0.0))
                for i in (-1, 0, 1) for j in (-1, 0, 1)), key=lambda t: t[0])
    runs = {}
    for p in points:
        runs.setdefault(p.step.key, []).append(p)
    return Model(dict(zip(columns, best[3].tolist())), best[1], best[2], runs)
