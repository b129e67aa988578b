"""Pipeline parallelism (``jaxaccel.train.pipeline``) on 8 fake CPU devices: a pipelined step is
the plain step (loss and updated parameters, fp32, dropout on) for both families on the three
meshes of issue 33 with M in {S, 2S, 4S} and R in {1, 2}; with remat, accumulation, fp16, fp8,
layer decay, the flat layout and padding layers; the layer placement and the bubble; the
settings it refuses; checkpoints move between pipelined and plain runs both ways."""
import collections
import dataclasses
import itertools
import os

import compile_only
import jax
import numpy as np
import pytest

from jaxaccel import config, plan, precision
from jaxaccel.models import model_spec
from jaxaccel import forms
from jaxaccel.forms.flat import FlatParams
from jaxaccel.forms.stacked import Stacked
from jaxaccel.train import pipeline
from jaxaccel.train import run as run_lib
from support import (CONFIGS, DEVICES, TINY, TINY_SETS, docs, needs_cuda_plugin, needs_libtpu,
                     packed, resumes_both_ways)

pytestmark = pytest.mark.usefixtures("on_eight_devices")   # DEVICES: the module's 8 devices

# The tiny BERT (synthetic rows) and the tiny decoder (packed documents: no data is read, the
# tokenizer is named only so that no corpus BPE is sized), dropout on.
BERT = TINY_SETS + ["model.hidden_dropout=0.1", "model.attention_dropout=0.1",
                    "train.eps=1e-3"]
LLAMA = ["model.name=llama-tiny", "data.name=canterbury", "model.tokenizer=unused",
         "data.max_len=16", "train.batch_size=16", "train.eval_batch_size=16",
         "train.max_steps=3", "train.learning_rate=3e-3", "train.eps=1e-3",
         "model.attention_dropout=0.1", "train.progress=false"]
LM_BATCHES = [packed([docs(8 * i + r, 5, 9, 2) for r in range(16)], 16) for i in range(2)]
MESHES = {"stage2_fsdp2_data2": {"stage": 2, "fsdp": 2, "data": 2},
          "stage4_tensor2": {"stage": 4, "tensor": 2, "data": 1},
          "stage8": {"stage": 8, "data": 1}}


def _run(sets, tmp_path, mesh, layers, *extra, policy=None):
    """The run of ``sets`` on ``mesh`` with ``layers`` layers; ``policy`` replaces the
    config's resolved precision policy (given to ``assemble`` in the ``Resolved``)."""
    cfg = config.build(sets=[*sets, f"workdir={tmp_path}",
                             *(f"mesh.{k}={v}" for k, v in mesh.items()), *extra])
    spec = model_spec(cfg.model)
    spec = dataclasses.replace(spec, architecture=dataclasses.replace(
        spec.architecture, num_hidden_layers=layers))
    lm = spec.task == "causal_lm"
    resolved = run_lib.resolve(cfg, DEVICES, spec=spec)
    if policy is not None:
        resolved = dataclasses.replace(resolved, policy=policy)
    return run_lib.assemble(resolved, data=not lm), lm


Steps = collections.namedtuple("Steps", "losses params run fp8")


def two_steps(sets, tmp_path, mesh, layers, *extra, policy=None):
    """``Steps``: the losses of two train steps, the parameters after them (the per-layer
    form), the run and the fp8 state after them (None without the fp8 policy)."""
    run, lm = _run(sets, tmp_path, mesh, layers, *extra, policy=policy)
    batches = LM_BATCHES if lm else itertools.islice(run.train_data.batches(0), 2)
    state, losses = run.state, []
    with jax.set_mesh(run.mesh):
        for batch in batches:
            state, metrics = run.train_step(state, run.put_batch(batch))
            losses.append(float(metrics["loss"]))
    return Steps(losses, jax.device_get(forms.portable(state.params)), run,
                 jax.device_get(state.fp8))


