"""A model's layer stack: the one way every family calls its layers, and the hook through which
a schedule that runs them otherwise (the scan, the pipeline: ``jaxaccel.train.pipeline``)
takes over.

Every family's forward is embeddings -> layers -> head, and its ``__call__`` runs the layers as
``stack(x, args, key, deterministic)`` (default: ``sequential`` over its own layers), where

* ``x`` [batch, seq, hidden] are the hidden states and ``args`` a tuple of what the layers read
  besides (per-row arrays with the batch leading, or None; BERT: the attention mask and the
  unpadding plan, Llama: positions and segment ids);
* ``key`` is the layers' dropout key, one draw from the model's ``dropout`` stream (None when
  deterministic). Layer ``i`` draws from its own stream ``fold_in(key, i)`` (``layer_rngs``):
  its masks depend on its index alone, not on the draws of the layers before it, so a schedule
  that runs layer groups on different devices draws the masks the plain loop draws;
* a family's model class (``models.family.FamilyModel``) has ``layer_call(layer, x, args,
  deterministic, rngs, rows) -> x``, where ``rows`` (int [batch], or None for the whole batch)
  numbers the rows of ``x`` within the whole batch: a micro-batch given its rows' numbers
  draws exactly its rows' part of the whole batch's dropout masks (``kernels_pallas.dropout.keep_mask``), so a pipelined step
  equals the plain one with dropout on.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxaccel.forms.stacked import LAYERS, Stacked, Stacking
from jaxaccel.models import remat as remat_lib
from jaxaccel.models.family import FamilyModel
from jaxaccel.models.fp8 import quantize_kernels
from jaxaccel.sharding import residual


def layers_key(rngs: nnx.Rngs | None, deterministic: bool):
    """The layers' dropout key: one draw from ``rngs``' dropout stream (None if deterministic)."""
    return None if deterministic or rngs is None else rngs.dropout()


def layer_rngs(key, index) -> nnx.Rngs | None:
    """Layer ``index``'s dropout stream: ``nnx.Rngs(dropout=fold_in(key, index))``."""
    return None if key is None else nnx.Rngs(dropout=jax.random.fold_in(key, index))


def token_rows(rows, seq: int):
    """[batch, seq] row-major numbers of the (row, position) pairs of rows ``rows`` [batch] of
    a batch of ``seq``-token rows (what a [batch, seq, features] dropout numbers its rows by);
    None for the whole batch."""
    if rows is None:
        return None
    return jnp.asarray(rows, jnp.int32)[:, None] * seq + jnp.arange(seq, dtype=jnp.int32)


def _call(layer_call, layer, x, args, rngs, deterministic):
    return layer_call(layer, x, args, deterministic, rngs, None)


def sequential(layers, layer_call, *, remat="none"):
    """``stack(x, args, key, deterministic)``: ``layers`` one after another on the whole batch
    (``layer_call`` the family's), each rematerialised in the backward pass by the policy
    ``remat`` names (``models.remat``), the hidden states kept split over the batch axes
    (and their width over ``tensor``: ``sharding.residual``) between layers."""
    call = remat_lib.checkpoint(_call, remat, static_argnums=(0, 5), modules=True)

    def stack(x, args, key, deterministic):
        for i, layer in enumerate(layers):
            x = residual(call(layer_call, layer, x, args, layer_rngs(key, i), deterministic))
        return x
    return stack


def layer_fn(layer_graphdef, layer_call, remat="none"):
    """``fn(p, f, x, args, rows, key, index, deterministic) -> x``: one layer of a stacked
    form, ``layer_graphdef`` merged with its parameters ``p`` and fp8 state ``f`` (None
    without), run by the family's ``layer_call`` on ``x`` with layer ``index``'s dropout
    stream; rematerialised in the backward pass by the policy ``remat`` names."""
    def one(p, f, x, args, rows, key, index, deterministic):
        layer = nnx.merge(layer_graphdef, p, *(() if f is None else (f,)))
        return layer_call(layer, x, args, deterministic, layer_rngs(key, index), rows)
    return remat_lib.checkpoint(one, remat, static_argnums=(7,))


