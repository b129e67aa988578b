"""A training step as the forecast reads it (``Step``), and the published runs of
``calibration.json`` as such steps (``Point``, ``load``): the model's shape through the planner's
own FLOP formula (``jaxaccel.flops``) at the peak of the step's matmul precision."""
from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax.numpy as jnp

from jaxaccel import devices as devices_lib
from jaxaccel import flops as flops_lib
from jaxaccel.compare import energy
from jaxaccel.models.spec import FAMILIES
from jaxaccel.precision import MATMUL_DTYPES, POLICIES

CALIBRATION_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "calibration.json")
DTYPES = MATMUL_DTYPES        # a published run's precision -> its matmul dtype
CLASSES = {"bfloat16": "bf16", "float16": "bf16", "float8": "fp8", "float32": "fp32"}
# The dtype an fp8 step's matmuls outside its fp8 layers run in: the fp8 policy's compute dtype.
FP8_REST_DTYPE = jnp.dtype(POLICIES["fp8"].compute_dtype).name
RECOMPUTE_ALL = ("wq", "wk", "wv", "wo", "attention", "w_gate", "w_up", "w_out")
OPTIMIZER_BYTES_PER_PARAM = 28      # fp32 AdamW: read param, grad, 2 moments; write 3
GENERATIONS = {     # device kinds that share one efficiency: one compute die, other memory
    "NVIDIA A100-SXM4-40GB": "A100 SXM", "NVIDIA A100-SXM4-80GB": "A100 SXM",
    "NVIDIA H100 80GB HBM3": "H100/H200 SXM", "NVIDIA H100": "H100/H200 SXM",
    "NVIDIA H200": "H100/H200 SXM"}


@dataclasses.dataclass(frozen=True)
class Step:
    """What the forecast reads from one training step, per chip."""

    device: str
    dtype: str                  # matmul dtype: bfloat16, float16, float8, float32
    dense_s: float              # the model's FLOPs but attention's, at the dtype's peak
    attention_s: float          # attention's (QK^T, AV) FLOPs at the peak
    recompute_s: float          # the recomputed forward's FLOPs at the peak
    width: int                  # hidden size
    layers: float               # layers one chip runs (a pipeline stage's)
    head: float                 # output head's width (the vocabulary of an LM)
    tokens: float               # tokens per chip per step
    recompute: float = 0.0      # share of the layers' forward recomputed (0..1)
    passes: float = 1.0         # forward-backward passes per step (micro-batches)
    optimizer_bytes: float = 0.0  # bytes the update reads and writes per chip
    power_limit_w: float | None = None
    hbm_bandwidth: float | None = None  # where it differs from the chip table's
    fp8_share: float = 1.0      # an fp8 step's share of its block-matmul FLOPs run in fp8

    @property
    def compute_s(self) -> float:
        """The planner's compute bound: every FLOP the step runs, at the peak."""
        return self.dense_s + self.attention_s + self.recompute_s

    @property
    def platform(self) -> str:
        return "tpu" if self.device.startswith("TPU") else "gpu"

    @property
    def precision(self) -> str:
        return CLASSES[self.dtype]

    @property
    def generation(self) -> str:
        """``GENERATIONS``' name of the device's chip: by its device kind, or by another kind
        of the same chip in ``jaxaccel.devices`` (a compile-only H200 target's "NVIDIA H200
        141GB HBM3e" is a real H200's "NVIDIA H200"); else the device kind itself."""
        if self.device in GENERATIONS:
            return GENERATIONS[self.device]
        chip = devices_lib.chip(self.device)
        return next((GENERATIONS[k] for k in (chip.kinds if chip else ()) if k in GENERATIONS),
                    self.device)

    @property
    def power_limited(self) -> bool:
        """Whether the card ran below its chip's TDP (``jaxaccel.compare.energy``)."""
        return self.power_limit_w is not None and \
            self.power_limit_w < energy.tdp(self.device)[0]

    @property
    def chip(self) -> str:
        """The efficiency's key: the chip's generation (``GENERATIONS``), and its power limit
        where a source lowered it below the TDP."""
        return self.generation + (f" at {self.power_limit_w:g} W" if self.power_limited else "")

    @property
    def key(self) -> str:
        return f"efficiency:{self.chip}/{self.precision}"

    @property
    def bandwidth(self) -> float:
        return self.hbm_bandwidth or devices_lib.chip(self.device).hbm_bandwidth

    @property
    def optimizer_s(self) -> float:
        return self.optimizer_bytes / self.bandwidth

    def in_dtype(self, dtype: str) -> "Step":
        """This step with its matmuls in ``dtype``: its FLOPs at that dtype's peak."""
        ratio = devices_lib.peak_rate(self.device, self.dtype)[0] \
            / devices_lib.peak_rate(self.device, dtype)[0]
        return dataclasses.replace(self, dtype=dtype, dense_s=self.dense_s * ratio,
                                   attention_s=self.attention_s * ratio,
                                   recompute_s=self.recompute_s * ratio, fp8_share=1.0)

    @property
    def fp8_rest(self) -> "Step":
        """The step as it would be with no layer in fp8 (``FP8_REST_DTYPE``): what the share
        of an fp8 step's block matmuls outside its fp8 layers is priced as."""
        return self.in_dtype(FP8_REST_DTYPE)

    def features(self, alpha: float, kappa: float) -> dict:
        """The inputs each fitted coefficient multiplies (``jaxaccel.plan.forecast``'s doc)."""
        elementwise = self.tokens * (self.layers * self.width * (1 + self.recompute / 3)
                                     + self.head) / self.bandwidth
        return {self.key: self.dense_s + alpha * self.attention_s + kappa * self.recompute_s,
                "elementwise": elementwise,
                f"layer:{self.platform}": self.passes * self.layers}


