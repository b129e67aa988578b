"""Model FLOPs, throughput and MFU: one analytic formula; the peaks are ``jaxaccel.devices``'.

Training FLOPs of a batch of ``B`` rows of ``L`` tokens (PaLM, Chowdhery et al. 2022,
appendix B; MaxText's ``calculate_tflops_training_per_device``; DESIGN.md):

    6 x N x B x L  +  12 x layers x L^2 x (heads x head_dim) x B  (x 1/2 if causal)

* ``N`` counts the weights every token is multiplied by: per layer the q, k, v, o projections
  (h x h, 2 x h x kv_heads x head_dim, h x h) and the MLP (2 matrices h x f, or 3 when gated
  as SwiGLU), plus the output head: BERT's pooler and classifier (h x h + h x labels; they
  see one token per row but are counted per token, as bench rows always did: 0.7% of
  bert-base's N), or the vocabulary projection h x V of a language model, tied to the
  embedding or not. The embedding lookup (no multiply), biases and norms (O(h)) are not
  counted. 6 = 2 (multiply + add) x 3 (forward, and the backward's two matmuls per weight).
* Attention: QK^T and AV are 2 x L^2 x heads x head_dim each in the forward, x 3 for
  forward + backward. Causal attention needs only the lower triangle, so it is halved, as
  MaxText does (nanoGPT and PaLM do not halve); packed rows count the whole row as one
  sequence whatever their documents (the kernels compute it so).

Rematerialisation's recomputed forward is not counted (model FLOPs, not hardware FLOPs);
``recompute_flops`` gives it (the planner's compute bound adds it to a remat run's).
Tokens are counted twice in the metrics: ``processed_tokens_per_s`` (B x L, padding included:
the work the FLOPs count) and ``tokens_per_s`` (non-padding tokens only: what a user means by
throughput). MFU = model FLOP/s / (devices x the device's peak for the policy's dtype);
``mfu_peak`` returns None where no peak is known (CPUs, or a dtype a device has no units
for), and then MFU is left out, never estimated.
"""
from __future__ import annotations

import dataclasses
import numpy as np

from jaxaccel import devices
from jaxaccel.precision import Policy, get_policy

RECOMPUTED = ("qkv", "out", "mlp_in", "mlp_out", "core")  # a layer's forward: all (full remat)


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the FLOPs formula reads from an architecture."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    mlp_matrices: int          # 2 (dense in/out) or 3 (gated: gate, up, down)
    head_weights: int          # weights of the output head per token
    causal: bool
    pre_norm: bool             # x + mlp(norm(x)) (Llama, ViT), not norm(x + mlp(x)) (BERT)

    @property
    def block_matrices(self) -> dict[str, list[tuple[int, int]]]:
        """A layer's weights [K, N] by the part of its forward they serve (``recompute_flops``'
        names): "qkv" the query, key and value projections, "out" attention's output
        projection, "mlp_in" the MLP's input projections (gate and up, or the one), "mlp_out"
        its output projection."""
        h, q, kv, f = self.hidden, self.heads * self.head_dim, \
            self.kv_heads * self.head_dim, self.intermediate
        return {"qkv": [(h, q), (h, kv), (h, kv)], "out": [(q, h)],
                "mlp_in": [(h, f)] * (self.mlp_matrices - 1), "mlp_out": [(f, h)]}

    @property
    def matmul_weights(self) -> int:
        """N of the formula."""
        return self.layers * sum(k * n for shapes in self.block_matrices.values()
                                 for k, n in shapes) + self.head_weights


    def attention_flops(self, batch: int, seq: int) -> float:
        attention = 12.0 * self.layers * seq * seq * self.heads * self.head_dim
        return attention * batch * (0.5 if self.causal else 1.0)

    def train_flops(self, batch: int, seq: int) -> float:
        return 6.0 * self.matmul_weights * batch * seq + self.attention_flops(batch, seq)

    def recompute_flops(self, batch: int, seq: int, parts=RECOMPUTED) -> float:
        """The forward FLOPs of ``parts`` of every layer again (remat): "qkv" (the query, key
        and value projections), "out" (attention's output projection), "mlp_in" (the MLP's
        input projections: gate and up, or the one), "mlp_out" (its output projection),
        "core" (attention's scores and context); all five: the layers' whole forward pass, a
        third of their training FLOPs, except in a pre-norm layer, where "mlp_out" counts
        nothing: nothing in the backward pass reads its result (it is added to the residual
        stream, whose next value is the next layer's input, kept anyway; its gradients need
        its input and the cotangent), so XLA leaves it out of the recompute, under ``full``
        too (tests/test_remat.py); a post-norm layer's LayerNorm reads it."""
        matrices = self.block_matrices
        flops = 2.0 * batch * seq * self.layers * sum(
            k * n for p in self._recomputed(parts) for k, n in matrices[p])
        return flops + (self.attention_flops(batch, seq) / 3.0 if "core" in parts else 0.0)

    def _recomputed(self, parts) -> set[str]:
        """The ``block_matrices`` parts of ``parts`` a remat runs again (module doc of
        ``recompute_flops``: a pre-norm layer's "mlp_out" never)."""
        return {p for p in parts if p in self.block_matrices
                and (p != "mlp_out" or not self.pre_norm)}

    def fp8_flops(self, batch: int, seq: int, fp8_dense, parts=()) -> float:
        """Of ``train_flops`` and ``recompute_flops(parts)``, those of the block matmuls that
        run fp8: the layers' weights [K, N] (q, k, v, o and the MLP's) for which
        ``fp8_dense(K, N)`` holds (``Policy.fp8_dense``); attention's scores and context and
        the output head run in the compute dtype."""
        recomputed = self._recomputed(parts)
        per_token = sum((6.0 + 2.0 * (part in recomputed)) * k * n
                        for part, shapes in self.block_matrices.items() for k, n in shapes
                        if fp8_dense(k, n))
        return per_token * self.layers * batch * seq

    @staticmethod
    def rows(batch: dict) -> tuple[int, int]:
        """(rows, padded length) of a host batch of token rows."""
        return batch["input_ids"].shape

    @staticmethod
    def row_tokens(seq: int) -> int:
        """Tokens of a row of ``seq`` tokens (a ViT's: its patches, whatever ``seq``)."""
        return seq

    @staticmethod
    def batch_tokens(batch: dict) -> tuple[int, int]:
        return batch_tokens(batch)


