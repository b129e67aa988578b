"""How far off the planner's forecast is: every published point of the calibration set
forecast from the others (leave-one-out), beside what was published and the roofline bound.

    jaxaccel bench backtest [--out bench/results/backtest]

Each point's step is the published model's shape at its tokens per chip per step, through the
planner's own FLOP formula and peak table (``jaxaccel.plan.forecast``): the compute bound
that a plan of that shape has (these are compute-bound steps of 7B-70B models on 8-256
chips, which this laptop-class machine does not compile; their memory and collective bounds
are not modelled here). Prints a Markdown table and writes ``DIR/backtest-calibration.json``
(its own folder: it is no device's result, which ``jaxaccel compare bench/results/*.json``
reads).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def table(rows: list[dict], summary: dict) -> str:
    head = ["point", "device", "published step s", "roofline s (error)",
            "forecast s (range)", "error", "calibrated on"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        out.append("| " + " | ".join([
            r["id"], r["device"], f"{r['published_step_s']:.3g}",
            f"{r['roofline_s']:.3g} ({r['roofline_error']:+.0%})",
            f"{r['forecast_s']:.3g} ({r['forecast_low_s']:.3g}-{r['forecast_high_s']:.3g})",
            f"{r['forecast_error']:+.0%}", ", ".join(r["calibration"])]) + " |")
    out.append("")
    out.append(f"median absolute error over {summary['forecast_points']} points: forecast "
               f"{summary['median_abs_forecast_error']:.1%}, roofline "
               f"{summary['median_abs_roofline_error']:.1%}; published step within the "
               f"forecast's range: {summary['within_range']} of {summary['forecast_points']}; "
               f"forecast closer than the roofline: {summary['closer_than_roofline']} of "
               f"{summary['forecast_points']}")
    return "\n".join(out)


def result() -> dict:
    from jaxaccel.plan import forecast
    rows = forecast.backtest()
    return {"bench": "backtest", "date": datetime.date.today().isoformat(),
            "method": forecast.__doc__.split("\n\n")[2].replace("\n", " "),
            "calibration": os.path.relpath(forecast.CALIBRATION_FILE, ROOT),
            "summary": forecast.summary(rows), "rows": rows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", metavar="DIR", help="write DIR/backtest-calibration.json")
    args = p.parse_args(argv)
    res = result()
    print(table(res["rows"], res["summary"]))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "backtest-calibration.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