SETS = {"bert": BERT, "llama": LLAMA}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The unpipelined references, data parallel over 8 devices: ``plain(family, layers)``."""
    tmp, done = tmp_path_factory.mktemp("plain"), {}

    def reference(family, layers):
        if (family, layers) not in done:
            done[family, layers] = two_steps(SETS[family], tmp, {"data": 8}, layers)[:2]
        return done[family, layers]
    return reference


# (mesh, micro-batches per stage, repeats, layers): each family on every mesh, with M = S, 2S
# or 4S, R = 1 or 2 and groups of 1 or 2 layers among them. The schedule is unrolled on the CPU
# (R M + S - 1 steps of a group each), so the models are as small as the case allows.
# The schedule is the families' own code only through layer_call: each mesh runs the decoder,
# BERT (its attention mask and unpadding arguments) one mesh by default and the other two under
# -m slow (suite time), the ViT one in tests/test_vit.py.
CASES = {"bert": [("stage2_fsdp2_data2", 4, 1, 2),
                  pytest.param("stage4_tensor2", 1, 2, 8, marks=pytest.mark.slow),
                  pytest.param("stage8", 2, 1, 8, marks=pytest.mark.slow)],
         "llama": [("stage2_fsdp2_data2", 1, 2, 4), ("stage4_tensor2", 2, 1, 4),
                   pytest.param("stage8", 1, 1, 8, marks=pytest.mark.slow)]}


def _case(family, case):
    if hasattr(case, "marks"):          # a pytest.param
        return pytest.param(family, *case.values, marks=case.marks)
    return (family, *case)


@pytest.mark.parametrize("family,mesh,per_stage,repeats,layers",
                         [_case(f, c) for f, cases in CASES.items() for c in cases])
@pytest.mark.long
def test_pipelined_steps_equal_the_plain_steps(plain, tmp_path, family, mesh, per_stage,
                                               repeats, layers):
    sizes = MESHES[mesh]
    m = per_stage * sizes["stage"]
    losses, params, run, _ = two_steps(SETS[family], tmp_path, sizes, layers,
                                    f"train.microbatches={m}",
                                    f"model.pipeline_repeats={repeats}")
    stages = run.resolved.stages
    assert (stages.stages, stages.microbatches, stages.repeats) == (sizes["stage"], m, repeats)
    assert isinstance(run.state.params, Stacked)
    # the layers live split over the stages: each device holds its stage's groups only
    leaf = jax.tree_util.tree_leaves(run.state.params.layers)[0]
    assert leaf.sharding.spec[0] == "stage"
    ref_losses, ref_params = plain(family, layers)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.long
def test_remat_gradient_accumulation_and_fp16_compose_with_the_pipeline(tmp_path):
    """The decoder with per-layer remat, 2 accumulated micro-batches each cut into 2 pipeline
    micro-batches, fp16 with loss scaling, the stages' FSDP weights gathered once per
    accumulated micro-batch: the plain run's losses (fp16 rounding apart)."""
    extra = ("model.remat=true", "train.grad_accum=2", "precision.policy=fp16")
    pipe = two_steps(LLAMA, tmp_path, MESHES["stage2_fsdp2_data2"], 2, *extra,
                     "train.microbatches=2", "sharding.pipeline_gather_once=true")
    assert pipe.run.resolved.stages.gather_once
    ref = two_steps(LLAMA, tmp_path, {"data": 8}, 2, *extra)
    np.testing.assert_allclose(pipe[0], ref[0], rtol=2e-3)
    for a, b in zip(jax.tree_util.tree_leaves(pipe[1]), jax.tree_util.tree_leaves(ref[1])):
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=0, atol=2e-3)


@pytest.mark.parametrize("family,layers,micro,repeats", [
    pytest.param("llama", 7, 2, 2, marks=pytest.mark.slow),
    pytest.param("bert", 2, 4, 1, marks=pytest.mark.slow)])