@dataclasses.dataclass(frozen=True)
class ViTShape:
    """A ViT (``models.vit``): its encoder on ``encoder_tokens`` per row (the CLS token and
    the kept patches under MAE, every patch otherwise), the MAE decoder on every patch and the
    CLS token (``decoder_tokens``; 0 without one), and the patch embedding (``patch_weights``
    per patch). A row's tokens are its ``patches``; the ``seq`` of the formula is unused."""

    encoder: Shape
    encoder_tokens: int
    decoder: Shape | None
    decoder_tokens: int
    patches: int
    patch_weights: int

    def attention_flops(self, batch: int, seq: int | None = None) -> float:
        dec = 0.0 if self.decoder is None else \
            self.decoder.attention_flops(batch, self.decoder_tokens)
        return self.encoder.attention_flops(batch, self.encoder_tokens) + dec

    def train_flops(self, batch: int, seq: int | None = None) -> float:
        dec = 0.0 if self.decoder is None else \
            self.decoder.train_flops(batch, self.decoder_tokens)
        return (self.encoder.train_flops(batch, self.encoder_tokens) + dec
                + 6.0 * self.patch_weights * batch * self.patches)

    def recompute_flops(self, batch: int, seq: int | None = None, parts=RECOMPUTED) -> float:
        dec = 0.0 if self.decoder is None else \
            self.decoder.recompute_flops(batch, self.decoder_tokens, parts)
        return self.encoder.recompute_flops(batch, self.encoder_tokens, parts) + dec

    def fp8_flops(self, batch: int, seq: int | None, fp8_dense, parts=()) -> float:
        dec = 0.0 if self.decoder is None else \
            self.decoder.fp8_flops(batch, self.decoder_tokens, fp8_dense, parts)
        return self.encoder.fp8_flops(batch, self.encoder_tokens, fp8_dense, parts) + dec

    def rows(self, batch: dict) -> tuple[int, int]:
        return len(batch["pixels"]), self.patches

    def row_tokens(self, seq: int | None = None) -> int:
        return self.patches

    def batch_tokens(self, batch: dict) -> tuple[int, int]:
        """(patches, patches of real rows: weight > 0)."""
        rows = len(batch["pixels"])
        return rows * self.patches, int(np.count_nonzero(batch["weights"])) * self.patches


