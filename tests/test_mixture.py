"""Weighted mixtures of corpora (data.name=mixture, jaxaccel.data.mixing): the weights kept over
a long stream, each source read in its own order and never twice in an epoch, exact mid-epoch
resume, disjoint process shares, bad mixtures refused, and the mixture end to end through the
CLI (data prepare, data show, train and its resume)."""
import numpy as np

from jaxaccel.data.mixing import BLOCK, Interleave, MixedBatches
from jaxaccel.data.packing import KEYS, PackedBatches

WEIGHTS = [5, 3, 2]


def test_the_interleave_keeps_the_weights_and_each_sources_order():
    """Over 100 blocks the proportions are the weights (to 1/BLOCK); each source's rows come in
    its own order 0, 1, 2, ...; any stretch of the stream is located as the whole stream has
    it; the order is the seed's."""
    mix, n = Interleave(WEIGHTS, seed=7), 100 * BLOCK + 123
    source, row = mix.locate(0, n)
    share = np.bincount(source) / n
    np.testing.assert_allclose(share, np.array(WEIGHTS) / sum(WEIGHTS), atol=0.01)
    np.testing.assert_allclose(share, np.array(WEIGHTS) / sum(WEIGHTS), atol=1.5 / BLOCK)
    for c in range(3):
        np.testing.assert_array_equal(row[source == c], np.arange((source == c).sum()))
        assert mix.row_of(c, 1000) == np.flatnonzero(source == c)[1000]
    np.testing.assert_array_equal(mix.taken(n), np.bincount(source))
    part = Interleave(WEIGHTS, seed=7).locate(5 * BLOCK - 10, 5 * BLOCK + 10)
    np.testing.assert_array_equal(part[0], source[5 * BLOCK - 10:5 * BLOCK + 10])
    np.testing.assert_array_equal(part[1], row[5 * BLOCK - 10:5 * BLOCK + 10])
    assert not np.array_equal(Interleave(WEIGHTS, seed=8).locate(0, BLOCK)[0], source[:BLOCK])


def _docs(seed, n):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 100, rng.integers(2, 40)).astype(np.int32) for _ in range(n)]


def test_mixed_batches_read_each_source_once_an_epoch_resume_and_split_over_processes():
    """Each source's rows, in the order of the stream, are that source's own packed rows epoch
    after epoch (a run of it alone); the epoch ends as the first source runs out and the next
    goes on where it stopped; batches from any step equal the uninterrupted ones; two
    processes' rows are disjoint halves of every batch."""
    docs = [_docs(0, 300), _docs(1, 60), _docs(2, 150)]
    mixed = MixedBatches(docs, WEIGHTS, 16, 8, seed=3)
    epochs = [list(mixed.batches(e)) for e in (0, 1)]
    per = mixed.steps_per_epoch
    assert len(epochs[0]) == per > 0 and mixed.rows_per_epoch == per * 8
    order = np.concatenate([mixed.sources_of(e, s) for e in (0, 1) for s in range(per)])
    taken = mixed.taken()
    np.testing.assert_array_equal(taken, np.bincount(order[:per * 8], minlength=3))
    first = mixed.first_out
    assert taken[first] <= mixed.rows[first] < taken[first] + 8     # it runs out within a batch
    assert np.all(taken <= mixed.rows)                               # no row twice an epoch
    for c, d in enumerate(docs):
        alone = PackedBatches(d, 16, 8, seed=3)
        own = np.concatenate([alone.rows(e)["input_ids"] for e in range(3)])
        got = np.concatenate([b["input_ids"] for b in epochs[0] + epochs[1]])[order == c]
        np.testing.assert_array_equal(got, own[:len(got)])
    for e in (0, 1):
        for start in (1, per // 2, per - 1):
            for a, b in zip(mixed.batches(e, start), epochs[e][start:]):
                assert all(np.array_equal(a[k], b[k]) for k in KEYS)
        halves = [list(MixedBatches(docs, WEIGHTS, 16, 8, seed=3, process_index=p,
                                    process_count=2).batches(e)) for p in (0, 1)]
        for step, whole in enumerate(epochs[e]):
            for k in KEYS:
                np.testing.assert_array_equal(
                    np.concatenate([halves[0][step][k], halves[1][step][k]]), whole[k])
