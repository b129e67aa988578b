"""The one-pass Adan on flat parameters (``forms.flat``, ``adan_onepass``, ``kernels_pallas``'s
``adan_apply``, ``train.flat_params``): the float64 rule, the kernel three ways, training equal
to the optax path on one device and sharded, checkpoints portable across the two paths."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compile_only
from jaxaccel import forms
from jaxaccel.forms.packing import Packer
from jaxaccel.optim import decay_mask
from jaxaccel.optim.adan import adan_onepass
from jaxaccel.train.checkpoint import Checkpointer, on_disk, restore_state
from jaxaccel.train.metrics import read_metrics
from kernels_pallas.adan import adan_apply, adan_update, apply_kernel
from kernels_pallas.adan_reference import LANES, ROW_ALIGN, BlockSizes
from support import (ADAN, CASES, DEVICES, TINY_CONFIG, Float64Adan, bert_tree, build,
                     flat_args, grads_at, rel, run_cli, small_tree, train_steps)

# ``build`` places every run on the module's 8 devices, the fake CPU ones on a one-GPU machine
# (see conftest.on_eight_devices and eight_device_placement).
pytestmark = pytest.mark.usefixtures("on_eight_devices")

FLAT = ("train.flat_params=true",)


def run_onepass(tx, params, steps):
    fp = tx.flatten(params)
    state = tx.init(fp)
    apply = jax.jit(tx.apply, donate_argnums=(1, 2))
    for t in range(steps):
        g = tx.flatten(grads_at(t, params)).buffers      # the gradient, laid out as the params
        fp, state = apply(g, state, fp)
    return fp.view(), state


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_onepass_matches_float64_rule(impl, case):
    kw = dict(lr=3e-3)
    kw.update(CASES[case])
    params = bert_tree(hidden=16, layers=1, vocab=50, mlp=24)
    decay = jax.tree_util.tree_leaves(decay_mask(params))
    tx = adan_onepass(kw["lr"], weight_decay=kw["wd"], no_prox=kw.get("no_prox", False),
                      max_grad_norm=kw.get("max_grad_norm", 0.0), mask=decay_mask,
                      impl=impl)
    ref = Float64Adan(kw["lr"], wd=kw["wd"], no_prox=kw.get("no_prox", False),
                      max_grad_norm=kw.get("max_grad_norm", 0.0), decay=decay)
    steps = 100 if impl == "xla" else 20
    ours, state = run_onepass(tx, params, steps)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    p64 = [x.astype(np.float64) for x in leaves]
    for t in range(steps):
        p64 = ref.step(p64, [g.astype(np.float64) for g in
                             treedef.flatten_up_to(grads_at(t, params))])
    assert int(state.count) == steps
    assert rel(ours, treedef.unflatten(p64)) < 1e-5


def test_groups_split_by_decay_and_dtype_and_views_round_trip():
    params = small_tree()
    params["half"] = jnp.arange(300, dtype=jnp.bfloat16).reshape(3, 100)
    tx = adan_onepass(1e-3, weight_decay=0.1, mask=decay_mask)
    fp = tx.flatten(params)
    kinds = [(g.decay, g.dtype) for g in fp.packing.groups]
    assert kinds == [(True, "bfloat16"), (True, "float32"), (False, "float32")]
    assert [b.dtype for b in fp.buffers] == [jnp.bfloat16, jnp.float32, jnp.float32]
    assert all(b.shape[0] % ROW_ALIGN == 0 and b.shape[1] == LANES for b in fp.buffers)
    for a, b in zip(jax.tree_util.tree_leaves(fp.view()), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    back = forms.restore(forms.portable(fp), fp)
    for a, b in zip(back.buffers, fp.buffers):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="gradient buffers for 3 groups"):
        tx.apply(fp.buffers[:1], tx.init(fp), fp)


def test_the_flat_gradient_norm_counts_a_replicated_leaf_once():
    """On a (fsdp=4, tensor=2) mesh each device's buffer holds its shard of a split leaf and
    a whole copy of a replicated one: the layout's norm of the flat gradient (the one the step
    reports and clips by) is the tree's norm, with and without ZeRO-1."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxaccel.optim import global_norm
    mesh = Mesh(np.array(DEVICES).reshape(4, 2), ("fsdp", "tensor"))
    grads = {"split": jnp.arange(64.0).reshape(8, 8) / 7, "half": jnp.full((8, 4), 0.5),
             "whole": jnp.arange(1.0, 13.0)}
    specs = {"split": P("fsdp", "tensor"), "half": P("fsdp", None), "whole": P()}
    shardings = {k: NamedSharding(mesh, v) for k, v in specs.items()}
    grads = jax.device_put(grads, shardings)
    for zero in ((), ("tensor",)):
        tx = adan_onepass(1e-3, mask=decay_mask, impl="xla", packer=Packer(shardings, zero))
        fp = tx.flatten(grads)
        layout = fp.packing
        assert [layout.copies(i) for i in range(3)] == [2, 1, 8]   # half, split, whole
        with jax.set_mesh(mesh):
            got = jax.jit(layout.global_norm)(fp.buffers)
        np.testing.assert_allclose(got, global_norm(grads), rtol=1e-6)


