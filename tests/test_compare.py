"""jaxaccel compare: the study's score table, join rules, price and energy fallbacks, plots, CLI."""
import json
import os
import sys

import pytest

from jaxaccel import cli, compare
from jaxaccel.compare import energy, prices
from support import ROOT

sys.path.insert(0, ROOT)

STUDY = os.path.join(os.path.dirname(__file__), "fixtures", "study_v100.json")
ORDER = ["Unfused Single Adan", "Fused Multi Adan", "Mixed precision", "FP16 LightSeq",
         "FP16 LightSeq 2GPU", "FP16 LightSeq 4GPU"]
# By hand from the input table (x / column max; then w1 T + w2 C + w3 E - 0.1 O), computed
# independently in numpy and pasted. Columns: T, C, E, O.
NORMALISED = [[1.000, 1.000, 1.000, 0.833],
              [0.890, 0.886, 0.872, 0.799],
              [0.356, 0.354, 0.298, 1.000],
              [0.234, 0.234, 0.228, 0.710],
              [0.200, 0.400, 0.273, 0.383],
              [0.123, 0.491, 0.309, 0.281]]
# Columns: balance, time_cost_energy, time_energy_cost, cost_time_energy, cost_energy_time,
# energy_time_cost, energy_cost_time.
SCORES = [[0.817, 0.817, 0.817, 0.817, 0.817, 0.817, 0.817],
          [0.714, 0.718, 0.715, 0.717, 0.714, 0.712, 0.711],
          [0.202, 0.214, 0.203, 0.214, 0.202, 0.191, 0.191],
          [0.138, 0.139, 0.138, 0.139, 0.138, 0.137, 0.137],
          [0.224, 0.209, 0.184, 0.249, 0.264, 0.198, 0.238],
          [0.249, 0.212, 0.175, 0.285, 0.323, 0.213, 0.286]]


def test_strategies_are_the_studys_seven():
    assert compare.STRATEGIES == {
        "balance": (0.3, 0.3, 0.3, 0.1),
        "time_cost_energy": (0.5, 0.3, 0.1, 0.1), "time_energy_cost": (0.5, 0.1, 0.3, 0.1),
        "cost_time_energy": (0.3, 0.5, 0.1, 0.1), "cost_energy_time": (0.1, 0.5, 0.3, 0.1),
        "energy_time_cost": (0.3, 0.1, 0.5, 0.1), "energy_cost_time": (0.1, 0.3, 0.5, 0.1)}


def test_study_fixture_reproduces_normalisation_and_scores():
    report = compare.compare([STUDY])
    assert not report["left_out"]
    (group,) = report["groups"]
    assert group.utilisation_source == "occupancy"
    by_name = {c.config: c for c in group.candidates}
    for name, norm, scores in zip(ORDER, NORMALISED, SCORES):
        c = by_name[name]
        assert [round(c.normalised[k], 3) for k in "TCEO"] == norm, name
        assert [round(c.scores[s], 3) for s in compare.STRATEGIES] == scores, name
    assert group.candidates[0].config == "FP16 LightSeq"      # ranked by balance
    md = compare.markdown(report)
    row = next(line for line in md.splitlines() if "/ FP16 LightSeq |" in line)
    assert row.count("**") == 2 * 7                           # best under every strategy


def _result(tmp_path, name, device="TPU v5 lite", jax="0.11.2", sha="abc", rows=None, **meta):
    rows = rows or [{"name": "jax.bf16.adan.pallas", "batch": 32, "median_s": 0.02,
                     "mfu": 0.4, "energy_j": 5.0, "energy_source": "nvml"}]
    path = tmp_path / name
    path.write_text(json.dumps({"bench": "train_step", "device": device, "jax": jax,
                                "jaxaccel": sha, "model": "bert-base", "seq": 128,
                                "device_count": 1, "rows": rows, **meta}))
    return str(path)