def scan_layers(fn, x, layers, fp8, args, rows, key, first, deterministic, *, count=None,
                unroll: bool = False, place=lambda h: h):
    """``x`` through the stacked ``layers`` [G, ...] (fp8 state ``fp8`` likewise, or None) by
    one ``jax.lax.scan`` of ``fn`` (``layer_fn``): layer ``j`` is the model's layer
    ``first + j``; one numbered ``count`` or more is padding and passes its input through
    (``count`` None: no padding); ``place`` constrains the hidden states between layers."""
    def body(h, xs):
        p, f, j = xs
        out = fn(p, f, h, args, rows, key, first + j, deterministic)
        if count is not None:
            out = jnp.where(first + j < count, out, h)
        return place(out), None
    size = jax.tree_util.tree_leaves(layers)[0].shape[0]
    x, _ = jax.lax.scan(body, x, (layers, fp8, jnp.arange(size)), unroll=unroll)
    return x


@dataclasses.dataclass(frozen=True)
class Scan(Stacking):
    """The ``Stacking`` of scanned layers: [layers, ...], run by one ``jax.lax.scan`` on the
    whole batch (``model.scan_layers``)."""

    layers: int

    @classmethod
    def of(cls, setting, layers: int, platform: str, remat: str) -> "Scan | None":
        """The scan ``model.scan_layers`` (``setting``) asks for on ``platform``'s devices,
        the layers rematerialised by policy ``remat`` (``ModelSpec.remat``). None (its
        default) scans on TPUs and GPUs where the layers are rematerialised, and nowhere
        else. Not on the CPU, where the scanned steps of the main job and the decoder job
        measured 5-13% slower (``bench/scan.py``). Not without remat: a scan's backward pass
        reads every residual of the layer body, stacked for all layers, where an unrolled
        stack lets XLA drop, fuse or recompute them across layers; BERT-base's step on v5e-8
        needs 12.87 GB of temporaries and 63.3 GB of HBM traffic a chip scanned against 5.28
        and 37.3 unrolled. With remat a layer keeps what its policy names, and one compiled
        layer body compiles several times faster (MaxText's ``llama-1b`` step on v5e-8, full
        remat: 61 against 261 CPU seconds, 4.22 against 5.45 GB of temporaries); a shallow
        model may still need less memory unrolled (BERT-base, full remat: 1.31 against 2.24
        GB), where ``model.scan_layers=false`` says so (docs/reports/scale-out.md)."""
        scan = platform != "cpu" and remat != "none" if setting is None else setting
        return cls(layers) if scan else None

    @property
    def shape(self) -> tuple:
        return (self.layers,)

    @property
    def lead(self) -> tuple:
        return (None,)

    def layer(self, i: int) -> int:
        return i

    def stack(self, model: FamilyModel, layers, fp8):
        def run(x, args, key, deterministic):
            # fp8: the kernels quantized once for all layers, before the loop.
            graphdef, f = ((nnx.graphdef(model.layers[0]), None) if fp8 is None else
                           quantize_kernels(model.layers[0], layers, fp8))
            fn = layer_fn(graphdef, type(model).layer_call, model.spec.remat)
            return scan_layers(fn, x, layers, f, args, None, key, 0, deterministic,
                               place=residual)
        return run


def merge(graphdef, params, fp8=None):
    """``(model, stack)``: the model of ``graphdef`` with ``params`` and the fp8 state
    ``fp8`` (per layer, as a train state holds it; None without the fp8 policy), and the
    ``stack`` to call it with: None (its own loop) for the model's tree; for the stacked form
    (``forms.stacked.Stacked``) its stacking's, the model's layers then holding placeholders
    the stack never reads and ``fp8`` stacked alike."""
    if not isinstance(params, Stacked):
        return nnx.merge(graphdef, params, *(() if fp8 is None else (fp8,))), None
    stacking = params.stacking
    if fp8 is not None:
        # A padding layer's scales are a real layer's (zero scales would quantize to NaN,
        # which its zero cotangent does not cancel), and give that layer no gradient.
        fp8 = Stacked.create(stacking, fp8, jax.lax.stop_gradient(fp8[LAYERS][0]))

    def placeholders(stacked):
        first = jax.tree_util.tree_map(lambda a: a[(0,) * len(stacking.shape)], stacked.layers)
        return {**stacked.rest, LAYERS: {l: first for l in range(stacking.layers)}}
    model = nnx.merge(graphdef, *(placeholders(t) for t in (params, fp8) if t is not None))
    return model, stacking.stack(model, params.layers, None if fp8 is None else fp8.layers)


__all__ = ["Scan", "layer_fn", "layer_rngs", "layers_key", "merge", "scan_layers",
           "sequential", "token_rows"]
