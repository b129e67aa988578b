"""The layer pieces every model family builds from (MaxText's ``layers/`` in small): a Dense
layer with the fp8 choice, layer norm, RMS norm, the activations of ``architectures.HIDDEN_ACTS``
and the logical-axis annotation of an initializer.

Every parameter carries logical axis names (``jaxaccel.sharding`` maps them to mesh axes) and
is made lazily (``eager_sharding=False``); dtypes come from a ``precision.Policy``: matmuls in
``compute_dtype``, parameters in ``param_dtype``, the norms' outputs in ``activation_dtype``
(their statistics in float32, ``use_fast_variance=False``: the two-pass variance of
transformers' norms).

    q = dense(hidden, hidden, ("embed", "heads"), std, policy, rngs)   # fp8 under the fp8 policy
    ln = layer_norm(hidden, eps, policy, rngs)
"""
from __future__ import annotations

import jax
from flax import nnx

from jaxaccel.models.fp8 import Fp8Linear
from jaxaccel.precision import Policy

ACTIVATIONS = {                    # one for each of architectures.HIDDEN_ACTS
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


def partitioned(init, axes: tuple):
    """``init`` annotated with the logical ``axes`` of the parameter it makes."""
    return nnx.with_partitioning(init, axes, eager_sharding=False)


def dense(din: int, dout: int, axes: tuple, std: float, policy: Policy, rngs, *,
          bias: bool = True, block: bool = True):
    """A Dense layer (normal(``std``) kernel, zero bias) whose parameters carry the logical
    ``axes`` (the bias the output's); a block matmul (``block=True``: a layer's attention
    and MLP projections, not embeddings or heads) is an ``fp8.Fp8Linear`` where the policy runs
    it in fp8 (``Policy.fp8_dense``: same parameters plus its non-trainable scales)."""
    linear, extra = nnx.Linear, {}
    if block and policy.fp8_dense(din, dout):
        linear, extra = Fp8Linear, {"amax_history_length": policy.amax_history_length}
    return linear(din, dout, **extra, use_bias=bias, dtype=policy.compute_dtype,
                  param_dtype=policy.param_dtype,
                  kernel_init=partitioned(nnx.initializers.normal(std), axes),
                  bias_init=partitioned(nnx.initializers.zeros_init(), (axes[1],)), rngs=rngs)


def layer_norm(size: int, eps: float, policy: Policy, rngs):
    """LayerNorm over ``size`` features (scale 1, bias 0, both on ``embed``)."""
    return nnx.LayerNorm(size, epsilon=eps, dtype=policy.activation_dtype,
                         param_dtype=policy.param_dtype, use_fast_variance=False,
                         scale_init=partitioned(nnx.initializers.ones_init(), ("embed",)),
                         bias_init=partitioned(nnx.initializers.zeros_init(), ("embed",)),
                         rngs=rngs)


def rms_norm(size: int, eps: float, policy: Policy, rngs):
    """RMSNorm over ``size`` features (scale 1 on ``embed``, no bias)."""
    return nnx.RMSNorm(size, epsilon=eps, dtype=policy.activation_dtype,
                       param_dtype=policy.param_dtype, use_fast_variance=False,
                       scale_init=partitioned(nnx.initializers.ones_init(), ("embed",)),
                       rngs=rngs)


__all__ = ["ACTIVATIONS", "dense", "layer_norm", "partitioned", "rms_norm"]
