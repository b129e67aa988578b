"""The study's score (``score``: max-normalised time, cost, energy and utilisation, weighted
under each strategy) and the whole comparison (``compare``: load, join, score, rank)."""
from __future__ import annotations

import itertools

from jaxaccel.compare import prices
from jaxaccel.compare.join import Group, candidates, join, load_results

W4 = 0.1
STRATEGIES = {"balance": (0.3, 0.3, 0.3, W4)}
for _order in itertools.permutations(("time", "cost", "energy")):
    _w = dict(zip(_order, (0.5, 0.3, 0.1)))
    STRATEGIES["_".join(_order)] = (_w["time"], _w["cost"], _w["energy"], W4)
UTILISATION = (("mfu", 1.0, "MFU"), ("gpu_util_pct", 0.01, "NVML utilization.gpu"),
               ("occupancy_pct", 0.01, "occupancy"))


def parse_weights(spec: str | None) -> tuple[str, tuple[float, float, float, float] | None]:
    """``(strategy to rank by, custom weights or None)`` from ``--weights``."""
    if spec is None:
        return "balance", None
    if spec in STRATEGIES:
        return spec, None
    parts = spec.split(",")
    try:
        weights = tuple(float(p) for p in parts)
    except ValueError:
        weights = ()
    if len(weights) != 4 or not all(w >= 0 for w in weights) or not any(weights[:3]):
        raise ValueError(f"--weights {spec!r} is neither a strategy ({', '.join(STRATEGIES)}) "
                         "nor four non-negative numbers w1,w2,w3,w4 (time, cost, energy, "
                         "utilisation), e.g. 0.5,0.3,0.1,0.1.")
    return "custom", weights


def score(group: Group, custom: tuple | None = None) -> None:
    """Max-normalise T, C, E, O over the group and score it under every strategy."""
    cs = group.candidates
    for key, scale, name in UTILISATION:
        if all(isinstance(c.row.get(key), (int, float)) for c in cs):
            group.utilisation_source = name
            for c in cs:
                c.utilisation = c.row[key] * scale
            break
    else:
        group.notes.append("no utilisation source common to all rows (MFU, NVML, occupancy): "
                           "the O term is 0")
    sources = sorted({c.energy_source for c in cs})
    if len(sources) > 1:
        group.notes.append(f"energy sources differ ({', '.join(sources)}): estimates are marked ~")
    planned = sorted({c.time_source for c in cs if c.time_source != "measured"})
    if planned:
        group.notes.append(f"times, tokens/s and costs marked ~ are compile-time estimates "
                           f"({', '.join(planned)}; `jaxaccel compile`), not measurements")
    metrics = {"T": [c.time_s for c in cs], "C": [c.cost_usd for c in cs],
               "E": [c.energy_j for c in cs], "O": [c.utilisation or 0.0 for c in cs]}
    for k, values in metrics.items():
        top = max(values)
        for c, v in zip(cs, values):
            c.normalised[k] = v / top if top > 0 else 0.0
    strategies = dict(STRATEGIES, **({"custom": custom} if custom else {}))
    for c in cs:
        n = c.normalised
        c.scores = {s: w1 * n["T"] + w2 * n["C"] + w3 * n["E"] - w4 * n["O"]
                    for s, (w1, w2, w3, w4) in strategies.items()}


def compare(paths: list[str], prices_file: str | None = None, weights: str | None = None,
            mixed_versions: bool = False) -> dict:
    """Load, join and score; returns ``{"groups", "left_out", "rank_by", "weights"}``."""
    rank_by, custom = parse_weights(weights)
    table = (prices.load(prices_file) if prices_file else []) + prices.PRICES
    groups, left_out = join(candidates(load_results(paths), table), mixed_versions)
    for g in groups:
        score(g, custom)
        g.candidates.sort(key=lambda c: c.scores[rank_by])
    return {"groups": groups, "left_out": left_out, "rank_by": rank_by,
            "weights": custom or STRATEGIES[rank_by]}
