"""The causal-LM loss over sequence chunks (``train.loss_chunks``, ``tasks.with_loss_chunks``):
the same losses, parameters and eval sums as over the whole logits, without the whole
[batch, length, vocab] float32 logits in the compiled step's memory; refused where it cannot
apply."""
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxaccel import config, forms, sharding
from jaxaccel.models.llama import head_logits
from jaxaccel.train import run as run_lib
from jaxaccel.train import tasks
from support import DEVICES, TINY_LM, TINY_SETS, docs, lm_run, packed

pytestmark = pytest.mark.usefixtures("on_eight_devices")   # DEVICES: the module's 8 devices

BATCHES = [packed([docs(8 * i + r, 5, 9, 2) for r in range(16)], 16) for i in range(2)]


def _run(tmp_path, *sets, devices=2):
    return lm_run(DEVICES[:devices], f"workdir={tmp_path}", *sets)


def _steps(run):
    state, losses = run.state, []
    with jax.set_mesh(run.mesh):
        for batch in BATCHES:
            state, metrics = run.train_step(state, run.put_batch(batch))
            losses.append(float(metrics["loss"]))
        sums = run.eval_step(state.params, run.put_batch(BATCHES[0]), state.fp8)
    return losses, jax.device_get(forms.portable(state.params)), jax.device_get(sums)


@pytest.mark.parametrize("sets", [(), ("model.scan_layers=true", "model.remat=true")])
def test_chunked_loss_steps_equal_the_whole_logits_steps(tmp_path, sets):
    whole = _steps(_run(tmp_path, *sets))
    chunked = _steps(_run(tmp_path, "train.loss_chunks=4", *sets))
    np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(chunked[1]), jax.tree_util.tree_leaves(whole[1])):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)   # the head gradient summed by chunk
    for key in ("loss_sum", "correct", "count"):
        np.testing.assert_allclose(chunked[2][key], whole[2][key], rtol=1e-6)


def test_chunked_sums_and_gradients_equal_the_whole_logits():
    """The causal-LM sums over 4 chunks and their gradients in the hidden states and the head,
    float32, against the whole logits': on one device, and jitted over data 2 x FSDP 4 with
    the head split over FSDP as a run places it."""
    rng = np.random.default_rng(0)
    rows, length, hidden, vocab = 8, 16, 32, 64
    h = jnp.asarray(rng.normal(size=(rows, length, hidden)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(hidden, vocab)) / hidden ** 0.5, jnp.float32)
    batch = {"targets": jnp.asarray(rng.integers(0, vocab, (rows, length)), jnp.int32),
             "target_weights": jnp.asarray(rng.integers(0, 2, (rows, length)), jnp.float32)}
    lm = tasks.TASKS["causal_lm"]
    chunked = tasks.with_loss_chunks(lm, 4, length)

    def whole_loss(h, k):
        return lm.sums(head_logits(h, k), batch)[0]

    def chunked_loss(h, k):
        return chunked.sums(tasks.LMHead(h, k), batch)[0]

    want = jax.jit(jax.value_and_grad(whole_loss, argnums=(0, 1)))(h, kernel)
    step = jax.jit(jax.value_and_grad(chunked_loss, argnums=(0, 1)))
    mesh = sharding.make_mesh({"data": 2, "fsdp": 4}, DEVICES)
    split = (jax.device_put(h, NamedSharding(mesh, P(("data", "fsdp")))),
             jax.device_put(kernel, NamedSharding(mesh, P("fsdp"))))
    with jax.set_mesh(mesh):
        sharded = step(*split)
    for got in (step(h, kernel), sharded):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
        for g, w in zip(got[1], want[1]):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)



def test_a_step_makes_each_chunks_logits_once():
    """The chunked loss's gradient comes from the loop that makes its sums: one loop of three
    dots (logits, the hidden states' gradient, the head's), not the sums' loop and a second
    that makes every chunk's logits again. With bf16 hidden states and head, as a run's, and
    a cotangent that is no power of two (scaled after the loop), each gradient is within
    2^-7 of its largest element of the whole logits' made in float32 (JAX's own gradient of
    the chunk loop and ours: 0.62% here)."""
    rng = np.random.default_rng(1)
    rows, length, hidden, vocab = 4, 16, 32, 64
    h = jnp.asarray(rng.normal(size=(rows, length, hidden)), jnp.bfloat16)
    kernel = jnp.asarray(rng.normal(size=(hidden, vocab)) / hidden ** 0.5, jnp.bfloat16)
    batch = {"targets": jnp.asarray(rng.integers(0, vocab, (rows, length)), jnp.int32),
             "target_weights": jnp.ones((rows, length), jnp.float32)}
    lm = tasks.TASKS["causal_lm"]
    chunked = tasks.with_loss_chunks(lm, 4, length)
    grad = jax.grad(lambda h, k: chunked.sums(tasks.LMHead(h, k), batch)[0] / 60.0, (0, 1))
    jaxpr = jax.make_jaxpr(grad)(h, kernel).jaxpr
    loops = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert len(loops) == 1, [e.primitive.name for e in jaxpr.eqns]
    body = loops[0].params["jaxpr"].jaxpr
    assert sum(e.primitive.name == "dot_general" for e in body.eqns) == 3
    want = jax.grad(lambda h, k: lm.sums(head_logits(h, k), batch)[0] / 60.0, (0, 1))(
        h.astype(jnp.float32), kernel.astype(jnp.float32))
    for g, w in zip(jax.jit(grad)(h, kernel), want):
        assert g.dtype == jnp.bfloat16
        assert np.max(np.abs(np.float32(g) - w)) <= 2 ** -7 * np.max(np.abs(w))


