"""Compare benchmark results across devices and configurations: time, cost, energy, utilisation.

Rows of the result files (``bench/results/<bench>-<device>.json``) are joined into groups that
ran the same work (the same bench and the fields in ``WORK_FIELDS``, or a file's ``work``
object); within a group each row is a candidate "device / configuration". Rows run with other
software (jax version, jaxaccel commit) than the group's majority are left out, and so are
duplicate candidates and groups of one, each with the reason.

Per candidate: time T (``time_s``, else ``median_s``), cost C = ``cost_usd`` or
T / 3600 x price per device-hour x devices, energy E (``energy_j``, or ``energy_kwh``; rows
without any get the labelled TDP estimate of jaxaccel/compare/energy.py) and utilisation O (MFU, else
NVML ``gpu_util_pct``, else ``occupancy_pct``: the first source every candidate has; none: the
O term is 0 and the table says so). Each metric is max-normalised over the group
(x / max x) and the study's score, lower is better, is::

    score = w1 T + w2 C + w3 E - w4 O,   w4 = 0.1

under seven strategies: ``balance`` (0.3, 0.3, 0.3) and, for each order of time, cost and
energy, the weights 0.5 / 0.3 / 0.1 in that order.
"""
from __future__ import annotations

import collections
import csv
import dataclasses
import html
import itertools
import json
import os
import re

from jaxaccel.compare import energy, prices

W4 = 0.1
STRATEGIES = {"balance": (0.3, 0.3, 0.3, W4)}
for _order in itertools.permutations(("time", "cost", "energy")):
    _w = dict(zip(_order, (0.5, 0.3, 0.1)))
    STRATEGIES["_".join(_order)] = (_w["time"], _w["cost"], _w["energy"], W4)

# Fields that say what work a row did, per bench: (file-level fields, row-level fields).
WORK_FIELDS = {
    "train_step": (("model", "seq"), ("batch",)),
    "attention": ((), ("shape", "mode", "B", "S", "H", "D", "causal", "dtype")),
    "optimizer": (("model", "parameters"), ()),
    "scaling": (("model", "seq", "batch"), ("strategy",)),
}
# Result files whose rows join another bench's: a compile-time plan (`jaxaccel compile`) of a
# step sits beside measured steps of the same model, sequence and global batch, its time,
# tokens/s and cost marked as estimates (the row's ``time_source``).
SAME_WORK_AS = {"plan": "train_step"}
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


@dataclasses.dataclass
class Candidate:
    """One row of one result file, with the metrics the score needs."""
    label: str
    device: str
    config: str
    file: str
    software: str
    time_s: float
    cost_usd: float
    price: str
    energy_j: float
    energy_source: str
    row: dict
    time_source: str = "measured"      # or "estimate:..." (a compile-time plan)
    utilisation: float | None = None
    normalised: dict = dataclasses.field(default_factory=dict)
    scores: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Group:
    bench: str
    work: dict
    candidates: list
    utilisation_source: str | None = None
    notes: list = dataclasses.field(default_factory=list)

    @property
    def title(self) -> str:
        work = ", ".join(f"{k}={v}" for k, v in self.work.items() if v is not None)
        return f"{self.bench}: {work}" if work else self.bench


def load_results(paths: list[str]) -> list[tuple[str, dict]]:
    """``(path, result)`` per file; clear errors for a missing or malformed file."""
    out = []
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"result file {path!r} does not exist; pass files written by "
                                    "`jaxaccel bench` (bench/results/<bench>-<device>.json).")
        try:
            with open(path) as f:
                result = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"result file {path!r} is not JSON ({e}).") from None
        missing = [k for k in ("bench", "device", "rows") if k not in result]
        if missing:
            raise ValueError(f"result file {path!r} lacks {missing}; expected the bench JSON "
                             '{"bench", "device", ..., "rows": [...]}.')
        if not result["rows"]:
            raise ValueError(f"result file {path!r} has no rows: nothing to compare from it "
                             "(did its bench run fail?). Run the bench again, or leave the "
                             "file out.")
        out.append((path, result))
    return out


