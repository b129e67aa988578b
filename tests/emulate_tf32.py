"""pytest plugin that gives the CPU a GPU's float32 matmul default, to catch references that
are not at ``precision="highest"`` without a GPU::

    python -m pytest -p tests.emulate_tf32 tests/test_attention.py

Every float32 operand of a ``dot_general`` whose precision is not HIGHEST (neither passed nor
set by ``jax.default_matmul_precision``) is rounded to TF32, the 10-bit mantissa of an NVIDIA
GPU's default float32 matmul, round to nearest: ``bits + 2^12`` then clear the low 13 bits.
The rounding happens when the CPU lowers the op, so autodiff is untouched and the backward's
matmuls are rounded too, as on a GPU. It reproduces the H100 failure of issue 9 (the float32
flash-attention tests' reference 4e-4 off, measured there 4.3e-4). Uses JAX internals (the CPU
lowering table); written against jax 0.10."""
import jax.numpy as jnp
from jax import lax
from jax._src.interpreters import mlir
from jax._src.lax import lax as lax_internal

_DOT = lax_internal.dot_general_p
_cpu_rule = mlir._platform_specific_lowerings["cpu"][_DOT].rule


def _to_tf32(x):
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    bits = (bits + jnp.uint32(1 << 12)) & jnp.uint32(~((1 << 13) - 1) & 0xFFFFFFFF)
    return lax.bitcast_convert_type(bits, jnp.float32)


_to_tf32_lowered = mlir.lower_fun(_to_tf32, multiple_results=False)


def _is_highest(precision):
    """``precision`` as bound: None (the default), a pair of lax.Precision, or an algorithm."""
    if isinstance(precision, tuple):
        return all(p == lax.Precision.HIGHEST for p in precision)
    return precision is not None and "F32" in str(precision)     # a float32 dot algorithm


def _dot_general_tf32(ctx, lhs, rhs, *, precision, **params):
    if not _is_highest(precision):
        operands = []
        for x, aval in zip((lhs, rhs), ctx.avals_in):
            if aval.dtype == jnp.float32:
                x = _to_tf32_lowered(ctx.replace(avals_in=[aval], avals_out=[aval]), x)[0]
            operands.append(x)
        lhs, rhs = operands
    return _cpu_rule(ctx, lhs, rhs, precision=precision, **params)


mlir.register_lowering(_DOT, _dot_general_tf32, platform="cpu")
