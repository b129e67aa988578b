"""N-gram baselines of a causal-LM config: the perplexity a count table gets on the very
next-token targets the trainer's evaluation scores.

    python bench/ngram.py --config configs/canterbury_lm.py [--set data.tokenizer_vocab=4096]

The documents of the config's train and eval splits are tokenized as the trainer tokenizes
them (``run_tokenizer.tokenizer_dir``: the corpus's BPE of ``data.tokenizer_vocab`` tokens, or the
model's tokenizer; each document ends with EOS). A target is every token whose predecessor is
in the same document, exactly the ``target_weights`` of ``packing.pack``: (tokens - documents)
targets, whatever the row length. Models, all counted on the train split:

* ``unigram``: add-one (Laplace) over the vocabulary of the tokenizer;
* ``bigram``: 0.6 x maximum-likelihood bigram + 0.4 x the unigram (the interpolation the
  README's reference point has always used);
* ``bigram_best``: the same with the interpolation weight that is best on the eval split
  itself (a grid of 0.05): an optimistic bigram, no held-out choice;
* ``kn_trigram``: interpolated Kneser-Ney trigram (discount 0.75, continuation counts for the
  lower orders, add-one unigram floor): the strongest count model here.

Prints one JSON object: the tokenizer's size, token and target counts, each perplexity, and
each as bits per byte of the targets' text (``bits_per_byte``: what compares tokenizers; a
run's own perplexity converts with the same ``eval_targets`` and ``eval_target_bytes``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DISCOUNT = 0.75


def documents(cfg) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Token ids of the train and eval splits' documents (EOS appended) and each token id's
    length in UTF-8 bytes (0 for special tokens)."""
    from jaxaccel.data import load_corpus
    from jaxaccel.data.packing import tokenize_documents
    from jaxaccel.data.pipeline import load_tokenizer
    from jaxaccel.data.run_tokenizer import tokenizer_dir
    from jaxaccel.train.run import resolve

    d = cfg.data
    tokenizer = load_tokenizer(tokenizer_dir(resolve(cfg).data))
    corpus = load_corpus(d.name, data_dir=d.data_dir or None, splits=("train", d.eval_split))
    special = set(tokenizer.all_special_ids)
    nbytes = np.array([0 if i in special else len(tokenizer.decode([i]).encode())
                       for i in range(len(tokenizer))], np.int64)
    return (tokenize_documents(tokenizer, corpus["train"]),
            tokenize_documents(tokenizer, corpus[d.eval_split]), nbytes)


def pairs(docs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(previous-but-one, previous, target) of every target; -1 where a document has no
    previous-but-one token."""
    two, one, tgt = [], [], []
    for doc in docs:
        doc = np.asarray(doc, np.int64)
        if len(doc) < 2:
            continue
        tgt.append(doc[1:])
        one.append(doc[:-1])
        two.append(np.concatenate([[-1], doc[:-2]]))
    return np.concatenate(two), np.concatenate(one), np.concatenate(tgt)


def perplexity(probs: np.ndarray) -> float:
    return float(math.exp(-np.mean(np.log(probs))))


def bits_per_byte(ppl: float, targets: int, target_bytes: int) -> float:
    """A per-target perplexity as bits per byte of the targets' text: comparable across
    tokenizers (a smaller vocabulary makes more, easier targets of the same text)."""
    return targets * math.log2(ppl) / target_bytes


def baselines(train: list[np.ndarray], evals: list[np.ndarray], nbytes: np.ndarray) -> dict:
    vocab = len(nbytes)
    tokens = np.concatenate([np.asarray(d, np.int64) for d in train])
    unigram = (np.bincount(tokens, minlength=vocab) + 1.0) / (len(tokens) + vocab)
    _, prev, tgt = pairs(train)
    e_two, e_prev, e_tgt = pairs(evals)
    big = Counter(zip(prev.tolist(), tgt.tolist()))
    ctx = np.bincount(prev, minlength=vocab).astype(np.float64)
    ml = np.array([big.get((p, t), 0) for p, t in zip(e_prev.tolist(), e_tgt.tolist())],
                  np.float64)
    ml = np.divide(ml, ctx[e_prev], out=np.zeros_like(ml), where=ctx[e_prev] > 0)
    uni = unigram[e_tgt]
    grid = {round(w, 2): perplexity(w * ml + (1 - w) * uni) for w in np.arange(0.0, 0.96, 0.05)}
    best = min(grid, key=grid.get)
    ppl = {"unigram": perplexity(uni), "bigram": perplexity(0.6 * ml + 0.4 * uni),
           "bigram_best": grid[best],
           "kn_trigram": perplexity(kneser_ney(train, e_two, e_prev, e_tgt, unigram))}
    target_bytes = int(nbytes[e_tgt].sum())
    return {"vocab": vocab, "train_tokens": int(len(tokens)), "eval_targets": int(len(e_tgt)),
            "eval_target_bytes": target_bytes, "perplexity": ppl, "bigram_best_weight": best,
            "bits_per_byte": {k: bits_per_byte(v, len(e_tgt), target_bytes)
                              for k, v in ppl.items()}}


def kneser_ney(train, e_two, e_prev, e_tgt, unigram) -> np.ndarray:
    """Interpolated Kneser-Ney probabilities of the eval targets (trigram, module doc)."""
    two, prev, tgt = pairs(train)
    tri = Counter(zip(two.tolist(), prev.tolist(), tgt.tolist()))
    big = Counter(zip(prev.tolist(), tgt.tolist()))
    tri_ctx, tri_types = Counter(), Counter()
    for (a, b, _), n in tri.items():
        tri_ctx[a, b] += n
        tri_types[a, b] += 1
    # lower orders on continuation counts: in how many contexts a (prev, tgt) / tgt was seen
    cont_big = Counter((b, c) for (_, b, c) in tri)
    cont_ctx, cont_types = Counter(), Counter()
    for (b, _), n in cont_big.items():
        cont_ctx[b] += n
        cont_types[b] += 1
    cont_uni = Counter(c for (_, c) in big)
    n_big_types = len(big)
    vocab = len(unigram)
    p_uni = {c: n / n_big_types for c, n in cont_uni.items()}
    floor = 1.0 / vocab
    out = np.empty(len(e_tgt))
    for i, (a, b, c) in enumerate(zip(e_two.tolist(), e_prev.tolist(), e_tgt.tolist())):
        p1 = 0.9 * p_uni.get(c, 0.0) + 0.1 * floor
        n_ctx = cont_ctx.get(b, 0)
        if n_ctx:
            p2 = (max(cont_big.get((b, c), 0) - DISCOUNT, 0.0)
                  + DISCOUNT * cont_types[b] * p1) / n_ctx
        else:
            p2 = p1
        n_tri = tri_ctx.get((a, b), 0)
        if n_tri:
            p3 = (max(tri.get((a, b, c), 0) - DISCOUNT, 0.0)
                  + DISCOUNT * tri_types[a, b] * p2) / n_tri
        else:
            p3 = p2
        out[i] = p3
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "canterbury_lm.py"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    from jaxaccel import config as config_lib

    cfg = config_lib.load(args.config, args.set)
    train, evals, nbytes = documents(cfg)
    print(json.dumps(baselines(train, evals, nbytes)))


if __name__ == "__main__":
    sys.exit(main())
