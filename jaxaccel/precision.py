"""Precision policies: which dtype parameters are stored in, which dtype the matmuls run in,
which dtype leaves the model (logits), and how the loss or the matmul inputs are scaled.

A policy is chosen by name in the config (``precision.policy``) so that a GPU run and a TPU run
can use the same numerics and be compared directly:

=======  ===========  =============  ===========  ============  ==================================
name     param dtype  compute dtype  activations  output dtype  scaling
=======  ===========  =============  ===========  ============  ==================================
fp32     float32      float32        float32      float32       none
bf16     float32      bfloat16       bfloat16     float32       none
fp16     float32      float16        float32      float32       dynamic loss scaling
fp8      float32      bfloat16       bfloat16     float32       block matmuls in fp8, delayed
                                                                scaling
=======  ===========  =============  ===========  ============  ==================================

Activations (``activation_dtype``) are the residual stream between and within the layers and
what the backward pass keeps of it (a rematerialised layer's input): bfloat16 under bf16 and
fp8, as MaxText keeps them, which halves those bytes; float32 under fp16, whose narrow range
the residual stream of a deep model can leave. Softmax, the norms' statistics, losses and
optimizer math always run in float32 whatever the policy (a norm reads its input in float32
and writes the activation dtype); model code reads dtypes from the policy and never
hard-codes them.

**fp16.** The loss is multiplied by a scale ``S`` before differentiation and the gradients
divided by it, so small fp16 gradients do not flush to zero. If any gradient is inf/NaN the
step is skipped (parameters and optimizer state unchanged) and ``S <- S * 0.5``; after
``growth_interval`` (2000) finite steps in a row ``S <- 2 S``. ``S`` starts at 2**15: BERT's
fp16 gradients overflow at 2**16 in the first steps of fine-tuning often enough to waste
steps, while 2**15 still lifts gradients of 1e-8 into fp16's normal range (min 6.1e-5).

**fp8.** Each encoder Dense (QKV, attention output, MLP in/out) quantizes its input and kernel
to E4M3 and its output gradient to E5M2 with per-tensor scales from an amax history (NVIDIA
Transformer Engine's delayed scaling, margin 0; see ``jaxaccel.models.fp8``). Attention, the
pooler and the classifier stay bf16.
"""
from __future__ import annotations

import dataclasses
import difflib

