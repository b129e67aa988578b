"""Causal-LM rows: documents packed into fixed-length rows, batched per process.

Packing (``pack``) is concatenate-and-chunk, as GPT-2/nanoGPT and Hugging Face's run_clm
(``group_texts``) prepare pretraining data, plus MaxText's segment ids: the documents of an
epoch, each ending with EOS, are laid end to end and the stream is cut into rows of
``seq_len`` tokens. Nothing is padded but the end of the last row, and every token of every
document appears exactly once, in order. Within a row each document (each piece of one) is a
segment: ``segment_ids`` 1, 2, ... (0 = padding), ``positions`` from 0 at its first token, so
attention never crosses a document boundary and rotary positions restart per document. A
document that runs past the end of a row continues at the start of the next row as a new
segment whose positions start again at 0 (the model sees no context from the previous row,
as at the start of any row, so its positions are those of a fresh context); its last token in
the first row still has the document's next token as target.

Batch (numpy, this process's rows of the global batch; shape [b, L], b = global batch /
process count):

* ``input_ids`` int32: tokens (0 on padding);
* ``positions`` int32: position within the segment;
* ``segment_ids`` int32: 1, 2, ... per segment in the row, 0 on padding;
* ``targets`` int32: the next token of the same document, 0 where there is none (a
  document's EOS, padding);
* ``target_weights`` float32: 1 where ``targets`` is such a token, else 0.

``PackedBatches`` plans an epoch like ``pipeline.BatchIterator``: the documents' order is a
permutation drawn from (seed, epoch) (``shuffle``), the rows are packed from that order,
global batch ``i`` is rows [i*B, (i+1)*B), process p of P keeps rows [p*B/P, (p+1)*B/P) of
it, and ``batches(epoch, start_step)`` resumes mid-epoch with the same batches. The number of
rows depends only on the total number of tokens, so every epoch has the same steps. Rows are
made as they are asked for (``_window``: where each document of the epoch's order ends in the
stream says which pieces a row holds), from documents in memory or in a token cache
(``cached.CachedDocs``): an epoch costs 12 bytes a document, not its tokens.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from jaxaccel.data.batches import (Batches, caches_of, check_start, decoded, epoch_order,
                                   whole_steps)

KEYS = ("input_ids", "positions", "segment_ids", "targets", "target_weights")


class ListDocs:
    """Documents held in memory: ``lengths`` and ``part(i, lo, hi)``, as ``DocStore`` has them."""

    def __init__(self, docs: Sequence[np.ndarray]):
        self.docs = [np.asarray(d, np.int32) for d in docs]
        self.lengths = np.fromiter(map(len, self.docs), np.int64, len(self.docs))

    def __len__(self) -> int:
        return len(self.docs)

    def part(self, i: int, lo: int, hi: int) -> np.ndarray:
        return self.docs[i][lo:hi]


class ChainedDocs:
    """Document stores one after another, as one store (``lengths``, ``part``): a mixture's
    eval split, its sources' eval splits in turn."""

    def __init__(self, stores: Sequence):
        self.stores = list(stores)
        self.lengths = np.concatenate([s.lengths for s in self.stores])
        self._starts = np.cumsum([0] + [len(s) for s in self.stores])

    def __len__(self) -> int:
        return len(self.lengths)

    def part(self, i: int, lo: int, hi: int) -> np.ndarray:
        s = int(np.searchsorted(self._starts, i, "right")) - 1
        return self.stores[s].part(i - int(self._starts[s]), lo, hi)

    def caches(self) -> list:
        return [c for s in self.stores for c in caches_of(s)]