def test_join_same_work_across_devices(tmp_path):
    a = _result(tmp_path, "a.json", device="TPU v5 lite")
    b = _result(tmp_path, "b.json", device="NVIDIA H100 80GB HBM3")
    report = compare.compare([a, b])
    (group,) = report["groups"]
    assert {c.device for c in group.candidates} == {"TPU v5 lite", "NVIDIA H100 80GB HBM3"}
    h100 = next(c for c in group.candidates if c.device.startswith("NVIDIA"))
    assert h100.cost_usd == pytest.approx(0.02 / 3600 * 11.06)


def test_a_plan_sits_beside_measured_steps_with_its_times_marked(tmp_path):
    """A `jaxaccel compile` plan joins measured train_step rows of the same model, sequence
    and batch; its time, tokens/s and cost carry ~ and the group says they are estimates."""
    measured = _result(tmp_path, "m.json", device="NVIDIA H100 80GB HBM3")
    plan = _result(tmp_path, "plan-x-v5e_2x4.json", bench="plan", device="TPU v5 lite",
                   device_count=8, rows=[{"name": "plan.bf16.adamw.xla", "batch": 32,
                                          "time_s": 0.004, "tokens_per_s": 1.0e6,
                                          "time_source": "estimate:roofline"}])
    (group,) = compare.compare([measured, plan])["groups"]
    est = next(c for c in group.candidates if c.device == "TPU v5 lite")
    assert est.time_source == "estimate:roofline" and est.cost_usd == pytest.approx(
        0.004 / 3600 * 1.20 * 8)
    assert any("compile-time estimates" in n for n in group.notes)
    md = compare.markdown(compare.compare([measured, plan]))
    row = next(line for line in md.splitlines() if "plan.bf16" in line).split(" | ")
    assert row[1].startswith("~") and row[2].startswith("~") and row[4].startswith("~")
    meas = next(line for line in md.splitlines() if "jax.bf16" in line).split(" | ")
    assert not meas[1].startswith("~")


def test_different_software_is_left_out_with_the_reason(tmp_path):
    a = _result(tmp_path, "a.json", device="TPU v5 lite")
    b = _result(tmp_path, "b.json", device="TPU v6 lite")
    c = _result(tmp_path, "c.json", device="NVIDIA H100 80GB HBM3", jax="0.10.2")
    report = compare.compare([a, b, c])
    assert [len(g.candidates) for g in report["groups"]] == [2]
    (out,) = report["left_out"]
    assert out["file"] == c and "jax 0.10.2" in out["why"] and "--mixed-versions" in out["why"]
    mixed = compare.compare([a, b, c], mixed_versions=True)
    assert len(mixed["groups"][0].candidates) == 3 and mixed["groups"][0].notes


def test_different_work_is_not_joined(tmp_path):
    a = _result(tmp_path, "a.json", device="TPU v5 lite")
    b = _result(tmp_path, "b.json", device="TPU v6 lite", seq=512)
    report = compare.compare([a, b])
    assert report["groups"] == []
    assert len(report["left_out"]) == 2
    assert all("nothing else ran the same work" in x["why"] for x in report["left_out"])


def test_price_table_and_user_prices(tmp_path):
    assert prices.lookup("TPU v5 lite", prices.PRICES).usd_per_hour == 1.20     # v5e
    assert prices.lookup("TPU v5", prices.PRICES).usd_per_hour == 4.20          # v5p
    assert prices.lookup("TPU v6 lite", prices.PRICES).usd_per_hour == 2.70     # v6e
    assert all(p.source and p.date for p in prices.PRICES)
    a = _result(tmp_path, "a.json", device="cpu")
    b = _result(tmp_path, "b.json", device="TPU v5 lite")
    with pytest.raises(KeyError, match="--prices"):
        compare.compare([a, b])
    table = tmp_path / "p.csv"
    table.write_text("device,usd_per_hour,source,date\ncpu,0.1,my VM,2026-11\n"
                     "TPU v5 lite,2.0,negotiated,2026-11\n")
    group = compare.compare([a, b], prices_file=str(table))["groups"][0]
    costs = {c.device: c.cost_usd for c in group.candidates}
    assert costs == pytest.approx({"cpu": 0.02 / 3600 * 0.1, "TPU v5 lite": 0.02 / 3600 * 2.0})
    bad = tmp_path / "bad.csv"
    bad.write_text("device,usd_per_hour\ncpu,free\n")
    with pytest.raises(ValueError, match="--prices"):
        compare.compare([a, b], prices_file=str(bad))


