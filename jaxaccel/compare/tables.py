"""A comparison as tables: one group's rows formatted (``table_rows``), the Markdown page
(``markdown``) and the flat records of the CSV and JSON files (``records``)."""
from __future__ import annotations

import re

from jaxaccel.compare.join import Candidate, Group


def energy_unit(group: Group) -> tuple[str, float]:
    return ("kWh", 3.6e6) if max(c.energy_j for c in group.candidates) >= 3.6e4 else ("J", 1.0)


def _accuracy(c: Candidate):
    return c.row.get("final_accuracy", c.row.get("eval_accuracy"))


def table_rows(group: Group, rank_by: str) -> tuple[list[str], list[list[str]]]:
    """Header and formatted rows of one group's table; the best score per strategy in bold."""
    unit, div = energy_unit(group)
    strategies = list(group.candidates[0].scores)
    best = {s: min(c.scores[s] for c in group.candidates) for s in strategies}
    header = ["device / configuration", "time s", "tokens/s", "MFU", "cost $", f"energy {unit}",
              "accuracy", "T", "C", "E", "O"] + [s + (" (rank)" if s == rank_by else "")
                                                  for s in strategies]

    def num(v, fmt=".4g"):
        return "-" if v is None else format(v, fmt)
    rows = []
    for c in group.candidates:
        est = "~" if c.energy_source.startswith("estimate") else ""
        t = "~" if c.time_source != "measured" else ""
        rows.append([c.label, t + num(c.time_s, ".6g"),
                     t + num(c.row.get("tokens_per_s"), ".0f"),
                     num(c.row.get("mfu"), ".3f"), t + num(c.cost_usd), est + num(c.energy_j / div),
                     num(_accuracy(c), ".4f")]
                    + [num(c.normalised[k], ".3f") for k in "TCEO"]
                    + [f"**{c.scores[s]:.3f}**" if c.scores[s] == best[s] else
                       f"{c.scores[s]:.3f}" for s in strategies])
    return header, rows


def markdown(report: dict) -> str:
    out = [f"Score = w1 T + w2 C + w3 E - w4 O over max-normalised metrics (lower is better; "
           f"best per strategy in bold; ranked by {report['rank_by']} "
           f"{report['weights']}); ~ marks an estimate (energy: TDP; time, tokens/s, cost: a "
           f"compile-time plan)."]
    for g in report["groups"]:
        header, rows = table_rows(g, report["rank_by"])
        out += ["", f"### {g.title}", "", "| " + " | ".join(header) + " |",
                "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]
        out += [f"- utilisation O: {g.utilisation_source or 'none'}"] + \
               [f"- {n}" for n in g.notes]
    if report["left_out"]:
        out += ["", "Left out:"] + [f"- {x['row']} ({x['file']}): {x['why']}"
                                    for x in report["left_out"]]
    return "\n".join(out)


def records(report: dict) -> list[dict]:
    recs = []
    for i, g in enumerate(report["groups"]):
        for c in g.candidates:
            recs.append({"group": i, "bench": g.bench, "work": g.title, "label": c.label,
                         "device": c.device, "config": c.config, "file": c.file,
                         "software": c.software, "time_s": c.time_s,
                         "time_source": c.time_source, "cost_usd": c.cost_usd,
                         "price": c.price, "energy_j": c.energy_j,
                         "energy_source": c.energy_source, "utilisation": c.utilisation,
                         "utilisation_source": g.utilisation_source,
                         "tokens_per_s": c.row.get("tokens_per_s"), "mfu": c.row.get("mfu"),
                         "accuracy": _accuracy(c),
                         **{f"norm_{k}": v for k, v in c.normalised.items()},
                         **{f"score_{k}": v for k, v in c.scores.items()}})
    return recs


def slug(i: int, g: Group) -> str:
    return f"{i:02d}-" + re.sub(r"[^A-Za-z0-9]+", "_", g.title).strip("_").lower()[:60]