def _window(docs, order: np.ndarray, ends: np.ndarray, first: int, count: int,
            seq_len: int) -> dict[str, np.ndarray]:
    """Rows ``first`` .. ``first + count`` of the documents ``order`` laid end to end (``ends``:
    where each ends in that stream), keys as ``KEYS``: the window's tokens and one more (a
    row's last target may be the next row's first token)."""
    a, b = first * seq_len, (first + count) * seq_len
    ids = np.zeros(b - a + 1, np.int32)
    doc = np.full(b - a + 1, -1, np.int64)
    k = int(np.searchsorted(ends, a, "right"))
    while k < len(order) and (start := int(ends[k]) - int(docs.lengths[order[k]])) <= b:
        lo, hi = max(a, start), min(b + 1, int(ends[k]))
        ids[lo - a:hi - a] = docs.part(int(order[k]), lo - start, hi - start)
        doc[lo - a:hi - a] = k
        k += 1
    real = doc[:-1] >= 0
    same_doc_next = real & (doc[1:] == doc[:-1])
    index = np.arange(b - a)
    starts = real & ((index % seq_len == 0) | (doc[:-1] != np.roll(doc[:-1], 1)))
    segment_ids = np.cumsum(starts.reshape(-1, seq_len), axis=1).reshape(-1) * real
    positions = (index - np.maximum.accumulate(np.where(starts, index, 0))) * real
    shape = (count, seq_len)
    return {"input_ids": ids[:-1].reshape(shape),
            "positions": positions.astype(np.int32).reshape(shape),
            "segment_ids": segment_ids.astype(np.int32).reshape(shape),
            "targets": np.where(same_doc_next, ids[1:], 0).astype(np.int32).reshape(shape),
            "target_weights": same_doc_next.astype(np.float32).reshape(shape)}


