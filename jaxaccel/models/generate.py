"""Sampling from a causal LM with a KV cache: greedy, temperature, top-k; batched over prompts.

    sampler = Sampler(model)                                  # jits prefill and decode once
    new_ids = sampler([[5, 9, 2], [7]], max_new_tokens=20, temperature=0.8, top_k=40, seed=0)

Prompts of different lengths are left-padded into one batch: row ``i``'s prompt of ``n_i``
tokens fills the last ``n_i`` slots, its positions are 0 .. n_i - 1 and the padding slots get
segment 0, so no token ever attends to them and every row computes what it would alone.
``prompts_of(input_ids, attention_mask)`` turns a padded array (left- or right-padded, or any
0/1 mask) into such prompt lists.

One step after the prompt (one jitted prefill over the padded prompts), each step appends one
token per row to the cache (one jitted decode step, the cache donated) and samples the next:

    greedy (temperature 0):  argmax_v logits_v
    otherwise:               v ~ softmax(logits / temperature), restricted to the top_k
                             largest logits when top_k > 0

with the key ``fold_in(PRNGKey(seed), step)``, so a seed reproduces a sample. A row stops at
``eos_id`` (not returned); the batch stops when every row has.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxaccel.models.family import FamilyModel
from jaxaccel.padding import padded_length



def prompts_of(input_ids, attention_mask) -> list[list[int]]:
    """The prompts of a padded batch: each row's tokens where its mask is 1."""
    ids, mask = np.asarray(input_ids), np.asarray(attention_mask).astype(bool)
    return [row[m].tolist() for row, m in zip(ids, mask)]


def _sample(logits, key, temperature: float, top_k: int):
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits).astype(jnp.int32)


SEEDS = 2 ** 32
"""Seeds are in [0, SEEDS): ``jax.random.PRNGKey`` keeps a seed's low 32 bits (with 64-bit
types off), so 2**32 draws what 0 draws and -1 what 2**32 - 1 does."""


def check_sampling(temperature: float, top_k: int, vocab_size: int, seed: int = 0) -> None:
    """Refuse sampling settings that sample something else than asked: a temperature that is
    not a finite number >= 0 (nan turns every logit into nan, and what is drawn from those is
    no distribution: the probe got empty texts; inf flattens the distribution to uniform), a
    top_k outside 0 .. ``vocab_size`` (beyond it JAX's top_k fails with its own words), or a
    seed outside [0, ``SEEDS``) (another seed's sample, or an ``OverflowError``)."""
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature} must be a finite number >= 0 (0: greedy; "
                         "around 0.7-1.0 for sampling); inf would sample uniformly and nan "
                         "nothing at all.")
    if not 0 <= top_k <= vocab_size:
        raise ValueError(f"top_k={top_k} must be between 0 (no top-k cut) and the model's "
                         f"vocabulary of {vocab_size} tokens; give at most {vocab_size}.")
    if not 0 <= seed < SEEDS:
        raise ValueError(f"seed={seed} is outside [0, 2**32) = [0, {SEEDS - 1}] (a seed is "
                         "32 bits: 2**32 would draw seed 0's sample); give a seed in that "
                         "range.")


class Sampler:
    """Batched sampling from ``model`` (a model that ``generates``: ``init_cache`` and a
    ``cache`` argument, e.g. ``llama.LlamaForCausalLM``); prompt batches are padded as
    training batches are (``jaxaccel.padding.padded_length``, to a multiple of
    ``pad_multiple``: the run's ``data.pad_multiple``), so few prefill lengths are compiled."""

    def __init__(self, model: FamilyModel, pad_multiple: int = 16):
        self.config, self.pad_multiple = model.config, pad_multiple
        self.init_cache = model.init_cache
        graphdef, self.state = nnx.split(model)

        def run(state, ids, positions, segment_ids, cache):
            out = nnx.merge(graphdef, state)(ids, positions, segment_ids, cache=cache)
            return out.logits[:, -1], out.cache

        self._prefill = jax.jit(run)
        self._decode = jax.jit(run, donate_argnums=4)
        self._sample = jax.jit(_sample, static_argnums=(2, 3))

    def check(self, prompts, max_new_tokens: int) -> None:
        """Refuse, before any work, what the model cannot do: empty prompts, ids outside the
        vocabulary, and a prompt plus ``max_new_tokens`` past its maximum position."""
        limit, vocab = self.config.max_position_embeddings, self.config.vocab_size
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1.")
        for i, p in enumerate(prompts):
            if not len(p):
                raise ValueError(f"prompt {i} is empty; give at least one token.")
            if len(p) + max_new_tokens > limit:
                raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens="
                                 f"{max_new_tokens} that is {len(p) + max_new_tokens} positions, "
                                 f"more than the model's max_position_embeddings={limit}. "
                                 "Shorten the prompt or lower max_new_tokens.")
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the model's "
                                 f"vocabulary [0, {vocab}); use the run's own tokenizer.")

    def __call__(self, prompts, max_new_tokens: int = 32, *, temperature: float = 0.0,
                 top_k: int = 0, seed: int = 0, eos_id: int | None = None,
                 return_logits: bool = False):
        """The new token ids of each prompt (lists of ids), and with ``return_logits`` the
        float32 logits each sampled token was drawn from ([batch, steps, vocab])."""
        check_sampling(temperature, top_k, self.config.vocab_size, seed)
        self.check(prompts, max_new_tokens)
        b = len(prompts)
        length = padded_length(max(len(p) for p in prompts), self.pad_multiple,
                               self.config.max_position_embeddings - max_new_tokens)
        ids = np.zeros((b, length), np.int32)
        segments, positions = np.zeros_like(ids), np.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, length - len(p):] = p
            segments[i, length - len(p):] = 1
            positions[i, length - len(p):] = np.arange(len(p))
        cache = self.init_cache(b, length + max_new_tokens)
        logits, cache = self._prefill(self.state, ids, positions, segments, cache)
        next_pos = np.array([len(p) for p in prompts], np.int32)[:, None]
        key = jax.random.PRNGKey(seed)
        out, seen, done = [], [], np.zeros(b, bool)
        for step in range(max_new_tokens):
            token = np.asarray(self._sample(logits, jax.random.fold_in(key, step),
                                            float(temperature), int(top_k)))
            out.append(token)
            if return_logits:
                seen.append(np.asarray(logits))
            if eos_id is not None:
                done |= token == eos_id
            if done.all() or step == max_new_tokens - 1:
                break
            logits, cache = self._decode(self.state, token[:, None], next_pos + step,
                                         np.ones((b, 1), np.int32), cache)
        tokens = np.stack(out, 1)
        new = []
        for row in tokens.tolist():
            new.append(row[:row.index(eos_id)] if eos_id in row else row)
        return (new, np.stack(seen, 1)) if return_logits else new


def generate(model, prompts, max_new_tokens: int = 32, **options):
    """``Sampler(model)(prompts, max_new_tokens, **options)`` (compiles for this call)."""
    return Sampler(model)(prompts, max_new_tokens, **options)


__all__ = ["Sampler", "check_sampling", "generate", "prompts_of"]
