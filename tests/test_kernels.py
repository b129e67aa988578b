"""The kernels of a compiled GPU program by what they do (jaxaccel.plan.kernels), on the
compile-only H100 target: fp8 GEMMs found by their operands, with the scales XLA's GEMM
rewriter fused into cuBLASLt's fp8 GEMM, and the fp8 work around them named."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxaccel.models.fp8 import SCOPE
from jaxaccel.plan import CUBLAS_GEMMS, kernels


def _compiled(target, fn, *args, **options):
    m = Mesh(np.asarray(target.devices[:1]), ("x",))
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(m, P()))
              for a in args]
    with jax.set_mesh(m):
        return jax.jit(fn).trace(*placed).lower().compile(compiler_options=options).as_text()


def _qdq_dot(a, b, sa, sb):
    """The dequantize-then-dot form XLA's GEMM rewriter turns into one fp8 GEMM."""
    return jax.lax.dot_general(a.astype(jnp.bfloat16) * sa.astype(jnp.bfloat16),
                               b.astype(jnp.bfloat16) * sb.astype(jnp.bfloat16),
                               (((1,), (1,)), ((), ())))


F8_ARGS = (jax.ShapeDtypeStruct((256, 512), jnp.float8_e4m3fn),
           jax.ShapeDtypeStruct((128, 512), jnp.float8_e4m3fn),
           jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32))


def test_the_h100_target_makes_cublaslt_fp8_gemms_with_their_scales(compile_target):
    """The target config names its CUDA runtime (12.8): without it XLA's rewriter upcasts
    fp8 operands to bf16 instead of calling cuBLASLt's fp8 GEMM."""
    target = compile_target("h100:1x1")
    found = kernels.of(_compiled(target, _qdq_dot, *F8_ARGS, **CUBLAS_GEMMS))
    gemms = [k for k in found if k.gemm]
    assert [(k.gemm, k.form) for k in gemms] == [("f8", "cublaslt fp8")], found
    assert gemms[0].scale_operands >= 2 and not gemms[0].amax_output
    assert gemms[0].bytes == 256 * 512 + 128 * 512 + 2 * 4 + 256 * 128 * 2  # not costed by XLA
    assert not any(k.kinds for k in found)


def test_fp8_work_outside_the_gemm_is_named_by_kind(compile_target):
    """Delayed scaling's work around a Triton fp8 GEMM (the compile-only default): the
    quantize of a bf16 input, its amax, the scale from a history and the history's roll."""
    from flax.linen import fp8_ops
    target = compile_target("h100:1x1")

    def step(x, w, scale, history):
        with jax.named_scope(SCOPE):
            q, new_scale = fp8_ops.in_q(jnp.bfloat16, jnp.float8_e4m3fn, x, scale, history)
            new_history = fp8_ops.compute_amax_history(x, history)
        return jax.lax.dot_general(q, w, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.bfloat16), new_scale, new_history

    found = kernels.of(_compiled(target, step, jax.ShapeDtypeStruct((256, 512), jnp.bfloat16),
                                 F8_ARGS[1], jax.ShapeDtypeStruct((1,), jnp.float32),
                                 jax.ShapeDtypeStruct((16,), jnp.float32)))
    split = kernels.summary(found)
    assert split["fp8_gemms"]["kernels"] == 1
    kinds = set().union(*(k.kinds for k in found))
    assert {"amax", "quantize", "scale", "history"} <= kinds, found
    quantize = [k for k in found if "quantize" in k.kinds]
    assert quantize and sum(k.bytes for k in quantize) >= 256 * 512 * 3  # x read, q written

