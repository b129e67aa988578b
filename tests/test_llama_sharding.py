"""The decoder under SPMD sharding on 8 fake CPU devices: sharded train steps equal the
one-device step (as tests/test_sharding.py checks for BERT), and the ~1B preset's step (FSDP +
tensor parallel, bf16 and fp8, Pallas causal attention, remat) lowers for TPU and CUDA from
shapes alone (nothing 1B-sized is allocated)."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxaccel import sharding as shd
from jaxaccel.plan.collectives import collective_bytes
from jaxaccel.models import LLAMA_PRESETS, ModelSpec, build_model
from jaxaccel.optim import make_optimizer
from jaxaccel.precision import get_policy
from jaxaccel.train.layout import TREE, state_shardings
from jaxaccel.train.run import split_model
from jaxaccel.train.checkpoint import abstract_like
from jaxaccel.train.state import TrainState
from jaxaccel.train.step import make_train_step
from support import DEVICES, LM, docs, lm_loss, packed

pytestmark = pytest.mark.usefixtures("on_eight_devices")   # DEVICES: the module's 8 devices


def sharded_step(spec, policy, mesh, abstract=False, grad_accum=1):
    """``(jitted step, state or its abstract twin, batch sharding)`` of ``spec`` on ``mesh``,
    laid out as the trainer lays it out (``run.split_model``'s logical-axis shardings)."""
    policy = get_policy(policy)
    make = lambda: build_model(spec, policy, 0)
    model = nnx.eval_shape(make) if abstract else make()
    graphdef, params, fp8, p_sh = split_model(model, mesh)
    fp8 = fp8 if policy.fp8 else None
    tx = make_optimizer("adamw", 3e-3, weight_decay=0.01, max_grad_norm=1.0, eps=1e-3)
    create = lambda p, f: TrainState.create(p, tx, 0, None, f)
    shapes = jax.eval_shape(create, params, fp8)
    rep = shd.replicated(mesh)
    shardings = TrainState(step=rep, params=p_sh,
                           opt_state=state_shardings(shapes.opt_state, p_sh, mesh), rng=rep,
                           fp8=jax.tree_util.tree_map(lambda _: rep, shapes.fp8))
    state = abstract_like(shapes, shardings) if abstract else \
        jax.jit(create, out_shardings=shardings)(jax.device_put(params, p_sh), fp8)
    step = jax.jit(make_train_step(graphdef, tx, TREE, task=LM,
                                   fp8_group=type(model).fp8_group, grad_accum=grad_accum),
                   in_shardings=(shardings, shd.batch_sharding(mesh)),
                   out_shardings=(shardings, rep), donate_argnums=0)
    return step, state, shd.batch_sharding(mesh)


BATCH = packed([docs(r, 5, 9, 2) for r in range(8)], 16)
TINY = ModelSpec(LLAMA_PRESETS["llama-tiny"])


def train(mesh_shape, devices, grad_accum=1):
    """3 steps on one batch (8 rows of 3 documents) on the mesh ``mesh_shape``."""
    mesh = shd.make_mesh(dict(zip(("data", "fsdp", "tensor"), mesh_shape)), DEVICES[:devices])
    with jax.set_mesh(mesh):
        step, state, batch_sharding = sharded_step(TINY, "fp32", mesh, grad_accum=grad_accum)
        losses = []
        for batch in [BATCH] * 3:
            state, metrics = step(state, jax.device_put(batch, batch_sharding))
            losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state.params)


@pytest.fixture(scope="module")
def one_device():
    return train((1, 1, 1), 1)


def test_the_step_minimises_the_causal_lm_loss(one_device):
    """The step's loss is the task's next-token loss of the model (from the log-softmax by
    hand) and falls on a repeated batch."""
    losses = one_device[0]
    np.testing.assert_allclose(losses[0], lm_loss(build_model(TINY, None, 0), BATCH), rtol=1e-5)
    assert losses[2] < losses[0] - 0.1, losses