def test_fp8_composes_with_the_pipeline(tmp_path, family, layers, micro, repeats):
    """fp8 with delayed scaling on 2 stages: each layer is used by every micro-batch (and
    idle in the bubble) and its scaling state comes out as the plain step's, the newest amax
    the whole batch's (the largest of its micro-batches', not their sum); the plain run's
    losses and parameters. The decoder's 7 layers on 2 stages x 2 repeats are groups of 2 and
    a padding layer, whose scales must not turn its zero weights into NaNs. The fp8 matmuls'
    compute dtype is float32 here (bfloat16 in the policy): the micro-batches' bfloat16
    rounding differs from the whole batch's by an ulp, which fp8 quantization turns into amax
    differences of ~3% that would hide what is tested."""
    fp8 = dataclasses.replace(precision.POLICIES["fp8"], compute_dtype=np.float32)
    extra = ("precision.policy=fp8",)
    pipe = two_steps(SETS[family], tmp_path, MESHES["stage2_fsdp2_data2"], layers, *extra,
                     f"train.microbatches={micro}", f"model.pipeline_repeats={repeats}",
                     policy=fp8)
    assert pipe.run.resolved.stages.padding == (1 if family == "llama" else 0)
    ref = two_steps(SETS[family], tmp_path, {"data": 8}, layers, *extra, policy=fp8)
    assert pipe.run.resolved.policy.fp8
    histories = [h for p, h in jax.tree_util.tree_flatten_with_path(ref.fp8)[0]
                 if "amax_history" in jax.tree_util.keystr(p)]
    # two steps: the newest amax at [0], the one before rolled to [-1]
    assert len(histories) >= 7 * layers and all(h[0] > 0 and h[-1] > 0 for h in histories)
    assert jax.tree_util.tree_structure(pipe.fp8) == jax.tree_util.tree_structure(ref.fp8)
    for a, b in zip(jax.tree_util.tree_leaves(pipe.fp8), jax.tree_util.tree_leaves(ref.fp8)):
        np.testing.assert_allclose(a, b, rtol=1e-5)
    np.testing.assert_allclose(pipe.losses, ref.losses, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(pipe.params), jax.tree_util.tree_leaves(ref.params)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mesh,extra", [
    ({"stage": 2, "data": 4}, ("train.layer_decay=0.5",)),
    # FSDP keeps some leaves whole and every stage holds the embeddings and the head: the flat
    # layout's clipping norm must count each once (clipping binds at 0.05)
    pytest.param({"stage": 2, "fsdp": 2, "data": 2},
                 ("train.optimizer=adan", "train.optimizer_impl=xla", "train.flat_params=true",
                  "train.weight_decay=0.01", "train.max_grad_norm=0.05"),
                 marks=pytest.mark.slow)], ids=["layer_decay", "flat"])
@pytest.mark.long
def test_layer_decay_and_the_flat_layout_compose_with_the_pipeline(plain, tmp_path, mesh, extra):
    """Layer-wise decay scales the stacked layers by their own layers' factors; the flat
    one-pass Adan keeps the staged parameters in its buffers: the plain run's losses and
    parameters with the setting, not those without it."""
    pipe = two_steps(LLAMA, tmp_path, mesh, 4, *extra, "train.microbatches=4")
    ref = two_steps(LLAMA, tmp_path, {"data": 8}, 4, *extra)
    np.testing.assert_allclose(pipe[0], ref[0], rtol=1e-5)
    diff = [np.max(np.abs(a - b)) for a, b in zip(jax.tree_util.tree_leaves(pipe[1]),
                                                  jax.tree_util.tree_leaves(ref[1]))]
    assert max(diff) < 1e-5, max(diff)
    without = plain("llama", 4)[1]
    assert max(np.max(np.abs(a - b)) for a, b in zip(jax.tree_util.tree_leaves(without),
                                                     jax.tree_util.tree_leaves(pipe[1]))) > 1e-3
    if "train.flat_params=true" in extra:
        assert isinstance(pipe[2].state.params, FlatParams)


