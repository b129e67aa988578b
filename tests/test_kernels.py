"""The kernels of a compiled GPU program by what they do (jaxaccel.plan.kernels), on the
compile-only H100 target: fp8 GEMMs found by their operands, with the scales XLA's GEMM
rewriter fused into cuBLASLt's fp8 GEMM, the fp8 work around them named, and an amax of GEMM
products sharing its kernel with their quantize."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxaccel.models import fp8
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


def _swiglu_grads(tokens, hidden, ffn):
    """The gradients (weights' and scales') of an fp8 SwiGLU MLP (``models.fp8.fp8_dot``, every
    GEMM in fp8) and its arguments' shapes: the down projection's input ``silu(gate) * up``
    is made from GEMM products, and so are its gradients."""

    def dot(x, w, scales):
        with jax.named_scope(SCOPE):
            q, amax = fp8.quantize_kernel(w, scales[1], jnp.bfloat16)
            return fp8.fp8_dot(x, w, q, amax, *scales, jnp.bfloat16)

    def loss(x, gate, up, down, *scales):
        h = jax.nn.silu(dot(x, gate, scales[0:3])) * dot(x, up, scales[3:6])
        return jnp.sum(dot(h, down, scales[6:9]).astype(jnp.float32) ** 2)

    shapes = [(tokens, hidden), (hidden, ffn), (hidden, ffn), (ffn, hidden)]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    scales = [jax.ShapeDtypeStruct((1,), jnp.float32)] * 9
    # The scales' gradients are the amaxes (``fp8_dot``'s VJP): asked for, so XLA keeps them.
    return jax.grad(loss, argnums=tuple(range(1, 13))), args + scales


def test_an_amax_and_a_quantize_of_gemm_products_share_one_kernel(compile_target):
    """Compiled for the H100, each amax of an activation or gradient shares its kernel with
    that array's quantize. Without the optimization barrier on the fp8 GEMMs' products
    (``models.fp8._shared_by_its_consumers``) XLA's multi-output fusion, which skips Triton
    GEMMs as a shared operand, ran four of these amaxes (SwiGLU's input to the down
    projection and its gradients) in kernels of their own that read the products again:
    185 MB outside the GEMMs against 105 MB."""
    target = compile_target("h100:1x1")
    tokens, hidden, ffn = 4096, 512, 1024
    grads, args = _swiglu_grads(tokens, hidden, ffn)
    found = kernels.of(_compiled(target, grads, *args))
    activations = [k for k in found if "amax" in k.kinds and k.bytes >= tokens * hidden * 2]
    assert len(activations) >= 3, found
    assert all("quantize" in k.kinds for k in activations), activations
    # Off a GPU the barrier is not there: CPU and TPU programs are as before.
    grads, args = _swiglu_grads(256, 64, 128)
    assert "optimization_barrier" not in jax.jit(grads).lower(*args).as_text()
