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

**Which Dense layers run fp8** (``precision.fp8_layers``): ``all`` of them, or, by default,
those that can pay (``paying``) on the device the run is compiled for. A Dense layer [M
tokens, K] x [K, N] runs three GEMMs (forward, two backward), 6 M N K FLOPs, which fp8 runs at
the fp8 peak instead of the bf16 one; what fp8 adds is passes over the rows it quantizes:
an amax and a quantize of the input [M, K] and of the output gradient [M, N], and the E4M3
operands kept for the backward pass, ``c`` bytes per element of M (K + N), which XLA does not
fuse into the GEMMs. The layer pays when the time saved exceeds the time those bytes take:

    6 M N K (1/P_bf16 - 1/P_fp8)  >  c M (K + N) / B
    <=>  N K / (N + K)  >  w = c / (6 B (1/P_bf16 - 1/P_fp8))

with ``P`` the chip's dense peaks and ``B`` its HBM bandwidth (``jaxaccel.devices``). ``c`` =
7.8 bytes is measured on the compiled H100 steps (``bench/results/fp8_cost-h100_1x1_
compile_only-unrolled_by_default-sliced_count.json``, ``fp8_work_bytes``: everything the step
runs under the fp8 name scope outside the GEMMs, ``jaxaccel.plan.kernels``): 59.85 GB over
llama-350m 8 x 2048's 24 x 19,712 x 16,384 elements is 7.72 bytes, 43.07 GB over BERT-base 256
x 128's 12 x 13,824 x 32,768 is 7.92. On an H100 SXM (989 / 1,979 TFLOP/s, 3.35 TB/s) ``w`` =
767: no GEMM of BERT-base (768 x 768: 384; 768 x 3,072: 614) or llama-350m (1,024 x 1,024:
512; 1,024 x 2,816: 751) pays, every one of Llama-3 8B's does (4,096 x 1,024: 819; 4,096 x
4,096: 2,048; 4,096 x 14,336: 3,186); on an H200 (4.8 TB/s) ``w`` = 535, which BERT-base's
and llama-350m's MLP GEMMs pass. Both sides are taken at peak, launches and the GEMMs' own
smaller fp8 operands left out, and ``c`` is all the traffic of the kernels doing fp8's work,
some of which also do the model's own (the bytes fp8 adds outside the GEMMs, fp8's step
less bf16's, are 2.3 and 1.8 per element in the same files): ``w`` leans to bf16, as the
H200's measured all-fp8 steps, each slower than bf16, advise. Since the fp8 GEMMs' products
pass a barrier on GPUs (``models.fp8``), the same measure gives 5.9 and 7.3 bytes; ``c`` stays
7.8 until a GPU times those steps (docs/reports/precision.md says why).
Where the device has no fp8 peak (CPU, TPU, A100: fp8 emulated by upcasting, run for its
numerics, not its speed) or is not in the table, every block Dense layer runs fp8 as under
``all``. A run whose layers are all below ``w`` has no fp8 layer and no fp8 state: its step is
the bf16 policy's.
"""
from __future__ import annotations

import dataclasses
import difflib

import jax
import jax.numpy as jnp
from flax import struct

from jaxaccel.devices import peak_bandwidth, peak_rate


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
      fp8_min_width: fp8 only: a block Dense layer [K, N] runs fp8 when N K / (N + K) is at
        least this (``fp8_break_even``; 0: every one, ``precision.fp8_layers=all``).
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
    fp8_min_width: float = 0.0

    def fp8_dense(self, din: int, dout: int) -> bool:
        """Whether a block Dense layer [din, dout] runs fp8 (module doc: which layers)."""
        return self.fp8 and din * dout / (din + dout) >= self.fp8_min_width

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


# fp8's bytes outside the GEMMs per element of a Dense layer's input and output rows, M (K + N):
# measured on the compiled H100 steps (module doc).
FP8_BYTES_PER_ELEMENT = 7.8


def fp8_break_even(device_kind: str | None) -> float | None:
    """``w`` of the module doc: the N K / (N + K) above which a Dense layer [K, N] is faster in
    fp8 on ``device_kind``; None where the chip has no fp8 peak of its own or is unknown."""
    fp8, bf16 = (peak_rate(device_kind or "", d, own_units=True) for d in ("float8", "bfloat16"))
    bandwidth = peak_bandwidth(device_kind or "")
    if fp8 is None or bf16 is None or bandwidth is None or fp8[0] <= bf16[0]:
        return None
    return FP8_BYTES_PER_ELEMENT / (6 * bandwidth * (1 / bf16[0] - 1 / fp8[0]))


def policy_of(precision, device_kind: str | None = None,
              fp8_min_width: float | None = None) -> Policy:
    """The run's policy from the config's ``precision`` section: the named policy with the
    section's fp8 amax history and logits dtype, and under fp8 the layers that run it
    (``precision.fp8_layers``) for a run on ``device_kind`` (None: unknown, every layer), or
    those of a trained run's recorded ``fp8_min_width`` (its checkpoint's). The one place a
    run's ``Policy`` is made."""
    policy = get_policy(precision.policy)
    if fp8_min_width is None:
        paying = policy.fp8 and precision.fp8_layers == "paying"
        fp8_min_width = (paying and fp8_break_even(device_kind)) or 0.0
    return dataclasses.replace(policy, amax_history_length=precision.fp8_amax_history,
                               logits_dtype=jnp.dtype(precision.logits_dtype),
                               fp8_min_width=fp8_min_width)


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
