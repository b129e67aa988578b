"""The planner's forecast (jaxaccel/plan/forecast.py): the compute bound divided by the
efficiency published runs reached, calibrated on a sourced set and backtested leave-one-out."""
import json
import os

import pytest

from jaxaccel import devices as devices_lib
from jaxaccel import flops
from jaxaccel.models import PRESETS, ModelSpec
from jaxaccel.plan import forecast
from support import ROOT

BACKTEST = os.path.join(ROOT, "bench", "results", "backtest", "backtest-calibration.json")


@pytest.fixture(scope="module")
def points():
    return forecast.load()


def test_the_calibration_set_is_sourced_and_spans_the_chips(points):
    with open(forecast.CALIBRATION_FILE) as f:
        raw = json.load(f)["points"]
    assert len({p["id"] for p in raw}) == len(raw) >= 8
    for p in raw:
        assert p["source"] and p["where"], p["id"]
        assert devices_lib.chip(p["device"]) is not None, p["id"]
    tpus = {p.device for p in points if p.platform == "tpu"}
    assert len(tpus) >= 3 and "NVIDIA H100 80GB HBM3" in {p.device for p in points}
    # An efficiency is a fraction of the chip's peak, by the planner's own FLOP formula.
    assert all(0.05 < p.efficiency < 1.0 for p in points)


def test_the_flop_formula_of_a_point_is_the_planners():
    """The one BERT point is this project's own H100 step (bert-base, 2 labels): the point's
    shape gives the FLOPs per token that jaxaccel.flops gives the model itself, and its
    tokens/s is the bench row's. (The row's own model_flops_per_step is 0.14% higher: that
    bench, at 4a2dd0e, predates jaxaccel.flops's one formula.)"""
    with open(os.path.join(ROOT, "bench", "results",
                           "train_step-nvidia_h100_80gb_hbm3.json")) as f:
        measured = json.load(f)
    point = next(p for p in forecast.load() if p.family == "bert")
    shape = flops.model_shape(ModelSpec(PRESETS["bert-base"], num_labels=2))
    seq = measured["seq"]
    assert point.flops_per_token == pytest.approx(flops.train_flops(shape, 1, seq) / seq,
                                                  rel=1e-12)
    row = next(r for r in measured["rows"] if r["name"] == "jax.bf16.adamw.xla")
    assert point.tokens_per_s == pytest.approx(row["tokens_per_s"], rel=1e-6)
    assert point.tokens_per_step == measured["batch"] * seq


def test_backtest_is_leave_one_out_and_beats_the_roofline(points):
    rows = forecast.backtest(points)
    assert all(r["id"] not in r["calibration"] and r["calibration"] for r in rows)
    s = forecast.summary(rows)
    assert s["forecast_points"] == len(points)
    assert s["median_abs_forecast_error"] <= 0.25
    assert s["median_abs_forecast_error"] < s["median_abs_roofline_error"]
    assert s["closer_than_roofline"] >= 0.75 * len(rows)
    # The roofline is a lower bound: every published step is slower.
    assert all(r["roofline_error"] < 0 for r in rows)


def test_the_committed_backtest_is_the_current_one(points):
    """bench/results/backtest/ (the README's table) is what the code and the set give now:
    rerun `jaxaccel bench backtest --out bench/results/backtest` after changing either."""
    with open(BACKTEST) as f:
        committed = json.load(f)
    now = forecast.backtest(points)
    assert [r["id"] for r in committed["rows"]] == [r["id"] for r in now]
    for old, new in zip(committed["rows"], now):
        assert old["forecast_s"] == pytest.approx(new["forecast_s"], rel=1e-9), old["id"]
        assert old["calibration"] == new["calibration"], old["id"]


def test_a_forecast_names_its_points_and_never_goes_below_the_roofline(points):
    f = forecast.forecast(1.0, 0.5, 1e15, "TPU v6 lite", "llama", "bfloat16", points)
    assert f["forecast_low_s"] <= f["forecast_s"] <= f["forecast_high_s"]
    assert f["forecast_s"] == pytest.approx(1.0 / f["forecast_efficiency"])
    assert f["calibration"] and all(
        next(p for p in points if p.id == i).device == "TPU v6 lite" for i in f["calibration"])
    # A roofline above compute / efficiency (a memory-bound step) is the floor.
    assert forecast.forecast(1.0, 100.0, 1e15, "TPU v6 lite", "llama", "bfloat16",
                             points)["forecast_s"] == 100.0
    # A chip without points borrows its platform's; a platform without any has no forecast.
    a100 = forecast.forecast(1.0, 0.5, 1e15, "NVIDIA A100-SXM4-80GB", "llama", "bfloat16",
                             points)
    assert "other GPUs" in a100["forecast_source"]
    tpu_only = [p for p in points if p.platform == "tpu"]
    assert forecast.forecast(1.0, 0.5, 1e15, "NVIDIA H100 80GB HBM3", "bert", "bfloat16",
                             tpu_only)["forecast_s"] is None


def test_a_small_bert_step_on_h100_is_calibrated_by_the_bert_point(points):
    """Work far below the decoders' (one decade more than the nearest point's distance) leaves
    only the nearest: the measured BERT step, not the 8B runs' efficiency."""
    bert = next(p for p in points if p.family == "bert")
    f = forecast.forecast(1.0, 0.1, bert.work, bert.device, "bert", "bfloat16", points)
    assert f["calibration"] == [bert.id]
    assert f["forecast_efficiency"] == pytest.approx(bert.efficiency)
