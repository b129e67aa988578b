"""The English texts of the Canterbury corpus as a TFDS ArrayRecord dataset of documents.

Source: the four English books of the Canterbury compression corpus (Arnold & Bell 1997),
shipped as test data inside the `brotli==1.2.1` sdist on PyPI (1.19 MB of text):

    alice29.txt   152,089 B  Lewis Carroll, Alice's Adventures in Wonderland (1865)
    asyoulik.txt  125,179 B  William Shakespeare, As You Like It (1599)
    lcet10.txt    426,754 B  Library of Congress Workshop on Electronic Texts, proceedings
                             (1992; a work of the US government, Project Gutenberg etext)
    plrabn12.txt  481,861 B  John Milton, Paradise Lost (1667; Project Gutenberg's 1992 etext)

Every text is in the public domain (the books by age, the workshop proceedings as a work of
the US federal government); the brotli package around them is MIT-licensed.

Documents: each book's paragraphs (blocks between blank lines, CRLF read as LF), each line
stripped of surrounding whitespace, empty lines dropped: 2,842 paragraphs, of which 164 repeat
an earlier one (headings, stage directions such as "[Exeunt]", rules of asterisks) and are
dropped, leaving 2,678 documents (1,128,899 characters). A seeded draw of
NUM_VALIDATION of them is `validation`, the rest `train` (sizes in docs/guides/pretrain-decoder.md
and in tests/test_lm_data.py).

Fetched once with `pip download` and checked against SDIST_SHA256 like the RT snippets
(`jaxaccel.data.rt_snippets`, whose module doc explains the TensorFlow-free TFDS path); the
built dataset is cached under `<data_dir>/canterbury/1.0.0/`. Air-gapped machines set
`JAXACCEL_CANTERBURY_SOURCE` (or pass `source=`) to a local copy of the sdist, or of a folder
holding the four .txt files; each is checked against its recorded sha256.
"""

from __future__ import annotations

import functools
import os
import re

import numpy as np
import tensorflow_datasets as tfds

from jaxaccel.data import sdist
from jaxaccel.data.sdist import pip_download
from jaxaccel.data.tfds_source import TfdsRecords, shipped

SOURCE_ENV = "JAXACCEL_CANTERBURY_SOURCE"
SDIST_REQUIREMENT = "brotli==1.2.1"
SDIST_NAME = "brotli-1.2.1.tar.gz"
SDIST_SHA256 = "02b2f7b5a83485efe448a44ddf7983def05c3bb1dcf917d4f7154070260e13de"
_MEMBER_DIR = "brotli-1.2.1/tests/testdata/"
TEXTS = {  # file -> sha256, in document order
    "alice29.txt": "7467306ee0feed4971260f3c87421154a05be571d944e9cb021a5713700c38f0",
    "asyoulik.txt": "eaa3526fe53859f34ecdf255712f9ecf0b2c903451d4755b2edaa2e2599cb0fc",
    "lcet10.txt": "5314ba1dbb03f471df88bec6cd120a938ef60d0fd3511c5c1dce61bf7463245f",
    "plrabn12.txt": "07e2e0b461af78c7c647cb53dab39de560198e16f799b4516eccf0fbd69f764c",
}
SDIST = sdist.Sdist(SDIST_REQUIREMENT, SDIST_NAME, SDIST_SHA256, SOURCE_ENV, _MEMBER_DIR, TEXTS,
                    "corpus", "the four .txt files")
NUM_VALIDATION = 268       # 10% of the 2,678 documents
SPLIT_SEED = 1997


def fetch_texts(source: str | os.PathLike | None = None) -> dict[str, bytes]:
    """The verified bytes of the four books, by file name.

    `source` (else $JAXACCEL_CANTERBURY_SOURCE, else a fresh `pip download`) is the sdist
    (sha256 SDIST_SHA256) or a folder holding the .txt files (each checked against TEXTS).
    """
    return sdist.fetch(SDIST, source, download=pip_download)   # this module's: tests replace it


def documents(text: str) -> list[str]:
    """The paragraphs of a book: blocks between blank lines, each line stripped, empty lines
    dropped."""
    out = []
    for block in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")):
        paragraph = "\n".join(line.strip() for line in block.split("\n") if line.strip())
        if paragraph:
            out.append(paragraph)
    return out


def all_documents(texts: dict[str, bytes]) -> list[tuple[str, str]]:
    """(book file name, paragraph) of every book, in TEXTS order, without repeats (the first
    of each repeated paragraph is kept)."""
    seen, out = set(), []
    for name in TEXTS:
        for doc in documents(texts[name].decode("ascii")):
            if doc not in seen:
                seen.add(doc)
                out.append((name, doc))
    return out


class Canterbury(tfds.core.GeneratorBasedBuilder):
    """Paragraph documents of four public-domain English books; TFDS name `canterbury`."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "brotli 1.2.1 test data; seeded 268-document validation."}

    def __init__(self, *, texts: dict[str, bytes] | None = None, **kwargs):
        self._texts = texts     # fetch_texts' output; read only when the dataset is built
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Paragraphs of the English texts of the Canterbury corpus.",
            features=tfds.features.FeaturesDict({
                "id": tfds.features.Scalar(np.int32),
                "book": tfds.features.Text(),
                "text": tfds.features.Text(),
            }),
            homepage="https://corpus.canterbury.ac.nz/descriptions/",
            citation="Arnold, R. & Bell, T. (1997). A corpus for the evaluation of lossless "
                     "compression algorithms. DCC '97.",
        )

    def _split_generators(self, dl_manager):
        docs = all_documents(self._texts if self._texts is not None else fetch_texts())
        order = np.random.default_rng(SPLIT_SEED).permutation(len(docs))
        held_out = set(order[:NUM_VALIDATION].tolist())
        return {
            "train": self._generate_examples(
                [(i, *d) for i, d in enumerate(docs) if i not in held_out]),
            "validation": self._generate_examples(
                [(i, *d) for i, d in enumerate(docs) if i in held_out]),
        }

    def _generate_examples(self, docs):
        for idx, book, text in docs:
            yield idx, {"id": idx, "book": book, "text": text}


def prepare(data_dir: str | None = None, source: str | os.PathLike | None = None) -> Canterbury:
    """The builder, built into `data_dir` (TFDS default if None) on first use; the texts are
    fetched and checked before TFDS writes anything, so a bad source leaves no folders."""
    builder = Canterbury(data_dir=data_dir, file_format="array_record")
    if not builder.is_prepared():
        builder = Canterbury(data_dir=data_dir, file_format="array_record",
                             texts=fetch_texts(source))
        builder.download_and_prepare()
    return builder


def reader(data_dir: str | None = None, *, manual_dir=None,
           source: str | os.PathLike | None = None) -> TfdsRecords:
    """The corpus's record reader (``tfds_source.TfdsRecords``): documents in id order, built
    on first read."""
    return TfdsRecords("canterbury", data_dir or "", functools.partial(prepare, data_dir or None,
                                                                       source),
                       sort_by="id", version=str(Canterbury.VERSION))


def describe(settings, model, batching):
    """The ``DataSpec`` of ``data.name=canterbury`` (``sources.SOURCES``); its token count is
    known once tokenized (a prepared cache)."""
    return shipped(reader(settings.data_dir), "corpus", settings, model, batching,
                   splits=("train", "validation"), counts={})
