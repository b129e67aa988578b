"""Unpadded tokens (jaxaccel/models/unpad.py): the per-token layers on the real tokens only give
the padded model's numbers, dropout included, under any grouping; the plan covers every batch
of the run and refuses any other."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxaccel import config
from jaxaccel.data.pipeline import BatchIterator, Tokenized
from jaxaccel.models.architectures import PRESETS
from jaxaccel.models.bert import BertModel
from jaxaccel.models.spec import ModelSpec
from jaxaccel.models.unpad import MAX_SHARE, Capacity, Unpadded
from jaxaccel.train import run as run_lib
from support import TINY_SETS

LENGTHS = np.array([16, 5, 9, 1, 12, 3, 16, 7])
MASK = (np.arange(16)[None] < LENGTHS[:, None]).astype(np.int32)
# The tiny run on rows of 32 tokens, padded from lengths uniform in [1, 32].
TINY = TINY_SETS + ["data.synthetic_seq_len=32", "data.synthetic_min_len=1", "train.log_every=1"]


def test_tokens_go_to_slots_and_back():
    tokens = Unpadded.of(jnp.asarray(MASK), 2, 40)
    idx = np.asarray(tokens.index)
    assert (np.diff(idx, axis=1) > 0).all()                   # ascending, distinct
    real = MASK.reshape(2, -1).sum(1)                          # 43 and 38 real tokens > 40?
    assert real.max() <= 40 or pytest.fail(f"fixture: {real}")
    x = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) + 1
    back = np.asarray(tokens.scatter(tokens.gather(x)))
    np.testing.assert_array_equal(back, np.asarray(x) * MASK)  # real tokens back, 0 padding
    pos = np.asarray(tokens.positions())
    rows = np.asarray(tokens.rows())
    for g in range(2):
        n = real[g]
        flat = np.flatnonzero(MASK.reshape(2, -1)[g])
        np.testing.assert_array_equal(pos[g, :n], flat % 16)
        np.testing.assert_array_equal(rows[g, :n], flat + g * 64)
        np.testing.assert_array_equal(np.asarray(tokens.gather(x))[g, n:], 0)  # empty slots


@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.long
def test_the_model_gives_the_padded_numbers(pooling):
    """Logits and every parameter's gradient, dropout on (the same masks per token), for one
    group and for four."""
    model = BertModel(ModelSpec(PRESETS["tiny"], num_labels=2, pooling=pooling))
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 100, MASK.shape) * MASK)
    mask, types = jnp.asarray(MASK), jnp.zeros_like(ids)
    from flax import nnx
    graphdef, params = nnx.split(model)

    def loss(p, tokens):
        m = nnx.merge(graphdef, p)
        out = m(ids, mask, types, deterministic=False, rngs=nnx.Rngs(dropout=3), tokens=tokens)
        return jnp.sum(out.logits * jnp.array([1.0, -2.0])), out.logits

    grads = jax.jit(jax.value_and_grad(loss, has_aux=True))
    with jax.default_matmul_precision("highest"):
        (_, want), g_want = grads(params, None)
        for groups, slots in ((1, 72), (4, 24)):
            (_, got), g_got = grads(params, Unpadded.of(mask, groups, slots))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
            for a, b in zip(jax.tree_util.tree_leaves(g_got), jax.tree_util.tree_leaves(g_want)):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_the_plan_covers_every_batch_and_refuses_others():
    rng = np.random.default_rng(1)
    lengths = np.where(rng.random(50) < 0.8, rng.integers(1, 11, 50), rng.integers(20, 33, 50))
    data = Tokenized(input_ids=[np.arange(1, n + 1) for n in lengths],
                     labels=np.zeros(50, np.int32), max_len=32, pad_id=0)
    it = BatchIterator(data, 8, seed=2, pad_multiple=16, drop_remainder=False)
    largest = it.token_capacity(0, 3 * it.steps_per_epoch, 2)
    seen = {}
    for epoch in range(3):
        for b in it.batches(epoch):
            m = b["attention_mask"]
            shape = m.shape
            seen[shape] = max(seen.get(shape, 0), int(m.reshape(2, -1).sum(1).max()))
    assert largest == seen
    plan = Capacity.of(2, largest)
    for (rows, length), c in plan.slots.items():
        assert c % 8 == 0 and largest[(rows, length)] <= c <= MAX_SHARE * (rows // 2) * length
    for shape in set(largest) - set(plan.slots):               # too full to gain: padded
        assert -(-largest[shape] // 8) * 8 > MAX_SHARE * (shape[0] // 2) * shape[1]
    assert plan.slots, largest
    (rows, length), c = next(iter(plan.slots.items()))
    full = np.ones((rows, length), np.int32)
    with pytest.raises(ValueError, match=f"more than the {c} slots planned"):
        plan.check(full)
    plan.check(full[:, :length - 1])                            # a shape the plan lacks: padded


def _steps(run, k=3):
    state = run.state
    with jax.set_mesh(run.mesh):
        for batch in itertools.islice(run.train_data.batches(0), k):
            state, metrics = run.train_step(state, run.put_batch(batch))
        report = run.evaluate(state)
    return float(metrics["loss"]), jax.device_get(state.params), report


def _build(tmp_path, devices, *sets):
    return run_lib.build(config.build(sets=TINY + [f"workdir={tmp_path}", *sets]), devices)


def _same(a, b):
    assert a[0] == pytest.approx(b[0], rel=1e-5)
    for x, y in zip(jax.tree_util.tree_leaves(a[1]), jax.tree_util.tree_leaves(b[1])):
        np.testing.assert_allclose(x, y, rtol=0, atol=2e-5)
    assert a[2]["loss"] == pytest.approx(b[2]["loss"], rel=1e-5)
    assert a[2]["accuracy"] == b[2]["accuracy"]


@pytest.fixture(scope="module")
def unpadded_one_device(tmp_path_factory):
    """Three unpadded steps on one device and the evaluation after them (both tests below
    compare with it)."""
    run = _build(tmp_path_factory.mktemp("one"), jax.devices()[:1])
    assert run.unpad.slots
    return _steps(run)


def test_training_is_the_same_unpadded(tmp_path, unpadded_one_device):
    """Three steps of the trainer with dropout on, unpadded and not, and the evaluation after
    them: same loss, parameters and eval sums."""
    padded = _build(tmp_path, jax.devices()[:1], "train.unpad=false")
    assert padded.unpad is None
    _same(unpadded_one_device, _steps(padded))


def test_sharded_unpadded_training_equals_one_device(tmp_path, eight_devices,
                                                     unpadded_one_device):
    """On a 2x2x2 mesh the batch's 4 row groups unpad separately (no token crosses a device):
    the same training as on one device, dropout masks included."""
    sharded = _build(tmp_path, eight_devices, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    assert sharded.unpad.groups == 4 and sharded.unpad.slots
    _same(_steps(sharded), unpadded_one_device)
