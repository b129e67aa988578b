"""Attention, forward and backward: the semantics every implementation keeps, and the dispatch.

For one batch row and query head (``P`` the attention weights, ``M`` the mask)::

    S   = scale * Q K^T                     masked entries of S are -inf
    P   = softmax(S) row-wise               a row with no unmasked key gives P = 0, O = 0
    O   = P V
    lse = logsumexp(S) row-wise             (the only residual besides O and the inputs)
    dV  = P^T dO
    dP  = dO V^T
    dS  = P * (dP - delta),  delta = rowsum(dO * O)
    dQ  = scale * dS K,      dK = scale * dS^T Q

The mask ``M[i, j]`` is the conjunction of: ``j < key_lengths[b]`` (padding), ``q_seg[i] ==
kv_seg[j]`` (packed sequences) and ``j <= i`` (causal, aligned at the start).

The kernels never build S for a whole row (flash attention: an online softmax over key
blocks, in base 2 and fp32); a query without an unmasked key gets zeros and no gradient.

Grouped-query attention (Hq = G * Hkv): query head h reads key/value head h // G.

Where each part lives (one file per backend, as jax's ``pallas/ops``):

* ``attention_reference``: the inputs every implementation takes (``check_inputs``) and the
  plain-XLA reference;
* ``attention_blocks``: the Pallas kernels' bodies and block sizes, shared by every target;
  ``attention_tpu`` (Mosaic TPU) and ``attention_triton`` (Triton, and the interpreter on CPU)
  their layouts; ``attention_pallas`` the differentiable ``flash_attention`` over them;
* ``attention_mgpu``: the kernels written for Hopper GPUs on Mosaic GPU, imported when they
  run (importing jax's Mosaic GPU modules takes a second or more);
* here: cuDNN's, and the registry that dispatches.

Implementations (``REGISTRY``, see ``kernels_pallas.registry``), all with the semantics above;
``attention(..., impl=...)`` dispatches:

* ``"xla"``: ``attention_reference``, plain XLA, the base the others are tested against; the
  only one with attention dropout (``dropout_rate``, ``dropout_rng``: inverted dropout on P);
* ``"pallas"``: ``attention_pallas.flash_attention`` (Mosaic on TPU, Triton on GPU, the
  interpreter on CPU);
* ``"mosaic_gpu"``: ``attention_mgpu.mgpu_flash_attention``, the same kernels written for Hopper
  GPUs on Mosaic GPU (bf16/fp16; jax's Mosaic GPU interpreter on CPU);
* ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (NVIDIA GPUs,
  fp16/bf16, no segment ids).

``"auto"`` tries, per platform, ``DEFAULT_ORDER``: on GPU, best first as measured on an H100
(``bench/results/attention-nvidia_h100_80gb_hbm3.json``, jax 0.11.2: the Triton kernel faster
than cuDNN on BERT-base shapes), the Triton kernel where this jax does not deprecate it
(``registry.gpu_order``: jax 0.10), then cuDNN, then XLA; on TPU the Pallas kernel; on CPU the
reference. The Mosaic GPU kernel is not in the GPU order until it is measured on a GPU
(``bench/attention.py``); ``model.attention_impl=mosaic_gpu`` runs it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import registry
from kernels_pallas.attention_pallas import flash_attention
from kernels_pallas.attention_reference import attention_reference, check_inputs


def cudnn_attention(q, k, v, *, key_lengths=None, segment_ids=None, causal: bool = False,
                    scale: float | None = None):
    """``jax.nn.dot_product_attention(implementation="cudnn")`` with this file's arguments."""
    here = registry.platform(q, k, v)
    if here != "gpu":
        raise NotImplementedError(f"cudnn attention needs an NVIDIA GPU; q, k, v live on "
                                  f"{here!r}. Use impl 'xla' or 'pallas'.")
    if q.dtype not in (jnp.float16, jnp.bfloat16):
        raise NotImplementedError(f"cudnn attention takes float16/bfloat16 inputs, not "
                                  f"{q.dtype}; use a bf16/fp16 precision policy or impl "
                                  "'xla'/'pallas'.")
    if segment_ids is not None:
        raise NotImplementedError("cudnn attention here takes no segment ids; use impl "
                                  "'xla' or 'pallas'.")
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                        key_value_seq_lengths=key_lengths,
                                        implementation="cudnn")


