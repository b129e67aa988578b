"""Adan: every impl against an independent float64 re-implementation of the official rule,
against each other on a BERT-shaped tree, optax composition, and kernel lowering.

The Adan math is elementwise (no matmuls), so a GPU's TF32 default does not touch it; on a GPU
``impl="pallas"`` runs the Triton kernel, whose float32 division is Triton's approximate
``div.full.f32`` (<= 2 ulp) where XLA divides correctly rounded: see ``KERNEL_TOL``."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compile_only
from jaxaccel.optim import decay_mask
from jaxaccel import forms
from jaxaccel.forms.packing import Packer
from jaxaccel.optim.adan import AdanState, adan, restart
from kernels_pallas import registry
from kernels_pallas import mgpu
from kernels_pallas.adan import DEFAULT_ORDER, UPDATE, adan_update, apply_kernel, update_kernel
from kernels_pallas.adan_mgpu import mgpu_apply_kernel, mgpu_update_kernel
from kernels_pallas.adan_reference import BLOCK_SIZES, LANES, ROW_ALIGN, SCALARS, BlockSizes
from support import CASES, Float64Adan, bert_tree, flat_args, grads_at, rel, small_tree

IMPLS = ("per_leaf", "xla", "pallas")
# The Mosaic GPU kernel's interpreter runs a few steps in the time the Pallas interpreter runs
# the 30 above: it joins the tests of a few steps.
WITH_MGPU = IMPLS + ("mosaic_gpu",) if mgpu.available() else IMPLS


def run(tx, params, steps, after=None):
    state = tx.init(params)
    update = jax.jit(tx.update)
    history = []
    for t in range(steps):
        # Blocked on before anything else is dispatched: jax 0.10's Mosaic GPU interpreter
        # dispatches computations from its callbacks (kernels_pallas/mgpu.py).
        updates, state = jax.block_until_ready(update(grads_at(t, params), state, params))
        params = optax.apply_updates(params, updates)
        history.append(params)
        if after is not None:
            state = after(t, state)
    return params, state, history


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_float64_rule_over_100_steps(impl, case):
    kw = dict(lr=3e-3)
    kw.update(CASES[case])
    params = small_tree()
    tx = adan(kw["lr"], weight_decay=kw["wd"], no_prox=kw.get("no_prox", False),
              max_grad_norm=kw.get("max_grad_norm", 0.0), impl=impl)
    ref = Float64Adan(kw["lr"], wd=kw["wd"], no_prox=kw.get("no_prox", False),
                      max_grad_norm=kw.get("max_grad_norm", 0.0))
    leaves, treedef = jax.tree_util.tree_flatten(params)
    p64 = [x.astype(np.float64) for x in leaves]
    ours, _, _ = run(tx, params, 100 if impl != "pallas" else 30)
    for t in range(100 if impl != "pallas" else 30):
        p64 = ref.step(p64, [g.astype(np.float64) for g in
                             treedef.flatten_up_to(grads_at(t, params))])
    assert rel(ours, treedef.unflatten(p64)) < 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_restart_matches_official_restart_opt(impl):
    params = small_tree()
    tx = adan(3e-3, weight_decay=0.01, impl=impl)
    ref = Float64Adan(3e-3, wd=0.01)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    p64 = [x.astype(np.float64) for x in leaves]
    ours, state, _ = run(tx, params, 12, after=lambda t, s: restart(s) if t == 5 else s)
    for t in range(12):
        p64 = ref.step(p64, [g.astype(np.float64) for g in
                             treedef.flatten_up_to(grads_at(t, params))])
        if t == 5:
            ref.restart()
    assert int(state.count) == 6
    assert rel(ours, treedef.unflatten(p64)) < 1e-5


# The Mosaic GPU interpreter's 4 steps on this tree took ~12 s (loaded 2-core CPU): one case
# (the kernel tests cover prox and no_prox).
@pytest.mark.parametrize("no_prox,clip,impls", [(False, 0.0, IMPLS), (True, 1.0, WITH_MGPU)])
@pytest.mark.long
def test_impls_agree_on_a_bert_tree(no_prox, clip, impls):
    params = bert_tree()
    results = {}
    for impl in impls:
        tx = adan(1e-3, weight_decay=0.01, no_prox=no_prox, max_grad_norm=clip,
                  mask=decay_mask, impl=impl)
        results[impl], _, _ = run(tx, params, 4)
    for impl in impls[1:]:
        assert rel(results[impl], results["per_leaf"]) < 1e-5, impl


def test_mask_keeps_biases_and_layer_norms_undecayed():
    params = small_tree()
    leaves, treedef = jax.tree_util.tree_flatten(params)
    flags = treedef.flatten_up_to(decay_mask(params))
    assert flags.count(False) == 2          # "bias" and "scale"
    tx = adan(3e-3, weight_decay=0.5, mask=decay_mask, impl="xla")
    ref = Float64Adan(3e-3, wd=0.5, decay=flags)
    ours, _, _ = run(tx, params, 20)
    p64 = [x.astype(np.float64) for x in leaves]
    for t in range(20):
        p64 = ref.step(p64, [g.astype(np.float64) for g in
                             treedef.flatten_up_to(grads_at(t, params))])
    assert rel(ours, treedef.unflatten(p64)) < 1e-5


def test_differs_from_optax_adan_which_weights_the_difference_by_one_minus_b2():
    """optax.adan's n-update uses (g + (1 - b2) d)^2; the official code uses (g + b2 d)^2."""
    params = small_tree()
    ours, _, _ = run(adan(1e-2, impl="xla"), params, 10)
    theirs, _, _ = run(optax.adan(1e-2, b1=0.02, b2=0.08, b3=0.01, eps=1e-8), params, 10)
    assert rel(theirs, ours) > 1e-3
    leaves, treedef = jax.tree_util.tree_flatten(params)
    ref = Float64Adan(1e-2)
    p64 = [x.astype(np.float64) for x in leaves]
    for t in range(10):
        p64 = ref.step(p64, [g.astype(np.float64) for g in
                             treedef.flatten_up_to(grads_at(t, params))])
    assert rel(ours, treedef.unflatten(p64)) < 1e-5 < rel(theirs, treedef.unflatten(p64))