def test_missing_energy_is_a_labelled_estimate_never_zero(tmp_path):
    measured = _result(tmp_path, "a.json", device="NVIDIA H100 80GB HBM3")
    old = _result(tmp_path, "b.json", device="TPU v5 lite",
                  rows=[{"name": "jax.bf16.adan.pallas", "batch": 32, "median_s": 0.04,
                         "mfu": 0.5}])
    report = compare.compare([measured, old])
    group = report["groups"][0]
    tpu = next(c for c in group.candidates if c.device == "TPU v5 lite")
    assert tpu.energy_source == energy.ESTIMATE
    assert tpu.energy_j == pytest.approx(197.0 * 0.04 * 0.5)      # TDP x time x MFU
    assert any("estimates are marked ~" in n for n in group.notes)
    tpu_line = next(line for line in compare.markdown(report).splitlines()
                    if line.startswith("| TPU v5 lite"))
    assert "| ~" in tpu_line


def test_energy_estimate_and_bench_fill():
    from bench.common import fill_energy
    est = energy.estimate("cpu", 2, 10.0, None)
    assert est["energy_j"] == pytest.approx(6.25 * 2 * 10.0) and est["energy_utilisation"] == 1.0
    assert est["energy_source"] == energy.ESTIMATE and est["tdp_source"]
    with pytest.raises(KeyError, match="TDP_W"):
        energy.estimate("Mystery NPU", 1, 1.0, None)
    rows = [{"name": "a", "median_s": 0.5, "mfu": 0.25},
            {"name": "b", "median_s": 0.5, "energy_j": 3.0, "energy_source": energy.NVML}]
    fill_energy(rows, "TPU v6 lite", 4)
    assert rows[0]["energy_j"] == pytest.approx(300.0 * 4 * 0.5 * 0.25)
    assert rows[0]["energy_source"] == energy.ESTIMATE
    assert rows[1] == {"name": "b", "median_s": 0.5, "energy_j": 3.0,
                       "energy_source": energy.NVML}
    with energy.Meter("cpu") as meter:       # no counter on a CPU: time only, no fake energy
        pass
    assert set(meter.result) == {"seconds"}


def test_cli_writes_tables_and_nonempty_plots(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["compare", STUDY, "--out", str(out), "--html",
                     "--weights", "energy_cost_time"]) == 0
    assert "| Tesla V100 / FP16 LightSeq |" in capsys.readouterr().out
    pngs = sorted(p for p in os.listdir(out) if p.endswith(".png"))
    assert [p.rsplit("-", 1)[1] for p in pngs] == ["bars.png", "scatter.png", "scores.png"]
    for p in pngs:
        data = (out / p).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    rows = json.loads((out / "comparison.json").read_text())["rows"]
    assert len(rows) == 6 and rows[0]["label"] == "Tesla V100 / FP16 LightSeq"
    assert (out / "comparison.csv").read_text().count("\n") == 7
    assert all(p in (out / "report.html").read_text() for p in pngs)


def test_custom_weights_add_a_column():
    report = compare.compare([STUDY], weights="1,0,0,0")
    group = report["groups"][0]
    assert report["rank_by"] == "custom"
    assert group.candidates[0].config == "FP16 LightSeq 4GPU"          # fastest
    assert group.candidates[0].scores["custom"] == pytest.approx(281.41 / 2286.85)


@pytest.mark.parametrize("args, says", [
    (["--weights", "fastest"], "balance"),
    (["--weights", "0.5,0.5"], "w1,w2,w3,w4"),
    (["--weights", "0.5,-1,0,0"], "non-negative"),
])
def test_cli_bad_weights(args, says, capsys, tmp_path):
    assert cli.main(["compare", STUDY, "--out", str(tmp_path), *args]) == cli.EXIT_ERROR
    assert says in capsys.readouterr().err


