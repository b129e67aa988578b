"""fp8 only on the Dense layers large enough to pay (``precision.fp8_layers``, issue 61): the
rule's choice for BERT-base, llama-350m and Llama-3 8B on an H100, every layer under ``all``
and where the device has no fp8 peak, a run where no layer pays has no fp8 state and takes
the bf16 policy's step to the bit, and the planner says which layers run fp8 and why."""
import jax
import numpy as np
import pytest

from jaxaccel import config, plan, precision
from jaxaccel import flops as flops_lib
from jaxaccel.plan import topology
from jaxaccel.models import fp8_layers, model_spec
from jaxaccel.precision import fp8_break_even, policy_of
from jaxaccel.train import loop
from jaxaccel.train import run as run_lib
from jaxaccel.train.inference import evaluate_run
from support import TINY_CONFIG, needs_cuda_plugin, tiny_cfg

H100 = "NVIDIA H100 80GB HBM3"


def _layers(name: str, device_kind: str, *sets) -> dict:
    cfg = config.build(sets=[f"model.name={name}", "precision.policy=fp8", *sets])
    return dict(fp8_layers(model_spec(cfg.model), policy_of(cfg.precision, device_kind)))


def test_the_break_even_width_comes_from_the_chips_peaks():
    """w = c / (6 B (1/P_bf16 - 1/P_fp8)), c = 7.8 bytes (precision's module doc); None where
    the chip has no fp8 units of its own or is unknown."""
    assert fp8_break_even(H100) == pytest.approx(7.8 / (6 * 3.35e12 * (1 / 989e12 - 1 / 1979e12)))
    assert round(fp8_break_even(H100)) == 767 and round(fp8_break_even("NVIDIA H200")) == 535
    for kind in ("NVIDIA A100-SXM4-80GB", "TPU v5 lite", "cpu", None):
        assert fp8_break_even(kind) is None, kind


@pytest.mark.parametrize("name,expected", [
    # [K, N] -> (count, fp8): N K / (N + K) against 767
    ("bert-base", {(768, 768, False): 48, (768, 3072, False): 12, (3072, 768, False): 12}),
    ("llama-350m", {(1024, 1024, False): 96, (1024, 2816, False): 48, (2816, 1024, False): 24}),
    ("llama3-8b", {(4096, 4096, True): 64, (4096, 1024, True): 64, (4096, 14336, True): 64,
                   (14336, 4096, True): 32}),
])
def test_the_rule_on_an_h100(name, expected):
    assert _layers(name, H100) == expected
    # precision.fp8_layers=all, or a device without fp8 units: every one, as before the rule.
    every = {(k, n, True): c for (k, n, _), c in expected.items()}
    assert _layers(name, H100, "precision.fp8_layers=all") == every
    assert _layers(name, "cpu") == every


@pytest.mark.parametrize("name,expected", [
    # against 535: the MLPs' layers pay, attention's projections do not
    ("bert-base", {(768, 768, False): 48, (768, 3072, True): 12, (3072, 768, True): 12}),
    ("llama-350m", {(1024, 1024, False): 96, (1024, 2816, True): 48, (2816, 1024, True): 24}),
])
def test_the_rule_on_an_h200(name, expected):
    """The compile-only H200 target's device kind and a real H200's give the same choice."""
    for kind in ("NVIDIA H200", "NVIDIA H200 141GB HBM3e"):
        assert _layers(name, kind) == expected


@pytest.mark.parametrize("name", ["bert-base", "llama-350m", "llama3-8b"])
@pytest.mark.parametrize("kind,rule", [(H100, "paying"), ("NVIDIA H200", "paying"),
                                       (H100, "all")])
