"""How far off the planner's forecast is on published runs it has not seen: every run of the
calibration set forecast by a fit without its whole source (leave-one-source-out), beside
leave-one-out, the roofline bound and the 80% range the forecast would print for it.

    jaxaccel bench backtest [--out bench/results/backtest]

Each run's step is the published model's shape at its tokens per chip per step through the
planner's own FLOP formula and peaks (``jaxaccel.plan.forecast``); these 0.1B-1T models on
1-1024 chips are not compiled here, so only their compute bound is the plan's. The range of a
held-out source's runs comes from the errors on the other sources alone, so its coverage is
measured on sources the range had not seen. Prints Markdown tables (by chip, by model size, by
source, this project's own measured steps held out and as a plan forecasts them now, every run) and writes ``DIR/backtest-calibration.json`` (its own folder: it is no
device's result, which ``jaxaccel compare bench/results/*.json`` reads).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWN = "jaxaccel (this repository)"     # the source groups of this project's own measurements
SIZES = {"<1B": 0, "1-10B": 1, "10-100B": 2, ">=100B": 3}
GROUPS = (("platform", "platform"), ("chip", "chip_family"), ("model size", "size_class"),
          ("source", "source_group"), ("task", "task"), ("precision", "precision"),
          ("own runs of the chip and precision at that width", "calibrated"))


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def grouped(rows: list[dict], key: str) -> list[dict]:
    """One summary per value of ``key``: leave-one-source-out, leave-one-out, roofline."""
    from jaxaccel.plan import forecast
    out = []
    values = sorted({r[key] for r in rows}, key=lambda v: (SIZES.get(v, len(SIZES)), str(v)))
    for value in values:
        part = [r for r in rows if r[key] == value]
        out.append({key: value, **forecast.summary(part),
                    "loo_median_abs_error": forecast.summary(part, "loo_error")[
                        "median_abs_error"],
                    "roofline_median_abs_error": forecast.summary(part, "roofline_error")[
                        "median_abs_error"]})
    return out


def group_table(title: str, groups: list[dict], key: str) -> str:
    head = [title, "runs", "sources", "held-out source: median abs error",
            "in its 80% range", "leave-one-out", "roofline"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        out.append("| " + " | ".join([
            str(g[key]), str(g["points"]), str(g["sources"]), _pct(g["median_abs_error"]),
            f"{g['within_range']}/{g['points']} ({g['coverage']:.0%})",
            _pct(g["loo_median_abs_error"]), _pct(g["roofline_median_abs_error"])]) + " |")
    return "\n".join(out)


def point_table(rows: list[dict]) -> str:
    head = ["run", "chip", "published step s", "forecast s (80% range)", "error",
            "leave-one-out error", "roofline error", "efficiency from"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        out.append("| " + " | ".join([
            f"`{r['id']}`", r["chip_family"], f"{r['published_step_s']:.3g}",
            f"{r['forecast_s']:.3g} ({r['forecast_low_s']:.3g}-{r['forecast_high_s']:.3g})",
            f"{r['error']:+.0%}", f"{r['loo_error']:+.0%}", f"{r['roofline_error']:+.0%}",
            r["efficiency_from"]]) + " |")
    return "\n".join(out)


def own_runs(rows: list[dict]) -> list[dict]:
    """This project's measured steps: the forecast with their source held out (the fit on the
    other sources, which is what a plan printed before they were added) and the forecast a plan
    prints now (the fit on every run, these included), each with its range, beside the step."""
    from jaxaccel.plan import forecast
    points = {p.id: p for p in forecast.load()}
    out = []
    for r in (r for r in rows if r["source_group"].startswith(OWN)):
        step = points[r["id"]].step
        now = forecast.forecast(step, step.compute_s)
        out.append({"id": r["id"], "published_step_s": r["published_step_s"],
                    **{f"held_out_{k}": r[k] for k in ("forecast_s", "forecast_low_s",
                                                       "forecast_high_s", "error")},
                    **{f"now_{k}": now[k] for k in ("forecast_s", "forecast_low_s",
                                                    "forecast_high_s")},
                    "now_error": now["forecast_s"] / r["published_step_s"] - 1})
    return out


def own_table(runs: list[dict]) -> str:
    head = ["run", "measured ms", "held out: forecast ms (80% range)", "error",
            "fit on every run: forecast ms (80% range)", "error"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        cells = [f"`{r['id']}`", f"{r['published_step_s'] * 1e3:.3g}"]
        for k in ("held_out", "now"):
            cells += [f"{r[f'{k}_forecast_s'] * 1e3:.3g} ({r[f'{k}_forecast_low_s'] * 1e3:.3g}-"
                      f"{r[f'{k}_forecast_high_s'] * 1e3:.3g})", f"{r[f'{k}_error']:+.0%}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def result() -> dict:
    from jaxaccel.plan import forecast
    rows = forecast.backtest()
    model = forecast.calibration()[0]
    return {"bench": "backtest", "date": datetime.date.today().isoformat(),
            "method": " ".join(forecast.__doc__.split("\n\n")[1:3]).replace("\n", " "),
            "calibration": os.path.relpath(forecast.CALIBRATION_FILE, ROOT),
            "fit_on_all_runs": {"alpha": model.alpha, "kappa": model.kappa,
                                "coefficients": model.coef},
            "summary": {"leave_one_source_out": forecast.summary(rows),
                        "leave_one_out": forecast.summary(rows, "loo_error"),
                        "roofline": forecast.summary(rows, "roofline_error")},
            "by": {key: grouped(rows, key) for _, key in GROUPS},
            "own_runs": own_runs(rows),
            "rows": rows}


def report(res: dict) -> str:
    s = res["summary"]
    loso = s["leave_one_source_out"]
    parts = [f"{loso['points']} published runs from {loso['sources']} sources. Median "
             f"absolute error: held-out source {_pct(loso['median_abs_error'])}, "
             f"leave-one-out {_pct(s['leave_one_out']['median_abs_error'])}, roofline "
             f"{_pct(s['roofline']['median_abs_error'])}; published step inside the printed "
             f"80% range: {loso['within_range']} of {loso['points']} "
             f"({loso['coverage']:.0%})."]
    for title, key in GROUPS:
        parts.append(group_table(title, res["by"][key], key))
    parts.append(own_table(res["own_runs"]))
    parts.append(point_table(res["rows"]))
    return "\n\n".join(parts)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", metavar="DIR", help="write DIR/backtest-calibration.json")
    args = p.parse_args(argv)
    if args.out:
        from jaxaccel.storage import check_out_dir
        check_out_dir(args.out)
    res = result()
    print(report(res))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "backtest-calibration.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