def attention_flops(shape: Shape | ViTShape, batch: int, seq: int) -> float:
    """The attention term of ``train_flops``: QK^T and AV, forward and backward."""
    return shape.attention_flops(batch, seq)


def train_flops(shape: Shape | ViTShape, batch: int, seq: int) -> float:
    """Model FLOPs of one training step on ``batch`` rows of ``seq`` tokens (module doc)."""
    return shape.train_flops(batch, seq)


def fp8_flops(shape: Shape | ViTShape, batch: int, seq: int, fp8_dense, parts=()) -> float:
    """The FLOPs of a step's block matmuls that run fp8 (``fp8_dense(K, N)``: the policy's
    ``Policy.fp8_dense``), trained and, under remat, recomputed (``parts``): what the planner's
    compute bound takes at the fp8 peak, the rest of the step's at the compute dtype's."""
    return shape.fp8_flops(batch, seq, fp8_dense, parts)


def recompute_flops(shape: Shape | ViTShape, batch: int, seq: int, parts=RECOMPUTED) -> float:
    """FLOPs a step with ``model.remat`` adds to ``train_flops``: the ``parts`` of each layer's
    forward pass its policy computes again in the backward pass (``models.remat``; all of it
    under ``full``, but a pre-norm layer's MLP output projection: ``Shape.recompute_flops``),
    not counted in MFU, which counts the model's FLOPs, but time the hardware spends."""
    return shape.recompute_flops(batch, seq, parts)


def model_shape(spec) -> Shape | ViTShape:
    """The FLOPs shape of a model spec: its family's model class's ``flops_shape`` (each
    family's shape lives beside its model; the formula is this module's)."""
    return spec.family.model_class().flops_shape(spec)


def mfu_peak(device_kind: str, policy: str | Policy) -> float | None:
    """MFU's denominator: peak FLOP/s of one device of ``device_kind`` (jax's) for the matmul
    dtype of ``policy`` (a ``Policy``, or its name: fp32 | bf16 | fp16 | fp8) from the one chip
    table (``jaxaccel.devices.peak_rate``), or None when the chip is unknown (CPUs) or has no
    units of that dtype (fp16/fp8 on TPUs, fp8 on A100)."""
    peak = devices.peak_rate(device_kind, get_policy(policy).matmul_dtype, own_units=True)
    return peak[0] if peak else None


def batch_tokens(batch: dict) -> tuple[int, int]:
    """``(processed, real)`` tokens of a host batch: rows x padded length, and the tokens that
    are not padding (``attention_mask`` of a classification batch, ``segment_ids > 0`` of a
    packed one)."""
    ids = batch["input_ids"]
    real = batch["attention_mask"] if "attention_mask" in batch else batch["segment_ids"] > 0
    return int(ids.size), int(np.count_nonzero(real))


class Throughput:
    """Tokens/s, model TFLOP/s per device and MFU over the steps since the last ``flush``.

    ``add(batch, seconds)`` per step: ``batch`` is this process's rows (scaled by
    ``processes``, as every process holds as many), ``seconds`` the step's wall time. The
    first step added is ignored: it includes compilation. ``policy``: the run's ``Policy``
    (``Run.resolved.policy``; a name is looked up), whose matmul dtype's peak MFU is a share of.
    """

    def __init__(self, shape: Shape, policy: str | Policy, device_kind: str, devices: int,
                 processes: int = 1):
        self.shape, self.devices, self.processes = shape, devices, processes
        self.peak = mfu_peak(device_kind, policy)
        self._skip_next = True
        self._sums = np.zeros(4)           # processed, real tokens, FLOPs, seconds

    def add(self, batch: dict, seconds: float) -> None:
        if self._skip_next:
            self._skip_next = False
            return
        processed, real = self.shape.batch_tokens(batch)
        rows, length = self.shape.rows(batch)
        flops = train_flops(self.shape, rows * self.processes, length)
        self._sums += (processed * self.processes, real * self.processes, flops, seconds)

    def flush(self) -> dict:
        """The window's metrics (none if it holds no timed step), and a new window."""
        processed, real, flops, seconds = self._sums
        self._sums = np.zeros(4)
        if seconds <= 0:
            return {}
        out = {"tokens_per_s": real / seconds, "processed_tokens_per_s": processed / seconds,
               "model_tflops_per_device": flops / seconds / self.devices / 1e12}
        if self.peak:
            out["mfu"] = flops / seconds / (self.devices * self.peak)
        return out