def check_comparable(report: dict) -> None:
    """``ValueError`` saying why, when no two rows of the report could be compared."""
    if not report["groups"]:
        why = "; ".join(f"{x['row']} ({x['file']}): {x['why']}" for x in report["left_out"])
        raise ValueError(f"nothing to compare: no two rows ran the same work with the same "
                         f"software. {why or 'No rows.'} Pass result files of the same bench "
                         "and work from two devices or configurations.")


def bench_of(result: dict) -> str:
    """The bench whose work a result file's rows did (``SAME_WORK_AS``)."""
    return SAME_WORK_AS.get(result["bench"], result["bench"])


def work_of(result: dict, row: dict) -> dict:
    """What a row computed: joins rows across files and configurations."""
    bench = bench_of(result)
    if bench in WORK_FIELDS:
        top, per_row = WORK_FIELDS[bench]
        return {**{k: result.get(k) for k in top}, **{k: row.get(k) for k in per_row}}
    return {**result.get("work", {}), **row.get("work", {})}


def _time(row: dict, path: str) -> float:
    t = row.get("time_s", row.get("median_s"))
    if not isinstance(t, (int, float)) or not t > 0:
        raise ValueError(f"{path}: row {row.get('name')!r} has no positive time_s or median_s "
                         f"(got {t!r}).")
    return float(t)


def _energy(result: dict, row: dict, seconds: float) -> tuple[float, str]:
    """Measured or recorded energy; else the labelled TDP estimate (never zero)."""
    if "energy_j" in row:
        return float(row["energy_j"]), row.get("energy_source", result.get("energy_source",
                                                                           "unknown"))
    if "energy_kwh" in row:
        return float(row["energy_kwh"]) * 3.6e6, row.get("energy_source",
                                                          result.get("energy_source", "unknown"))
    devices = result.get("energy_devices", result.get("device_count", 1))
    est = energy.estimate(result["device"], devices, seconds, row.get("mfu"))
    return est["energy_j"], est["energy_source"]


def candidates(loaded: list[tuple[str, dict]], price_table: list) -> list[tuple]:
    """Every row as ``(bench, work, Candidate)``."""
    out = []
    for path, result in loaded:
        software = f"jax {result.get('jax', '?')} @ {result.get('jaxaccel', '?')}"
        devices = result.get("device_count", 1)
        for row in result["rows"]:
            seconds = _time(row, path)
            if "cost_usd" in row:
                cost, price = float(row["cost_usd"]), "recorded in the result file"
            else:
                p = prices.lookup(result["device"], price_table)
                cost = seconds / 3600 * p.usd_per_hour * devices
                price = f"{p.device}: ${p.usd_per_hour}/h x {devices} ({p.source}, {p.date})"
            joules, source = _energy(result, row, seconds)
            name = row.get("name", "?")
            label = f"{result['device']} / {name}" + (f" x{devices}" if devices > 1 else "")
            out.append((bench_of(result), work_of(result, row),
                        Candidate(label, result["device"], name, path, software, seconds, cost,
                                  price, joules, source, row,
                                  row.get("time_source", "measured"))))
    return out


