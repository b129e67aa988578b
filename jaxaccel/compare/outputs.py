"""A comparison written out (``write``): comparison.md, .csv and .json, the plots and an
optional report.html."""
from __future__ import annotations

import csv
import html
import json
import os

from jaxaccel.compare.plots import plot_group
from jaxaccel.compare.score import STRATEGIES
from jaxaccel.compare.tables import markdown, records, slug, table_rows


def write(report: dict, out_dir: str, plots: bool = True, html_page: bool = False) -> list[str]:
    """comparison.md/.csv/.json, the plots and optionally report.html under ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    md = markdown(report)
    path = os.path.join(out_dir, "comparison.md")
    with open(path, "w") as f:
        f.write(md + "\n")
    written.append(path)
    recs = records(report)
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
            figures[i] = plot_group(g, out_dir, slug(i, g))
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
