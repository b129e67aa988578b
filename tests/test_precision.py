"""Precision policies: fp8 quantization equals a numpy/ml_dtypes simulation, fp16 loss scaling
skips overflowing steps bit-exactly and grows/backs off its scale, fp16/fp8 runs train and resume
exactly after SIGTERM, both lower for TPU and GPU on a 2x2x2 mesh, bad input fails early."""
import json
import os
import re
import subprocess
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import compile_only
from jaxaccel import config
from jaxaccel.models import build_model, model_spec
from jaxaccel.models.fp8 import KERNEL_SCOPE, SCOPE, Fp8Linear, advance
from jaxaccel.models.stack import sequential
from jaxaccel.plan import kernels, loops
from jaxaccel.precision import POLICIES, LossScale, get_policy
from jaxaccel.train import loop
from jaxaccel.train import run as run_lib
from jaxaccel.train.run import resolve
from jaxaccel.train.inference import evaluate_run
from jaxaccel.train.metrics import read_metrics
from support import CLI, CONFIGS, ROOT, TINY, cpu_env, logged_losses, sigterm_at, tiny_cfg


# ---- fp8: quantization against an independent simulation ----

def _sim_quantize(x, history, fp8_dtype):
    """Delayed scaling in numpy: scale from the history's max, saturate, round to fp8."""
    fmax = np.float32(ml_dtypes.finfo(fp8_dtype).max)
    amax = np.float32(history.max())
    scale = np.float32(1) / (fmax / amax)
    q = np.clip(x / scale, -fmax, fmax).astype(fp8_dtype)
    return q.astype(np.float32), scale