def test_composes_with_inject_hyperparams_chain_and_apply_if_finite():
    params = small_tree()
    tx = optax.chain(optax.identity(),
                     optax.inject_hyperparams(adan)(learning_rate=3e-3, weight_decay=0.01))
    tx = optax.apply_if_finite(tx, max_consecutive_errors=2)
    state = tx.init(params)
    update = jax.jit(tx.update)
    u1, state = update(grads_at(0, params), state, params)
    u1, state = update(grads_at(0, params), state, params)    # state now as the update makes it
    compiled = update._cache_size()
    # A new learning rate is a runtime value: the same compiled update serves it.
    state.inner_state[1].hyperparams["learning_rate"] = jnp.asarray(6e-3, jnp.float32)
    bad = jax.tree_util.tree_map(lambda g: g * np.nan, grads_at(1, params))
    u_bad, state = update(bad, state, params)
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree_util.tree_leaves(u_bad))
    assert int(state.notfinite_count) == 1
    u2, state = update(grads_at(1, params), state, params)
    assert update._cache_size() == compiled
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(u2))


def test_state_structure_is_fixed_under_scan():
    params = small_tree()
    tx = adan(1e-3, impl="xla")

    def body(carry, g):
        p, s = carry
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), None
    grads = jax.tree_util.tree_map(lambda x: jnp.stack([x] * 3), grads_at(0, params))
    (_, state), _ = jax.lax.scan(body, (params, tx.init(params)), grads)
    assert isinstance(state, AdanState) and int(state.count) == 3


