"""fp8 Dense layers with delayed scaling (NVIDIA Transformer Engine's recipe) for NNX models.

``Fp8Linear`` is an ``nnx.Linear`` whose matmul is ``fp8_dot`` (built from the pieces of
``flax.linen.fp8_ops``, Flax's maintained fp8 op, which MaxText's "fp8" quantization uses on
GPUs, with the same numerics): the input ``x`` and the kernel ``w`` are quantized to E4M3, the
output gradient ``g`` to E5M2, each with its own per-tensor scale ``s`` taken from an amax
history ``h`` (the last ``len(h)`` amaxes, newest at ``h[0]``) of the steps *before* this one
(delayed scaling, margin 0):

    s   = max(h) / fmax            (kept when max(h) is 0 or not finite; fmax = 448 for E4M3,
                                    57344 for E5M2)
    q   = fp8(clip(x / s, -fmax, fmax))          round to nearest even, saturating
    y   = (q_x . q_w) * s_x * s_w                 the GEMM takes fp8 operands
    h'  = roll(h, -1) with h'[0] = amax(x)       drops the oldest amax, adds this step's

The forward GEMM runs on E4M3 operands and the two backward GEMMs on E5M2 x E4M3, so XLA's GPU
compiler emits fp8 GEMMs (cuBLASLt's ``__cublas$lt$matmul$f8``, or Triton's) on Hopper/Ada; on
CPU and TPUs without an fp8 unit the same HLO is executed by upcasting the fp8 operands, i.e.
the identical quantize-dequantize numerics.

The scales and histories are ``Fp8Meta`` variables, not ``nnx.Param``: the optimizer never sees
them. Each scale holds the scale of the step to come, made from its history once per step
(``advance``, in the train step, for every layer at once), so a layer only reads its scales and
measures its operands' amaxes: ``fp8_dot``'s custom VJP returns each operand's amax as the
"gradient" of its scale (the train step differentiates with respect to the fp8 state and hands
those to ``advance``). Flax's ``fp8_scaled_dot_general`` makes each scale from its history
inside the layer, forward and backward, in small kernels of their own per operand and layer;
the scales used at every step are the same either way (``advance`` makes at the end of step
``t`` the scale Flax would make at the start of step ``t + 1``, from the same history).

A kernel's quantization and amax depend on no input, so where the layers are scanned
(``models.stack.Scan``) every layer's kernel is quantized before the loop, all layers at once
(``quantize_kernels``), and the loop reads each layer's E4M3 kernel instead of reading its
float32 one and quantizing it there; ``fp8_dot`` takes the kernel quantized (whether before
the loop or in the layer, ``quantize_kernel``: the same numbers) and gives the kernel its
gradient straight through.

In a program for a GPU the fp8 GEMMs' products (the layer's output forward, its input's
gradient backward) pass an optimization barrier (``_shared_by_its_consumers``): XLA's GPU
multi-output fusion never merges two consumers of a Triton GEMM, so the amax and the quantize of
a next fp8 operand made from GEMM products (SwiGLU's ``silu(gate) * up``, its gradients) ran as
two kernels, each reading the products; behind the barrier they merge into one. It moves no
bytes and changes no value; on a TPU or CPU there is none.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
_ROLES = ("input", "kernel", "output_grad")
# The name scope of the fp8 matmul's work (scales, histories, quantize, the GEMM), forward and
# backward: the compiled program's op_name metadata keeps it (``jaxaccel.plan.kernels``).
SCOPE = "fp8"
KERNEL_SCOPE = "quantize_kernel"    # the kernels' quantization, inside SCOPE


class Fp8Meta(nnx.Variable):
    """Delayed-scaling state of one fp8 matmul operand (a scale or an amax history)."""


class Fp8Kernel(nnx.Variable):
    """A kernel quantized ahead of its layer, or its amax (``quantize_kernels``): held by the
    layers a scan runs, never by a train state."""


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
            # A layer of a scanned stack is handed its kernel quantized before the loop
            # (``quantize_kernels``); any other quantizes it here.
            quantized = ((self.kernel_fp8[...], self.kernel_amax[...])
                         if hasattr(self, "kernel_fp8") else
                         quantize_kernel(kernel, self.kernel_scale[...], self.dtype))
            y = fp8_dot(x, kernel, *quantized, self.input_scale[...], self.kernel_scale[...],
                        self.output_grad_scale[...], self.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def _amax(x):
    """This step's amax of an operand, as Flax's ``compute_amax_history`` takes it."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _contract_last(x):
    """``x``'s last axis against a kernel's first: a Dense layer's dimension numbers."""
    return ((x.ndim - 1,), (0,)), ((), ())