def test_the_heads_gradient_is_summed_over_batch_shards_by_one_reduce_scatter():
    """Over data 2 x FSDP 4 each device sums its own rows' head gradient through the chunks'
    loop and the shares are reduced once after it: a reduce-scatter over FSDP to the head's
    own layout (hidden 32 / 4) and an all-reduce of that share over data, not an all-reduce
    of the whole head (which XLA's partitioner makes of the loop's replicated sum: on a
    v5e-8, llama-350m's step sends 1.68 GB of collectives a chip against 1.75).
    The values: test_chunked_sums_and_gradients_equal_the_whole_logits."""
    rows, length, hidden, vocab = 8, 16, 32, 64
    batch = {"targets": jnp.zeros((rows, length), jnp.int32),
             "target_weights": jnp.ones((rows, length), jnp.float32)}
    chunked = tasks.with_loss_chunks(tasks.TASKS["causal_lm"], 4, length)
    grad = jax.jit(jax.grad(lambda h, k: chunked.sums(tasks.LMHead(h, k), batch)[0], (0, 1)))
    mesh = sharding.make_mesh({"data": 2, "fsdp": 4}, DEVICES)
    args = (jax.ShapeDtypeStruct((rows, length, hidden), jnp.bfloat16,
                                 sharding=NamedSharding(mesh, P(("data", "fsdp")))),
            jax.ShapeDtypeStruct((hidden, vocab), jnp.bfloat16,
                                 sharding=NamedSharding(mesh, P("fsdp"))))
    with jax.set_mesh(mesh):
        text = grad.lower(*args).as_text()
    ops = lambda name: re.findall(rf'"stablehlo.{name}".*?replica_groups = (.*?), '
                                  r'(?:scatter_dimension|use_global).*?\}\) : \((.*?)\) -> '
                                  r'(.*?)\n', text, re.S)
    # the groups as device lists (jax 0.10) or as mesh axes (jax 0.12)
    axis = 'axes = [#stablehlo.axis_ref<name = "{}">]'.format
    over = {"fsdp": ("dense<[[0, 1, 2, 3], [4, 5, 6, 7]]>", axis("fsdp")),
            "data": ("dense<[[0, 4], [1, 5], [2, 6], [3, 7]]>", axis("data"))}
    (groups, *shapes), = ops("reduce_scatter")
    assert shapes == ["tensor<32x64xbf16>", "tensor<8x64xbf16>"]
    assert any(g in groups for g in over["fsdp"]), groups
    (groups, *shapes), = ops("all_reduce")
    assert shapes == ["tensor<8x64xbf16>", "tensor<8x64xbf16>"]
    assert any(g in groups for g in over["data"]), groups


