"""Training tasks: what a batch holds, the model call, the loss and metrics of the train step,
and what an evaluation sums and reports. One entry per task in ``TASKS``; the model spec names
its task (``ModelSpec.task``) and the step, the loop and ``jaxaccel eval`` take that entry.

A batch holds the model's inputs (its class's ``input_keys``: token ids and masks for the
text families, ``pixels`` for ViT) and the task's ``targets``. A task's ``sums(logits, batch)``
gives three float32 sums over the batch, weighted by the batch's ``weights`` key: the
``loss_sum`` (cross entropy; MAE's reconstruction error), the ``correct`` predictions and the
total ``count`` (the weight). The train step's loss is ``loss_sum / count`` over the global
batch (micro-batches accumulate the sums), its metrics ``loss`` and ``accuracy = correct /
count``; an evaluation adds the sums over every batch and ``report``\\s from the totals.

* ``classification`` (one label per row): the model's inputs (BERT: ``input_ids``,
  ``attention_mask``, ``token_type_ids`` [B, L]; ViT: ``pixels`` [B, H, W]), ``labels`` [B],
  ``weights`` [B] (0 = padding row); logits [B, labels]; eval also tallies the confusion
  matrix (``confusion.counts``) and reports ``accuracy``, ``loss``, ``examples``, per-class
  ``precision``, ``recall``, ``f1``, ``support``, ``macro_f1`` and the ``confusion_matrix``
  (``confusion.report``).
* ``causal_lm`` (packed rows of documents): batch ``input_ids``, ``positions`` (within the
  document, from 0), ``segment_ids`` (1, 2, ... per document, 0 = padding), ``targets`` (the
  next token of the same document) [B, L] int32 and ``target_weights`` [B, L] float32 (1
  where ``targets`` is a real next token, else 0); logits [B, L, vocab]; the loss is the
  next-token cross entropy ``-sum_t w_t log p(targets_t) / sum_t w_t``; eval reports ``loss``,
  ``perplexity = exp(loss)``, token ``accuracy`` and ``tokens``. With ``train.loss_chunks``
  = N > 1 (``with_loss_chunks``; by default where the logits would be the step's peak,
  ``auto_loss_chunks``) the [B, L, vocab] float32 logits never exist whole: the
  model gives its last hidden states and head (``LMHead``) and the sums are taken over N
  chunks of L / N positions, each chunk's logits made, used and dropped (MaxText's
  vocabulary tiling), in a train step by one loop that makes the loss's gradient too
  (``_sums_in_order``), the head gathered once for all chunks (``_chunked_sums``): the same
  sums and gradients.
* ``mae`` (masked-autoencoder pretraining, ``models.vit``): batch ``pixels`` [B, H, W] and
  ``weights`` [B]; the model masks each row's patches at random and predicts them; a row's
  loss is the mean squared error over its masked patches (of the normalised patches under
  ``norm_pix_loss``), the batch's the weighted mean over rows (transformers'
  ``ViTMAEForPreTraining`` loss: every row masks as many patches); nothing is counted
  ``correct``. Eval reports ``loss`` and ``examples`` (its masks from a fixed key).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import PartitionSpec as P

from jaxaccel import sharding
from jaxaccel.models.family import FamilyModel
from jaxaccel.models.llama import head_logits
from jaxaccel.train import confusion
from kernels_pallas import registry


@dataclasses.dataclass(frozen=True)
class Task:
    """One task's entry in ``TASKS``.

    Attributes:
      name: the task's name (``ModelSpec.task``).
      targets: what a batch holds besides the model's inputs (numpy per process, leading
        dimension the rows): int32 [rows, length], except ``row_keys`` ([rows]) and
        ``weights`` (float32).
      weights: the batch key weighting the loss (its sum is ``count``).
      logits: ``logits(model, batch, deterministic, rngs[, unpad], stack=None)`` -> float32
        logits; ``unpad`` (a ``models.unpad.Capacity``) is passed only to a task that
        ``unpads``; ``stack`` runs the model's layers (``models.stack``; a pipeline's).
      unpads: whether the task's rows are padded and ``logits`` takes ``unpad``.
      sums: ``sums(logits, batch)`` -> (loss_sum, correct, count), float32 scalars.
      report: eval totals {"loss_sum", "correct", "count", **tallies} -> what eval reports.
      summary: ``(report, split)`` -> the one line ``jaxaccel train`` ends with (``split``:
        the eval split it scored, named).
      row_keys: the batch keys with one value per row rather than per token.
      counts_correct: whether ``correct`` counts anything (the train step's ``accuracy``
        metric); MAE predicts pixels, nothing is right or wrong.
      tallies: ``tallies(logits, batch)`` -> {name: int32 array} an evaluation sums over its
        batches besides the three sums (classification: the confusion matrix), or None.
      loss_chunks: the sequence chunks a causal LM's loss is taken over
        (``with_loss_chunks``; 1: the whole logits).
    """

    name: str
    targets: tuple[str, ...]
    weights: str
    logits: Callable
    sums: Callable
    report: Callable[[dict], dict]
    summary: Callable[[dict], str]
    unpads: bool = False
    row_keys: tuple[str, ...] = ()
    counts_correct: bool = True
    tallies: Callable | None = None
    loss_chunks: int = 1

    def batch_shapes(self, spec, rows: int, length: int) -> dict:
        """``{key: (shape, dtype)}`` of a batch of ``rows`` of the model of ``spec`` (its
        inputs: ``input_shapes`` of its class) with ``length`` tokens (text): what a step
        compiled ahead of its data (``jaxaccel compile``) is given."""
        inputs = spec.family.model_class().input_shapes(spec.architecture, length)
        shapes = {k: ((rows, *shape), dtype) for k, (shape, dtype) in inputs.items()}
        shapes.update({k: ((rows,) if k in self.row_keys else (rows, length),
                           jnp.float32 if k == self.weights else jnp.int32)
                       for k in self.targets})
        return shapes


def _weighted_sums(logits, labels, weights):
    """Weighted cross entropy (float32), weighted correct count, total weight."""
    w = weights.astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = (argmax(logits, jnp.any(jnp.isnan(ce))) == labels).astype(jnp.float32)
    return jnp.sum(ce * w), jnp.sum(correct * w), jnp.sum(w)


ARGMAX_BLOCK = 128


def argmax(x, has_nan=None):
    """``jnp.argmax(x, -1)``, the same indices; on the CPU in two cheap passes where the last
    axis is a multiple of ``ARGMAX_BLOCK`` longer than one block (a vocabulary): the maximum
    of each block of 128 entries, the first block holding the row's maximum (so the first
    maximum of the row lies in it), then ``jnp.argmax`` within that block. XLA:CPU computed
    the one-pass (value, index) reduction over [8, 128, 8192] logits ~7x slower than a max
    (bench/README.md, "The decoder step against the stock Hugging Face loops"). Elsewhere
    ``jnp.argmax`` itself: the two passes' ``cond`` keeps the whole logits as its operand,
    which took a pipelined llama-350m step on v5e-8 from 6.2 to 9.5 GB of temporaries.

    NaN: ``jnp.argmax`` takes a row's first NaN, while XLA:CPU's blockwise max may drop
    NaNs; ``has_nan`` (a boolean scalar, true if any NaN may be in ``x``: the cross entropy's
    rows are NaN exactly where theirs are) then selects ``jnp.argmax`` itself; None checks
    ``x``."""
    v = x.shape[-1]
    if v % ARGMAX_BLOCK or v == ARGMAX_BLOCK or registry.platform(x) != "cpu":
        return jnp.argmax(x, -1)

    def blockwise(x):
        blocks = x.reshape(*x.shape[:-1], v // ARGMAX_BLOCK, ARGMAX_BLOCK)
        first = jnp.argmax(jnp.max(blocks, -1), -1)
        inside = jnp.take_along_axis(blocks, first[..., None, None], -2)[..., 0, :]
        return (first * ARGMAX_BLOCK + jnp.argmax(inside, -1)).astype(jnp.int32)

    has_nan = jnp.any(jnp.isnan(x)) if has_nan is None else has_nan
    return jax.lax.cond(has_nan, lambda x: jnp.argmax(x, -1).astype(jnp.int32), blockwise, x)


def _classification_logits(model: FamilyModel, batch, deterministic, rngs, unpad=None, stack=None):
    extra = {} if unpad is None else {"tokens": unpad.tokens(batch["attention_mask"])}
    out = model(*(batch[k] for k in model.input_keys), deterministic=deterministic, rngs=rngs,
                stack=stack, **extra)
    return out.logits.astype(jnp.float32)


def _classification_report(t: dict) -> dict:
    n = max(t["count"], 1.0)
    return {"accuracy": t["correct"] / n, "loss": t["loss_sum"] / n, "examples": int(t["count"]),
            **confusion.report(t.get("confusion", np.zeros((0, 0))))}


def _classification_tallies(logits, batch) -> dict:
    """The batch's confusion counts, predicted as the accuracy's ``correct`` are."""
    return {"confusion": confusion.counts(argmax(logits), batch["labels"], batch["weights"],
                                          logits.shape[-1])}


def _lm_logits(model: FamilyModel, batch, deterministic, rngs, stack=None):
    out = model(batch["input_ids"], positions=batch["positions"],
                segment_ids=batch["segment_ids"], deterministic=deterministic, rngs=rngs,
                stack=stack)
    return out.logits.astype(jnp.float32)


@struct.dataclass
class LMHead:
    """A causal LM's last hidden states [B, L, hidden] and head [hidden, vocab] (compute
    dtype): its logits in ``logits_dtype``, not yet made (``with_loss_chunks``)."""

    hidden: jax.Array
    kernel: jax.Array
    logits_dtype: jnp.dtype = struct.field(pytree_node=False, default=jnp.float32)


def _lm_head(model: FamilyModel, batch, deterministic, rngs, stack=None):
    out = model(batch["input_ids"], positions=batch["positions"],
                segment_ids=batch["segment_ids"], deterministic=deterministic, rngs=rngs,
                stack=stack, head=False)
    return LMHead(out.hidden, model.head_kernel(), model.policy.logits_dtype)


def _by_chunk(a, chunks: int):
    """[B, L, ...] as [chunks, B, L / chunks, ...]: a loop's trips over sequence chunks."""
    b, length = a.shape[:2]
    return a.reshape(b, chunks, length // chunks, *a.shape[2:]).swapaxes(0, 1)


def _chunk_sums(hidden, kernel, targets, weights, chunks: int, logits_dtype):
    """``_weighted_sums`` of the logits ``hidden @ kernel``, made ``chunks`` sequence chunks at
    a time by a loop (an evaluation's; a train step's also makes their gradient,
    ``_sums_in_order``)."""
    def body(total, xs):
        h, targets, weights = xs
        logits = head_logits(h, kernel, logits_dtype).astype(jnp.float32)
        sums = _weighted_sums(logits, targets, weights)
        return tuple(t + s for t, s in zip(total, sums)), None
    zero = jnp.zeros((), jnp.float32)
    total, _ = jax.lax.scan(body, (zero, zero, zero),
                            tuple(_by_chunk(a, chunks) for a in (hidden, targets, weights)))
    return total


def _chunk_gradients(h, kernel, targets, weights, logits_dtype, groups: int = 1):
    """One chunk's sums and the gradients of its loss sum in ``h`` (float32) and ``kernel``
    (its dtype) for a cotangent of one: the operations JAX's own gradient makes (the logits'
    dot, the cross entropy's derivative, the two transposed dots accumulated in float32, the
    head's rounded to its dtype), not yet scaled by the loss sum's cotangent. The head's is
    given per group of ``groups`` equal groups of rows, [groups, hidden, vocab], not yet
    summed over them."""
    flat = h.reshape(-1, h.shape[-1])
    z = jnp.einsum("th,hv->tv", flat, kernel, preferred_element_type=jnp.float32)
    sums, vjp = jax.vjp(lambda z: _weighted_sums(
        z.astype(logits_dtype).astype(jnp.float32).reshape(*h.shape[:-1], -1), targets,
        weights), z)
    one, zero = jnp.ones((), jnp.float32), jnp.zeros((), jnp.float32)
    dz, = vjp((one, zero, zero))
    d_h = jnp.einsum("tv,hv->th", dz, kernel, preferred_element_type=jnp.float32)
    d_k = jnp.einsum("gth,gtv->ghv", flat.reshape(groups, -1, flat.shape[-1]),
                     dz.reshape(groups, -1, dz.shape[-1]), preferred_element_type=jnp.float32)
    return sums, d_h.reshape(h.shape), d_k.astype(kernel.dtype)


@struct.dataclass
class _LossGradients:
    """The loss sum's gradients made in the forward loop, not yet scaled, and the dtype the
    hidden states' is given in once scaled."""

    hidden: jax.Array
    kernel: jax.Array
    hidden_dtype: jnp.dtype = struct.field(pytree_node=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _sums_in_order(hidden, kernel, targets, weights, chunks: int, logits_dtype):
    """``_chunk_sums``, and under differentiation the same sums made by one loop that also
    makes their gradient (``_chunk_gradients``, summed over the chunks as JAX's own gradient
    of the loop sums it): each chunk's logits are made once, not again in a backward loop.
    Only the loss sum has a gradient (the correct count and the weight have none), linear in
    its cotangent, which ``_in_order_bwd`` multiplies in: the hidden states' gradient is
    rounded to their dtype once, after it, as JAX's own is; the head's, summed in its dtype,
    is rounded once more. Compiled for Llama-3 8B on a v5p-32 (FSDP 16): 8.6 TFLOP (1.9%) and
    16.7 GB of HBM bytes less a chip than the loss's logits made again backward, the same
    collectives, temporaries 10.42 GB against 10.49 (docs/reports/maxtext.md).

    The head's gradient is reduced across devices before the layers' backward pass (an order
    XLA's schedule otherwise gets wrong once the head enters the loop whole,
    ``_chunked_sums``): compiled for the same 8B step without it, the gathered head and the
    unreduced gradient (1 GiB each) were held through that pass, 13.99 GB of temporaries
    against 10.49 with it."""
    return _chunk_sums(hidden, kernel, targets, weights, chunks, logits_dtype)


def _in_order_fwd(hidden, kernel, targets, weights, chunks, logits_dtype):
    mesh, batch = sharding.batch_split(hidden)
    groups = 1 if batch is None else sharding.batch_shards(mesh)

    def body(carry, xs):
        (total, d_kernel), (h, targets, weights) = carry, xs
        sums, d_h, d_k = _chunk_gradients(h, kernel, targets, weights, logits_dtype, groups)
        return (tuple(t + s for t, s in zip(total, sums)), d_kernel + d_k), d_h
    zero = jnp.zeros((), jnp.float32)
    d_kernel = sharding.constrain(jnp.zeros((groups, *kernel.shape), kernel.dtype),
                                  ("batch", None, "vocab"))
    (total, d_kernel), d_hidden = jax.lax.scan(
        body, ((zero, zero, zero), d_kernel),
        tuple(_by_chunk(a, chunks) for a in (hidden, targets, weights)))
    d_hidden = d_hidden.swapaxes(0, 1).reshape(hidden.shape)
    return total, _LossGradients(d_hidden, d_kernel, hidden.dtype)


def _sum_groups(partial):
    """``partial`` [groups, hidden, vocab] (a gradient per batch shard, each on its devices)
    summed over its groups, as the head is laid out (``("embed", "vocab")``): one
    reduce-scatter over the batch axes that also split the head's hidden dimension (FSDP),
    an all-reduce of the scattered shares over the rest (``data``)."""
    mesh, batch = sharding.batch_split(partial)
    if batch is None:
        return partial.sum(0, dtype=partial.dtype)
    embed, vocab = sharding.mesh_spec(partial.shape[1:], ("embed", "vocab"), mesh)
    scatter = tuple(a for a in sharding.entry_axes(batch) if a in sharding.entry_axes(embed))
    rest = tuple(a for a in sharding.entry_axes(batch) if a not in scatter)

    def local(p):
        p = p[0]
        if scatter:
            p = jax.lax.psum_scatter(p, scatter, scatter_dimension=0, tiled=True)
        return jax.lax.psum(p, rest) if rest else p
    return sharding.per_shard(local, (P(batch, None, vocab),), P(scatter or None, vocab),
                              mesh=mesh)(partial)


def _in_order_bwd(chunks, logits_dtype, grads, g):
    scale = g[0]
    d_hidden = (scale * grads.hidden).astype(grads.hidden_dtype)
    d_kernel = sharding.constrain(_sum_groups(grads.kernel), ("embed", "vocab"))
    d_kernel = (scale * d_kernel).astype(grads.kernel.dtype)
    d_hidden, d_kernel = jax.lax.optimization_barrier((d_hidden, d_kernel))
    return d_hidden, d_kernel, None, None


_sums_in_order.defvjp(_in_order_fwd, _in_order_bwd)


def _chunked_sums(out: LMHead, batch, chunks: int):
    """``_chunk_sums`` of ``out``. The head enters the loops whole along its hidden dimension
    (FSDP splits it there): XLA gathers it once for both passes, not on every trip forward
    and again backward, and sums its gradient over the trips before reducing it across
    devices once. Compiled for Llama-3 8B on a v5p-32 with 8 chunks: 46.3 GB of collectives
    a chip against 77.6 when gathered per trip (docs/reports/maxtext.md)."""
    kernel = sharding.constrain(out.kernel, (None, "vocab"))
    return _sums_in_order(out.hidden, kernel, batch["targets"], batch["target_weights"],
                          chunks, out.logits_dtype)


def with_loss_chunks(task: Task, chunks: int, length: int) -> Task:
    """``task`` with its loss over ``chunks`` sequence chunks of its rows of ``length`` tokens
    (``train.loss_chunks``; module doc): itself for 1; ``ValueError`` for a task other than
    causal_lm, whose logits are per row or per patch, or a length ``chunks`` does not
    divide."""
    if chunks == 1:
        return task
    if task.name != "causal_lm":
        raise ValueError(f"train.loss_chunks={chunks}: only a causal LM's logits are "
                         f"[batch, length, vocab]; the {task.name} task's are not chunked. "
                         "Use train.loss_chunks=1.")
    if length % chunks:
        raise ValueError(f"train.loss_chunks={chunks} does not divide the rows' length "
                         f"{length} (data.max_len); use a divisor of it.")
    return dataclasses.replace(task, logits=_lm_head, sums=lambda out, b: _chunked_sums(
        out, b, chunks), loss_chunks=chunks)


CHUNK_LOGITS_BYTES = 128 * 2 ** 20
CHUNK_OF_KEPT = 0.25
LOGITS_OVER_KEPT = 1.7


def auto_loss_chunks(spec, policy, rows: int, length: int, vocab_shards: int = 1,
                     hidden_shards: int = 1) -> int:
    """``train.loss_chunks=0``: the chunks a causal LM's loss is taken over by default, given
    ``rows`` of ``length`` tokens per device, the vocabulary split ``vocab_shards`` ways and
    the residual stream's width ``hidden_shards`` ways (``sharding.residual``). Where the
    layers are rematerialised (each keeps little more than its input, [rows, length, hidden /
    hidden_shards] in the activations' dtype) and the whole float32 logits are more
    than ``LOGITS_OVER_KEPT`` times those inputs of every layer, the logits and their gradient
    are the step's peak: then the fewest chunks (a divisor of the length) whose float32 logits
    are at most ``CHUNK_OF_KEPT`` of those inputs or ``CHUNK_LOGITS_BYTES``, the larger; else
    1 (other tasks, no remat, small logits: a CPU job's). Each chunk reads the whole head and
    its gradient, so no more chunks than memory needs. From compiled steps
    (docs/reports/maxtext.md): llama-1b's logits on a v5e-8 are 1.4 times its layer inputs,
    its peak is in its layers and 8 chunks add 0.12 GB; Llama-3 8B's on a v5p-32 (one row of
    8,192) are 1.96 times, its peak is their gradient and 8 chunks (a quarter of the inputs
    each) take its temporaries from 12.95 to 10.49 GB at no cost in collectives (the head
    gathered once, ``_chunked_sums``); 32 chunks of 128 MiB take as much memory and move 126
    GB more HBM bytes. llama-350m's on a v5e-8 are 2.6 times: 8 chunks, 2.68 to 1.87 GB; over
    FSDP 4 x tensor 2 (4 rows a device, the vocabulary and the width split in two) 2.6 times
    too: 4 chunks, 1.34 to 0.96 GB, the same FLOPs, fewer HBM and collective bytes."""
    if spec.task != "causal_lm" or spec.remat == "none":
        return 1
    a = spec.architecture
    logits = 4 * rows * length * a.vocab_size / vocab_shards
    kept = rows * length * a.hidden_size // hidden_shards * a.num_hidden_layers * \
        jnp.dtype(policy.activation_dtype).itemsize
    if logits <= LOGITS_OVER_KEPT * kept:
        return 1
    chunk = max(CHUNK_LOGITS_BYTES, CHUNK_OF_KEPT * kept)
    return next(c for c in range(1, length + 1)
                if length % c == 0 and (logits / c <= chunk or c == length))


def _lm_report(t: dict) -> dict:
    n = max(t["count"], 1.0)
    loss = t["loss_sum"] / n
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "accuracy": t["correct"] / n,
            "tokens": int(t["count"])}


def _mae_logits(model: FamilyModel, batch, deterministic, rngs, stack=None):
    """``(predicted patches, mask, target patches)``, float32."""
    out = model(batch["pixels"], deterministic=deterministic, rngs=rngs, stack=stack)
    return out.logits.astype(jnp.float32), out.mask, model.target(batch["pixels"])


def _mae_sums(out, batch):
    pred, mask, target = out
    per_row = jnp.sum(jnp.mean((pred - target) ** 2, -1) * mask, -1) / \
        jnp.maximum(jnp.sum(mask, -1), 1.0)
    w = batch["weights"].astype(jnp.float32)
    return jnp.sum(per_row * w), jnp.zeros((), jnp.float32), jnp.sum(w)


def _mae_report(t: dict) -> dict:
    n = max(t["count"], 1.0)
    return {"loss": t["loss_sum"] / n, "examples": int(t["count"])}


TASKS = {
    "classification": Task(
        "classification", targets=("labels", "weights"),
        weights="weights", logits=_classification_logits,
        sums=lambda logits, b: _weighted_sums(logits, b["labels"], b["weights"]),
        report=_classification_report,
        summary=lambda r, split: f"final {split} accuracy: {r['accuracy']:.4f}, macro-F1 "
                                 f"{r['macro_f1']:.4f} ({r['examples']} examples)",
        unpads=True, row_keys=("labels", "weights"), tallies=_classification_tallies),
    "causal_lm": Task(
        "causal_lm", targets=("targets", "target_weights"),
        weights="target_weights", logits=_lm_logits,
        sums=lambda logits, b: _weighted_sums(logits, b["targets"], b["target_weights"]),
        report=_lm_report,
        summary=lambda r, split: f"final {split} loss {r['loss']:.4f}, perplexity "
                                 f"{r['perplexity']:.2f} ({r['tokens']} tokens)"),
    "mae": Task(
        "mae", targets=("weights",), weights="weights", logits=_mae_logits, sums=_mae_sums,
        report=_mae_report,
        summary=lambda r, split: f"final {split} loss {r['loss']:.4f} (masked patches' mean "
                                 f"squared error, {r['examples']} examples)",
        row_keys=("weights",), counts_correct=False),
}


def weight_sum(task: Task, batch) -> jax.Array:
    """The loss denominator of a (global) batch: its total weight, at least 1."""
    return jnp.maximum(jnp.sum(batch[task.weights].astype(jnp.float32)), 1.0)


__all__ = ["CHUNK_LOGITS_BYTES", "CHUNK_OF_KEPT", "LMHead", "LOGITS_OVER_KEPT", "TASKS", "Task",
           "auto_loss_chunks", "weight_sum", "with_loss_chunks"]
