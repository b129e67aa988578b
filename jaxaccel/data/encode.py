"""Tokenization as a Hugging Face fast tokenizer does it, from its backend alone, so that worker
processes tokenize without importing transformers (``tokencache``).

A fast tokenizer's ``tokenizer(texts, truncation=True, max_length=L)`` is its backend's
``encode_batch(texts, add_special_tokens=True)`` with truncation set to (L, longest first,
right): ``Encoder`` does exactly that (tested equal, id for id, with ``pipeline.tokenize`` and
``packing.tokenize_documents``). Its fingerprint (``fingerprint``) is a digest of the backend's
JSON without the truncation and padding state, so the same tokenizer loaded by another class
or saved again (a run folder's copy) has the same one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json

import numpy as np


def backend_json(tokenizer) -> str:
    """The backend (``tokenizers``) JSON of a fast tokenizer, without truncation or padding."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no fast (Rust) backend; the "
                         "token cache needs one. Use a folder with tokenizer.json.")
    state = json.loads(backend.to_str())
    state["truncation"] = state["padding"] = None
    return json.dumps(state, sort_keys=True, ensure_ascii=False)


def fingerprint(tokenizer) -> str:
    """A digest of what the tokenizer does (``backend_json``)."""
    return hashlib.sha256(backend_json(tokenizer).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Encoder:
    """Token ids of texts: ``kind`` "text" truncated to ``max_len`` (labelled examples),
    "corpus" whole and ending with ``eos_id`` (documents). Picklable: the backend is rebuilt
    from its JSON on first use in each process."""

    backend: str
    kind: str
    max_len: int | None
    eos_id: int | None
    vocab_size: int

    @property
    def dtype(self):
        return np.uint16 if self.vocab_size <= 1 << 16 else np.uint32

    def _tokenizer(self):
        # Truncation is state of the backend object: one per (backend, kind, max_len), or
        # one encoder's setting leaks into another's in the same process.
        key = (self.backend, self.kind, self.max_len)
        tok = _BACKENDS.get(key)
        if tok is None:
            from tokenizers import Tokenizer
            tok = _BACKENDS[key] = Tokenizer.from_str(self.backend)
            tok.no_padding()
            if self.kind == "text":
                tok.enable_truncation(self.max_len, stride=0, strategy="longest_first",
                                      direction="right")
            else:
                tok.no_truncation()
        return tok

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, lengths)``: every text's ids laid end to end (``dtype``), and each one's
        count."""
        rows = [e.ids for e in self._tokenizer().encode_batch(texts, add_special_tokens=True)]
        if self.kind == "corpus":
            eos = self.eos_id
            rows = [r if r and r[-1] == eos else r + [eos] for r in rows]
        lengths = np.fromiter(map(len, rows), np.int64, len(rows))
        flat = np.fromiter(itertools.chain.from_iterable(rows), self.dtype, int(lengths.sum()))
        return flat, lengths


_BACKENDS: dict[tuple, object] = {}


def encoder(tokenizer, kind: str, max_len: int | None) -> Encoder:
    """The ``Encoder`` of a loaded (transformers) tokenizer."""
    if kind == "corpus" and tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no EOS token; documents "
                         "need one to end them. Use a tokenizer with eos_token set.")
    return Encoder(backend_json(tokenizer), kind, max_len if kind == "text" else None,
                   tokenizer.eos_token_id, len(tokenizer))


__all__ = ["Encoder", "backend_json", "encoder", "fingerprint"]