def _temporaries(run, rows=16, length=64):
    batch = run.abstract_batch(rows, length)
    with jax.set_mesh(run.mesh):
        compiled = run.train_step.lower(run.state, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_chunks_keep_the_whole_logits_out_of_the_step(tmp_path):
    """16 rows of 64 tokens of the CPU decoder's 2,048-token vocabulary on one device: the
    whole float32 logits are 16 x 64 x 2048 x 4 = 8.4 MB (and their gradient as much); in 8
    chunks the step's temporaries shrink by more than that."""
    sets = ("model.name=llama-cpu", "data.max_len=64")
    whole = _temporaries(_run(tmp_path, *sets, devices=1))
    chunked = _temporaries(_run(tmp_path, *sets, "train.loss_chunks=8", devices=1))
    vocab = run_lib.resolve(config.build(sets=[*TINY_LM, *sets]), DEVICES[:1]).spec.architecture \
        .vocab_size
    logits = 16 * 64 * vocab * 4
    assert whole - chunked > logits, (whole, chunked, logits)


@pytest.mark.parametrize("sets,chunks", [
    ((), 8),                                        # 1,000 MiB of logits, 384 MiB kept
    (("model.remat=false",), 1),                    # the layers keep far more than the logits
    (("train.loss_chunks=1",), 1),                  # asked for the whole logits
    (("train.batch_size=8",), 2),                   # 250 MiB of logits, 96 MiB kept
    (("train.batch_size=16", "mesh.tensor=2"), 4),  # 4 rows, the vocabulary and width split
    (("train.batch_size=16", "mesh.tensor=2", "mesh.data=2", "mesh.fsdp=2"), 1),  # width whole
    (("model.name=llama-1b",), 1),                  # 1,000 MiB of logits, 704 MiB kept
    (("model.name=llama3-8b", "train.batch_size=8", "data.max_len=8192"), 8),  # 1.96 times
])
def test_the_loss_is_chunked_by_default_where_the_logits_would_be_the_peak(sets, chunks):
    """llama-350m (vocabulary 32,000, 24 layers of width 1,024), bf16 with remat, 32 rows of
    2,048 tokens over 8 devices: each device's float32 logits (4 x 2,048 x 32,000 x 4 bytes)
    are 2.6 times the bf16 layer inputs remat keeps (24 x 4 x 2,048 x 1,024 x 2), more than
    ``LOGITS_OVER_KEPT`` (1.7): the loss is taken over the fewest chunks of at most 128 MiB of
    logits (more than a quarter of the inputs). llama-1b's (22 layers of width 2,048) are 1.4
    times its inputs: its peak is in its layers, it keeps them whole. Llama-3 8B's, one row of
    8,192 tokens (vocabulary 128,256, 32 layers of width 4,096), are 1.96 times: chunks of at
    most a quarter of its 2.1 GB of inputs, 8."""
    cfg = config.build(sets=[*TINY_LM, "model.name=llama-350m", "precision.policy=bf16",
                             "model.remat=true", "data.max_len=2048", "train.batch_size=32",
                             *sets])
    assert run_lib.resolve(cfg, DEVICES).task.loss_chunks == chunks


def test_other_tasks_keep_their_logits_whole():
    """A rematerialised ViT's MAE step: no vocabulary, no chunks (its architecture is not read)."""
    mae = SimpleNamespace(task="mae", remat="full", architecture=None)
    assert tasks.auto_loss_chunks(mae, None, rows=64, length=513) == 1


@pytest.mark.parametrize("sets,message", [
    ([*TINY_SETS, "train.loss_chunks=2"], "only a causal LM's logits"),
    ([*TINY_LM, "train.loss_chunks=3"], "does not divide the rows' length 16"),
])
def test_chunks_that_cannot_apply_are_refused(sets, message):
    with pytest.raises(ValueError, match=message):
        run_lib.resolve(config.build(sets=sets), DEVICES[:1])


@pytest.mark.long
def test_bf16_logits_are_opt_in_and_the_loss_stays_float32(tmp_path):
    """``precision.logits_dtype``: float32 by default, whose head is the float32 matmul alone
    (the same program, so the same numbers, as before the setting); bfloat16 (MaxText's
    default) writes the head matmul's output and its gradient in bf16 and the loss reads them
    in float32: the step's losses move by a rounding, whole logits or chunked alike."""
    assert config.build(sets=[]).precision.logits_dtype == "float32"
    h, kernel = jnp.ones((2, 4, 8), jnp.bfloat16), jnp.ones((8, 32), jnp.bfloat16)
    matmul = lambda h, k: jnp.einsum("th,hv->tv", h.reshape(-1, 8), k,
                                     preferred_element_type=jnp.float32).reshape(2, 4, -1)
    assert str(jax.make_jaxpr(head_logits)(h, kernel)) == str(jax.make_jaxpr(matmul)(h, kernel))
    grads = jax.make_jaxpr(jax.grad(lambda h, k: head_logits(h, k, jnp.bfloat16)
                                    .astype(jnp.float32).sum(), argnums=(0, 1)))(h, kernel)
    assert "bf16[8,32] = convert_element_type" in str(grads)      # logits, then their gradient
    whole, chunked = (_steps(_run(tmp_path, "precision.logits_dtype=bfloat16", *sets))
                      for sets in ((), ("train.loss_chunks=4",)))
    fp32 = _steps(_run(tmp_path))
    assert whole[0] != fp32[0]
    np.testing.assert_allclose(whole[0], fp32[0], rtol=1e-2)
    np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-5)
    with pytest.raises(ValueError, match="use 'float32' or 'bfloat16'"):
        config.build(sets=["precision.logits_dtype=float16"])
