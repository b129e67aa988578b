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
out together), each source weighing one, taken separately for steps whose chip and precision
have their own runs within 2x of their width ("calibrated") and the rest ("extrapolated").
``backtest`` measures leave-one-out, leave-one-source-out, and the coverage of exactly that
range on sources the range itself had not seen.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics

import numpy as np
from scipy.optimize import nnls

from jaxaccel import devices as devices_lib
from jaxaccel import flops as flops_lib

CALIBRATION_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.json")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp8": "float8", "tf32": "float32",
          "fp32": "float32"}
CLASSES = {"bfloat16": "bf16", "float16": "bf16", "float8": "fp8", "float32": "fp32"}
RECOMPUTE_ALL = ("wq", "wk", "wv", "wo", "attention", "w_gate", "w_up", "w_out")
OPTIMIZER_BYTES_PER_PARAM = 28      # fp32 AdamW: read param, grad, 2 moments; write 3
ALPHAS = tuple(0.5 * i for i in range(1, 9))         # attention FLOP cost: 0.5 .. 4
KAPPAS = tuple(0.2 * i for i in range(7))            # recomputed FLOP cost: 0 .. 1.2
GENERATIONS = {     # device kinds that share one efficiency: one compute die, other memory
    "NVIDIA A100-SXM4-40GB": "A100 SXM", "NVIDIA A100-SXM4-80GB": "A100 SXM",
    "NVIDIA H100 80GB HBM3": "H100/H200 SXM", "NVIDIA H100": "H100/H200 SXM",
    "NVIDIA H200": "H100/H200 SXM"}
WIDTH_SPAN = 2.0                    # "calibrated": the chip's runs reach within 2x the width
QUANTILES = (0.1, 0.9)
MIN_BAND_POINTS = 8
CAVEAT = ("the forecast is the compute bound over the efficiency published runs reached on the "
          "chip plus fitted elementwise and per-layer costs (calibration.json); its range is "
          "the spread of its errors on published runs of sources it had not seen")


@dataclasses.dataclass(frozen=True)
class Step:
    """What the forecast reads from one training step, per chip."""

    device: str
    dtype: str                  # matmul dtype: bfloat16, float16, float8, float32
    dense_s: float              # the model's FLOPs but attention's, at the dtype's peak
    attention_s: float          # attention's (QK^T, AV) FLOPs at the peak
    recompute_s: float          # the recomputed forward's FLOPs at the peak
    width: int                  # hidden size
    layers: float               # layers one chip runs (a pipeline stage's)
    head: float                 # output head's width (the vocabulary of an LM)
    tokens: float               # tokens per chip per step
    recompute: float = 0.0      # share of the layers' forward recomputed (0..1)
    passes: float = 1.0         # forward-backward passes per step (micro-batches)
    optimizer_bytes: float = 0.0  # bytes the update reads and writes per chip
    power_limit_w: float | None = None
    hbm_bandwidth: float | None = None  # where it differs from the chip table's

    @property
    def compute_s(self) -> float:
        """The planner's compute bound: every FLOP the step runs, at the peak."""
        return self.dense_s + self.attention_s + self.recompute_s

    @property
    def platform(self) -> str:
        return "tpu" if self.device.startswith("TPU") else "gpu"

    @property
    def precision(self) -> str:
        return CLASSES[self.dtype]

    @property
    def generation(self) -> str:
        return GENERATIONS.get(self.device, self.device)

    @property
    def chip(self) -> str:
        """The efficiency's key: the chip's generation (``GENERATIONS``), and its power limit
        where a source lowered it."""
        return self.generation + (f" at {self.power_limit_w:g} W" if self.power_limit_w else "")

    @property
    def key(self) -> str:
        return f"efficiency:{self.chip}/{self.precision}"

    @property
    def bandwidth(self) -> float:
        return self.hbm_bandwidth or devices_lib.chip(self.device).hbm_bandwidth

    @property
    def optimizer_s(self) -> float:
        return self.optimizer_bytes / self.bandwidth

    def features(self, alpha: float, kappa: float) -> dict:
        """The inputs each fitted coefficient multiplies (module doc)."""
        elementwise = self.tokens * (self.layers * self.width * (1 + self.recompute / 3)
                                     + self.head) / self.bandwidth
        return {self.key: self.dense_s + alpha * self.attention_s + kappa * self.recompute_s,
                "elementwise": elementwise,
                f"layer:{self.platform}": self.passes * self.layers}