def join(cands, mixed_versions: bool = False) -> tuple[list[Group], list[dict]]:
    """Groups of candidates that ran the same work with the same software; and what was left
    out, with the reason."""
    groups: dict = collections.OrderedDict()
    for bench, work, c in cands:
        key = (bench, json.dumps(work, sort_keys=True, default=str))
        groups.setdefault(key, Group(bench, work, [])).candidates.append(c)
    kept, left_out = [], []

    def leave(c, why):
        left_out.append({"row": c.label, "file": c.file, "why": why})
    for g in groups.values():
        counts = collections.Counter(c.software for c in g.candidates)
        main = max(counts, key=lambda s: (counts[s], -[c.software for c in g.candidates]
                                          .index(s)))
        seen, members = set(), []
        for c in g.candidates:
            if c.software != main and not mixed_versions:
                leave(c, f"software {c.software} differs from the group's {main} "
                         f"({g.title}); rerun on one version or pass --mixed-versions")
            elif c.label in seen:
                leave(c, f"duplicate of {c.label!r} in an earlier file ({g.title})")
            else:
                seen.add(c.label)
                members.append(c)
        if len(counts) > 1 and mixed_versions:
            g.notes.append(f"joined across software versions (--mixed-versions): "
                           f"{sorted(counts)}")
        if len(members) < 2:
            for c in members:
                leave(c, f"nothing else ran the same work ({g.title})")
            continue
        g.candidates = members
        kept.append(g)
    return kept, left_out


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


# ---------------------------------------------------------------- tables

def _energy_unit(group: Group) -> tuple[str, float]:
    return ("kWh", 3.6e6) if max(c.energy_j for c in group.candidates) >= 3.6e4 else ("J", 1.0)


def _accuracy(c: Candidate):
    return c.row.get("final_accuracy", c.row.get("eval_accuracy"))


def table_rows(group: Group, rank_by: str) -> tuple[list[str], list[list[str]]]:
    """Header and formatted rows of one group's table; the best score per strategy in bold."""
    unit, div = _energy_unit(group)
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


def _records(report: dict) -> list[dict]:
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


def _slug(i: int, g: Group) -> str:
    return f"{i:02d}-" + re.sub(r"[^A-Za-z0-9]+", "_", g.title).strip("_").lower()[:60]


# ---------------------------------------------------------------- plots

def _log_if_wide(set_scale, values) -> None:
    """Log axis when the values span more than 100x (a CPU beside an accelerator)."""
    if max(values) > 100 * min(values) > 0:
        set_scale("log")