def quantize_kernel(kernel, scale, dtype):
    """``(q, amax)``: ``kernel`` [..., in, out] (any leading axes: stacked layers) quantized to
    E4M3 by ``scale`` [..., 1] in ``dtype``, and its amax [..., 1]; both without gradient:
    ``fp8_dot`` gives the kernel its gradient straight through and the amax to its scale.
    Named ``KERNEL_SCOPE`` in the compiled program (under ``SCOPE``)."""
    with jax.named_scope(KERNEL_SCOPE):
        q = fp8_ops.quantize(kernel, E4M3, scale[..., None], dtype)
        amax = jnp.max(jnp.abs(kernel), axis=(-2, -1)).astype(jnp.float32)[..., None]
    return jax.lax.stop_gradient(q), jax.lax.stop_gradient(amax)


def _shared_by_its_consumers(product):
    """An fp8 GEMM's ``product`` behind an optimization barrier where the program is lowered for
    a GPU (the module docstring): XLA's multi-output fusion skips a Triton GEMM as the operand
    two kernels share, not the barrier, so an amax and a quantize both computed from GEMM
    products fuse into one kernel that reads them once. Elsewhere ``product`` itself."""
    return jax.lax.platform_dependent(product, cuda=jax.lax.optimization_barrier,
                                      default=lambda p: p)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def fp8_dot(x, kernel, kernel_q, kernel_amax, x_scale, kernel_scale, grad_scale, dtype):
    """``x @ kernel`` with ``x`` quantized to E4M3 by its scale and the kernel given quantized
    (``kernel_q``, ``kernel_amax``: ``quantize_kernel`` by ``kernel_scale``), the product in
    ``dtype``; its VJP quantizes the output gradient to E5M2 by ``grad_scale``, gives
    ``kernel`` the quantized kernel's gradient and returns, for the three scales, the amaxes
    of ``x``, the kernel and the gradient."""
    return _fp8_dot_fwd(x, kernel, kernel_q, kernel_amax, x_scale, kernel_scale, grad_scale,
                        dtype)[0]


def _fp8_dot_fwd(x, kernel, kernel_q, kernel_amax, x_scale, kernel_scale, grad_scale, dtype):
    del kernel                  # its gradient's shape only: the GEMMs read kernel_q
    qx = fp8_ops.quantize(x, E4M3, x_scale, dtype)
    y = jax.lax.dot_general(qx, kernel_q, _contract_last(x), preferred_element_type=dtype,
                            precision=jax.lax.Precision.DEFAULT)
    y = _shared_by_its_consumers(fp8_ops.dequantize(y, dtype, x_scale * kernel_scale))
    return y, (qx, kernel_q, x_scale, kernel_scale, grad_scale, _amax(x), kernel_amax)


def _fp8_dot_bwd(dtype, residuals, g):
    qx, qk, x_scale, kernel_scale, grad_scale, x_amax, kernel_amax = residuals
    qg = fp8_ops.quantize(g, E5M2, grad_scale, dtype)
    dims = _contract_last(qx)
    dx = fp8_ops.dot_general_transpose_lhs(qg, qx, qk, dimension_numbers=dims,
                                           precision=jax.lax.Precision.HIGHEST,
                                           preferred_element_type=dtype)
    dk = fp8_ops.dot_general_transpose_rhs(qg, qx, qk, dimension_numbers=dims,
                                           precision=jax.lax.Precision.HIGHEST,
                                           preferred_element_type=dtype)
    amaxes = [jnp.broadcast_to(a, s.shape) for a, s in
              ((x_amax, x_scale), (kernel_amax, kernel_scale), (_amax(g), grad_scale))]
    return (_shared_by_its_consumers(fp8_ops.dequantize(dx, dtype, kernel_scale * grad_scale)),
            fp8_ops.dequantize(dk, dtype, x_scale * grad_scale), None, None, *amaxes)


fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def quantize_kernels(layer, params, fp8):
    """``(graphdef, fp8)`` for a stack of layers of ``layer``'s structure whose parameters and
    fp8 state are ``params`` and ``fp8`` (pure dicts of [L, ...] arrays): every ``Fp8Linear``'s
    kernel quantized for all L layers at once, before a loop over them, which then reads each
    layer's E4M3 kernel (not its float32 one) and quantizes none; ``graphdef`` a copy of
    ``layer`` whose ``Fp8Linear`` layers hold them (``Fp8Kernel`` variables ``kernel_fp8`` and
    ``kernel_amax``), ``fp8`` the state with their stacked values beside each scale."""
    layer, fp8 = nnx.merge(*nnx.split(layer)), jax.tree_util.tree_map(lambda a: a, fp8)
    at = lambda tree, path: functools.reduce(lambda t, k: t[k], path, tree)
    with jax.named_scope(SCOPE):
        for path, module in list(nnx.iter_graph(layer)):
            if isinstance(module, Fp8Linear):
                state = at(fp8, path)
                q, amax = quantize_kernel(at(params, path)["kernel"].astype(module.dtype),
                                          state["kernel_scale"], module.dtype)
                state.update(kernel_fp8=q, kernel_amax=amax)
                module.kernel_fp8, module.kernel_amax = Fp8Kernel(q[0]), Fp8Kernel(amax[0])
    return nnx.graphdef(layer), fp8


FMAX = {"input": fp8_ops.get_fp8_max(E4M3, jnp.float32),
        "kernel": fp8_ops.get_fp8_max(E4M3, jnp.float32),
        "output_grad": fp8_ops.get_fp8_max(E5M2, jnp.float32)}


def advance(state, amaxes):
    """The fp8 state after a step (or micro-batch) whose matmuls saw ``amaxes`` (the state's
    "gradient" from ``fp8_dot``: each scale's holds its operand's amax; its histories' are
    unused): each history drops its oldest amax and takes this step's at ``[0]`` (Flax's roll),
    each scale becomes the next step's, from its new history's maximum (Flax's
    ``compute_scale``, margin 0, the old scale kept where the maximum is 0 or not finite).
    Leaves may carry leading axes (stacked layers). Every operand's scale and history is
    advanced in one [operands, history] array: a few kernels a step, not a few per operand."""
    with jax.named_scope(SCOPE):
        return _advance(state, amaxes)


def _advance(state, amaxes):
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    keys = [tuple(str(getattr(p, "key", p)) for p in path) for path, _ in flat]
    leaves = dict(zip(keys, (leaf for _, leaf in flat)))
    measured = dict(zip(keys, treedef.flatten_up_to(amaxes)))
    scales = [k for k in keys if k[-1].endswith("_scale")]
    history_of = {k: (*k[:-1], k[-1][:-len("_scale")] + "_amax_history") for k in scales}
    rows = lambda ks, get: jnp.concatenate([get(k).reshape(-1, get(k).shape[-1]) for k in ks])
    history = rows(scales, lambda k: leaves[history_of[k]])
    history = jnp.roll(history, -1, axis=-1).at[:, :1].set(rows(scales, measured.get))
    fmax = rows(scales, lambda k: jnp.full(leaves[k].shape, FMAX[k[-1][:-len("_scale")]]))
    scale = fp8_ops.compute_scale(history.max(axis=-1, keepdims=True),
                                  rows(scales, leaves.get), fmax)
    new, start = {}, 0
    for k in scales:
        n = leaves[k].size
        new[k] = scale[start:start + n].reshape(leaves[k].shape)
        new[history_of[k]] = history[start:start + n].reshape(leaves[history_of[k]].shape)
        start += n
    return jax.tree_util.tree_unflatten(treedef, [new[k] for k in keys])


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