@dataclasses.dataclass(frozen=True)
class Point:
    """A published run: its step and the time it took."""

    id: str
    source_group: str
    step: Step
    published_s: float
    params: float
    task: str

    @property
    def efficiency(self) -> float:
        """Compute bound / published step: the share of peak the run reached."""
        return self.step.compute_s / self.published_s

    @property
    def size_class(self) -> str:
        return "<1B" if self.params < 1e9 else "1-10B" if self.params < 1e10 else \
            "10-100B" if self.params < 1e11 else ">=100B"

    @property
    def chip_family(self) -> str:
        for name in ("A100", "H100", "H200", "v4", "v5 lite", "v5", "v6 lite"):
            if name in self.step.device:
                return {"v5 lite": "TPU v5e", "v5": "TPU v5p", "v6 lite": "TPU v6e",
                        "v4": "TPU v4"}.get(name, name)
        return self.step.device


def shape_of(point: dict) -> flops_lib.Shape:
    """The published model's shape as ``jaxaccel.flops`` reads an architecture."""
    d = point["d_model"]
    head = point["head_weights"] if "head_weights" in point else point["vocab"] * d
    return flops_lib.Shape(
        hidden=d, layers=point["layers"], heads=point["heads"], kv_heads=point["kv_heads"],
        head_dim=point.get("head_dim") or d // point["heads"], intermediate=point["d_ff"],
        mlp_matrices=3 if point["gated_mlp"] else 2, head_weights=head,
        causal=point["family"] == "llama")


def recompute_flops(shape: flops_lib.Shape, parts, seq: int) -> float:
    """Forward FLOPs per token a remat policy recomputes: ``parts`` is "none", "full" or the
    recomputed matmuls (``RECOMPUTE_ALL``'s names; attention = QK^T and AV)."""
    if isinstance(parts, str):
        parts = {"none": (), "full": RECOMPUTE_ALL}[parts]
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    mlp = 2.0 * h * shape.intermediate
    forward = {"wq": 2.0 * h * q, "wk": 2.0 * h * kv, "wv": 2.0 * h * kv, "wo": 2.0 * h * q,
               "attention": shape.attention_flops(1, seq) / seq / shape.layers / 3,
               "w_gate": mlp if shape.mlp_matrices == 3 else 0.0, "w_up": mlp, "w_out": mlp}
    unknown = set(parts) - set(forward)
    if unknown:
        raise ValueError(f"unknown recompute parts {sorted(unknown)}: expected some of "
                         f"{RECOMPUTE_ALL}, 'none' or 'full'")
    return shape.layers * sum(forward[p] for p in parts)


def step_of(shape, device: str, dtype: str, tokens: float, seq: int, recomputed: float,
            idle: float = 0.0, stages: int = 1, passes: float = 1.0,
            optimizer_bytes: float = 0.0, **variant) -> Step:
    """The ``Step`` of ``tokens`` per chip of a model of ``shape`` (a ``jaxaccel.flops``
    shape; a ViT's encoder and decoder are read as one stack) in rows of ``seq`` tokens, with
    ``recomputed`` FLOPs per token rematerialised."""
    stacks = [shape] if isinstance(shape, flops_lib.Shape) else \
        [s for s in (shape.encoder, shape.decoder) if s is not None]
    rows = tokens / shape.row_tokens(seq)
    peak = devices_lib.peak_flops(device, dtype)[0] * (1.0 - idle)
    attention = flops_lib.attention_flops(shape, rows, seq)
    layers = sum(s.layers for s in stacks)
    full = flops_lib.recompute_flops(shape, rows, seq) / tokens
    return Step(device=device, dtype=dtype,
                dense_s=(flops_lib.train_flops(shape, rows, seq) - attention) / peak,
                attention_s=attention / peak, recompute_s=recomputed * tokens / peak,
                width=max(s.hidden for s in stacks), layers=layers / stages,
                head=sum(s.head_weights for s in stacks) / stacks[0].hidden, tokens=tokens,
                recompute=recomputed / full if full else 0.0, passes=passes,
                optimizer_bytes=optimizer_bytes, **variant)


