"""Weighted mixtures: which source each row of a mixture comes from (``Interleave``,
``Mixture``), and the batches of a mixture of corpora (``MixedBatches``: packed causal-LM
rows) or of labelled texts (``MixedExamples``: padded classification rows).

The interleave is block-deterministic, as levanter's ``MixtureDataset``
(``levanter/data/mixture.py``: ``block_size``, counts per block, a permutation per block drawn
from the block's index) makes it, with grain's counts (``MapDataset.mix``,
``transformations/mix.py``, ``_counts_per_dataset``: how many of the first ``k`` rows each
source gives, exact integers from the weights alone). The mixture's stream of rows is cut into
blocks of ``block`` rows, one a global batch; block ``b`` holds the rows grain's counts give
each source between rows ``b * block`` and ``(b + 1) * block``, in an order drawn from (seed,
block) alone: a counter-based draw, any block made without the ones before it. Row ``r`` of the
stream, in block ``b``, is then row ``counts(b * block)[c] + j`` of its source ``c``'s own
stream (``j``: the rows of ``c`` before it in its block): a row's source and its place in that
source are arithmetic on the row's index, never a count of the rows before it. grain's counts
are cumulative, so every batch holds each source's share of its rows, and at every batch's end
each source has given its share of the rows so far to within two rows, however small its
weight or short the epoch (levanter's fixed counts a block of 2048 refuse a weight below one
row a block, and drift within a block).

A source's own stream is its rows epoch after epoch (a corpus's packed rows, a labelled split's
examples), each epoch in the (seed, epoch) order a run of that source alone reads
(``packing.PackedBatches``; ``pipeline.BatchIterator`` without length buckets); a source that
runs out goes on with its next epoch (levanter's ``restart``).

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

from jaxaccel.data.batches import Batches, caches_of, epoch_order
from jaxaccel.data.packing import KEYS, PackedBatches, packed_row
from jaxaccel.data.pipeline import BatchIterator, Tokenized

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
    stream (module doc), in blocks of ``block`` rows."""

    def __init__(self, weights: Sequence[float], seed: int, block: int):
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
        kept = self._kept                   # one read: batches are made in another thread
        if kept[0] != b:
            first, n = self._before(b), self._before(b + 1) - self._before(b)
            order = np.random.default_rng((self.seed, _SALT, b)).permutation(self.block)
            source = np.repeat(np.arange(len(n)), n)[order]
            rank = np.empty(self.block, np.int64)
            rank[np.argsort(source, kind="stable")] = np.arange(self.block) - np.repeat(
                np.cumsum(n) - n, n)
            kept = self._kept = (b, source, first[source] + rank)
        return kept[1], kept[2]

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