def test_fsdp_decoder_step_gathers_each_parameter_once():
    """FSDP-8's compiled decoder step all-gathers each parameter once and reduces each
    gradient once, not the activations (``sharding.by_batch`` on the residual stream; without
    it XLA gathered 2.5x the parameters' bytes)."""
    mesh = shd.make_mesh({"data": 1, "fsdp": 8, "tensor": 1}, DEVICES)
    with jax.set_mesh(mesh):
        step, state, batch_sharding = sharded_step(TINY, "fp32", mesh)
        hlo = step.lower(state, jax.device_put(BATCH, batch_sharding)).compile().as_text()
    moved = collective_bytes(hlo)
    params = 4 * sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    assert moved["all-gather"] <= 1.1 * params, (moved, params)
    assert moved["all-reduce"] + moved["reduce-scatter"] <= 1.1 * params, (moved, params)
    assert moved["all-to-all"] + moved["collective-permute"] <= 0.15 * params, moved


@pytest.mark.parametrize("mesh,devices,grad_accum", [
    ((2, 2, 2), 8, 2), ((1, 8, 1), 8, 1), ((1, 1, 4), 4, 1)])
def test_sharded_decoder_steps_equal_one_device(one_device, mesh, devices, grad_accum):
    """2x2x2 (with two micro-batches per step: one compile checks both), FSDP 8, tensor 4."""
    losses, params = train(mesh, devices, grad_accum)
    np.testing.assert_allclose(losses, one_device[0], rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(one_device[1])):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_fp8_decoder_step_trains_and_reports_its_layer_groups():
    """Under fp8 the block Dense layers carry delayed-scaling state through the step: the loss
    falls and the metrics hold each group's amaxes (the decoder's own layer paths)."""
    mesh = shd.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, DEVICES[:1])
    with jax.set_mesh(mesh):
        step, state, batch_sharding = sharded_step(TINY, "fp8", mesh)
        losses = []
        for _ in range(3):
            state, metrics = step(state, jax.device_put(BATCH, batch_sharding))
            losses.append(float(metrics["loss"]))
    assert losses[2] < losses[0] - 0.1, losses
    for group in ("qkv", "attn_out", "mlp_in", "mlp_out"):
        assert float(metrics[f"fp8/{group}_input_amax"]) > 0, group


@pytest.mark.parametrize("name,policy,kernel", [
    ("v5e:2x4", "bf16", "tpu_custom_call"), ("h100:1x8", "fp8", "__gpu$xla.gpu.triton")])
def test_1b_step_lowers_for_accelerators_with_fsdp_and_tensor_parallel(
        compile_target, name, policy, kernel):
    """The llama-1b preset (TinyLlama-1.1B shapes) with remat and Pallas causal attention on
    fsdp=2 x tensor=4 of a TPU slice's or an H100 host's compile-only devices, 2048-token rows:
    the whole train step lowers, the attention picking its Pallas kernels from the mesh; the
    flash kernels run inside manual (per-shard) regions; under fp8 the block matmuls are
    E4M3/E5M2."""
    spec = ModelSpec(LLAMA_PRESETS["llama-1b"], attention_impl="pallas", remat=True)
    mesh = shd.make_mesh({"data": 1, "fsdp": 2, "tensor": 4}, compile_target(name).devices)
    step, state, batch_sharding = sharded_step(spec, policy, mesh, abstract=True)
    batch = {k: jax.ShapeDtypeStruct((2, 2048), v.dtype, sharding=batch_sharding)
             for k, v in BATCH.items()}
    with jax.set_mesh(mesh):
        text = step.trace(state, batch).lower().as_text()
    calls = " ".join(line for line in text.splitlines() if f"custom_call @{kernel}" in line)
    for name in ("flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"):
        assert name in calls, name
    assert "sdy.manual_computation" in text or "SPMDFullToShardShape" in text
    if policy == "fp8":
        dots = [line for line in text.splitlines() if "dot_general" in line]
        assert sum("f8E4M3FN" in line for line in dots) >= 7 * 22
        assert sum("f8E5M2" in line for line in dots) >= 7 * 22


def test_tensor_parallelism_must_split_whole_key_value_heads():
    mesh = shd.make_mesh({"data": 1, "fsdp": 1, "tensor": 8}, DEVICES)
    with pytest.raises(ValueError, match="mesh.tensor=8 does not divide the model's "
                                         "num_key_value_heads=4"):
        shd.check_model_fits(TINY.architecture, mesh)