def _apply_args(rows, dtype=jnp.float32):
    """``support.flat_args`` in adan_apply's order (s, g, p, m, v, n, prev)."""
    s, g, m, v, n, prev, p = flat_args(rows, dtype)
    return s, g, p, m, v, n, prev


@pytest.mark.parametrize("no_prox", [False, True])
def test_apply_kernel_interpret_matches_reference_and_update(no_prox):
    """The one-pass kernel (interpreted) = its XLA reference, and p' = p + the optax-path
    update of the same step."""
    s, g, p, m, v, n, prev = _apply_args(ROW_ALIGN, jnp.bfloat16)
    a = adan_apply(s, g, p, m, v, n, prev, no_prox=no_prox, impl="xla")
    b = apply_kernel(s, g, p, m, v, n, prev, no_prox=no_prox, target="interpret",
                     block_sizes=BlockSizes(128))
    for x, y in zip(a, b):
        assert x.dtype == y.dtype
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                   rtol=2.0 ** -7, atol=1e-6)
    s, g, p, m, v, n, prev = _apply_args(ROW_ALIGN)
    new = adan_apply(s, g, p, m, v, n, prev, no_prox=no_prox, impl="xla")
    u, *state = adan_update(s, g, m, v, n, prev, p, no_prox=no_prox, impl="xla")
    np.testing.assert_allclose(new[0], p + u, rtol=1e-6, atol=1e-6)
    for x, y in zip(new[1:], state):
        np.testing.assert_array_equal(x, y)


def test_block_sizes_are_checked():
    with pytest.raises(ValueError, match="block rows 48 must divide ROW_ALIGN"):
        BlockSizes(48)
    with pytest.raises(ValueError, match="num_warps=3 must be a power of two"):
        BlockSizes(16, num_warps=3)


@pytest.mark.parametrize("name", ["v5e:2x2", "h100:1x1"])
def test_apply_kernel_compiles_in_place_for_tpu_and_gpu(compile_target, name):
    """Compiled by the target's compiler (the kernel chosen from the buffers' mesh): the
    donated p, m, v, n, prev are updated in place, aliased to the kernel's outputs, with no
    copy of any buffer around it."""
    target = compile_target(name)
    rows = 2 * ROW_ALIGN
    m = compile_only.mesh(target)
    args = compile_only.replicated(m, *jax.eval_shape(lambda: _apply_args(rows)))
    compiled, _ = compile_only.compile_timed(apply_kernel, *args, mesh=m,
                                             donate_argnums=(2, 3, 4, 5, 6))
    text = compiled.as_text()
    assert compile_only.KERNEL_CALL[target.platform] in text and "adan_apply" in text
    assert compiled.memory_analysis().alias_size_in_bytes == 5 * rows * LANES * 4
    assert " copy(" not in text             # donated in the kernel's output order: no copy