def test_fp8_linear_equals_numpy_simulation():
    """The layer quantizes with the scales the step before left (each from its history), and
    ``advance`` makes the next state: histories rolled with this step's amaxes, scales from
    them."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 8)) * 3).astype(np.float32)
    x[0, 0] = 40.0                      # beyond the history's amax: saturates at 448 * scale
    w = (rng.standard_normal((8, 6)) * 0.05).astype(np.float32)
    g = (rng.standard_normal((5, 6)) * 1e-3).astype(np.float32)
    hist = {"input": [2.0, 5.0, 0.0, 1.0], "kernel": [0.1, 0.0, 0.0, 0.0],
            "output_grad": [3e-3, 1e-3, 0.0, 0.0]}
    dtypes = {"input": ml_dtypes.float8_e4m3fn, "kernel": ml_dtypes.float8_e4m3fn,
              "output_grad": ml_dtypes.float8_e5m2}
    layer = Fp8Linear(8, 6, use_bias=False, dtype=jnp.float32, amax_history_length=4,
                      rngs=nnx.Rngs(0))
    layer.kernel[...] = w
    for role, h in hist.items():
        getattr(layer, f"{role}_amax_history")[...] = jnp.asarray(h, jnp.float32)
        getattr(layer, f"{role}_scale")[...] = jnp.asarray(
            [_sim_quantize(x, np.array(h), dtypes[role])[1]])
    graphdef, params, meta = nnx.split(layer, nnx.Param, ...)
    meta = nnx.to_pure_dict(meta)

    def f(params, meta, x):
        y = nnx.merge(graphdef, params, meta)(x)
        return jnp.sum(y * g), y

    (_, y), (_, amaxes, dx) = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(
        params, meta, jnp.asarray(x))

    qx, sx = _sim_quantize(x, np.array(hist["input"]), dtypes["input"])
    qw, sw = _sim_quantize(w, np.array(hist["kernel"]), dtypes["kernel"])
    qg, sg = _sim_quantize(g, np.array(hist["output_grad"]), dtypes["output_grad"])
    assert qx[0, 0] == 448.0            # saturated, not inf
    np.testing.assert_allclose(np.asarray(y), (qx.astype(np.float64) @ qw) * sx * sw,
                               rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(np.asarray(dx), (qg.astype(np.float64) @ qw.T) * sg * sw,
                               rtol=1e-6, atol=1e-12)
    new = jax.device_get(advance(meta, amaxes))
    for role, value in (("input", x), ("kernel", w), ("output_grad", g)):
        expected = np.roll(np.array(hist[role], np.float32), -1)
        expected[0] = np.abs(value).max()
        np.testing.assert_array_equal(new[f"{role}_amax_history"], expected)
        assert new[f"{role}_scale"][0] == _sim_quantize(value, expected, dtypes[role])[1], role


# ---- fp16: the loss-scale rule and skipped steps ----

def test_loss_scale_grows_after_the_interval_and_backs_off_on_overflow():
    ls = LossScale.create(2.0 ** 15, growth_interval=3)
    seen = []
    for finite in (True, True, True, True, False, False, True):
        ls = ls.update(jnp.asarray(finite))
        seen.append((float(ls.scale), int(ls.skipped), int(ls.consecutive)))
    assert seen == [(2 ** 15, 0, 0), (2 ** 15, 0, 0), (2 ** 16, 0, 0), (2 ** 16, 0, 0),
                    (2 ** 15, 1, 1), (2 ** 14, 2, 2), (2 ** 14, 2, 0)]


def _fp16_run(tmp_path, *sets):
    run = run_lib.build(tiny_cfg(tmp_path, "precision.policy=fp16", *sets), jax.devices()[:1])
    return run, run.train_step, (run.put_batch(b) for b in run.train_data.batches(0))


@pytest.mark.long
def test_fp16_overflow_skips_the_step_bit_exactly(tmp_path):
    run, step, batches = _fp16_run(tmp_path, "precision.loss_scale_growth_interval=2")
    state, _ = step(run.state, next(batches))
    state, m = step(state, next(batches))
    assert float(state.loss_scale.scale) == 2.0 ** 16         # 2 finite steps: doubled
    assert float(m["loss_scale"]) == 2.0 ** 15 and int(m["skipped_steps"]) == 0
    # Inject an overflow: at 2**40 the scaled gradient exceeds fp16's range (65504).
    before = jax.device_get(state.replace(loss_scale=state.loss_scale.replace(scale=2.0 ** 40)))
    after, m = step(jax.device_put(before), next(batches))
    after = jax.device_get(after)
    assert int(m["skipped_steps"]) == 1 and int(m["consecutive_skips"]) == 1
    assert float(after.loss_scale.scale) == 2.0 ** 39
    for a, b in zip(jax.tree_util.tree_leaves((before.params, before.opt_state)),
                    jax.tree_util.tree_leaves((after.params, after.opt_state))):
        np.testing.assert_array_equal(a, b)
    assert int(after.step) == int(before.step) + 1            # the batch was consumed


def test_fp16_stops_after_too_many_skips_in_a_row(tmp_path):
    bad = loop.train(tiny_cfg(tmp_path, "precision.policy=fp16", "train.max_steps=10",
                              "precision.loss_scale_init=1e38",
                              "precision.max_consecutive_skips=3"))
    assert bad["status"] == "nonfinite" and "3 steps in a row" in bad["error"], bad


# ---- training, metrics and exact resume under each policy ----

# fp8 under -m slow (31 s of the default suite): the fp16 case resumes the state a policy adds
# to the train state (its loss scale) through the same checkpoint code the fp8 state takes.
@pytest.mark.parametrize("policy,metric", [
    ("fp16", "train/loss_scale"),
    pytest.param("fp8", "train/fp8/qkv_output_grad_scale", marks=pytest.mark.slow)])
@pytest.mark.long
def test_policy_trains_and_resume_after_sigterm_matches_uninterrupted(tmp_path, policy, metric):
    # fp16 from 2**19: the first steps overflow and back off (skipped, no NaN stop) until the
    # scale fits; then it grows every 5 finite steps, across the resume.
    sets = (f"precision.policy={policy}", "train.epochs=3",
            "precision.loss_scale_init=524288.0",
            "precision.loss_scale_growth_interval=5", "precision.fp8_amax_history=4")
    full = loop.train(tiny_cfg(tmp_path, "name=full", *sets))
    lf = logged_losses(full["run_dir"])
    assert np.mean([lf[s] for s in (10, 11, 12)]) < np.mean([lf[s] for s in (1, 2, 3)]) - 0.05
    part = loop.train(tiny_cfg(tmp_path, "name=part", *sets), sigterm_at(6))
    assert part["status"] == "preempted" and part["step"] == 6
    resumed = loop.train(tiny_cfg(tmp_path, "name=part", *sets))
    assert resumed["status"] == "completed" and resumed["step"] == 12
    rf = {r["step"]: r for r in read_metrics(full["run_dir"]) if "train/loss" in r}
    rp = {r["step"]: r for r in read_metrics(part["run_dir"]) if "train/loss" in r}
    assert sorted(rp) == list(range(1, 13))
    for key in ("train/loss", metric):
        np.testing.assert_allclose([rp[s][key] for s in rp], [rf[s][key] for s in rp],
                                   rtol=1e-6, err_msg=key)
    assert resumed["eval_accuracy"] == pytest.approx(full["eval_accuracy"])
    if policy == "fp16":
        skipped = [rf[s]["train/skipped_steps"] for s in rf]
        assert 0 < skipped[-1] < 6 and skipped == sorted(skipped)
        np.testing.assert_array_equal(skipped, [rp[s]["train/skipped_steps"] for s in rp])
        # The scale each step used follows the rule from the skips alone: halved after a
        # skipped step, doubled after every 5 finite ones in a row (growth_interval=5).
        scale, good, before = 2.0 ** 19, 0, 0
        for s in sorted(rf):
            assert rf[s][metric] == scale, (s, rf[s][metric], scale)
            if rf[s]["train/skipped_steps"] > before:
                scale, good, before = scale / 2, 0, rf[s]["train/skipped_steps"]
            else:
                good += 1
                scale, good = (scale * 2, 0) if good == 5 else (scale, good)
    else:   # eval from the run folder, with the saved scales, gives the run's own accuracy
        assert evaluate_run(full["run_dir"])["accuracy"] == pytest.approx(full["eval_accuracy"])


@pytest.mark.long
def test_bf16_training_lowers_the_loss(tmp_path):
    result = loop.train(tiny_cfg(tmp_path, "precision.policy=bf16", "train.epochs=3"))
    losses = logged_losses(result["run_dir"])
    assert np.mean([losses[s] for s in (10, 11, 12)]) < np.mean([losses[s] for s in (1, 2, 3)]) \
        - 0.05


# ---- activations ----

# vit-tiny under -m slow (12 s): its layers run through the same layer stack as the others'.
@pytest.mark.parametrize("name", ["tiny", "llama-tiny",
                                  pytest.param("vit-tiny", marks=pytest.mark.slow)])
def test_the_residual_stream_is_bf16_under_bf16_and_fp8_and_float32_otherwise(name):
    """What enters and leaves the layer stack (the residual stream, and what a rematerialised
    or scanned layer keeps of it) is in the policy's activation dtype, for each family; the
    logits stay float32."""
    spec = model_spec(config.build(sets=[f"model.name={name}"]).model)
    for policy, want in (("fp32", jnp.float32), ("fp16", jnp.float32),
                         ("bf16", jnp.bfloat16), ("fp8", jnp.bfloat16)):
        model = build_model(spec, policy)
        seen = []

        def stack(x, args, key, deterministic):
            out = sequential(model.layers, type(model).layer_call)(x, args, key, deterministic)
            seen.extend((x.dtype, out.dtype))
            return out
        inputs = {k: jnp.ones((2, *shape), dtype) for k, (shape, dtype) in
                  type(model).input_shapes(spec.architecture, 16).items()}
        out = model(*(inputs[k] for k in model.input_keys), stack=stack)
        assert set(seen) == {jnp.dtype(want)}, (policy, seen)
        assert out.logits.dtype == jnp.float32


# ---- sharding and compiling for accelerators ----

# bf16 on the H100 target runs under -m slow: by default BERT-base's bf16 H100 step
# (tests/test_sharding.py) checks every GEMM's bf16 operands, and the fp8 case here the 2x2x2
# H100 compile (18 s of the suite's 15 minutes). fp8 on the TPU target too (18 s): the TPU
# compiler takes the 2x2x2 step in tests/test_sharding.py, and fp8's own lowering is checked
# where it reaches fp8 GEMMs, on the H100.
@pytest.mark.parametrize("name,policy", [
    pytest.param("v5e:2x4", "fp8", marks=pytest.mark.slow), ("h100:1x8", "fp8"),
    pytest.param("h100:1x8", "bf16", marks=pytest.mark.slow)])
@pytest.mark.long
def test_step_compiles_for_accelerators_on_a_2x2x2_mesh(tmp_path, compile_target, name, policy):
    """The tiny model's step on a 2x2x2 mesh of an 8-chip slice / 8-GPU host, compiled by its
    compiler (tests/compile_only.py). On the H100 target, from the optimized HLO (no
    autotuning without a GPU: XLA's default GEMM choices): fp8 operands reach the GEMMs
    (forward E4M3 x E4M3, backward E5M2 gradients: 6 encoder Dense x 2 layers, 1 forward and
    2 backward GEMMs each), and every GEMM of the bf16 step, backward ones included, takes
    bf16 operands; fp8's work outside the GEMMs is found (jaxaccel.plan.kernels) in the fp8
    step alone, and its scaling takes fewer kernels than it has operands."""
    target = compile_target(name)
    run = run_lib.build(tiny_cfg(tmp_path, f"precision.policy={policy}", "mesh.data=2",
                              "mesh.fsdp=2", "mesh.tensor=2"))
    if policy == "fp8":
        for leaf in jax.tree_util.tree_leaves(run.state.fp8):
            assert leaf.sharding.is_fully_replicated and len(leaf.addressable_shards) == 8
    m = compile_only.mesh(target, run.mesh.devices.shape, run.mesh.axis_names)
    text = compile_only.compile_step(run, m)[0].as_text()
    if target.platform == "gpu":
        compile_only.assert_gemm_dtypes(text, policy, run.spec.architecture.num_hidden_layers)
        found = kernels.of(text)
        split = kernels.summary(found)
        assert (split["fp8_work"]["kernels"] > 0) == (policy == "fp8"), split
        assert (split["fp8_gemms"]["kernels"] > 0) == (policy == "fp8"), split
        # Scales are made once per step for all operands (models.fp8.advance), not by small
        # kernels of their own per operand in each layer (6 Dense x 3 operands x 2 layers).
        scaling = [k for k in found if k.kinds & {"scale", "history"}]
        assert len(scaling) < 6 * 3 * run.spec.architecture.num_hidden_layers, scaling


@pytest.mark.long
def test_scanned_fp8_kernels_are_quantized_once_before_the_layer_loop(tmp_path,
                                                                     compile_target):
    """With the layers scanned, each fp8 Dense kernel is quantized (amax, divide, clip,
    convert to E4M3) for all layers at once before the layer loop (models.fp8
    .quantize_kernels): in the step compiled for an H100 that work runs once a step, none of
    it in the loop's body, which runs once per layer."""
    target = compile_target("h100:1x1")
    run = run_lib.build(tiny_cfg(tmp_path, "precision.policy=fp8", "model.scan_layers=true"),
                        jax.devices()[:1])
    m = compile_only.mesh(target, run.mesh.devices.shape, run.mesh.axis_names)
    text = compile_only.compile_step(run, m)[0].as_text()
    runs = loops.runs(text)
    assert run.spec.architecture.num_hidden_layers in runs.values(), runs    # the layer loop
    # op_name ".../jvp(fp8)/quantize_kernel/div" (".../fp8/quantize_kernel/..." in the loop);
    # the reducers XLA clones from the kernel's amax serve other reductions too: left out.
    scope = re.compile(rf"[(/]{SCOPE}\)?/{KERNEL_SCOPE}/")
    quantize = [(c, runs[c], i.shape) for c, body in loops.parse(text)[0].items()
                for i in body.values()
                if i.opcode in ("reduce", "divide", "convert") and scope.search(i.attributes)]
    assert any(shape.startswith("f8e4m3fn[") for _, _, shape in quantize), quantize
    assert {n for _, n, _ in quantize} == {1}, quantize


@pytest.mark.gpu
def test_fp8_step_compiles_to_cublaslt_fp8_gemms_on_a_gpu(tmp_path):
    if jax.default_backend() != "gpu":
        pytest.skip("needs an NVIDIA GPU (sm89+)")
    run = run_lib.build(tiny_cfg(tmp_path, "precision.policy=fp8"), jax.devices()[:1])
    batch = run.put_batch(next(run.train_data.batches(0)))
    hlo = run.train_step.lower(run.state, batch).compile().as_text()
    assert "__cublas$lt$matmul$f8" in hlo


# ---- bad input ----

def test_unknown_policy_names_the_four():
    with pytest.raises(ValueError) as e:
        resolve(config.build(sets=TINY + ["precision.policy=fp4"]))
    for name in POLICIES:
        assert repr(name) in str(e.value)
    assert sorted(POLICIES) == ["bf16", "fp16", "fp32", "fp8"]
    assert get_policy("fp8").fp8 and get_policy("fp16").loss_scaling


@pytest.mark.parametrize("sets,message", [
    (["model.attention_impl=cudnn"], "cuDNN flash attention takes fp16/bf16"),
    (["model.attention_impl=mosaic_gpu"], "Mosaic GPU flash attention .* takes fp16/bf16"),
    (["precision.policy=fp16", "precision.loss_scale_init=0.0"], "must be > 0"),
    (["precision.policy=fp8", "precision.fp8_amax_history=0"], "fp8_amax_history=0"),
])
def test_impossible_combinations_fail_before_building(sets, message):
    """Refused by the config's checks or, for a choice, by its owner when the run is resolved
    (``train.run.resolve``): before anything is built either way."""
    with pytest.raises(ValueError, match=message):
        resolve(config.build(sets=TINY + sets))


# ---- accuracy on the main job ----

@pytest.mark.slow
def test_fp16_and_fp8_match_fp32_accuracy_on_the_main_job(tmp_path):
    """MiniLM-L6 on the RT snippets: the README's main-job command (configs/minilm_rt.py on one
    CPU device, as a user runs it) under each policy: fp16 and fp8 reach test accuracy within 1
    point of fp32. 7.5 to 12 minutes per policy, 29 in all, on the idle 2-core CPU."""
    path = os.path.join(CONFIGS, "minilm_rt.py")
    acc = {}
    for policy in ("fp32", "fp16", "fp8"):
        start = time.perf_counter()
        proc = subprocess.run(
            [*CLI, "train", "--config", path,
             "--set", f"workdir={tmp_path}", "--set", f"name={policy}",
             "--set", f"precision.policy={policy}", "--set", "train.progress=false"],
            capture_output=True, text=True, env=cpu_env(PYTHONPATH=ROOT))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        result, _ = json.JSONDecoder().raw_decode(proc.stdout)   # then where the files are
        assert result["status"] == "completed", result
        acc[policy] = result["eval_accuracy"]
        print(f"{policy}: test accuracy {acc[policy]:.4f}, {time.perf_counter() - start:.0f} s",
              flush=True)
    for policy in ("fp16", "fp8"):
        assert abs(acc[policy] - acc["fp32"]) <= 0.01, acc
