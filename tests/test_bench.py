"""Benchmark helpers that carry logic: the backward-time estimator and the kernel counter."""
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import count_kernels  # noqa: E402
from bench.scaling import predict_backward  # noqa: E402


def test_estimator_overlaps_communication_with_compute():
    assert predict_backward(12, 1.0, 0.0) == 12.0                 # no communication
    assert predict_backward(12, 1.0, 0.5) == 12.5                 # hidden but the last one
    assert predict_backward(4, 1.0, 3.0) == 1.0 + 4 * 3.0         # channel-bound
    assert predict_backward(1, 2.0, 1.0) == 3.0


def test_kernel_counter_sees_fusions():
    f = jax.jit(lambda x, y: (jnp.sin(x) * 2 + y, jnp.cos(y).sum()))
    counts = count_kernels(f.lower(jnp.ones(128), jnp.ones(128)).compile())
    assert counts["fusions_and_custom_calls"] >= 1
    assert counts["entry_ops"] >= counts["fusions_and_custom_calls"]
