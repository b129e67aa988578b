"""Training tasks: what a batch holds, the model call, the loss and metrics of the train step,
and what an evaluation sums and reports. One entry per task in ``TASKS``; the model spec names
its task (``ModelSpec.task``) and the step, the loop and ``jaxaccel eval`` take that entry.

A task's ``sums(logits, batch)`` gives three float32 sums over the batch, weighted by the
batch's ``weights`` key: the cross entropy ``loss_sum``, the ``correct`` predictions and the
total ``count`` (the weight). The train step's loss is ``loss_sum / count`` over the global
batch (micro-batches accumulate the sums), its metrics ``loss`` and ``accuracy = correct /
count``; an evaluation adds the sums over every batch and ``report``\\s from the totals.

* ``classification`` (one label per row): batch ``input_ids``, ``attention_mask``,
  ``token_type_ids`` [B, L], ``labels`` [B], ``weights`` [B] (0 = padding row); logits
  [B, labels]; eval reports ``accuracy``, ``loss``, ``examples``.
* ``causal_lm`` (packed rows of documents): batch ``input_ids``, ``positions`` (within the
  document, from 0), ``segment_ids`` (1, 2, ... per document, 0 = padding), ``targets`` (the
  next token of the same document) [B, L] int32 and ``target_weights`` [B, L] float32 (1
  where ``targets`` is a real next token, else 0); logits [B, L, vocab]; the loss is the
  next-token cross entropy ``-sum_t w_t log p(targets_t) / sum_t w_t``; eval reports ``loss``,
  ``perplexity = exp(loss)``, token ``accuracy`` and ``tokens``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class Task:
    """One task's entry in ``TASKS``.

    Attributes:
      name: the task's name (``ModelSpec.task``).
      batch_keys: what a batch holds (numpy per process, leading dimension the rows): int32
        [rows, length], except ``row_keys`` ([rows]) and ``weights`` (float32).
      weights: the batch key weighting the loss (its sum is ``count``).
      logits: ``logits(model, batch, deterministic, rngs[, unpad], stack=None)`` -> float32
        logits; ``unpad`` (a ``models.unpad.Capacity``) is passed only to a task that
        ``unpads``; ``stack`` runs the model's layers (``models.stack``; a pipeline's).
      unpads: whether the task's rows are padded and ``logits`` takes ``unpad``.
      sums: ``sums(logits, batch)`` -> (loss_sum, correct, count), float32 scalars.
      report: eval totals {"loss_sum", "correct", "count"} -> what eval reports.
      summary: a report -> the one line ``jaxaccel train`` ends with.
      row_keys: the batch keys with one value per row rather than per token.
    """

    name: str
    batch_keys: tuple[str, ...]
    weights: str
    logits: Callable
    sums: Callable
    report: Callable[[dict], dict]
    summary: Callable[[dict], str]
    unpads: bool = False
    row_keys: tuple[str, ...] = ()

    def batch_shapes(self, rows: int, length: int) -> dict:
        """``{key: (shape, dtype)}`` of a batch of ``rows`` x ``length`` tokens: what a step
        compiled ahead of its data (``jaxaccel compile``) is given."""
        return {k: ((rows,) if k in self.row_keys else (rows, length),
                    jnp.float32 if k == self.weights else jnp.int32) for k in self.batch_keys}


def _weighted_sums(logits, labels, weights):
    """Weighted cross entropy (float32), weighted correct count, total weight."""
    w = weights.astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    return jnp.sum(ce * w), jnp.sum(correct * w), jnp.sum(w)


def _classification_logits(model, batch, deterministic, rngs, unpad=None, stack=None):
    tokens = None if unpad is None else unpad.tokens(batch["attention_mask"])
    out = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"],
                deterministic=deterministic, rngs=rngs, tokens=tokens, stack=stack)
    return out.logits.astype(jnp.float32)


def _classification_report(t: dict) -> dict:
    n = max(t["count"], 1.0)
    return {"accuracy": t["correct"] / n, "loss": t["loss_sum"] / n, "examples": int(t["count"])}


def _lm_logits(model, batch, deterministic, rngs, stack=None):
    out = model(batch["input_ids"], positions=batch["positions"],
                segment_ids=batch["segment_ids"], deterministic=deterministic, rngs=rngs,
                stack=stack)
    return out.logits.astype(jnp.float32)


def _lm_report(t: dict) -> dict:
    n = max(t["count"], 1.0)
    loss = t["loss_sum"] / n
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "accuracy": t["correct"] / n,
            "tokens": int(t["count"])}


TASKS = {
    "classification": Task(
        "classification",
        batch_keys=("input_ids", "attention_mask", "token_type_ids", "labels", "weights"),
        weights="weights", logits=_classification_logits,
        sums=lambda logits, b: _weighted_sums(logits, b["labels"], b["weights"]),
        report=_classification_report,
        summary=lambda r: f"final test accuracy: {r['accuracy']:.4f} ({r['examples']} examples)",
        unpads=True, row_keys=("labels", "weights")),
    "causal_lm": Task(
        "causal_lm",
        batch_keys=("input_ids", "positions", "segment_ids", "targets", "target_weights"),
        weights="target_weights", logits=_lm_logits,
        sums=lambda logits, b: _weighted_sums(logits, b["targets"], b["target_weights"]),
        report=_lm_report,
        summary=lambda r: f"final eval loss {r['loss']:.4f}, perplexity {r['perplexity']:.2f} "
                          f"({r['tokens']} tokens)"),
}


def weight_sum(task: Task, batch) -> jax.Array:
    """The loss denominator of a (global) batch: its total weight, at least 1."""
    return jnp.maximum(jnp.sum(batch[task.weights].astype(jnp.float32)), 1.0)


__all__ = ["TASKS", "Task", "weight_sum"]