def _no_dropout(name, dropout_rate):
    if dropout_rate > 0:
        raise NotImplementedError(f"attention impl {name!r} has no attention dropout "
                                  f"(dropout_rate={dropout_rate}); use impl 'xla' or set the "
                                  "attention dropout to 0.")


def _xla(q, k, v, *, dropout_rate=0.0, dropout_rng=None, dropout_rows=None, **mask):
    return attention_reference(q, k, v, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                               dropout_rows=dropout_rows, **mask)


def _pallas(q, k, v, *, dropout_rate=0.0, dropout_rng=None, dropout_rows=None, **mask):
    _no_dropout("pallas", dropout_rate)
    return flash_attention(q, k, v, **mask)


def _cudnn(q, k, v, *, dropout_rate=0.0, dropout_rng=None, dropout_rows=None, **mask):
    _no_dropout("cudnn", dropout_rate)
    return cudnn_attention(q, k, v, **mask)


def _mosaic_gpu(q, k, v, *, dropout_rate=0.0, dropout_rng=None, dropout_rows=None, **mask):
    _no_dropout("mosaic_gpu", dropout_rate)
    from kernels_pallas.attention_mgpu import mgpu_flash_attention   # slow to import: only to run
    return mgpu_flash_attention(q, k, v, **mask)


# GPU: best first as measured on an H100 (module docstring); registry.gpu_order drops the Triton
# kernel where jax deprecates it.
MEASURED_GPU_ORDER = ("pallas", "cudnn", "xla")
DEFAULT_ORDER = {"cpu": ("xla",), "gpu": registry.gpu_order(MEASURED_GPU_ORDER),
                 "tpu": ("pallas", "xla")}
REGISTRY = registry.Registry("attention", {"xla": _xla, "pallas": _pallas, "cudnn": _cudnn,
                                           "mosaic_gpu": _mosaic_gpu}, DEFAULT_ORDER)
IMPLS = REGISTRY.names
WITH_DROPOUT = ("xla",)
# Platforms an implementation runs on (default: all); Mosaic GPU's CPU is its interpreter.
ONLY_ON = {"cudnn": ("gpu",), "mosaic_gpu": ("gpu", "cpu")}


def check_impl(impl, dropout_rate: float = 0.0) -> None:
    """Validate ``impl`` before anything is built: a known name, one that runs on this
    platform (``registry.platform()``: the ambient mesh's, else the default device's), and one
    with attention dropout when ``dropout_rate > 0`` ("auto" always has one: the reference)."""
    names = REGISTRY.candidates(impl)
    here = registry.platform()
    if all(here not in ONLY_ON.get(n, (here,)) for n in names):
        raise ValueError(f"attention_impl={impl!r} runs on {ONLY_ON[names[0]]} only; the "
                         f"platform here (ambient mesh, else default device) is {here!r}. Use "
                         "attention_impl='auto', 'xla' or 'pallas'.")
    if dropout_rate > 0 and not set(names) & set(WITH_DROPOUT):
        raise ValueError(
            f"attention_impl={impl!r} has no attention dropout, but the model asks for "
            f"attention dropout {dropout_rate}. Either set the model's attention dropout to 0 "
            "(config: model.attention_dropout=0.0) or use attention_impl='xla' (or 'auto', "
            "which falls back to it while dropout is active).")


def attention(q, k, v, *, key_lengths=None, segment_ids=None, causal: bool = False,
              scale: float | None = None, dropout_rate: float = 0.0, dropout_rng=None,
              dropout_rows=None, impl="auto"):
    """Multi-head attention by ``impl`` (``IMPLS``, or a tuple of names tried in order).

    Arguments as ``flash_attention``'s, plus attention dropout (``"xla"`` only; its arguments
    as ``attention_reference``'s). Returns
    [B, Sq, Hq, D] in q's dtype; a query with no unmasked key gets zeros."""
    segs = check_inputs(q, k, v, key_lengths, segment_ids, scale)
    return REGISTRY(q, k, v, key_lengths=key_lengths, segment_ids=segs, causal=causal,
                    scale=scale, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                    dropout_rows=dropout_rows, impl=impl)