def test_the_planners_fp8_flops_are_the_fp8_layers(name, kind, rule):
    """``flops.fp8_flops``, what the planner's compute bound takes at the fp8 peak, is 6 K N
    per token of every block Dense layer the model builds in fp8 (``models.fp8_layers``), and
    2 K N more of those a full remat recomputes (a pre-norm layer's MLP output: none)."""
    cfg = config.build(sets=[f"model.name={name}", "precision.policy=fp8",
                             f"precision.fp8_layers={rule}"])
    spec, policy = model_spec(cfg.model), policy_of(cfg.precision, kind)
    layers = fp8_layers(spec, policy)
    shape = flops_lib.model_shape(spec)
    assert flops_lib.fp8_flops(shape, 1, 1, policy.fp8_dense) == \
        6 * sum(k * n * c for (k, n, on), c in layers.items() if on)
    down = shape.intermediate * shape.hidden * shape.layers \
        if policy.fp8_dense(shape.intermediate, shape.hidden) and shape.pre_norm else 0
    assert flops_lib.fp8_flops(shape, 1, 1, policy.fp8_dense, flops_lib.RECOMPUTED) == \
        8 * sum(k * n * c for (k, n, on), c in layers.items() if on) - 2 * down


@needs_cuda_plugin
def test_the_compute_bound_takes_only_the_fp8_layers_at_the_fp8_peak():
    """On an H200, where the MLP layers run fp8 and attention's projections bf16, the step's
    compute bound is the fp8 layers' FLOPs at 1,979 TFLOP/s and the rest at 989."""
    target = topology.resolve("h200:1x1")
    cfg = config.build(sets=["model.name=llama-350m", "precision.policy=fp8"])
    policy = policy_of(cfg.precision, target.device_kind)
    flops = {"analytic": 3e15, "attention": 4e14, "recompute": 0.0, "fp8": 1e15}
    e = plan.estimate_step(target, policy, "xla", flops, {"bytes accessed": 1.0}, 8, 2048, 0.0)
    assert e["compute_s"] == pytest.approx(1e15 / 1979e12 + 2e15 / 989e12)
    assert "for the fp8 layers' 33% of the FLOPs" in e["peak"]
    every = {**flops, "fp8": 3e15}
    assert plan.estimate_step(target, policy, "xla", every, {"bytes accessed": 1.0}, 8, 2048,
                              0.0)["compute_s"] == pytest.approx(3e15 / 1979e12)


def test_a_bad_fp8_layers_value_is_refused():
    with pytest.raises(ValueError, match="precision.fp8_layers='some'.*'paying'"):
        config.build(sets=["precision.fp8_layers=some"])


def _one_step(run):
    batch = run.put_batch(next(run.train_data.batches(0)))
    state, metrics = run.train_step(run.state, batch)
    return jax.device_get((state.params, metrics["loss"]))


@pytest.mark.long
def test_where_no_layer_pays_the_fp8_policy_is_the_bf16_step(tmp_path, monkeypatch):
    """With a break-even no layer reaches (as BERT-base's on an H100), the tiny model under
    fp8 has no fp8 layer and no fp8 state, bounds its matmuls by the bf16 peak, and its step
    gives the bf16 policy's loss and parameters bit for bit; ``fp8_layers=all`` keeps every
    block Dense fp8 (the tiny fp8 run of before: the same state, the same step)."""
    def built(name, *sets):
        return run_lib.build(tiny_cfg(tmp_path / name, *sets), jax.devices()[:1])

    before = built("before", "precision.policy=fp8")      # on the CPU: no fp8 peak, all fp8
    monkeypatch.setattr(precision, "fp8_break_even", lambda device_kind: 1e9)
    bf16, fp8, every = (built("bf16", "precision.policy=bf16"),
                        built("fp8", "precision.policy=fp8"),
                        built("all", "precision.policy=fp8", "precision.fp8_layers=all"))
    assert fp8.state.fp8 is None and fp8.resolved.policy.matmul_dtype == "bfloat16"
    assert not fp8.resolved.policy.fp8 and fp8.resolved.policy.fp8_min_width == 1e9
    (p_bf16, l_bf16), (p_fp8, l_fp8) = _one_step(bf16), _one_step(fp8)
    assert l_fp8 == l_bf16
    jax.tree_util.tree_map(np.testing.assert_array_equal, p_fp8, p_bf16)
    assert every.resolved.policy.fp8_min_width == 0 and every.state.fp8 is not None
    jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(every.state.fp8),
                           jax.device_get(before.state.fp8))
    (p_all, l_all), (p_before, l_before) = _one_step(every), _one_step(before)
    assert l_all == l_before
    jax.tree_util.tree_map(np.testing.assert_array_equal, p_all, p_before)