class Mixture:
    """The stream of sources of ``sizes`` rows an epoch each, cut into global batches (module
    doc): the epoch's length, and where each row of a step comes from."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], global_batch_size: int,
                 seed: int, process_index: int = 0, process_count: int = 1):
        if global_batch_size % process_count or not 0 <= process_index < process_count:
            raise ValueError(f"a mixture's global_batch_size={global_batch_size}, "
                             f"process_index={process_index}, process_count={process_count}; "
                             "expected a batch that divides by the count, and an index below "
                             "it.")
        self.sizes = list(sizes)
        self.interleave = Interleave(weights, seed, global_batch_size)
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // process_count
        self.process_index = process_index
        self.rows_per_epoch, self.first_out = epoch_rows(self.interleave, self.sizes,
                                                         global_batch_size)
        if not self.rows_per_epoch:
            raise ValueError(f"source [{self.first_out}] of the mixture runs out within the "
                             f"first batch of {global_batch_size} rows (it has "
                             f"{self.sizes[self.first_out]} rows: examples, or packed rows of a "
                             "corpus): no whole batch an epoch. Give it more data or less "
                             "weight, or use a smaller batch.")

    @property
    def steps_per_epoch(self) -> int:
        return self.rows_per_epoch // self.global_batch_size

    def taken(self) -> np.ndarray:
        """int64 [sources]: each source's rows in an epoch (all processes')."""
        return self.interleave.taken(self.rows_per_epoch)

    def epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Every row of ``epoch`` (all processes'): its source, and its row in that source's
        stream."""
        return self.interleave.locate(epoch * self.rows_per_epoch,
                                      (epoch + 1) * self.rows_per_epoch)

    def rows(self, epoch: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """This process's rows of ``step`` of ``epoch``: each one's source, and its row in that
        source's stream."""
        first = epoch * self.rows_per_epoch + step * self.global_batch_size \
            + self.process_index * self.local_batch_size
        return self.interleave.locate(first, first + self.local_batch_size)

    def pieces(self, source: np.ndarray, row: np.ndarray) -> Iterator[tuple[int, np.ndarray,
                                                                         list]]:
        """For each source of a stretch of the stream (``(source, row)`` as ``rows`` and
        ``epoch`` give them, where each source's rows follow one another in its own stream):
        the source, where its rows are, and the runs of its own epochs they read, ``(epoch,
        first, count)`` in order (a source that runs out goes on with its next epoch)."""
        for c in np.unique(source):
            where, size = source == c, self.sizes[c]
            k, count, runs = int(row[where][0]), int(where.sum()), []
            while count:
                epoch, first = divmod(k, size)
                n = min(count, size - first)
                runs.append((epoch, first, n))
                k, count = k + n, count - n
            yield int(c), where, runs

    def check_step(self, epoch: int, start_step: int) -> None:
        """An epoch >= 0 and a step of it to start at (``batches(epoch, start_step)``)."""
        if epoch < 0 or not 0 <= start_step <= self.steps_per_epoch:
            raise ValueError(f"epoch={epoch}, start_step={start_step}; expected epoch >= 0 and "
                             f"a step in 0..{self.steps_per_epoch}.")


class Mixed:
    """What a mixture's batches (``MixedBatches``, ``MixedExamples``) say of their sources
    (``source_names``, one a source): the epoch and each source's share of it
    (``Batches.describe``), and each row's source (``Batches.row_sources``)."""

    mixture: Mixture
    source_names: Sequence[str]

    def _source_facts(self, i: int) -> str:
        """What source ``i`` holds (documents or examples, tokens)."""
        raise NotImplementedError

    def describe(self, label_names) -> list[str]:
        mix, names = self.mixture, self.source_names
        lines = [f"a mixture of {len(mix.sizes)} sources; {self.steps_per_epoch:,} steps an "
                 f"epoch, until [{mix.first_out}] {names[mix.first_out]} runs out (each source "
                 "then goes on, one that runs out with its next epoch's order)"]
        for i, taken in enumerate(mix.taken()):
            lines.append(f"  [{i}] {names[i]}, weight {mix.interleave.weights[i]:.3f}: "
                         f"{self._source_facts(i)}; {taken:,} rows an epoch, "
                         f"{taken / mix.rows_per_epoch:.3f} of them")
        return lines

    def row_sources(self, epoch: int, step: int) -> list[str]:
        return [f"[{c}] {self.source_names[c]}" for c in self.mixture.rows(epoch, step)[0]]


class MixedBatches(Mixed, Batches):
    """Epochs of packed causal-LM batches (``packing`` module doc), each row from one of several
    corpora as ``weights`` say (module doc), of this process.

    docs: each source's documents (a store with ``lengths`` and ``part``, as
      ``PackedBatches`` takes), each source's rows packed from them in its own (seed, epoch)
      order; ``source_names``: the sources' names, for what the data commands say."""

    def __init__(self, docs: Sequence, weights: Sequence[float], seq_len: int,
                 global_batch_size: int, *, seed: int = 0, process_index: int = 0,
                 process_count: int = 1, source_names: Sequence[str] = ()):
        self.sources = [PackedBatches(d, seq_len, 1, seed=seed) for d in docs]
        self.mixture = Mixture([s.rows_per_epoch for s in self.sources], weights,
                               global_batch_size, seed, process_index, process_count)
        self.seq_len, self.global_batch_size = seq_len, global_batch_size
        self.source_names = tuple(source_names) or tuple(map(str, range(len(docs))))

    @property
    def steps_per_epoch(self) -> int:
        return self.mixture.steps_per_epoch

    def batch_lengths(self, start: int, stop: int) -> set[int]:
        """The lengths of the batches ``start`` to ``stop``: every row is ``seq_len`` long."""
        return {self.seq_len} if stop > start else set()

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """This process's rows of each batch of ``epoch``, from ``start_step`` on."""
        self.mixture.check_step(epoch, start_step)
        for step in range(start_step, self.steps_per_epoch):
            source, row = self.mixture.rows(epoch, step)
            batch = {}
            for c, where, runs in self.mixture.pieces(source, row):
                read = [self.sources[c].window(*run) for run in runs]
                for key in KEYS:
                    rows = np.concatenate([r[key] for r in read])
                    batch.setdefault(key, np.empty((len(source), self.seq_len), rows.dtype))
                    batch[key][where] = rows
            yield batch

    def _source_facts(self, i: int) -> str:
        s = self.sources[i]
        return (f"{len(s.docs):,} documents, {s.tokens:,} tokens, {s.rows_per_epoch:,} rows of "
                f"{self.seq_len}")

    def show_row(self, batch: dict, i: int, tokenizer, label_names) -> list[str]:
        return packed_row(batch, i, tokenizer)

    def caches(self) -> list:
        return [c for s in self.sources for c in s.caches()]


class ChainedRows(Sequence):
    """Sequences of token id rows one after another, as one (``Tokenized.input_ids``)."""

    def __init__(self, stores: Sequence[Sequence]):
        self.stores = list(stores)
        self._starts = np.cumsum([0] + [len(s) for s in self.stores])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i):
        s = int(np.searchsorted(self._starts, i, "right")) - 1
        return self.stores[s][int(i) - int(self._starts[s])]

    def caches(self) -> list:
        return [c for s in self.stores for c in caches_of(s)]


