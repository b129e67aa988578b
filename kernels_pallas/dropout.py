"""Dropout from the Threefry hash with none of its bits thrown away.

``jax.random.bernoulli(key, p, shape)`` (what ``nnx.Dropout`` calls) draws a float32 uniform per
element from ``jax.random.bits``, which with the (default) partitionable Threefry computes one
Threefry-2x32 hash per element and XORs its two 32-bit output words into one. The hash is the
expensive part (20 rounds of 32-bit adds, rotations and XORs): on the CPU the dropout bits of
the MiniLM train step were ~9% of its time.

``keep_mask`` hashes one counter per *pair* of elements and uses both output words, each
compared with ``round(keep_prob * 2**32)``: half the hashes, and a keep probability resolved to
2**-32 (``bernoulli``'s float32 uniform resolves 2**-23). Element ``i`` of the mask is a function
of the key and ``i`` only (the counter is the global index of its pair), so, as with
partitionable Threefry, the mask does not depend on how the array is sharded; and rows can be
numbered by the caller (``rows``), so that a gathered subset of the rows of an array draws
exactly what those rows draw in the whole array.

The masks differ from ``jax.random.bernoulli``'s for the same key (another stream, the same
distribution); keys of another PRNG implementation fall back to ``bernoulli``.

Two formulations give the same bits (``BITS``, a registry as in ``kernels_pallas.registry``):

* ``"pairs"`` (CPU): one hash per pair, its two words interleaved into the mask. Half the
  hashes; the interleave (a stack and reshape across the minor dimension) makes XLA write the
  words out and read them back, cheap beside the hashes on a CPU.
* ``"xla"`` (the reference; GPU and TPU): each element hashes its pair's counter and keeps the
  word of its parity, as many hashes as ``bernoulli`` but purely element-wise, so the mask fuses
  into its consumer. With the interleave, XLA's TPU byte count of the BERT-base train step
  (v6e-8, fp32, dropout 0.1) was 22% higher than with ``bernoulli``; element-wise it is a
  little below ``bernoulli``'s (roofline 45.4 against 46.7 ms; docs/reports/plans.md).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.random import threefry2x32_p

from kernels_pallas import registry


def _threefry_words(key) -> tuple[jax.Array, jax.Array] | None:
    """The two uint32 words of a Threefry key (typed or raw), or None for another PRNG."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        if "threefry" not in str(jax.random.key_impl(key)):
            return None
        key = jax.random.key_data(key)
    elif jax.config.jax_default_prng_impl != "threefry2x32":
        return None
    return key[0], key[1]


def keep_mask(key, keep_prob: float, shape: tuple[int, ...], rows=None) -> jax.Array:
    """A boolean array of ``shape``, each element True with probability ``keep_prob`` (to
    2**-32), independently; element ``(r, j)`` (``r`` all but the last index) depends only on
    ``key``, the row's number and ``j``. A row's number is its row-major index among the rows
    of ``shape``, or ``rows[r]`` (integer array of shape ``shape[:-1]``) where given: the
    rows of a gathered array (e.g. the real tokens of a padded batch, ``models.unpad``) then
    draw what they would in the whole one. Rows' numbers times ``ceil(shape[-1] / 2)`` must
    stay below 2**32."""
    shape = tuple(shape)
    if not shape:
        return keep_mask(key, keep_prob, (1,)).reshape(())
    words = _threefry_words(key)
    if words is None:
        return jax.random.bernoulli(key, keep_prob, shape)
    threshold = round(keep_prob * 2.0 ** 32)
    if threshold >= 2 ** 32:
        return jnp.ones(shape, bool)
    half = (shape[-1] + 1) // 2
    if rows is None:
        if math.prod(shape[:-1]) * half >= 2 ** 32:
            raise ValueError(f"a dropout mask of {shape} needs more than 2**32 counters.")
        rows, stride = jnp.zeros(shape[:-1], jnp.uint32), 1
        for dim in reversed(range(len(shape) - 1)):       # row-major row numbers
            rows = rows + lax.broadcasted_iota(jnp.uint32, shape[:-1], dim) * jnp.uint32(stride)
            stride *= shape[dim]
    first = jnp.asarray(rows).astype(jnp.uint32)[..., None] * jnp.uint32(half)
    return BITS(words, first, shape) < jnp.uint32(threshold)


def _hash(words, counter):
    return threefry2x32_p.bind(words[0], words[1], jnp.zeros_like(counter), counter)


def _bits_pairs(words, first, shape):
    """The mask's 32 random bits per element: one hash per pair, both words interleaved.
    ``first``: each row's first pair counter, shape ``shape[:-1] + (1,)``."""
    half = (shape[-1] + 1) // 2
    pairs = shape[:-1] + (half,)
    hi, lo = _hash(words, first + lax.broadcasted_iota(jnp.uint32, pairs, len(pairs) - 1))
    return jnp.stack([hi, lo], axis=-1).reshape(*shape[:-1], 2 * half)[..., :shape[-1]]


def _bits_elementwise(words, first, shape):
    """``_bits_pairs``'s bits, element-wise: element j hashes pair j // 2 and keeps the first
    word for even j, the second for odd j."""
    j = lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1)
    hi, lo = _hash(words, first + j // jnp.uint32(2))
    return jnp.where(j % jnp.uint32(2) == 0, hi, lo)


# "auto" picks by where the mask is computed: the ambient mesh, else the row numbers' mesh or
# device, else the default backend (registry.platform).
BITS = registry.Registry("dropout_bits", {"xla": _bits_elementwise, "pairs": _bits_pairs},
                         {"cpu": ("pairs", "xla"), "gpu": ("xla",), "tpu": ("xla",)})
