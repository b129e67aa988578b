"""The run's tokenizer folder, as ``resolve`` decided it (``DataSpec.tokenizer``:
``train.run_data.tokenizer_folder``): the one the model names (``model.tokenizer``, a
checkpoint's, a trained run's), else for a corpus its own byte-level BPE of
``data.tokenizer_vocab`` tokens (``bpe_folder``), trained on its training split the first time
and cached beside its token cache, else the model's default vocabulary.

    folder = tokenizer_dir(data)     # the BPE trained there if it is not yet; None for arrays
"""
from __future__ import annotations

import os

from jaxaccel.data import bpe, tokencache
from jaxaccel.data.spec import DataSpec


def trains_bpe(data: DataSpec) -> bool:
    """Whether the run's tokenizer is the corpus's own BPE (a corpus, and the model names no
    tokenizer: neither ``model.tokenizer`` nor ``model.checkpoint``)."""
    return data.kind == "corpus" and data.model.tokenizer is None


def check_tokenizer_vocab(data: DataSpec) -> None:
    """A run that trains the corpus's BPE: ``data.tokenizer_vocab`` must be a size a byte-level
    BPE can have and that the model's embedding table (``ModelInput.vocab_size``) can index,
    checked before the BPE is trained and cached."""
    if not trains_bpe(data):
        return
    n, vocab_size = data.settings.tokenizer_vocab, data.model.vocab_size
    if n < bpe.MIN_VOCAB:
        raise ValueError(f"data.tokenizer_vocab={n} is too small: a byte-level BPE needs its "
                         f"{bpe.MIN_VOCAB - 1} byte symbols and the end-of-text token; use at "
                         f"least {bpe.MIN_VOCAB} (e.g. 8192).")
    if n > vocab_size:
        raise ValueError(f"data.tokenizer_vocab={n} is more than the model's vocab_size="
                         f"{vocab_size} (model.name={data.model.name!r}): its token ids would "
                         f"index past the embedding table. Set data.tokenizer_vocab <= "
                         f"{vocab_size}, or train a preset whose vocabulary is at least the "
                         "tokenizer's.")


def _bpe_home(data: DataSpec) -> str:
    """The folder of the corpus's trained tokenizers (keyed by its training split)."""
    p = tokencache.plan(data, "train", "")
    key = tokencache.digest({"source": p.key["source"], "reader": p.key["reader"]})
    return os.path.join(p.root, f"{data.name}-train-{key[:16]}")


def bpe_folder(data: DataSpec) -> str:
    """Where the corpus's BPE of ``data.tokenizer_vocab`` tokens is cached."""
    return os.path.join(_bpe_home(data), "tokenizers", f"bpe-{data.settings.tokenizer_vocab}")


def _texts(data: DataSpec, split: str):
    reader = data.reader
    for chunk in reader.chunks(split):
        yield from reader.read(chunk).texts


def tokenizer_dir(data: DataSpec) -> str | None:
    """The run's tokenizer folder (``DataSpec.tokenizer``); a corpus's BPE
    (``trains_bpe``) is trained on its training split there the first time. None for arrays."""
    if data.tokenizer is None or not trains_bpe(data):
        return data.tokenizer
    if not os.path.isfile(os.path.join(data.tokenizer, "tokenizer.json")):
        tokencache.require_writable(tokencache.cache_root(data.settings),
                                    f"the BPE of data.name={data.name!r} (data.tokenizer_vocab)")
    return bpe.cached(_bpe_home(data), data.settings.tokenizer_vocab,
                      lambda: _texts(data, "train"))