@pytest.mark.parametrize("impl", WITH_MGPU)
def test_low_precision_params_state_and_odd_leaves(impl):
    params = {"w": jnp.asarray(small_tree()["w"], jnp.bfloat16), "steps": jnp.arange(3),
              "empty": jnp.zeros((0, 4), jnp.float32)}
    tx = adan(1e-2, weight_decay=0.1, state_dtype=jnp.bfloat16, impl=impl)
    state = tx.init(params)
    grads = {"w": jnp.ones((7, 13), jnp.bfloat16), "steps": jnp.zeros(3, jnp.int32),
             "empty": jnp.zeros((0, 4), jnp.float32)}
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert updates["w"].dtype == jnp.bfloat16 and updates["steps"].dtype == jnp.int32
    np.testing.assert_array_equal(updates["steps"], 0)
    assert updates["empty"].shape == (0, 4)
    # First step: d = 0, m = (1-b1) g, n = (1-b3) g^2, so step = lr g/|g| = lr; prox update.
    p = np.asarray(params["w"], np.float32)
    expected = (p - 1e-2) / (1 + 1e-3) - p
    np.testing.assert_allclose(np.asarray(updates["w"], np.float32), expected, atol=2e-2 * 0.05)


def test_empty_tree_is_a_noop():
    tx = adan(1e-3, impl="xla")
    state = tx.init({})
    updates, state = tx.update({}, state, {})
    assert updates == {} and int(state.count) == 1


def test_weight_decay_needs_params():
    tx = adan(1e-3, weight_decay=0.1)
    params = small_tree()
    with pytest.raises(ValueError, match="needs params"):
        tx.update(grads_at(0, params), tx.init(params))


def test_portable_form_is_the_reference_state_and_round_trips():
    """The flat state's per-parameter form is what impl="per_leaf" keeps, and converting it
    back gives the flat buffers bit for bit."""
    params = bert_tree()
    kw = dict(weight_decay=0.01, mask=decay_mask)
    _, flat_state, _ = run(adan(1e-3, impl="xla", **kw), params, 3)
    _, ref, _ = run(adan(1e-3, impl="per_leaf", **kw), params, 3)
    portable = forms.portable(flat_state)
    assert jax.tree_util.tree_structure(portable) == jax.tree_util.tree_structure(ref)
    for a, b in zip(jax.tree_util.tree_leaves(portable), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    back = forms.restore(portable, flat_state)
    assert back.m.packing == flat_state.m.packing
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(flat_state)):
        np.testing.assert_array_equal(a, b)
    # Inside an optax chain too; the other parts of the state pass through.
    tx = optax.chain(optax.trace(decay=0.9), adan(1e-3, impl="xla"))
    state = tx.init(params)
    assert isinstance(forms.portable(state)[1].m, dict)
    assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(forms.portable(state)[0]),
                                      jax.tree_util.tree_leaves(state[0])))


def test_sharding_arguments_are_checked(eight_devices):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.asarray(eight_devices), ("fsdp",))
    params = small_tree()                          # bias is (13,): 8 does not divide 13
    split = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P("fsdp")), params)
    with pytest.raises(ValueError, match=r"shape \(13,\) is sharded .* 13 into 8 uneven"):
        adan(1e-3, impl="xla", packer=Packer(split)).init(params)
    with pytest.raises(ValueError, match="zero_axes.*needs the parameters' shardings"):
        adan(1e-3, impl="xla", packer=Packer(zero_axes=("data",))).init(params)
    replicated = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), params)
    with pytest.raises(ValueError, match=r"zero_axes \['data'\] are not axes of the mesh"):
        adan(1e-3, impl="xla", packer=Packer(replicated, ("data",))).init(params)