@dataclasses.dataclass(frozen=True)
class Point:
    """A published run: its step and the time it took."""

    id: str
    source_group: str
    step: Step
    published_s: float
    params: float
    task: str

    @property
    def efficiency(self) -> float:
        """Compute bound / published step: the share of peak the run reached."""
        return self.step.compute_s / self.published_s

    @property
    def size_class(self) -> str:
        return "<1B" if self.params < 1e9 else "1-10B" if self.params < 1e10 else \
            "10-100B" if self.params < 1e11 else ">=100B"

    @property
    def chip_family(self) -> str:
        for name in ("A100", "H100", "H200", "v4", "v5 lite", "v5", "v6 lite"):
            if name in self.step.device:
                return {"v5 lite": "TPU v5e", "v5": "TPU v5p", "v6 lite": "TPU v6e",
                        "v4": "TPU v4"}.get(name, name)
        return self.step.device


def shape_of(point: dict) -> flops_lib.Shape:
    """The published model's shape as ``jaxaccel.flops`` reads an architecture; its attention
    causal and its layers pre-norm as its family's (``models.spec.FAMILIES``: a published
    ``llama`` is a pre-norm decoder, as GPT, MPT and Llama are; ``bert`` post-norm)."""
    d = point["d_model"]
    head = point["head_weights"] if "head_weights" in point else point["vocab"] * d
    return flops_lib.Shape(
        hidden=d, layers=point["layers"], heads=point["heads"], kv_heads=point["kv_heads"],
        head_dim=point.get("head_dim") or d // point["heads"], intermediate=point["d_ff"],
        mlp_matrices=3 if point["gated_mlp"] else 2, head_weights=head,
        causal=FAMILIES[point["family"]].causal, pre_norm=FAMILIES[point["family"]].pre_norm)


def recompute_flops(shape: flops_lib.Shape, parts, seq: int, eager: bool = False) -> float:
    """Forward FLOPs per token a remat policy recomputes: ``parts`` is "none", "full" or the
    recomputed matmuls (``RECOMPUTE_ALL``'s names; attention = QK^T and AV); a pre-norm
    layer's "w_out" counts nothing, as in ``jaxaccel.flops`` (nothing reads its result, so a
    compiled graph leaves it out), unless ``eager``: a remat that reruns each checkpointed
    block's forward as written (eager PyTorch's ``torch.utils.checkpoint``) runs it too."""
    if isinstance(parts, str):
        parts = {"none": (), "full": RECOMPUTE_ALL}[parts]
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    mlp = 2.0 * h * shape.intermediate
    forward = {"wq": 2.0 * h * q, "wk": 2.0 * h * kv, "wv": 2.0 * h * kv, "wo": 2.0 * h * q,
               "attention": shape.attention_flops(1, seq) / seq / shape.layers / 3,
               "w_gate": mlp if shape.mlp_matrices == 3 else 0.0, "w_up": mlp,
               "w_out": 0.0 if shape.pre_norm and not eager else mlp}
    unknown = set(parts) - set(forward)
    if unknown:
        raise ValueError(f"unknown recompute parts {sorted(unknown)}: expected some of "
                         f"{RECOMPUTE_ALL}, 'none' or 'full'")
    return shape.layers * sum(forward[p] for p in parts)


