"""Dropout masks from both words of every Threefry hash (kernels_pallas.dropout.keep_mask):
the keep probability, independence, mesh independence, and the nnx stand-in."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxaccel import plan
from jaxaccel.models.dropout import Dropout, dropout
from kernels_pallas import dropout as dropout_lib
from kernels_pallas.dropout import keep_mask


@pytest.mark.parametrize("keep", [0.9, 0.5, 0.25])
def test_keep_probability_and_independence(keep):
    m = np.asarray(keep_mask(jax.random.key(3), keep, (64, 128, 129))).astype(np.float64)
    n = m.size
    assert abs(m.mean() - keep) < 5 * np.sqrt(keep * (1 - keep) / n)
    # Neighbours share a hash (the two words of one pair) or not: uncorrelated either way.
    flat = m.reshape(-1)
    for a, b in ((flat[0::2], flat[1::2]), (flat[1:-1:2], flat[2::2]),
                 (m[:, :, :-1].reshape(-1), m[:, :, 1:].reshape(-1))):
        k = min(a.size, b.size)
        assert abs(np.corrcoef(a[:k], b[:k])[0, 1]) < 5 / np.sqrt(k)
    # Another key gives another mask.
    other = np.asarray(keep_mask(jax.random.key(4), keep, (64, 128, 129)))
    assert (other != m.astype(bool)).mean() > 0.1


def test_threshold_is_exact_and_edges():
    # keep 1/4: threshold 2**30 exactly; keep 1: all kept; raw uint32 keys as typed ones.
    assert keep_mask(jax.random.key(0), 1.0, (7, 3)).all()
    assert keep_mask(jax.random.key(0), 0.0, (7, 3)).sum() == 0
    raw = np.asarray(keep_mask(jax.random.PRNGKey(5), 0.5, (33,)))
    typed = np.asarray(keep_mask(jax.random.wrap_key_data(jax.random.PRNGKey(5)), 0.5, (33,)))
    np.testing.assert_array_equal(raw, typed)
    assert keep_mask(jax.random.key(0), 0.5, (5,)).shape == (5,)
    assert keep_mask(jax.random.key(0), 0.5, ()).shape == ()


def test_other_prng_implementations_fall_back_to_bernoulli():
    key = jax.random.key(1, impl="rbg")
    np.testing.assert_array_equal(keep_mask(key, 0.7, (9, 11)),
                                  jax.random.bernoulli(key, 0.7, (9, 11)))


@pytest.mark.parametrize("spec", [P("x"), P(None, None, "x"), P("x", None, "y")])
def test_the_mask_does_not_depend_on_the_mesh(spec):
    devices = np.asarray(jax.devices()[:8])
    if devices.size < 8:
        pytest.skip("needs 8 devices")
    mesh = Mesh(devices.reshape(4, 2), ("x", "y"))
    shape = (8, 6, 20)
    want = np.asarray(keep_mask(jax.random.key(7), 0.9, shape))
    sharding = NamedSharding(mesh, spec)
    got = jax.jit(lambda k: keep_mask(k, 0.9, shape), out_shardings=sharding)(
        jax.random.key(7))
    assert got.sharding == sharding
    np.testing.assert_array_equal(np.asarray(got), want)


def test_inverted_dropout_and_the_module():
    x = jnp.arange(1.0, 1001.0).reshape(10, 100)
    y = np.asarray(dropout(x, 0.2, jax.random.key(2)))
    kept = y != 0
    np.testing.assert_allclose(y[kept], np.asarray(x)[kept] / 0.8, rtol=1e-6)
    np.testing.assert_array_equal(kept, np.asarray(keep_mask(jax.random.key(2), 0.8, x.shape)))
    assert (np.asarray(dropout(x, 1.0, jax.random.key(2))) == 0).all()
    layer = Dropout(0.2)
    np.testing.assert_array_equal(layer(x, deterministic=True), x)
    rngs = nnx.Rngs(dropout=2)
    assert (np.asarray(layer(x, deterministic=False, rngs=rngs)) == 0).any()
    with pytest.raises(ValueError, match="needs rngs"):
        layer(x, deterministic=False)


@pytest.mark.parametrize("shape", [(4, 6, 20), (3, 7, 33), (129,)])
def test_both_formulations_draw_the_same_bits(shape):
    # The CPU's one-hash-per-pair interleave and the accelerators' element-wise form.
    words = (jnp.uint32(0x1234567), jnp.uint32(0x89ABCDE))
    half = (shape[-1] + 1) // 2
    first = (jnp.arange(int(np.prod(shape[:-1])), dtype=jnp.uint32).reshape(shape[:-1])
             * jnp.uint32(half))[..., None]
    pairs = np.asarray(dropout_lib.BITS(words, first, shape, impl="pairs"))
    elementwise = np.asarray(dropout_lib.BITS(words, first, shape, impl="xla"))
    assert pairs.shape == elementwise.shape == shape
    np.testing.assert_array_equal(pairs, elementwise)
    assert len(np.unique(pairs)) > 0.99 * pairs.size          # distinct words, not one repeated


def test_on_tpu_the_mask_fuses_into_dropout(compile_target):
    # Compiled for a v6e chip, dropout reads x and writes its result once (XLA's byte count):
    # the element-wise bits fuse; the interleaved pairs would write and read the words (4x).
    import compile_only
    m = compile_only.mesh(compile_target("v6e:1x1"))
    x = jax.ShapeDtypeStruct((4, 4, 256, 256), jnp.float32)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    compiled, _ = compile_only.compile_timed(lambda k, x: dropout(x, 0.1, k),
                                             *compile_only.replicated(m, key, x), mesh=m)
    cost = plan.xla_cost(compiled)
    x_bytes = 4 * 4 * 256 * 256 * 4
    assert cost["bytes accessed"] <= 2.1 * x_bytes, cost["bytes accessed"] / x_bytes