def plot_group(g: Group, out_dir: str, stem: str) -> list[str]:
    """Bars (time, cost, energy), time-vs-cost scatter (marker size = energy), score heat map."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [c.label for c in g.candidates]
    unit, div = _energy_unit(g)
    paths = []

    fig, axes = plt.subplots(1, 3, figsize=(13, 1.2 + 0.45 * len(labels)), sharey=True)
    for ax, (name, vals) in zip(axes, (("time s", [c.time_s for c in g.candidates]),
                                       ("cost $", [c.cost_usd for c in g.candidates]),
                                       (f"energy {unit}", [c.energy_j / div
                                                          for c in g.candidates]))):
        colors = ["tab:gray" if name.startswith("energy") and
                  c.energy_source.startswith("estimate") else "tab:blue" for c in g.candidates]
        ax.barh(range(len(labels)), vals, color=colors)
        _log_if_wide(ax.set_xscale, vals)
        ax.set_title(name + (" (grey: estimate)" if "tab:gray" in colors else ""), fontsize=9)
        ax.tick_params(labelsize=8)
    axes[0].set_yticks(range(len(labels)), labels)
    axes[0].invert_yaxis()
    fig.suptitle(g.title, fontsize=10)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, f"{stem}-bars.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 5))
    e = [c.energy_j for c in g.candidates]
    sizes = [60 + 600 * v / max(e) for v in e]
    ax.scatter([c.time_s for c in g.candidates], [c.cost_usd for c in g.candidates], s=sizes,
               alpha=0.6)
    for c in g.candidates:
        ax.annotate(c.label, (c.time_s, c.cost_usd), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    _log_if_wide(ax.set_xscale, [c.time_s for c in g.candidates])
    _log_if_wide(ax.set_yscale, [c.cost_usd for c in g.candidates])
    ax.set_xlabel("time s")
    ax.set_ylabel("cost $")
    ax.set_title(f"{g.title}\nmarker area ~ energy", fontsize=9)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, f"{stem}-scatter.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    strategies = list(g.candidates[0].scores)
    grid = [[c.scores[s] for s in strategies] for c in g.candidates]
    fig, ax = plt.subplots(figsize=(2 + 1.1 * len(strategies), 1.2 + 0.45 * len(labels)))
    im = ax.imshow(grid, cmap="viridis_r", aspect="auto")
    for i, row in enumerate(grid):
        best = [min(r[j] for r in grid) for j in range(len(strategies))]
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.3f}" + ("*" if v == best[j] else ""), ha="center",
                    va="center", fontsize=7, color="w" if v > (max(map(max, grid)) +
                                                            min(map(min, grid))) / 2 else "k")
    ax.set_xticks(range(len(strategies)), strategies, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_title(f"score (lower is better, * best)\n{g.title}", fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, f"{stem}-scores.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


# ---------------------------------------------------------------- outputs

def write(report: dict, out_dir: str, plots: bool = True, html_page: bool = False) -> list[str]:
    """comparison.md/.csv/.json, the plots and optionally report.html under ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    md = markdown(report)
    path = os.path.join(out_dir, "comparison.md")
    with open(path, "w") as f:
        f.write(md + "\n")
    written.append(path)
    recs = _records(report)
    path = os.path.join(out_dir, "comparison.csv")
    with open(path, "w", newline="") as f:
        fields = list(dict.fromkeys(k for r in recs for k in r))
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(recs)
    written.append(path)
    path = os.path.join(out_dir, "comparison.json")
    with open(path, "w") as f:
        json.dump({"rank_by": report["rank_by"], "weights": report["weights"],
                   "strategies": STRATEGIES, "rows": recs, "left_out": report["left_out"],
                   "groups": [{"title": g.title, "bench": g.bench, "work": g.work,
                               "utilisation_source": g.utilisation_source, "notes": g.notes}
                              for g in report["groups"]]}, f, indent=2, default=str)
    written.append(path)
    figures = {}
    if plots:
        for i, g in enumerate(report["groups"]):
            figures[i] = plot_group(g, out_dir, _slug(i, g))
            written += figures[i]
    if html_page:
        written.append(_html(report, out_dir, figures))
    return written


def _cells(values: list[str], tag: str) -> str:
    """HTML cells of a table row; Markdown bold becomes <b>."""
    return "".join(f"<{tag}><b>{html.escape(v[2:-2])}</b></{tag}>" if v.startswith("**")
                   else f"<{tag}>{html.escape(v)}</{tag}>" for v in values)


def _html(report: dict, out_dir: str, figures: dict) -> str:
    esc = html.escape
    parts = ["<!doctype html><meta charset='utf-8'><title>jaxaccel compare</title>",
             "<style>body{font-family:sans-serif;max-width:1400px;margin:auto}"
             "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;"
             "padding:3px 6px;text-align:right}td:first-child{text-align:left}</style>",
             "<h1>jaxaccel compare</h1>",
             f"<p>{esc(markdown(report).splitlines()[0])}</p>"]
    for i, g in enumerate(report["groups"]):
        header, rows = table_rows(g, report["rank_by"])
        parts += [f"<h2>{esc(g.title)}</h2><table><tr>{_cells(header, 'th')}</tr>"]
        parts += [f"<tr>{_cells(r, 'td')}</tr>" for r in rows] + ["</table>"]
        parts += [f"<p>{esc(n)}</p>" for n in [f"utilisation O: {g.utilisation_source}"]
                  + g.notes]
        parts += [f"<img src='{os.path.basename(p)}' style='max-width:100%'>"
                  for p in figures.get(i, [])]
    if report["left_out"]:
        parts += ["<h2>Left out</h2><ul>"] + [f"<li>{esc(x['row'])} ({esc(x['file'])}): "
                                              f"{esc(x['why'])}</li>"
                                              for x in report["left_out"]] + ["</ul>"]
    path = os.path.join(out_dir, "report.html")
    with open(path, "w") as f:
        f.write("\n".join(parts))
    return path