def test_cli_unknown_device_and_missing_file(tmp_path, capsys):
    a = _result(tmp_path, "a.json", device="Mystery NPU")
    assert cli.main(["compare", a, STUDY, "--out", str(tmp_path)]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert "Mystery NPU" in err and "--prices" in err
    missing = str(tmp_path / "nope.json")
    assert cli.main(["compare", missing, "--out", str(tmp_path)]) == cli.EXIT_ERROR
    assert missing in capsys.readouterr().err


def test_cli_bench_dispatches_to_the_suite(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "job", "--help"])
    assert e.value.code == 0 and "time-to-accuracy" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["bench", "nonsense"])


def test_meter_reads_nvml_energy_and_utilisation(monkeypatch):
    """NVML path with a fake pynvml: energy = sum of counter differences, util sampled."""
    import types
    counters = {0: 1000, 1: 5000}               # millijoules per device

    def energy_mj(h):
        counters[h] += 2000                     # each read: +2 J on every device
        return counters[h]
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetTotalEnergyConsumption=energy_mj,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=60 + 20 * h))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with energy.Meter("gpu", devices=2, interval=0.001) as meter:
        pass
    r = meter.result
    assert r["energy_source"] == energy.NVML
    assert r["energy_j"] == pytest.approx(4.0)            # 2 J x 2 devices between reads
    assert r["avg_power_w"] == pytest.approx(4.0 / r["seconds"])
    assert r["gpu_util_pct"] == pytest.approx(70.0)


def test_cli_says_when_there_is_nothing_to_compare(tmp_path, capsys):
    """Fault probe 2, item 12: an empty result file, or rows that share no work, wrote an
    empty report and exited 0."""
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"bench": "train_step", "device": "cpu", "rows": []}))
    out = tmp_path / "out"
    assert cli.main(["compare", str(empty), "--out", str(out)]) == cli.EXIT_ERROR
    assert f"result file {str(empty)!r} has no rows" in capsys.readouterr().err
    a = _result(tmp_path, "a.json", device="TPU v5 lite")
    b = _result(tmp_path, "b.json", device="TPU v6 lite", seq=512)
    assert cli.main(["compare", a, b, "--out", str(out)]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert "nothing to compare" in err and "nothing else ran the same work" in err, err
    assert not out.exists()


@pytest.mark.parametrize("body, says", [
    ("device,usd_per_hour\ncpu,0.1\nTPU v5 lite\n", "line 3: 'TPU v5 lite'"),
    ("device,usd_per_hour\ncpu,free\n", "line 2: 'cpu,free'"),
    ("device,usd_per_hour\ncpu,0.1\nTPU v5 lite,1,a,b,c\n", "line 3: 'TPU v5 lite,1,a,b,c'"),
    ("device,usd_per_hour\ncpu,0.1\nTPU v5 lite,2\nCPU,0.2\n",
     "lists device 'CPU' twice: line 2: 'cpu,0.1' and line 4: 'CPU,0.2'"),
    ('{"cpu": 0.1, "cpu": 0.2}', "lists device 'cpu' twice"),
    ('{"cpu": null}', "entry 'cpu': None"),
])
def test_bad_price_files_name_the_line(tmp_path, capsys, body, says):
    """Fault probe 2, item 12: a bad line gave Python's TypeError text; a device listed twice
    silently took the first."""
    prices_file = tmp_path / ("p.json" if body.startswith("{") else "p.csv")
    prices_file.write_text(body)
    a = _result(tmp_path, "a.json", device="cpu")
    b = _result(tmp_path, "b.json", device="TPU v5 lite")
    assert cli.main(["compare", a, b, "--prices", str(prices_file), "--no-plots",
                     "--out", str(tmp_path / "out")]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert says in err and "TypeError" not in err, err
