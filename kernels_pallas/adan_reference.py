"""Adan's math on arrays, shared by every implementation (``kernels_pallas.adan``'s docstring
has the update), the flat buffers it runs on ([rows, ``LANES``], rows a multiple of
``ROW_ALIGN``) and the blocks the kernels cut them into, the hyperparameter vector
(``make_scalars``, laid out as ``SCALARS``), and the plain-XLA reference the kernels are tested
against.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

LANES = 128
ROW_ALIGN = 1024   # flat buffers have a multiple of this many rows: every block size divides it
SCALARS = ("lr", "b1", "b2", "b3", "eps", "wd", "bc1", "bc2", "bc3_sqrt", "clip", "first")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """One kernel instance's work: ``rows`` of every [rows, 128] buffer. On GPU also the
    Triton program's ``num_warps`` and ``num_stages`` (ignored elsewhere); for the Mosaic GPU
    kernel ``rows`` is one TMA block, ``num_stages`` the blocks in flight and ``steps`` the
    blocks one program (a warpgroup) streams. Tune with ``bench/optimizer.py --block-rows ...
    --num-warps ... --num-stages ... --steps ...``."""

    rows: int
    num_warps: int = 4
    num_stages: int = 1
    steps: int = 1

    def __post_init__(self):
        if self.rows <= 0 or ROW_ALIGN % self.rows:
            raise ValueError(f"block rows {self.rows} must divide ROW_ALIGN={ROW_ALIGN}; pick "
                             "a power of two up to it.")
        if self.num_warps <= 0 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps={self.num_warps} must be a power of two (1..32).")
        if self.num_stages <= 0:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1.")
        if self.steps <= 0 or (ROW_ALIGN // self.rows) % self.steps:
            raise ValueError(f"steps={self.steps} must divide ROW_ALIGN / rows = "
                             f"{ROW_ALIGN // self.rows}.")


# Per target: TPU blocks fill VMEM tiles (11 buffers x 512 x 128 x 4 B = 2.9 MB, double
# buffered); GPU blocks keep each Triton program at 16 elements per thread and buffer (not yet
# tuned on a GPU: the sweep flags of bench/optimizer.py are there for that). The interpreter
# (CPU) takes the largest block: each of its grid steps copies every whole buffer, so its time
# grows with rows x grid steps (the tiny BERT's fused Adan step on 4 CPU devices: 0.74 s at 256
# rows, 0.23 s at 1024; compile 5.4 s -> 3.3 s).
# Mosaic GPU: 8-row blocks (4 KiB per float32 buffer), 3 in flight: 6 inputs x 3 + 5 outputs
# = 92 KiB of shared memory, two programs per H100 SM; not tuned on a GPU. Its interpreter
# (CPU) takes whole 1024-row groups in one step, as the Pallas interpreter does.
BLOCK_SIZES = {"tpu": BlockSizes(512), "gpu": BlockSizes(16, num_warps=4, num_stages=1),
               "interpret": BlockSizes(ROW_ALIGN),
               "mosaic_gpu": BlockSizes(8, num_stages=3, steps=16),
               "mosaic_gpu_interpret": BlockSizes(256, num_stages=2, steps=4)}


def make_scalars(*, lr, b1, b2, b3, eps, weight_decay, count, clip):
    """The float32 hyperparameter vector for step ``count + 1`` (``count`` steps done)."""
    t = jnp.asarray(count, jnp.float32) + 1.0
    f = lambda x: jnp.asarray(x, jnp.float32)
    values = dict(lr=f(lr), b1=f(b1), b2=f(b2), b3=f(b3), eps=f(eps), wd=f(weight_decay),
                  bc1=1.0 / (1.0 - f(b1) ** t), bc2=1.0 / (1.0 - f(b2) ** t),
                  bc3_sqrt=1.0 / jnp.sqrt(1.0 - f(b3) ** t), clip=f(clip),
                  first=(t == 1.0).astype(jnp.float32))
    return jnp.stack([values[k] for k in SCALARS])


def _moments(s, g, m, v, n, prev, sqrt=jnp.sqrt):
    """The new moments and the step ``lr (bc1 m + b2 bc2 v) / den``, float32."""
    lr, b1, b2, b3, eps, wd, bc1, bc2, bc3_sqrt, clip, first = (s[i] for i in range(len(SCALARS)))
    g = g.astype(jnp.float32) * clip
    d = (g - prev.astype(jnp.float32)) * (1.0 - first)
    m = b1 * m.astype(jnp.float32) + (1.0 - b1) * g
    v = b2 * v.astype(jnp.float32) + (1.0 - b2) * d
    u = g + b2 * d
    n = b3 * n.astype(jnp.float32) + (1.0 - b3) * u * u
    den = sqrt(n) * bc3_sqrt + eps
    step = (lr * bc1 * m + lr * b2 * bc2 * v) / den
    return step, m, v, n, g


def adan_math(s, g, m, v, n, prev, p=None, *, no_prox: bool, sqrt=jnp.sqrt):
    """One Adan step on arrays (any shape), float32 math. ``s`` indexes like ``SCALARS``.

    Returns ``(update, m, v, n, prev)`` in float32; ``p=None`` means weight decay is 0."""
    step, m, v, n, g = _moments(s, g, m, v, n, prev, sqrt)
    lr, wd = s[0], s[5]
    if p is None:
        update = -step
    else:
        p = p.astype(jnp.float32)
        update = -lr * wd * p - step if no_prox else (p - step) / (1.0 + lr * wd) - p
    return update, m, v, n, g


def adan_apply_math(s, g, p, m, v, n, prev, *, no_prox: bool, sqrt=jnp.sqrt):
    """One Adan step returning the new parameter ``p'`` itself (float32):
    ``p (1 - lr wd) - step`` (no_prox) or ``(p - step) / (1 + lr wd)``."""
    step, m, v, n, g = _moments(s, g, m, v, n, prev, sqrt)
    lr, wd = s[0], s[5]
    p = p.astype(jnp.float32)
    p = p * (1.0 - lr * wd) - step if no_prox else (p - step) / (1.0 + lr * wd)
    return p, m, v, n, g


def adan_apply_reference(scalars, g, p, m, v, n, prev, *, no_prox: bool):
    """The plain-XLA one-pass path: ``adan_apply_math`` cast back to the storage dtypes."""
    out = adan_apply_math(scalars, g, p, m, v, n, prev, no_prox=no_prox)
    return tuple(x.astype(like.dtype) for x, like in zip(out, (p, m, v, n, prev)))


def adan_reference(scalars, g, m, v, n, prev, p=None, *, no_prox: bool):
    """The plain-XLA path: ``adan_math`` cast back to the storage dtypes."""
    update, m2, v2, n2, prev2 = adan_math(scalars, g, m, v, n, prev, p, no_prox=no_prox)
    return (update.astype(g.dtype), m2.astype(m.dtype), v2.astype(v.dtype), n2.astype(n.dtype),
            prev2.astype(prev.dtype))

