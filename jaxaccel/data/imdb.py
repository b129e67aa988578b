"""IMDb reviews (Maas et al. 2011): the TFDS `imdb_reviews/plain_text` dataset, built offline.

Cloud nodes often cannot reach Stanford's server, so the genuine archive is placed by
hand. TFDS's DownloadManager, asked for a URL whose checksum is registered (upstream
tensorflow_datasets/datasets/imdb_reviews/checksums.tsv), first looks for
`<manual_dir>/<registered filename>`, i.e. `<manual_dir>/aclImdb_v1.tar.gz`, and uses it
instead of downloading after checking its size and sha256 (NonMatchingChecksumError
otherwise). manual_dir defaults to `<data_dir>/downloads/manual`.

The upstream builder reads the archive through `tf.io.gfile` (tfds 4.9.10
`extractor.iter_tar`), which needs TensorFlow. `ImdbReviews` is that builder (same name,
config, features, example keys, README, checksums) with only the archive reader
swapped for `tarfile`, so the dataset it writes is the standard one and is readable with
`tfds.data_source("imdb_reviews/plain_text")`.
"""

from __future__ import annotations

import functools
import os
import tarfile

import tensorflow_datasets as tfds
from etils import epath
from tensorflow_datasets.datasets.imdb_reviews import imdb_reviews_dataset_builder as upstream

from jaxaccel.data.tfds_source import TfdsRecords, shipped

ARCHIVE = "aclImdb_v1.tar.gz"
URL = upstream._DOWNLOAD_URL  # pylint: disable=protected-access
ARCHIVE_SIZE = 84_125_825
ARCHIVE_SHA256 = "c40f74a18d3b61f90feba1e17730e0d38e8b97c05fde7008942e91923d1658fe"
LABEL_NAMES = ("neg", "pos")
SPLIT_EXAMPLES = 25_000         # train and test each


def _iter_tar(path):
    with tarfile.open(path, "r|gz") as tar:
        for member in tar:
            if member.isfile():
                yield os.path.normpath(member.name), tar.extractfile(member)


class ImdbReviews(upstream.Builder, skip_registration=True):
    """Upstream `imdb_reviews` with a TensorFlow-free archive reader."""

    name = "imdb_reviews"
    pkg_dir_path = upstream.Builder.code_path.parent  # Upstream README and citation.

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return upstream.Builder.code_path  # Upstream checksums.tsv validates the archive.

    def _split_generators(self, dl_manager):
        path = dl_manager.download(URL)
        return [
            tfds.core.SplitGenerator(
                name=split,
                gen_kwargs={
                    "archive": _iter_tar(path),
                    "directory": os.path.join("aclImdb", folder),
                    "labeled": split != "unsupervised",
                },
            )
            for split, folder in (("train", "train"), ("test", "test"), ("unsupervised", "train"))
        ]


def prepare(
    data_dir: str | None = None, manual_dir: str | os.PathLike | None = None
) -> ImdbReviews:
    """The builder, built into `data_dir` from `<manual_dir>/aclImdb_v1.tar.gz` on first use."""
    builder = ImdbReviews(config="plain_text", data_dir=data_dir, file_format="array_record")
    if builder.is_prepared():
        return builder
    manual_dir = epath.Path(manual_dir or builder.data_dir_root / "downloads" / "manual")
    archive = manual_dir / ARCHIVE
    if not archive.exists():
        raise FileNotFoundError(
            f"IMDb archive not found at {archive}. Download {URL} ({ARCHIVE_SIZE:,} bytes, "
            f"sha256 {ARCHIVE_SHA256}) on a machine with internet access and copy it to "
            f"{archive} keeping the name {ARCHIVE!r}, or pass manual_dir=<folder holding it>."
        )
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=os.fspath(manual_dir))
    )
    return builder


def reader(data_dir: str | None = None, *, manual_dir: str | os.PathLike | None = None,
           source=None) -> TfdsRecords:
    """The dataset's record reader (``tfds_source.TfdsRecords``), built on first read from
    ``<manual_dir>/aclImdb_v1.tar.gz``."""
    return TfdsRecords("imdb_reviews", data_dir or "",
                       functools.partial(prepare, data_dir or None, manual_dir or None),
                       label_field="label", version=str(ImdbReviews.VERSION))


def describe(settings, model, batching):
    """The ``DataSpec`` of ``data.name=imdb_reviews`` (``sources.SOURCES``)."""
    return shipped(reader(settings.data_dir, manual_dir=settings.manual_dir), "text", settings,
                   model, batching, splits=("train", "test"),
                   counts={"train": SPLIT_EXAMPLES, "test": SPLIT_EXAMPLES},
                   label_names=LABEL_NAMES)