import jax
import jax.numpy as jnp
from flax import struct


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy.

    Attributes:
      name: the policy's config name.
      param_dtype: dtype the parameters (master weights) are stored in.
      compute_dtype: dtype activations and matmul inputs are cast to.
      output_dtype: dtype of the model's outputs (logits, hidden states handed to losses).
      loss_scaling: dynamic loss scaling of the gradients (fp16).
      fp8: encoder matmuls in fp8 with delayed scaling.
      amax_history_length: fp8 only: steps of amax history a scale is taken from (1024, as
        Transformer Engine's DelayedScaling).
      matmul_dtype: the dtype the dense matmuls run in, whose published peak FLOP/s bounds
        them (``jaxaccel.devices``; MFU's denominator): fp8's encoder matmuls run in float8
        although its other compute is bfloat16.
      compute_activations: the activations in ``compute_dtype`` (``activation_dtype``), else
        float32.
      logits_dtype: the dtype a causal LM's head matmul writes its logits in
        (``precision.logits_dtype``): float32, or bfloat16 as MaxText's default (its
        ``logits_dense`` in the compute dtype, then ``cast_logits_to_fp32``), which halves the
        logits and their gradient; the log-softmax and the loss read them in float32 either way.
    """

    name: str
    param_dtype: jnp.dtype
    compute_dtype: jnp.dtype
    output_dtype: jnp.dtype
    loss_scaling: bool = False
    fp8: bool = False
    amax_history_length: int = 1024
    matmul_dtype: str = "float32"
    compute_activations: bool = False
    logits_dtype: jnp.dtype = jnp.float32

    @property
    def activation_dtype(self):
        """The dtype of the residual stream and the activations kept for the backward pass."""
        return self.compute_dtype if self.compute_activations else jnp.float32

    def cast_to_compute(self, x):
        return x.astype(self.compute_dtype)

    def cast_to_output(self, x):
        return x.astype(self.output_dtype)


POLICIES = {
    "fp32": Policy("fp32", jnp.float32, jnp.float32, jnp.float32),
    "bf16": Policy("bf16", jnp.float32, jnp.bfloat16, jnp.float32, matmul_dtype="bfloat16",
                   compute_activations=True),
    "fp16": Policy("fp16", jnp.float32, jnp.float16, jnp.float32, loss_scaling=True,
                   matmul_dtype="float16"),
    "fp8": Policy("fp8", jnp.float32, jnp.bfloat16, jnp.float32, fp8=True,
                  matmul_dtype="float8", compute_activations=True),
}

# The dtype the dense matmuls of each precision name run in, whose peak FLOP/s bounds them
# (``jaxaccel.devices``): the policies' own, and "tf32", which published runs name
# (``jaxaccel/plan/calibration.json``): fp32 matmuls at XLA's default precision, which run on
# NVIDIA's TF32 tensor cores (the chip table's "float32" figure).
MATMUL_DTYPES = {**{name: p.matmul_dtype for name, p in POLICIES.items()}, "tf32": "float32"}


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


def policy_of(precision) -> Policy:
    """The run's policy from the config's ``precision`` section: the named policy with the
    section's fp8 amax history and logits dtype. The one place a run's ``Policy`` is made."""
    return dataclasses.replace(get_policy(precision.policy),
                               amax_history_length=precision.fp8_amax_history,
                               logits_dtype=jnp.dtype(precision.logits_dtype))


class LossScale(struct.PyTreeNode):
    """Dynamic loss-scaling state (part of the train state: checkpointed, replicated).

    The rule is ``flax.training.dynamic_scale.DynamicScale``'s (growth x2 once ``good_steps``
    reaches ``growth_interval``, backoff x0.5 on a non-finite gradient), kept as a state of its
    own because the train step updates it once per optimizer step after gradient accumulation
    (DynamicScale.value_and_grad differentiates and updates in one call per loss function), and
    because it also counts the skipped steps: ``skipped`` in total, ``consecutive`` in a row.
    """

    scale: jax.Array
    good_steps: jax.Array
    skipped: jax.Array
    consecutive: jax.Array
    growth_interval: int = struct.field(pytree_node=False, default=2000)
    growth_factor: float = struct.field(pytree_node=False, default=2.0)
    backoff_factor: float = struct.field(pytree_node=False, default=0.5)

    @classmethod
    def create(cls, init_scale: float = 2.0 ** 15, growth_interval: int = 2000) -> "LossScale":
        zero = lambda: jnp.zeros((), jnp.int32)     # distinct buffers: the state is donated
        return cls(scale=jnp.asarray(init_scale, jnp.float32), good_steps=zero(),
                   skipped=zero(), consecutive=zero(), growth_interval=growth_interval)

    def update(self, finite: jax.Array) -> "LossScale":
        """The state after a step whose gradients were ``finite`` (a bool scalar):

            finite:  S' = 2 S if good_steps + 1 == growth_interval else S;  good' = (good+1) % G
            else:    S' = max(S / 2, tiny);  good' = 0;  skipped' = skipped + 1
        """
        good = self.good_steps + 1
        grow = good >= self.growth_interval
        tiny = jnp.finfo(jnp.float32).tiny
        fmax = jnp.finfo(jnp.float32).max
        scale = jnp.where(
            finite, jnp.where(grow, jnp.minimum(self.scale * self.growth_factor, fmax),
                              self.scale),
            jnp.maximum(self.scale * self.backoff_factor, tiny))
        skip = (~finite).astype(jnp.int32)
        return self.replace(scale=scale,
                            good_steps=jnp.where(finite & ~grow, good, 0).astype(jnp.int32),
                            skipped=self.skipped + skip,
                            consecutive=(self.consecutive + 1) * skip)