def chained(parts: Sequence[Tokenized]) -> Tokenized:
    """Labelled splits one after another, as one: a mixture's eval split, and what
    ``MixedExamples`` picks its examples from."""
    first = parts[0]
    return Tokenized(ChainedRows([p.input_ids for p in parts]),
                     np.concatenate([p.labels for p in parts]), first.max_len, first.pad_id,
                     np.concatenate([p.row_lengths() for p in parts]))


class MixedExamples(Mixed, BatchIterator):
    """Epochs of padded labelled batches (``pipeline.BatchIterator``'s: dynamic padding, each
    process's rows), each example from one of several labelled splits as ``weights`` say
    (module doc), each split's examples in its own (seed, epoch) order; not bucketed by
    length. ``source_names``: the splits' names, for what the data commands say."""

    def __init__(self, parts: Sequence[Tokenized], weights: Sequence[float],
                 global_batch_size: int, *, seed: int = 0, pad_multiple: int = 16,
                 process_index: int = 0, process_count: int = 1,
                 source_names: Sequence[str] = ()):
        self.mixture = Mixture([len(p) for p in parts], weights, global_batch_size, seed,
                               process_index, process_count)
        self.offsets = np.cumsum([0] + [len(p) for p in parts])
        self.source_names = tuple(source_names) or tuple(map(str, range(len(parts))))
        super().__init__(chained(parts), global_batch_size, seed=seed, pad_multiple=pad_multiple,
                         process_index=process_index, process_count=process_count)

    @property
    def steps_per_epoch(self) -> int:
        return self.mixture.steps_per_epoch

    def plan(self, epoch: int) -> list[np.ndarray]:
        """The examples (indices into the chained splits) of each global batch of ``epoch``."""
        self.mixture.check_step(epoch, 0)
        source, row = self.mixture.epoch(epoch)
        index = np.empty(len(source), np.int64)
        for c, where, runs in self.mixture.pieces(source, row):
            n = self.mixture.sizes[c]
            index[where] = self.offsets[c] + np.concatenate([
                epoch_order(n, self.seed, e)[0][first:first + count]
                for e, first, count in runs])
        b = self.global_batch_size
        return [index[i:i + b] for i in range(0, len(index), b)]

    def _source_facts(self, i: int) -> str:
        lengths = self.lengths[self.offsets[i]:self.offsets[i + 1]]
        return f"{len(lengths):,} examples, {int(lengths.sum()):,} tokens"


__all__ = ["ChainedRows", "Interleave", "Mixed", "MixedBatches", "MixedExamples", "Mixture",
           "chained", "counts", "epoch_rows", "proportions"]