def _losses_and_params(run, k=3):
    """The losses of ``k`` steps, and the parameter tree (in the per-parameter form), fp16
    loss scale and fp8 state they leave."""
    losses, state = train_steps(run, k)
    # The view jitted: one program instead of a few eager ops per parameter (183 compiles on a
    # sharded flat layout).
    view = jax.jit(run.resolved.layout.view)(state.params)
    return losses, jax.device_get((view, state.loss_scale, state.fp8))


@pytest.fixture(scope="module")
def optax_path(tmp_path_factory):
    return _losses_and_params(build(tmp_path_factory.mktemp("optax"), (1, 1, 1), 1, *ADAN))


def _assert_same(ours, ref, tol=1e-5):
    np.testing.assert_allclose(ours[0], ref[0], rtol=tol)
    for a, b in zip(jax.tree_util.tree_leaves(ours[1]), jax.tree_util.tree_leaves(ref[1])):
        np.testing.assert_allclose(a, b, rtol=0, atol=tol)


def test_flat_training_equals_the_optax_path(tmp_path, optax_path):
    """3 steps of the tiny config: the one-pass path (Pallas kernel, interpreted) gives the
    losses and parameters of the optax multi-tensor path."""
    run = build(tmp_path, (1, 1, 1), 1, *ADAN, *FLAT)
    leaves = jax.tree_util.tree_leaves(run.state.params)
    assert len(leaves) == len(run.state.params.buffers)          # everything packed
    assert all(a is b for a, b in zip(leaves, run.state.params.buffers))
    _assert_same(_losses_and_params(run), optax_path)


@pytest.mark.parametrize("mesh,devices,sets", [
    ((1, 8, 1), 8, []),                                    # FSDP
    ((2, 2, 2), 8, ["sharding.zero1=true"]),               # all three + ZeRO-1 over data
])
def test_sharded_flat_training_equals_one_device(tmp_path, optax_path, mesh, devices, sets):
    run = build(tmp_path, mesh, devices, *ADAN, *FLAT, *sets)
    buf = run.state.params.buffers[0]
    assert buf.sharding.spec == run.state.params.packing.param_spec
    _assert_same(_losses_and_params(run), optax_path)


@pytest.fixture(scope="module")
def flat_142(tmp_path_factory):
    """The flat run both targets below compile (built once: compiling does not change it)."""
    return build(tmp_path_factory.mktemp("flat_142"), (1, 4, 2), 8, *ADAN, *FLAT)


@pytest.mark.parametrize("name", ["v5e:2x4", "h100:1x8"])
@pytest.mark.long
def test_flat_step_compiles_for_tpu_and_gpu_with_one_kernel_per_group(flat_142, compile_target,
                                                                       name):
    """The one-pass step on a (1, 4, 2) mesh of compile-only devices: one apply kernel per
    group in the compiled program (Mosaic / Triton, chosen from the mesh), no update kernel."""
    from jax.sharding import PartitionSpec as P
    target = compile_target(name)
    run = flat_142
    assert run.state.params.packing.param_spec == P(("fsdp", "tensor"))
    m = compile_only.mesh(target, run.mesh.devices.shape, run.mesh.axis_names)
    text = compile_only.compile_step(run, m)[0].as_text()
    calls = compile_only.kernel_calls(text, target.platform)
    assert sum("adan_apply" in c for c in calls) == len(run.state.params.packing.groups)
    assert not any("adan_update" in c for c in calls)


@pytest.mark.parametrize("source,target", [((FLAT, (1, 8, 1)), ((), (2, 2, 2))),
                                           (((), (8, 1, 1)), (FLAT, (1, 4, 2)))])