def pack(docs: Sequence[np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
    """The rows [R, seq_len] of ``docs`` (int token ids, each ending with its EOS) laid end to
    end in the order given, R = ceil(total tokens / seq_len); keys as ``KEYS``."""
    if seq_len < 1:
        raise ValueError(f"pack: seq_len={seq_len}; expected >= 1.")
    store = ListDocs(docs)
    n = int(store.lengths.sum())
    if n == 0:
        raise ValueError("pack: no tokens; expected at least one non-empty document.")
    return _window(store, np.arange(len(store)), np.cumsum(store.lengths), 0, -(-n // seq_len),
                   seq_len)


class PackedBatches(Batches):
    """Epochs of packed causal-LM batches (module doc) of this process.

    docs: the documents' token ids (a list), or a store of them with ``lengths`` (int [n])
      and ``part(i, lo, hi)`` (the ids lo..hi of document i), e.g. a token cache: only the
      rows of this process's batches are read, as they are asked for."""

    def __init__(self, docs, seq_len: int, global_batch_size: int, *,
                 shuffle: bool = True, seed: int = 0, drop_remainder: bool = True,
                 process_index: int = 0, process_count: int = 1):
        if len(docs) == 0:
            raise ValueError("PackedBatches: no documents; expected a non-empty split.")
        if seq_len < 1:
            raise ValueError(f"PackedBatches: seq_len={seq_len}; expected >= 1.")
        self._share("PackedBatches", global_batch_size, process_index, process_count)
        self.docs = docs if hasattr(docs, "part") else ListDocs(docs)
        self.seq_len = seq_len
        self.shuffle, self.seed, self.drop_remainder = shuffle, seed, drop_remainder
        self.tokens = int(self.docs.lengths.sum())
        self.rows_per_epoch = -(-self.tokens // seq_len)
        self._epoch: tuple[int, np.ndarray, np.ndarray] | None = None
        if drop_remainder and self.rows_per_epoch < global_batch_size:
            raise ValueError(f"PackedBatches: {self.tokens} tokens make {self.rows_per_epoch} "
                             f"rows of {seq_len} < global_batch_size={global_batch_size} with "
                             "drop_remainder=True gives no batch; use a smaller batch or "
                             "shorter rows.")

    @property
    def steps_per_epoch(self) -> int:
        return whole_steps(self.rows_per_epoch, self.global_batch_size, self.drop_remainder)

    def batch_lengths(self, start: int, stop: int) -> set[int]:
        """The lengths of the batches ``start`` to ``stop``: every row is ``seq_len`` long."""
        return {self.seq_len} if stop > start else set()

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The documents' order in ``epoch`` (a permutation drawn from (seed, epoch)) and where
        each ends in the epoch's stream."""
        if self._epoch is None or self._epoch[0] != epoch:
            order, _ = epoch_order(len(self.docs), self.seed, epoch, self.shuffle)
            self._epoch = (epoch, order, np.cumsum(self.docs.lengths[order]))
        return self._epoch[1], self._epoch[2]

    def rows(self, epoch: int) -> dict[str, np.ndarray]:
        """Every row of ``epoch`` (all processes'), packed from that epoch's document order."""
        return self.window(epoch, 0, self.rows_per_epoch)

    def window(self, epoch: int, first: int, count: int) -> dict[str, np.ndarray]:
        """Rows ``first`` .. ``first + count`` of ``epoch`` (of all processes' rows; a mixture
        reads its sources so: ``mixing.MixedBatches``)."""
        return _window(self.docs, *self._order(epoch), first, count, self.seq_len)

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """This process's rows of each batch of ``epoch``, from ``start_step`` on; without
        drop_remainder the last batch is completed with padding rows (all weights 0)."""
        check_start(start_step, self.steps_per_epoch)
        order, ends = self._order(epoch)
        b, lo = self.global_batch_size, self.process_index * self.local_batch_size
        for step in range(start_step, self.steps_per_epoch):
            first = step * b + lo
            count = max(0, min(self.local_batch_size, self.rows_per_epoch - first))
            batch = _window(self.docs, order, ends, first, count, self.seq_len)
            short = self.local_batch_size - count
            if short:
                batch = {k: np.concatenate([v, np.zeros((short, self.seq_len), v.dtype)])
                         for k, v in batch.items()}
            yield batch

    def describe(self, label_names) -> list[str]:
        return [f"{len(self.docs):,} documents, {self.tokens:,} tokens, {self.rows_per_epoch:,} "
                f"rows of {self.seq_len}; {self.steps_per_epoch:,} steps an epoch"]

    def show_row(self, batch: dict, i: int, tokenizer, label_names) -> list[str]:
        return packed_row(batch, i, tokenizer)

    def caches(self) -> list:
        return caches_of(self.docs)


def packed_row(batch: dict, r: int, tokenizer) -> list[str]:
    """Row ``r`` of a packed batch as ``data show`` prints it: its segments, decoded, and their
    targets."""
    seg, w = batch["segment_ids"][r], batch["target_weights"][r]
    out = [f"  {int((seg > 0).sum())} tokens in {int(seg.max())} segment(s), "
           f"{int(w.sum())} targets"]
    for s in range(1, int(seg.max()) + 1):
        where = np.flatnonzero(seg == s)
        last = where[-1]
        end = ("its last token's target is the next row's first token" if w[last] else
               "ends its document (no target after its EOS)")
        out.append(f"  segment {s} (positions 0-{len(where) - 1}; {end}): "
                   f"{decoded(tokenizer, batch['input_ids'][r][where])}")
    return out


def tokenize_documents(tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """Token ids of each text (with the tokenizer's own special tokens, e.g. a Llama BOS) and
    its EOS, in one batched call. (That the ids fit the model's vocabulary is checked with the
    model: ``models.check_vocab``.)"""
    if len(texts) == 0:
        raise ValueError("tokenize_documents: no texts; expected a non-empty split.")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no EOS token; documents "
                         "need one to end them. Use a tokenizer with eos_token set.")
    eos = tokenizer.eos_token_id
    enc = tokenizer(list(texts), return_attention_mask=False, return_token_type_ids=False)
    return [np.asarray(ids if ids and ids[-1] == eos else ids + [eos], np.int32)
            for ids in enc["input_ids"]]
