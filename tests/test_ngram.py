"""The n-gram baselines the decoder job is compared with (bench/ngram.py)."""
import math
import sys

import numpy as np
import pytest

from support import ROOT

sys.path.insert(0, ROOT)

from bench.ngram import baselines, kneser_ney, pairs  # noqa: E402

TRAIN = [np.array(d) for d in ([1, 2, 3, 0], [1, 2, 4, 2, 3, 0], [3, 4, 0], [2, 2, 1, 0])]
VOCAB = 6            # id 5 never occurs: the smoothing must still give it mass


def test_targets_are_the_packed_rows_targets():
    """Every token whose predecessor is in the same document, as packing.pack weights them."""
    two, prev, tgt = pairs(TRAIN)
    assert len(tgt) == sum(len(d) - 1 for d in TRAIN)
    assert list(tgt[:3]) == [2, 3, 0] and list(prev[:3]) == [1, 2, 3]
    assert list(two[:3]) == [-1, 1, 2]      # no previous-but-one at a document's start


def test_kneser_ney_is_a_distribution_in_every_context():
    unigram = np.full(VOCAB, 1.0 / VOCAB)
    for a, b in [(1, 2), (2, 2), (-1, 3), (4, 5), (5, 5)]:   # seen, seen, start, unseen
        probs = kneser_ney(TRAIN, np.full(VOCAB, a), np.full(VOCAB, b), np.arange(VOCAB),
                           unigram)
        assert probs.min() > 0 and probs.sum() == pytest.approx(1.0), (a, b, probs)


def test_bigram_interpolates_counts_with_the_add_one_unigram():
    nbytes = np.ones(VOCAB, np.int64)
    nbytes[0] = 0                                  # EOS: no text
    got = baselines(TRAIN, [np.array([1, 2, 5, 0])], nbytes)
    tokens = np.concatenate(TRAIN)
    uni = (np.bincount(tokens, minlength=VOCAB) + 1) / (len(tokens) + VOCAB)
    # 1 is a context 3 times, followed by 2 twice; 2->5 never; 5 never a context
    p = [0.6 * 2 / 3 + 0.4 * uni[2], 0.4 * uni[5], 0.4 * uni[0]]
    assert got["perplexity"]["bigram"] == pytest.approx(math.exp(-np.mean(np.log(p))))
    assert got["perplexity"]["unigram"] == pytest.approx(
        math.exp(-np.mean(np.log(uni[[2, 5, 0]]))))
    assert got["eval_targets"] == 3 and got["eval_target_bytes"] == 2
    assert got["bits_per_byte"]["bigram"] == pytest.approx(
        3 * math.log2(got["perplexity"]["bigram"]) / 2)