@pytest.mark.long
def test_a_run_where_no_layer_paid_is_evaluated_elsewhere(tmp_path, monkeypatch):
    """Trained where no layer pays (no fp8 state saved), evaluated on a device where every
    layer would run fp8 (this CPU, the rule undone): the checkpoint's break-even rebuilds
    its bf16 layers, and the evaluation gives the run's own accuracy."""
    monkeypatch.setattr(precision, "fp8_break_even", lambda device_kind: 1e9)
    out = loop.train(tiny_cfg(tmp_path, "precision.policy=fp8", "train.max_steps=2"))
    monkeypatch.undo()
    assert evaluate_run(out["run_dir"])["accuracy"] == pytest.approx(out["eval_accuracy"])


@pytest.mark.long
@pytest.mark.parametrize("scan", ["false", "true"])
def test_a_run_with_some_layers_in_fp8_trains_saves_and_evaluates(tmp_path, monkeypatch, scan):
    """A break-even between the tiny model's attention layers (64 x 64: 32) and its MLP's (64
    x 128: 43), as the rule's H200 choice splits BERT-base and llama-350m: only the MLP's
    layers run fp8 and hold fp8 state, layers scanned or not; the run trains, checkpoints and
    evaluates to its own accuracy on a device where every layer would run fp8."""
    monkeypatch.setattr(precision, "fp8_break_even", lambda device_kind: 40.0)
    cfg = tiny_cfg(tmp_path, "precision.policy=fp8", f"model.scan_layers={scan}",
                   "train.max_steps=2")
    run = run_lib.build(cfg, jax.devices()[:1])
    assert dict(fp8_layers(run.spec, run.resolved.policy)) == {
        (64, 64, False): 8, (64, 128, True): 2, (128, 64, True): 2}
    assert {group for layer in run.state.fp8["layers"].values() for group in layer} == {
        "intermediate", "output"}
    out = loop.train(cfg)
    monkeypatch.undo()
    assert np.isfinite(out["eval_loss"])
    assert evaluate_run(out["run_dir"])["accuracy"] == pytest.approx(out["eval_accuracy"])


@pytest.mark.long
def test_the_plan_says_which_layers_run_fp8(compile_target):
    """On an H100 target the tiny model's 64-wide layers do not pay: the abstract run has no
    fp8 state and the planner's line says so, shape by shape; under ``all`` every one."""
    target = compile_target("h100:1x1")
    sets = ["precision.policy=fp8", "mesh.data=1"]
    run = plan.abstract_run(plan.load_config(TINY_CONFIG, sets, target), target)
    assert run.state.fp8 is None
    said = plan.fp8_choice(run, target.device_kind)
    assert said.startswith(f"fp8 on 0 of 12 block Dense layers: N*K/(N+K) at least 767 on "
                           f"{target.device_kind} (precision.fp8_layers=paying): "), said
    assert "in bf16" in said and "in fp8" not in said
    every = plan.abstract_run(plan.load_config(
        TINY_CONFIG, [*sets, "precision.fp8_layers=all"], target), target)
    assert every.state.fp8 is not None
    said = plan.fp8_choice(every, target.device_kind)
    assert said.startswith("fp8 on 12 of 12 block Dense layers: every one "
                           "(precision.fp8_layers=all; "), said
    assert plan.fp8_choice(plan.abstract_run(plan.load_config(
        TINY_CONFIG, ["mesh.data=1"], target), target), target.device_kind) == ""
