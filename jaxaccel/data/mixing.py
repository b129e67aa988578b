"""Weighted mixtures: which source each row of a mixture comes from (``Interleave``), and the
packed causal-LM batches of a mixture of corpora (``MixedBatches``).

The interleave is block-deterministic, as levanter's ``MixtureDataset``
(``levanter/data/mixture.py``: ``block_size``, counts per block, a permutation per block drawn
from the block's index) makes it, with grain's counts (``MapDataset.mix``,
``transformations/mix.py``, ``_counts_per_dataset``: how many of the first ``k`` rows each
source gives, exact integers from the weights alone). The mixture's stream of rows is cut into
blocks of ``BLOCK`` rows; block ``b`` holds the rows grain's counts give each source between
rows ``b * BLOCK`` and ``(b + 1) * BLOCK``, in an order drawn from (seed, block) alone: a
counter-based draw, any block made without the ones before it. Row ``r`` of the stream, in
block ``b``, is then row ``counts(b * BLOCK)[c] + j`` of its source ``c``'s own stream (``j``:
the rows of ``c`` before it in its block): a row's source and its place in that source are
arithmetic on the row's index, never a count of the rows before it. At every block's end each
source has given its weight's share of the rows to within two rows (grain's counts are cumulative,
so a small weight needs no large block: ``BLOCK`` is smaller than levanter's 2048, and a short
epoch stays closer to the weights).

A source's own stream is its rows epoch after epoch, each epoch in the (seed, epoch) order a
run of that source alone reads (``packing.PackedBatches``); a source that runs out goes on with
its next epoch (levanter's ``restart``).

An epoch of the mixture is the whole batches of the stream before the first source runs out
(levanter's ``first_exhausted``; grain's mixed length, "elements of constituent datasets appear
at most once"): within it no row is read twice. The stream goes on: epoch
``e + 1`` continues every source where epoch ``e`` left it (the source that ran out with its
next epoch), so a source given more weight than its size repeats in later epochs, and
``train.max_steps`` sets any budget (steps x batch rows x ``data.max_len`` tokens).

Global batch ``g`` is the stream's rows [g*B, (g+1)*B) (g counted over epochs); process ``p``
of ``P`` keeps rows [g*B + p*B/P, g*B + (p+1)*B/P), and ``batches(epoch, start_step)`` resumes
mid-epoch with the same rows: all of it is arithmetic on the row index.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from fractions import Fraction

import numpy as np

from jaxaccel.data.packing import KEYS, PackedBatches

BLOCK = 256             # rows a block
_SALT = 0x6D6978        # the blocks' draws, apart from the sources' (seed, epoch) orders


def proportions(weights: Sequence[float]) -> tuple[int, ...]:
    """The weights as integers in the same ratios (exact: each weight's decimal digits)."""
    exact = [Fraction(str(w)) for w in weights]
    scale = math.lcm(*(f.denominator for f in exact))
    return tuple(int(f * scale) for f in exact)


def counts(k: int, props: Sequence[int]) -> list[int]:
    """How many of the stream's first ``k`` rows each source gives (grain's mixing counts):
    the first source ceil(k p0 / P) of them, P the proportions' sum, the others so of the rows
    it leaves; each count grows by one row at a time as ``k`` does, and stays within two rows
    of ``k`` times the source's share."""
    out, rest = [], sum(props)
    for p in props:
        left = k * (rest - p) // rest
        out.append(k - left)
        k, rest = left, rest - p
    return out


class Interleave:
    """Which source each row of the mixture's stream is from, and its row in that source's
    stream (module doc)."""

    def __init__(self, weights: Sequence[float], seed: int, block: int = BLOCK):
        if len(weights) == 0 or not all(0 < w < math.inf for w in weights):
            raise ValueError(f"Interleave: weights {list(weights)}; expected one or more, each "
                             "a finite number > 0.")
        self.props = proportions(weights)
        self.weights = np.asarray(self.props, np.float64) / sum(self.props)
        self.seed, self.block = seed, block
        self._kept: tuple = (-1, None, None)

    def _before(self, b: int) -> np.ndarray:
        """int64 [sources]: each source's rows in the blocks before block ``b``."""
        return np.asarray(counts(b * self.block, self.props), np.int64)

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block ``b``'s source of each row, and each row's row in its source's stream."""
        if self._kept[0] != b:
            first, n = self._before(b), self._before(b + 1) - self._before(b)
            order = np.random.default_rng((self.seed, _SALT, b)).permutation(self.block)
            source = np.repeat(np.arange(len(n)), n)[order]
            rank = np.empty(self.block, np.int64)
            rank[np.argsort(source, kind="stable")] = np.arange(self.block) - np.repeat(
                np.cumsum(n) - n, n)
            self._kept = (b, source, first[source] + rank)
        return self._kept[1], self._kept[2]

    def locate(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """For the stream's rows ``start`` .. ``stop``: each one's source, and its row in that
        source's stream."""
        sources, rows, k = [], [], self.block
        for b in range(start // k, -(-stop // k)):
            source, row = self._block(b)
            part = slice(max(start - b * k, 0), min(stop - b * k, k))
            sources.append(source[part])
            rows.append(row[part])
        return np.concatenate(sources), np.concatenate(rows)

    def taken(self, stop: int) -> np.ndarray:
        """int64 [sources]: each source's rows among the stream's first ``stop``."""
        full, rest = divmod(stop, self.block)
        within = np.bincount(self._block(full)[0][:rest], minlength=len(self.props)) \
            if rest else 0
        return self._before(full) + within

    def row_of(self, source: int, k: int) -> int:
        """The stream's row that is row ``k`` of ``source``'s stream."""
        low, high = 0, 1                    # the block holding it: before(low) <= k < before(high)
        while self._before(high)[source] <= k:
            low, high = high, 2 * high
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self._before(mid)[source] <= k else (low, mid)
        which, row = self._block(low)
        return low * self.block + int(np.flatnonzero((which == source) & (row == k))[0])


def epoch_rows(interleave: Interleave, rows: Sequence[int], batch: int) -> tuple[int, int]:
    """``(rows an epoch, the source that runs out first)``: the whole batches of ``batch`` rows
    of the stream before one of the sources (of ``rows`` rows each) runs out."""
    ends = [interleave.row_of(c, n) for c, n in enumerate(rows)]
    first = int(np.argmin(ends))
    return ends[first] // batch * batch, first


class MixedBatches:
    """Epochs of packed causal-LM batches (``packing`` module doc), each row from one of several
    corpora as ``weights`` say (module doc), of this process.

    docs: each source's documents (a store with ``lengths`` and ``part``, as
      ``PackedBatches`` takes), each source's rows packed from them in its own (seed, epoch)
      order."""

    def __init__(self, docs: Sequence, weights: Sequence[float], seq_len: int,
                 global_batch_size: int, *, seed: int = 0, process_index: int = 0,
                 process_count: int = 1):
        if global_batch_size % process_count or not 0 <= process_index < process_count:
            raise ValueError(f"MixedBatches: global_batch_size={global_batch_size}, "
                             f"process_index={process_index}, process_count={process_count}; "
                             "expected a batch that divides by the count, and an index below "
                             "it.")
        self.sources = [PackedBatches(d, seq_len, 1, seed=seed) for d in docs]
        self.interleave = Interleave(weights, seed)
        self.seq_len, self.global_batch_size = seq_len, global_batch_size
        self.local_batch_size = global_batch_size // process_count
        self.process_index = process_index
        self.rows = [s.rows_per_epoch for s in self.sources]
        self.rows_per_epoch, self.first_out = epoch_rows(self.interleave, self.rows,
                                                         global_batch_size)
        if not self.rows_per_epoch:
            raise ValueError(f"source {self.first_out} of the mixture runs out within the first "
                             f"batch of {global_batch_size} rows (it packs into "
                             f"{self.rows[self.first_out]} rows of {seq_len}): no whole batch "
                             "an epoch. Give it more text or less weight, or use a smaller "
                             "batch.")

    @property
    def steps_per_epoch(self) -> int:
        return self.rows_per_epoch // self.global_batch_size

    def taken(self) -> np.ndarray:
        """int64 [sources]: each source's rows in an epoch (all processes')."""
        return self.interleave.taken(self.rows_per_epoch)

    def batch_lengths(self, start: int, stop: int) -> set[int]:
        """The lengths of the batches ``start`` to ``stop``: every row is ``seq_len`` long."""
        return {self.seq_len} if stop > start else set()

    def _rows(self, epoch: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The source of each of this process's rows of ``step`` of ``epoch``, and its row in
        that source's stream."""
        first = (epoch * self.steps_per_epoch + step) * self.global_batch_size \
            + self.process_index * self.local_batch_size
        return self.interleave.locate(first, first + self.local_batch_size)

    def sources_of(self, epoch: int, step: int) -> np.ndarray:
        """The source of each of this process's rows of ``step`` of ``epoch``."""
        return self._rows(epoch, step)[0]

    def _read(self, c: int, k: int, count: int) -> dict[str, np.ndarray]:
        """Rows ``k`` .. ``k + count`` of source ``c``'s stream (its epochs one after another)."""
        pieces = []
        while count:
            epoch, row = divmod(k, self.rows[c])
            n = min(count, self.rows[c] - row)
            pieces.append(self.sources[c].window(epoch, row, n))
            k, count = k + n, count - n
        return {key: np.concatenate([p[key] for p in pieces]) for key in KEYS}

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """This process's rows of each batch of ``epoch``, from ``start_step`` on."""
        if epoch < 0 or not 0 <= start_step <= self.steps_per_epoch:
            raise ValueError(f"epoch={epoch}, start_step={start_step}; expected epoch >= 0 and "
                             f"a step in 0..{self.steps_per_epoch}.")
        for step in range(start_step, self.steps_per_epoch):
            source, row = self._rows(epoch, step)
            read = {int(c): self._read(int(c), int(row[source == c][0]),
                                       int((source == c).sum())) for c in np.unique(source)}
            batch = {}
            for key in KEYS:
                batch[key] = np.empty((len(source), self.seq_len), read[int(source[0])][key].dtype)
                for c, rows in read.items():
                    batch[key][source == c] = rows[key]
            yield batch


__all__ = ["BLOCK", "Interleave", "MixedBatches", "counts", "epoch_rows", "proportions"]
