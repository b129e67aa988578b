"""fp8 Dense layers with delayed scaling (NVIDIA Transformer Engine's recipe) for NNX models.

``Fp8Linear`` is an ``nnx.Linear`` whose matmul is ``flax.linen.fp8_ops.fp8_scaled_dot_general``
(Flax's maintained fp8 op, the path MaxText's "fp8" quantization uses on GPUs): the input ``x``
and the kernel ``w`` are quantized to E4M3, the output gradient ``g`` to E5M2, each with its own
per-tensor scale ``s`` taken from an amax history ``h`` (the last ``len(h)`` amaxes, newest at
``h[0]``) *before* this step's amax is added (delayed scaling, margin 0):

    s   = max(h) / fmax            (kept when max(h) is 0 or not finite; fmax = 448 for E4M3,
                                    57344 for E5M2)
    q   = fp8(clip(x / s, -fmax, fmax))          round to nearest even, saturating
    y   = (q_x . q_w) * s_x * s_w                 the GEMM takes fp8 operands
    h'  = roll(h, -1) with h'[0] = amax(x)       drops the oldest amax, adds this step's

The forward GEMM runs on E4M3 operands and the two backward GEMMs on E5M2 x E4M3, so XLA's GPU
compiler emits cuBLASLt fp8 matmuls (``__cublas$lt$matmul$f8``) on Hopper/Ada; on CPU and TPUs
without an fp8 unit the same HLO is executed by upcasting the fp8 operands, i.e. the identical
quantize-dequantize numerics.

The scales and histories are ``Fp8Meta`` variables, not ``nnx.Param``: the optimizer never sees
them. fp8_ops returns their new values as their "gradients" (the custom VJPs carry them out of
the backward pass), so the train step differentiates with respect to them and *replaces* them
by those outputs (``jaxaccel.train.step``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
_ROLES = ("input", "kernel", "output_grad")
# The name scope of the fp8 matmul's work (scales, histories, quantize, the GEMM), forward and
# backward: the compiled program's op_name metadata keeps it (``jaxaccel.plan.kernels``).
SCOPE = "fp8"


class Fp8Meta(nnx.Variable):
    """Delayed-scaling state of one fp8 matmul operand (a scale or an amax history)."""


class Fp8Linear(nnx.Linear):
    """``nnx.Linear`` with the matmul in fp8 (see the module docstring); same parameters."""

    def __init__(self, *args, amax_history_length: int = 1024, **kwargs):
        super().__init__(*args, **kwargs)
        for role in _ROLES:
            setattr(self, f"{role}_scale", Fp8Meta(jnp.ones((1,), jnp.float32)))
            setattr(self, f"{role}_amax_history",
                    Fp8Meta(jnp.zeros((amax_history_length,), jnp.float32)))

    def __call__(self, x):
        kernel = self.kernel[...].astype(self.dtype)
        x = x.astype(self.dtype)
        with jax.named_scope(SCOPE):
            y = fp8_ops.fp8_scaled_dot_general(
                x, kernel, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=self.dtype,
                lhs_scale=self.input_scale[...], rhs_scale=self.kernel_scale[...],
                grad_scale=self.output_grad_scale[...],
                lhs_amax_history=self.input_amax_history[...],
                rhs_amax_history=self.kernel_amax_history[...],
                grad_amax_history=self.output_grad_amax_history[...],
                quantize_compute_type=self.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def block_dense(din: int, dout: int, axes: tuple, std: float, policy, rngs, *,
                bias: bool = True, block: bool = True):
    """A Dense layer (normal(``std``) kernel, zero bias; matmul in the policy's compute dtype,
    parameters in its param dtype) whose parameters carry the logical ``axes`` (the bias the
    output's); a block matmul (``block=True``) is an ``Fp8Linear`` under the fp8 policy. The
    Llama and ViT families' Dense layers."""
    linear, extra = nnx.Linear, {}
    if block and policy.fp8:
        linear, extra = Fp8Linear, {"amax_history_length": policy.amax_history_length}
    partitioned = lambda init, names: nnx.with_partitioning(init, names, eager_sharding=False)
    return linear(din, dout, **extra, use_bias=bias, dtype=policy.compute_dtype,
                  param_dtype=policy.param_dtype,
                  kernel_init=partitioned(nnx.initializers.normal(std), axes),
                  bias_init=partitioned(nnx.initializers.zeros_init(), (axes[1],)), rngs=rngs)


def summary(fp8_state, group_of) -> dict[str, jax.Array]:
    """Mean latest amax and mean scale per layer group and operand role, for the metrics:
    ``{"fp8/<group>_<role>_amax": ..., "fp8/<group>_<role>_scale": ...}``, role one of
    input, kernel, output_grad. ``group_of(path)`` names the group of a layer from its path (a
    tuple of strings), or None to leave it out."""
    found: dict[str, list] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(fp8_state)[0]:
        keys = tuple(str(getattr(p, "key", p)) for p in path)
        group = group_of(keys[:-1])
        if group is None:
            continue
        name = keys[-1]
        role, kind = ((name[:-len("_scale")], "scale") if name.endswith("_scale")
                      else (name[:-len("_amax_history")], "amax"))
        # leaf[0]: the scale, or the newest amax of the history.
        found.setdefault(f"fp8/{group}_{role}_{kind}", []).append(leaf[0])
    return {k: jnp.mean(jnp.stack(v)) for k, v in sorted(found.items())}