def test_sharded_layout_takes_the_mesh_from_the_arrays(eight_devices):
    """The flat layout keeps axis sizes, not a Mesh: the update runs per device over the mesh
    the arrays are placed on (no ``jax.set_mesh``), equals the unsharded update, and unplaced
    arrays fail with a message instead of being gathered."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.asarray(eight_devices), ("fsdp",))
    params = {"w": np.ones((16, 8), np.float32), "b": np.arange(8, dtype=np.float32)}
    split = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P("fsdp")), params)
    tx = adan(1e-3, weight_decay=0.1, impl="xla", packer=Packer(split))
    state = tx.init(params)
    assert state.m.packing.axis_sizes == (("fsdp", 8),) and state.m.packing.shard_axes == ("fsdp",)
    assert not any(isinstance(getattr(state.m.packing, f.name), Mesh)
                   for f in dataclasses.fields(state.m.packing))
    grads = grads_at(0, params)
    with pytest.raises(ValueError, match="no mesh is set and the arrays are not placed"):
        tx.update(grads, state, params)
    place = lambda tree: jax.device_put(tree, split)
    buffers = NamedSharding(mesh, state.m.packing.buffer_spec)
    state = jax.device_put(state, jax.tree_util.tree_map(lambda _: buffers, state)
                           .replace(count=NamedSharding(mesh, P())))
    updates, _ = jax.jit(tx.update)(place(grads), state, place(params))
    want, _ = adan(1e-3, weight_decay=0.1, impl="xla").update(
        grads, adan(1e-3, weight_decay=0.1, impl="xla").init(params), params)
    for a, b in zip(jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(want)):
        assert a.sharding.spec == P("fsdp")
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)   # p up to 7: ulp 4.8e-7


# Elementwise bounds of the kernel's outputs against adan_reference (XLA, same float32 math), by
# where the kernel runs and the buffers' dtype: (rtol, atol). Both sides compute in float32;
# the interpreter runs the very same jnp ops, so only storing to bfloat16 may round the other
# way (one bf16 ulp: rtol 2^-7). Triton divides with div.full.f32 (<= 2 ulp): in the prox update
# (p - step) / (1 + lr wd) - p that is up to 2 ulp of |p| (< 8 here: 2 x 4.8e-7) absolute on an
# update of ~1e-3, hence atol 2e-6 on GPU; the relative bounds stay those of the interpreter.
KERNEL_TOL = {
    ("interpret", jnp.float32): (1e-6, 1e-6),
    ("interpret", jnp.bfloat16): (2.0 ** -7, 1e-6),
    ("gpu", jnp.float32): (1e-6, 2e-6),
    ("gpu", jnp.bfloat16): (2.0 ** -7, 2e-6),
}
# The Mosaic GPU kernel: its interpreter as the Pallas one; compiled, its square root is
# x rsqrt(x) (jax 0.10's Mosaic GPU lowers no sqrt: a few ulp, as Triton's division).
KERNEL_TOL.update({(f"mosaic_{t}", d): KERNEL_TOL[t, d] for t in ("interpret", "gpu")
                   for d in (jnp.float32, jnp.bfloat16)})
GPU = [pytest.mark.gpu, pytest.mark.gpu_smoke]
MGPU = [pytest.mark.skipif(not mgpu.available(), reason="this jax has no Mosaic GPU")]
# Interpreted: 4 blocks of the buffers' 1024 rows for the Pallas kernel (its interpreter's
# default block is all of them) and, for the Mosaic GPU kernel, 2 programs of 4 blocks of 128
# rows, 2 in flight: the grid's indexing and the stream's refills are checked on CPU too.
KERNELS = {
    "interpret": lambda *a, **kw: update_kernel(*a, **kw, target="interpret",
                                                block_sizes=BlockSizes(ROW_ALIGN // 4)),
    "gpu": lambda *a, **kw: update_kernel(*a, **kw, target="gpu"),
    "mosaic_interpret": lambda *a, **kw: mgpu_update_kernel(
        *a, **kw, block_sizes=BlockSizes(128, num_stages=2, steps=4)),
    "mosaic_gpu": mgpu_update_kernel,
}


@pytest.mark.parametrize("target", ["interpret", pytest.param("gpu", marks=GPU),
                                    pytest.param("mosaic_interpret", marks=MGPU),
                                    pytest.param("mosaic_gpu", marks=GPU + MGPU)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("no_prox", [False, True])
def test_kernel_matches_reference(no_prox, dtype, target):
    """The kernel (interpreted, or the real Triton / Mosaic GPU kernel on a GPU) against the
    XLA path on flat buffers of ``dtype`` (the second moment n stays float32), weight decay and
    clipping on."""
    s, g, m, v, n, prev, p = flat_args(ROW_ALIGN, dtype)
    assert float(jnp.abs(p).max()) < 8
    a = adan_update(s, g, m, v, n, prev, p, no_prox=no_prox, impl="xla")
    b = KERNELS[target](s, g, m, v, n, prev, p, no_prox=no_prox)
    for name, x, y in zip(("update", "m", "v", "n", "prev"), a, b):
        assert x.dtype == y.dtype, name
        rtol, atol = KERNEL_TOL[target, jnp.dtype(x.dtype).type]
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(x, np.float32),
                                   rtol=rtol, atol=atol, err_msg=name)
    # Not vacuous: the update is ~lr, far above atol, and it moved every state buffer.
    assert float(jnp.abs(a[0].astype(jnp.float32)).mean()) > 100 * KERNEL_TOL[target, dtype][1]
    for before, after in zip((m, v, n, prev), b[1:]):
        assert not np.array_equal(np.asarray(before, np.float32), np.asarray(after, np.float32))


def test_registry_auto_order_and_names():
    """"auto" is the kernel on TPU and XLA's fusion on GPU (measured faster there than the
    Triton kernel; the Mosaic GPU kernel is named, not a default, until it is measured) and
    CPU; the optimizer's impls are the kernel's names plus the per-leaf layout; unknown names
    fail before anything is built."""
    assert UPDATE.candidates("auto") == DEFAULT_ORDER[registry.platform()]
    assert DEFAULT_ORDER == {"cpu": ("xla",), "gpu": ("xla",), "tpu": ("pallas", "xla")}
    from jaxaccel.optim.adan import IMPLS as OPTIMIZER_IMPLS
    assert OPTIMIZER_IMPLS == UPDATE.names + ("per_leaf",)
    s, g, m, v, n, prev, p = flat_args(ROW_ALIGN)
    for x, y in zip(adan_update(s, g, m, v, n, prev, p),
                    adan_update(s, g, m, v, n, prev, p, impl=UPDATE.candidates("auto")[0])):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="impl='reference' is not one of"):
        adan(1e-3, impl="reference")
    with pytest.raises(ValueError, match="impl='triton' is unknown"):
        adan_update(s, g, m, v, n, prev, impl="triton")


def state_first(update):
    """The update form ``update`` (``update_kernel``, ``mgpu_update_kernel``) returning
    ``(m, v, n, prev, update)``: its new state in the order of its donated inputs, as the
    trainer's step returns the state it was given. jit aliases each donated input to the first
    output of its shape and dtype not yet taken: in the kernel's own order (the update first)
    donated m would be paired with the update, v with the new m, and so on, against the
    kernel's aliases (m to the new m), and XLA would copy every state buffer around it (4
    before the kernel and 3 after, on the compile-only H100) while still aliasing 4 buffers."""
    def run(*args):
        new, *state = update(*args)
        return (*state, new)
    return run


@pytest.mark.parametrize("name", ["v5e:2x2", "v6e:2x2", "h100:1x1"])
def test_kernel_compiles_in_place_for_tpu_and_gpu(compile_target, name):
    """A 1,000,003-parameter group (not a multiple of the chunk), padded, compiled by the
    target's compiler (Mosaic / Triton, chosen from the buffers' mesh): the donated state is
    updated in place, its four buffers aliased to outputs with no copy of any buffer around
    the kernel (``state_first``)."""
    target = compile_target(name)
    rows = -(-1_000_003 // (ROW_ALIGN * LANES)) * ROW_ALIGN
    m = compile_only.mesh(target)
    args = compile_only.replicated(m, *jax.eval_shape(lambda: flat_args(rows)))
    compiled, _ = compile_only.compile_timed(state_first(update_kernel), *args, mesh=m,
                                             donate_argnums=(2, 3, 4, 5))
    text = compiled.as_text()
    assert compile_only.KERNEL_CALL[target.platform] in text
    assert compiled.memory_analysis().alias_size_in_bytes == 4 * rows * LANES * 4
    assert " copy(" not in text


@pytest.mark.skipif(not mgpu.available(), reason="this jax has no Mosaic GPU")
def test_mosaic_gpu_kernels_compile_in_place_for_h100(compile_target, ptxas_reports):
    """The Mosaic GPU update and one-pass apply on the group above, compiled for a
    compile-only H100 (ptxas for sm_90a): one Mosaic GPU kernel each, neither spilling a
    register to local memory; the state (and, one pass, the parameters) aliased in place with
    no copy of any buffer around either kernel (the update's outputs in its donated inputs'
    order, ``state_first``; the one pass donated in its output order: 11 words per element,
    nothing else moves)."""
    target = compile_target("h100:1x1")
    rows = -(-1_000_003 // (ROW_ALIGN * LANES)) * ROW_ALIGN
    m = compile_only.mesh(target)
    s, g, mm, v, n, prev, p = compile_only.replicated(m, *jax.eval_shape(lambda: flat_args(rows)))
    update, _ = compile_only.compile_timed(state_first(mgpu_update_kernel), s, g, mm, v, n, prev,
                                           p, mesh=m, donate_argnums=(2, 3, 4, 5))
    apply, _ = compile_only.compile_timed(mgpu_apply_kernel, s, g, p, mm, v, n, prev, mesh=m,
                                          donate_argnums=(2, 3, 4, 5, 6))
    buffer = rows * LANES * 4
    for compiled, aliased in ((update, 4), (apply, 5)):
        text = compiled.as_text()
        assert text.count(compile_only.KERNEL_CALL["mosaic_gpu"]) == 1
        assert compiled.memory_analysis().alias_size_in_bytes == aliased * buffer
        assert " copy(" not in text
    reports = ptxas_reports()
    assert len(reports) == 2, sorted(reports)
    for name, report in reports:
        compile_only.assert_spills_at_most(name, report)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_triton_kernel_compiles_for_h100_without_register_spills(compile_target, tmp_path,
                                                                  no_compilation_cache, dtype):
    """The one-pass Triton kernel (``impl="pallas"`` on a GPU) as XLA compiles it for a
    compile-only H100, on a small group of ``dtype`` (n stays float32): XLA's own assembler
    (ptxas, or libnvJitLink on jax 0.12) fails the compile if a kernel spills registers
    (``xla_gpu_fail_ptx_compilation_on_register_spilling``); one Triton launch with no copy
    around it, the five updated buffers aliased; the PTX XLA wrote (dumped) moves each
    buffer's bytes once, no more: per thread, its elements of the six inputs loaded and of
    the five outputs stored, plus the scalars; and ptxas's report of that PTX names the
    kernel's entry function and no spilled byte."""
    target = compile_target("h100:1x1")
    m = compile_only.mesh(target)
    s, g, mm, v, n, prev, p = compile_only.replicated(
        m, *jax.eval_shape(lambda: flat_args(ROW_ALIGN, dtype)))
    compiled, _ = compile_only.compile_timed(
        apply_kernel, s, g, p, mm, v, n, prev, mesh=m, donate_argnums=(2, 3, 4, 5, 6),
        compiler_options={"xla_dump_to": str(tmp_path), "xla_dump_emitter_re": "ptx",
                          "xla_gpu_fail_ptx_compilation_on_register_spilling": True})
    text = compiled.as_text()
    assert len(compile_only.kernel_calls(text, "gpu")) == 1 and " copy(" not in text
    outputs = (p, mm, v, n, prev)
    assert compiled.memory_analysis().alias_size_in_bytes == \
        sum(x.size * x.dtype.itemsize for x in outputs)
    ptx = [f for f in tmp_path.iterdir() if f.suffix == ".ptx"
           and ".entry adan_apply(" in f.read_text()]
    assert len(ptx) == 1, sorted(f.name for f in tmp_path.iterdir())
    moved = {"ld": 0, "st": 0}
    for op, width, bits in re.findall(r"\b(ld|st)\.global(?:\.v(\d))?\.b(\d+)",
                                      ptx[0].read_text()):
        moved[op] += int(width or 1) * int(bits) // 8
    blocks = BLOCK_SIZES["gpu"]
    per_thread = blocks.rows * LANES // (32 * blocks.num_warps)    # elements of each buffer
    size = lambda xs: per_thread * sum(x.dtype.itemsize for x in xs)
    assert moved == {"ld": size((g,) + outputs) + 4 * len(SCALARS), "st": size(outputs)}
    compile_only.assert_spills_at_most("adan_apply", compile_only.ptxas_report(str(ptx[0])),
                                       entry="adan_apply")