@pytest.mark.long
def test_layers_that_do_not_split_evenly_are_padded_at_the_end(plain, tmp_path):
    """3 decoder layers on 2 stages: groups of 2, the last place a padding layer that passes
    its input through. The plain run's losses and parameters (which hold the 3 layers
    only); the placement, the padding and the idle share the planner divides by."""
    st = pipeline.Stages(stages=4, repeats=1, microbatches=4, layers=22)
    assert (st.group, st.padding) == (6, 2)
    assert st.idle == pytest.approx(1 - 22 * 4 / (4 * 6 * 7)) and st.idle > st.bubble
    params = {"layers": {i: {"w": np.full((2,), i + 1.0)} for i in range(22)}}
    staged = Stacked.create(st, params)
    assert (staged.layers["w"][3, 0, 4:] == 0).all() and staged.layers["w"][3, 0, 3, 0] == 22
    assert sorted(staged.unstacked()["layers"]) == list(range(22))
    losses, params, run, _ = two_steps(LLAMA, tmp_path, MESHES["stage2_fsdp2_data2"], 3,
                                       "train.microbatches=2")
    assert run.resolved.stages.padding == 1
    ref_losses, ref_params = plain("llama", 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert len(params["layers"]) == 3
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_layers_are_placed_round_robin_by_repeat_and_the_bubble_follows():
    st = pipeline.Stages(stages=4, repeats=2, microbatches=8, layers=16)
    assert st.group == 2 and st.iterations == 2 * 8 + 3
    assert st.bubble == pytest.approx(3 / 19)
    # stage 1 holds layers 2, 3 (repeat 0) and 10, 11 (repeat 1)
    assert [st.layer(1, r, j) for r in range(2) for j in range(2)] == [2, 3, 10, 11]
    params = {"embed": np.zeros(3), "layers": {i: {"w": np.full((2,), i)} for i in range(16)}}
    staged = Stacked.create(st, params)
    assert staged.layers["w"].shape == (4, 2, 2, 2)
    assert staged.layers["w"][1, 1, 0, 0] == 10
    back = staged.unstacked()
    assert all((back["layers"][i]["w"] == i).all() for i in range(16))


@pytest.mark.parametrize("extra,message", [
    (["mesh.stage=4", "mesh.data=2", "model.pipeline_repeats=3"], "do not fill"),
    (["mesh.stage=2", "mesh.data=4", "train.microbatches=1"], "fewer than mesh.stage=2"),
    (["mesh.stage=2", "mesh.data=4", "train.microbatches=3"], "does not split into"),
])
def test_pipelines_it_cannot_run_are_refused_before_anything_is_built(tmp_path, extra, message):
    cfg = config.build(sets=TINY + [f"workdir={tmp_path}", *extra])
    with pytest.raises(ValueError, match=message):
        run_lib.resolve(cfg, DEVICES)


# Under -m slow (56 s of the default suite): by default a checkpoint moving between stacked and
# per-layer forms both ways is tests/test_scan.py's (multi-tensor Adan packed over the stacked
# layers), the flat layout's across paths and meshes tests/test_flat.py's, and a pipelined flat
# run read back per layer tests/test_export.py's. The 20-step comparison: 60 steps of
# the unrolled 8-device schedule instead of 18 took the test from 38 to 106 s.
@pytest.mark.slow
@pytest.mark.parametrize("steps", [6, 20])
def test_checkpoints_move_between_pipelined_and_plain_runs(tmp_path, steps):
    """Runs stopped after step 3 on one layout, resumed on the other, both ways: the losses of
    the unpipelined run that never stopped (dropout on), its final eval, and the eval of the
    folder on 2 devices. Adan throughout; the pipelined side keeps its staged parameters and
    Adan's state in the flat layout, so its checkpoint is converted through both forms."""
    sets = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1", f"train.max_steps={steps}",
            "mesh.data=-1", "train.optimizer=adan", "train.optimizer_impl=xla"]
    resumes_both_ways(tmp_path, sets, ("mesh.stage=2", "train.flat_params=true"),
                      ("mesh.stage=1",), steps)