@pytest.mark.long
def test_checkpoints_cross_paths_and_meshes(tmp_path, source, target):
    """A checkpoint of the flat path restores into the optax path on another mesh and the
    other way round: the same per-parameter values, laid out and placed for the target."""
    xla = ("train.optimizer=adan", "train.optimizer_impl=xla")   # the kernel is not the point
    run = build(tmp_path, source[1], 8, *xla, *source[0])
    _, state = train_steps(run, 2)
    ckpt = Checkpointer(str(tmp_path / "ck"))
    ckpt.save(2, on_disk(state), {"epoch": 0})
    saved = jax.device_get(on_disk(state))
    other = build(tmp_path, target[1], 8, *xla, *target[0])
    restored, _ = restore_state(ckpt, other.state, other.state_shardings)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(other.state)
    for a, b in zip(jax.tree_util.tree_leaves(restored),
                    jax.tree_util.tree_leaves(other.state_shardings)):
        assert a.sharding == b
    for a, b in zip(jax.tree_util.tree_leaves(jax.device_get(on_disk(restored))),
                    jax.tree_util.tree_leaves(saved)):
        np.testing.assert_array_equal(a, b)


XLA_ADAN = ("train.optimizer=adan", "train.optimizer_impl=xla")   # the kernel is not the point


@pytest.mark.parametrize("sets", [("train.grad_accum=4",), ("precision.policy=fp16",),
                                  ("precision.policy=fp8",)])
@pytest.mark.long
def test_the_flat_layout_accumulates_scales_and_takes_fp8_like_the_optax_path(tmp_path, sets):
    """Gradient accumulation, fp16 loss scaling and fp8 are written once around either layout
    (``train.step``): 3 steps on the flat layout give the optax Adan path's losses,
    parameters, loss scale and fp8 scaling state."""
    ref = _losses_and_params(build(tmp_path / "optax", (1, 1, 1), 1, *XLA_ADAN, *sets))
    ours = _losses_and_params(build(tmp_path / "flat", (1, 1, 1), 1, *XLA_ADAN, *FLAT, *sets))
    _assert_same(ours, ref)


def test_the_flat_layout_rule_is_one_function():
    """``layout.choose`` decides, and names every setting that keeps a run off the flat
    layout; accumulation and the fp16/fp8 policies are not among them."""
    from jaxaccel import config
    from jaxaccel.train import layout

    def choose(*sets):
        return layout.choose(config.build(sets=["train.flat_params=true", *sets]).train)
    with pytest.raises(ValueError, match="needs train.optimizer=adan .*layer_decay=1"):
        choose("train.optimizer=adamw", "train.layer_decay=0.9")
    with pytest.raises(ValueError, match="optimizer_impl in"):
        choose("train.optimizer=adan", "train.optimizer_impl=per_leaf")
    assert choose("train.optimizer=adan", "train.grad_accum=2",
                  "precision.policy=fp16") is layout.FLAT
    assert layout.choose(config.build(sets=["train.optimizer=adan"]).train) is layout.TREE


@pytest.mark.long
def test_a_flat_run_resumes_as_optax_and_back_and_evaluates(tmp_path, capsys):
    """Through the command line: 2 flat steps, resumed to 4 on the optax path, resumed to 6
    on the flat path again (each step trained once: no run started afresh); ``jaxaccel eval``
    reads the flat run's checkpoint. A constant learning rate: the steps do not depend on
    the run's length, so the third run's flat step is the first run's (compiled once)."""
    def train(steps, *sets):
        code, out, err = run_cli(capsys, "train", "--config", TINY_CONFIG, "--set",
                                 f"workdir={tmp_path}", "--set", f"train.max_steps={steps}",
                                 "--set", "train.progress=false", "--set", "train.log_every=1",
                                 "--set", "train.schedule=constant",
                                 "--set", "train.warmup_ratio=0.0", *XLA_ADAN_SETS, *sets)
        assert code == 0, err
        return json.loads(out[:out.rindex("}") + 1])
    flat = ("--set", "train.flat_params=true")
    assert train(2, *flat)["step"] == 2
    assert train(4)["step"] == 4
    last = train(6, *flat)
    assert last["step"] == 6
    steps = [r["step"] for r in read_metrics(last["run_dir"]) if "train/loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    code, out, err = run_cli(capsys, "eval", "--checkpoint", last["run_dir"])
    assert code == 0, err
    report = json.loads(out)
    assert report["step"] == 6 and report["accuracy"] == pytest.approx(last["eval_accuracy"])


XLA_ADAN_SETS = [arg for s in XLA_ADAN for arg in ("--set", s)]