def to_point(p: dict) -> Point:
    """A calibration point (docs/calibration.md has the fields) as the step it measured."""
    shape = shape_of(p)
    seq, chips = p["seq"], p["chips"]
    attn_seq = p.get("attention_seq", seq)  # packed documents attend within themselves
    tp, pp, cp = p.get("tp", 1), p.get("pp", 1), p.get("cp", 1)
    passes = p["global_batch"] / (p["micro_batch"] * chips // (tp * pp * cp))
    tokens = p["global_batch"] * seq / chips
    params = shape.matmul_weights + (0 if p.get("tied_embeddings") else p["vocab"] * shape.hidden)
    step = step_of(shape, p["device"], DTYPES[p["precision"]], tokens, attn_seq,
                   recompute_flops(shape, p.get("recompute", "none"), attn_seq),
                   idle=(pp - 1) / (p.get("vp", 1) * passes + pp - 1), stages=pp,
                   passes=passes,
                   optimizer_bytes=OPTIMIZER_BYTES_PER_PARAM * params
                   / p.get("optimizer_shards", chips),
                   power_limit_w=p.get("power_limit_w"), hbm_bandwidth=p.get("hbm_bandwidth"))
    return Point(p["id"], p["source_group"], step, tokens / p["tokens_per_s_per_chip"], params,
                 p.get("task", "pretraining"))


@functools.lru_cache(maxsize=4)
def _load(path: str) -> tuple:
    with open(path) as f:
        return tuple(to_point(p) for p in json.load(f)["points"])


def load(path: str = CALIBRATION_FILE) -> list[Point]:
    return list(_load(path))


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

        if step.power_limit_w and step.precision in chips.get(step.generation, {}):
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

    def terms(self, step: Step) -> dict | None:
        """Seconds per term (module doc); None where no efficiency can be had."""
        eff = self.efficiency(step)[0]
        if eff is None:
            return None
        f = step.features(self.alpha, self.kappa)
        plat = step.platform
        return {"compute": f[step.key] / eff,
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
    error at each (module doc)."""
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


def _error(model: Model, p: Point) -> dict:
    terms = model.terms(p.step)
    s = None if terms is None else sum(terms.values())
    return {"id": p.id, "source_group": p.source_group, "forecast_s": s,
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


def band(held_out: list[dict], calibrated: bool) -> tuple[float, float, int]:
    """(10th, 90th percentile, points) of held-out errors of steps like this one (calibrated
    or not; all where those are fewer than ``MIN_BAND_POINTS``), each source weighing one."""
    rows = [r for r in held_out if r["error"] is not None]
    like = [r for r in rows if r["calibrated"] == calibrated]
    rows = like if len(like) >= MIN_BAND_POINTS else rows
    count = {}
    for r in rows:
        count[r["source_group"]] = count.get(r["source_group"], 0) + 1
    errors = [r["error"] for r in rows]
    weights = [1.0 / count[r["source_group"]] for r in rows]
    lo, hi = (_weighted_quantile(errors, weights, q) for q in QUANTILES)
    return lo, hi, len(rows)


def _range(forecast_s: float, held_out: list[dict], calibrated: bool) -> tuple[float, float]:
    """The published step's 80% range for a forecast: errors are forecast / published - 1."""
    lo, hi, _ = band(held_out, calibrated)
    return forecast_s / (1 + hi), forecast_s / (1 + lo)


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
    low, high = _range(total, held_out, calibrated)
    n = band(held_out, calibrated)[2]
    shown = ", ".join(f"{k.replace('_', ' ')} {v * 1e3:.3g} ms" for k, v in terms.items() if v)
    notes = []
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
                "80% range: the spread of the method's errors on " + str(n) + " runs of "
                "sources it had not seen" + ("" if calibrated else
                                             ", of steps like this one with no run of their "
                                             "own chip and precision at this width (range "
                                             "widened)")),
            "calibration": [p.id for p in runs]}


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
                _range(r["forecast_s"], inner, r["calibrated"])
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