def step_of(shape, device: str, dtype: str, tokens: float, seq: int, recomputed: float,
            idle: float = 0.0, stages: int = 1, passes: float = 1.0,
            optimizer_bytes: float = 0.0, full: float | None = None, **variant) -> Step:
    """The ``Step`` of ``tokens`` per chip of a model of ``shape`` (a ``jaxaccel.flops``
    shape; a ViT's encoder and decoder are read as one stack) in rows of ``seq`` tokens, with
    ``recomputed`` FLOPs per token rematerialised, a share of ``full``'s, the FLOPs per token
    of a whole recompute (the planner's ``full`` where not given: an eager remat's is more)."""
    stacks = [shape] if isinstance(shape, flops_lib.Shape) else \
        [s for s in (shape.encoder, shape.decoder) if s is not None]
    rows = tokens / shape.row_tokens(seq)
    peak = devices_lib.peak_rate(device, dtype)[0] * (1.0 - idle)
    attention = flops_lib.attention_flops(shape, rows, seq)
    layers = sum(s.layers for s in stacks)
    full = flops_lib.recompute_flops(shape, rows, seq) / tokens if full is None else full
    return Step(device=device, dtype=dtype,
                dense_s=(flops_lib.train_flops(shape, rows, seq) - attention) / peak,
                attention_s=attention / peak, recompute_s=recomputed * tokens / peak,
                width=max(s.hidden for s in stacks), layers=layers / stages,
                head=sum(s.head_weights for s in stacks) / stacks[0].hidden, tokens=tokens,
                recompute=recomputed / full if full else 0.0, passes=passes,
                optimizer_bytes=optimizer_bytes, **variant)


def to_point(p: dict) -> Point:
    """A calibration point (docs/calibration.md has the fields) as the step it measured."""
    shape = shape_of(p)
    seq, chips = p["seq"], p["chips"]
    attn_seq = p.get("attention_seq", seq)  # packed documents attend within themselves
    tp, pp, cp = p.get("tp", 1), p.get("pp", 1), p.get("cp", 1)
    passes = p["global_batch"] / (p["micro_batch"] * chips // (tp * pp * cp))
    tokens = p["global_batch"] * seq / chips
    params = shape.matmul_weights + (0 if p.get("tied_embeddings") else p["vocab"] * shape.hidden)
    eager = p.get("eager_recompute", False)   # its remat reruns each block as written
    step = step_of(shape, p["device"], DTYPES[p["precision"]], tokens, attn_seq,
                   recompute_flops(shape, p.get("recompute", "none"), attn_seq, eager),
                   idle=(pp - 1) / (p.get("vp", 1) * passes + pp - 1), stages=pp,
                   passes=passes,
                   optimizer_bytes=OPTIMIZER_BYTES_PER_PARAM * params
                   / p.get("optimizer_shards", chips),
                   full=recompute_flops(shape, "full", attn_seq, eager) if eager else None,
                   power_limit_w=p.get("power_limit_w"), hbm_bandwidth=p.get("hbm_bandwidth"))
    return Point(p["id"], p["source_group"], step, tokens / p["tokens_per_s_per_chip"], params,
                 p.get("task", "pretraining"))


@functools.lru_cache(maxsize=4)
def _load(path: str) -> tuple:
    with open(path) as f:
        return tuple(to_point(p) for p in json.load(f)["points"])


def load(path: str = CALIBRATION_FILE) -> list[Point]:
    return list(_load(path))
