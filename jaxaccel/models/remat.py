"""Rematerialisation policies by name (``model.remat``): what a layer keeps of its forward pass
for the backward pass, and what it computes again. MaxText's names:

=====================  =========================================  ========================
name                   kept (besides the layer's input)           recomputed in the backward
=====================  =========================================  ========================
none                   everything (no rematerialisation)          nothing
minimal                every weight matmul's output (``dots with  the elementwise ops and
                       no batch dimensions``)                     attention's core
save_dot_except_mlpwi  the attention projections' outputs and     the MLP's input
                       the MLP's output projection's              projections, attention's
                                                                  core
save_dot_except_mlp    the attention projections' outputs         the MLP, attention's core
                       (query/key/value/out)
save_qkv_proj          the query/key/value projections' outputs   the rest of the layer
minimal_offloaded      as ``minimal``, in host memory (the        as ``minimal``
                       device's ``pinned_host``) instead of HBM
full                   nothing                                    the whole layer
=====================  =========================================  ========================

``true`` and ``false`` (and None) name ``full`` and ``none``. The models tag their attention
projections' outputs with ``jax.ad_checkpoint.checkpoint_name`` (``tag``): ``query_proj``,
``key_proj``, ``value_proj``, ``out_proj``, and their MLP's output projection's: ``mlpwo``.
A policy keeps only what the backward pass reads: in a pre-norm layer (Llama, ViT) nothing in
the layer reads the MLP's output (it is added to the residual stream, the next layer's input,
kept anyway), so ``save_dot_except_mlpwi`` keeps there what ``save_dot_except_mlp`` does, and
no policy computes that projection again there (XLA leaves it out of the recompute, ``full``'s
too: the table's "whole layer" is one matmul less; ``flops.Shape.recompute_flops`` counts it
so); in BERT's post-norm layer the LayerNorm after the residual reads it.
"""
from __future__ import annotations

import dataclasses

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxaccel.models.spec import remat_name

ATTENTION_PROJ = ("query_proj", "key_proj", "value_proj", "out_proj")
QKV_PROJ = ATTENTION_PROJ[:3]
MLP_OUT = "mlpwo"
HOST = "pinned_host"


@dataclasses.dataclass(frozen=True)
class Remat:
    """A policy: ``name``, ``policy`` (``jax.checkpoint``'s; None without rematerialisation)
    and which forward matmuls the backward pass computes again (``recomputes``: of
    ``flops.RECOMPUTED``: "qkv", "out", "mlp_in", "mlp_out" and "core", attention's scores and
    context: the planner's FLOPs, which count no "mlp_out" in a pre-norm layer)."""

    name: str
    policy: object
    recomputes: tuple
    offloads: bool = False

    @property
    def on(self) -> bool:
        return self.name != "none"


POLICIES = {r.name: r for r in (       # one for each of spec.REMATS
    Remat("none", None, ()),
    Remat("minimal", jax.checkpoint_policies.dots_with_no_batch_dims_saveable, ("core",)),
    Remat("save_dot_except_mlpwi", jax.checkpoint_policies.save_only_these_names(
        *ATTENTION_PROJ, MLP_OUT), ("mlp_in", "core")),
    Remat("save_dot_except_mlp", jax.checkpoint_policies.save_only_these_names(*ATTENTION_PROJ),
          ("mlp_in", "mlp_out", "core")),
    Remat("save_qkv_proj", jax.checkpoint_policies.save_only_these_names(*QKV_PROJ),
          ("out", "mlp_in", "mlp_out", "core")),
    Remat("minimal_offloaded", jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        offload_src="device", offload_dst=HOST), ("core",), offloads=True),
    Remat("full", jax.checkpoint_policies.nothing_saveable,
          ("qkv", "out", "mlp_in", "mlp_out", "core")),
)}
# The policies from the one that keeps the most to the one that keeps the least (what
# ``jaxaccel compile --fit`` tries in turn); host offloading is beside them, not on it.
LADDER = ("none", "minimal", "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj",
          "full")


def of(value) -> Remat:
    """The policy ``value`` (a name, true/false or None: ``spec.remat_name``) names."""
    return POLICIES[remat_name(value)]


def check(value, devices) -> None:
    """``ValueError`` where the policy offloads to host memory the target's ``devices`` do not
    have."""
    remat = of(value)
    if remat.offloads and devices and not any(
            m.kind == HOST for m in devices[0].addressable_memories()):
        raise ValueError(f"model.remat={remat.name} offloads activations to host memory "
                         f"({HOST}), which {devices[0].device_kind} devices do not have here; "
                         "use model.remat=minimal.")


def checkpoint(fn, value, static_argnums=(), *, modules: bool = False):
    """``fn`` rematerialised in the backward pass by the policy ``value`` names (``fn`` itself
    under ``none``); ``modules``: ``fn`` takes NNX modules (``nnx.remat``), else arrays."""
    remat = of(value)
    if not remat.on:
        return fn
    lift = nnx.remat if modules else jax.checkpoint
    return lift(fn, static_argnums=static_argnums, policy=remat.policy)


def tag(x, name: str):
    """``x``, named for the policies (``checkpoint_name``)."""
    return checkpoint_name(x, name)


__all__ = ["LADDER", "POLICIES", "Remat", "check", "checkpoint", "of", "tag"]
