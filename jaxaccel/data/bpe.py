"""A byte-level BPE tokenizer trained on a corpus's training split, once, and cached.

GPT-2's scheme with the `tokenizers` package: the text is split into bytes mapped to 256
printable characters (``ByteLevel``, no prefix space, GPT-2's word-splitting regex), so every
string encodes with no unknown token, and merges are learnt until ``vocab_size`` tokens. One
special token, ``<|endoftext|>`` (id 0), ends every document and pads rows (padding is masked
by ``segment_ids == 0``, never by its id). Training is deterministic: the same texts give the
same tokenizer.json byte for byte (tested).

The tokenizer is saved as a Hugging Face folder (tokenizer.json, tokenizer_config.json,
special_tokens_map.json) at ``<dataset folder>/tokenizers/bpe-<vocab_size>/``, so
``pipeline.load_tokenizer`` reads it like a checkpoint's and a run folder keeps a copy.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable

EOS = "<|endoftext|>"


MIN_VOCAB = 257     # a byte-level BPE's 256 byte symbols and its end-of-text token


def train(texts: Iterable[str], vocab_size: int):
    """A ``transformers.PreTrainedTokenizerFast``: byte-level BPE of ``vocab_size`` tokens
    (special token included) learnt from ``texts`` (a list, or any iterable: a corpus streamed
    from its files)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"BPE vocab_size={vocab_size} is too small: a byte-level BPE needs the "
                         f"{len(alphabet)} byte symbols and {EOS}; use e.g. 8192.")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer,
                            length=len(texts) if hasattr(texts, "__len__") else None)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                   bos_token=EOS, unk_token=None)


def cached(folder: str, vocab_size: int, texts: Callable[[], Iterable[str]]) -> str:
    """The folder of the BPE of ``vocab_size`` under ``folder``/tokenizers, trained on
    ``texts()`` the first time (written to a temporary folder, then renamed into place, so a
    half-written tokenizer is never read)."""
    path = os.path.join(folder, "tokenizers", f"bpe-{vocab_size}")
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".bpe-", dir=os.path.dirname(path))
    try:
        train(texts(), vocab_size).save_pretrained(tmp)
        os.replace(tmp, path)
    except OSError:
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):  # another writer won
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
