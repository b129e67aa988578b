"""A split's rows or documents read from its token cache as batches ask for them: only the
rows of this process's batches are read (``splits``' stores for ``pipeline.Tokenized`` and
``packing.PackedBatches``).

    rows = CachedRows(cache, rows)      # Tokenized.input_ids: rows[i] is row i's ids
    docs = CachedDocs(cache, rows)      # PackedBatches' store: lengths, part(i, lo, hi)
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxaccel.data import tokencache


class CachedRows(Sequence):
    """Rows ``rows`` of a token cache, each read as it is asked for (``Tokenized.input_ids``)."""

    def __init__(self, cache: tokencache.TokenCache, rows: np.ndarray):
        self.cache, self.rows = cache, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.cache.read(int(self.rows[i]))

    def caches(self) -> list[tokencache.TokenCache]:
        return [self.cache]


class CachedDocs:
    """Documents ``rows`` of a token cache, as ``packing.PackedBatches`` reads them: their
    ``lengths`` and ``part(i, lo, hi)``."""

    def __init__(self, cache: tokencache.TokenCache, rows: np.ndarray):
        self.cache, self.rows = cache, rows
        self.lengths = cache.lengths()[rows]
        self._starts = np.asarray(cache.offsets[:-1])[rows]

    def __len__(self) -> int:
        return len(self.rows)

    def part(self, i: int, lo: int, hi: int) -> np.ndarray:
        start = int(self._starts[i])
        return self.cache.span(start + lo, start + hi)

    def caches(self) -> list[tokencache.TokenCache]:
        return [self.cache]


__all__ = ["CachedDocs", "CachedRows"]