# The decoder job's config with the tiny decoder (2 layers; a tokenizer named so that no corpus
# BPE is sized) on 2 stages x 2 FSDP x 2 data, 32 rows of 64 tokens.
PLANNED = ["model.name=llama-tiny", "model.tokenizer=unused", "data.max_len=64",
           "mesh.stage=2", "mesh.fsdp=2", "mesh.data=2", "train.batch_size=32",
           "train.eval_batch_size=32"]


@pytest.mark.aot_compile
@needs_libtpu
@needs_cuda_plugin
@pytest.mark.parametrize("name", [pytest.param("v5e-8", marks=pytest.mark.slow), "h100:1x8"])
@pytest.mark.long
def test_a_pipelined_decoder_plans_for_tpu_and_gpu(name):
    """The TPU and GPU compilers take the pipelined step (its loops scanned there, not
    unrolled): the stage-to-stage collective permutes are in the compiled program, the plan
    states the bubble, and on the TPU the memory per stage does not grow with the
    micro-batches: parameters and optimizer state are the same, the activations of a fixed
    batch no larger."""
    config_path = os.path.join(CONFIGS, "canterbury_lm.py")
    p = plan.make_plan(config_path, PLANNED + ["train.microbatches=2"], name)
    assert p.pipeline["permute_bytes"] > 0 and p.collectives["collective-permute"] > 0
    assert p.pipeline["bubble"] == pytest.approx(1 / 3)
    assert p.estimate["idle"] == pytest.approx(1 / 3)
    assert "bubble (S-1)/(R*M+S-1) = 33.3%" in plan.report(p)
    assert plan.result(p)["rows"][0]["pipeline"]["stages"] == 2
    if name == "v5e-8":
        more = plan.make_plan(config_path, PLANNED + ["train.microbatches=8"], name)
        assert more.pipeline["bubble"] == pytest.approx(1 / 9)
        for key in ("params", "opt_state"):
            assert more.memory[key] == p.memory[key]
        assert more.memory["temp"] <= p.memory["temp"] * 1.05, (more.memory, p.memory)
        # the stages' FSDP weights gathered once, not at each of the 9 schedule steps: fewer
        # all-gathers, and no all-reduce or reduce-scatter more (each use's gradient is
        # reduce-scattered, not all-reduced)
        once = plan.make_plan(config_path, PLANNED + ["train.microbatches=8",
                                                      "sharding.pipeline_gather_once=true"], name)
        assert once.pipeline["gather_once"] and not more.pipeline["gather_once"]
        assert once.collectives["all-gather"] < more.collectives["all-gather"], (
            once.collectives, more.collectives)
        for kind in ("all-reduce", "reduce-scatter"):
            assert once.collectives[kind] <= more.collectives[kind], (once.collectives,
                                                                      more.collectives)


@pytest.mark.aot_compile
@pytest.mark.slow                   # 29 s of the suite; the plain step's fp8 GEMMs: test_precision
def test_fp8_gemms_stay_fp8_in_the_pipelined_step_for_h100(tmp_path, compile_target):
    """The pipelined fp8 step compiled for 8 x H100 (no GPU used): the vmap over stages and
    the scanned schedule leave the block GEMMs of the stage's layer on fp8 operands, E4M3 x
    E4M3 forward and with E5M2 gradients backward."""
    target = compile_target("h100:1x8")
    run, _ = _run(BERT, tmp_path, MESHES["stage2_fsdp2_data2"], 2, "precision.policy=fp8",
                  "train.microbatches=2")
    m = compile_only.mesh(target, run.mesh.devices.shape, run.mesh.axis_names)
    compile_only.assert_gemm_dtypes(compile_only.compile_step(run, m)[0].as_text(), "fp8", 1)
