"""Precision policies: which dtype parameters are stored in, which dtype the matmuls run in,
and which dtype leaves the model (logits), plus loss scaling.

A policy is chosen by name in the config (``precision.policy``) so that a GPU run and a TPU run
can use the same numerics and be compared directly:

=======  ===========  =============  ============  ==============
name     param dtype  compute dtype  output dtype  loss scaling
=======  ===========  =============  ============  ==============
fp32     float32      float32        float32       none
bf16     float32      bfloat16       float32       none
=======  ===========  =============  ============  ==============

Softmax, layer norm, losses and optimizer math always run in float32 whatever the policy;
model code reads dtypes from the policy and never hard-codes them. fp16 (with dynamic loss
scaling) and fp8 policies plug in here.
"""
from __future__ import annotations

import dataclasses
import difflib

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy.

    Attributes:
      name: the policy's config name.
      param_dtype: dtype the parameters (master weights) are stored in.
      compute_dtype: dtype activations and matmul inputs are cast to.
      output_dtype: dtype of the model's outputs (logits, hidden states handed to losses).
    """

    name: str
    param_dtype: jnp.dtype
    compute_dtype: jnp.dtype
    output_dtype: jnp.dtype

    def cast_to_compute(self, x):
        return x.astype(self.compute_dtype)

    def cast_to_output(self, x):
        return x.astype(self.output_dtype)


POLICIES = {
    "fp32": Policy("fp32", jnp.float32, jnp.float32, jnp.float32),
    "bf16": Policy("bf16", jnp.float32, jnp.bfloat16, jnp.float32),
}


def get_policy(policy: str | Policy | None) -> Policy:
    """Return a Policy from its name (None means fp32); a Policy passes through."""
    if policy is None:
        return POLICIES["fp32"]
    if isinstance(policy, Policy):
        return policy
    if policy not in POLICIES:
        close = difflib.get_close_matches(str(policy), POLICIES, n=2)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"precision policy {policy!r} is unknown; expected one of "
                         f"{sorted(POLICIES)}.{hint}")
    return POLICIES[policy]
