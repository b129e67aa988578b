"""Orbax checkpoints in buckets: TensorStore's own ``s3`` driver for the arrays of an ``s3://``
checkpoint, and a bound on how long a failing bucket request is retried.

Orbax (0.12) maps ``gs://`` paths to TensorStore's ``gcs`` driver and nothing else: an
``s3://`` path is normalised to ``s3:/bucket/...`` and written as a local folder of that name.
Its non-array files (metadata, commit files, listing, deletion) already go through
``etils.epath`` and so fsspec's ``s3fs``; only the array store needs the mapping, which Orbax
offers no public hook for. ``enable`` supplies it by wrapping the three functions of Orbax's
TensorStore utilities that make the choice, for ``s3://`` paths only, once per process, and
refuses with the Orbax version when those functions are not there (another Orbax: a clear
error, never a local folder named ``s3:``).

The S3 endpoint and region come from the standard AWS variables (``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL``: S3-compatible stores and test servers; ``AWS_REGION`` or
``AWS_DEFAULT_REGION``), which TensorStore does not read itself; credentials come from the
environment when ``AWS_ACCESS_KEY_ID`` is set, else from TensorStore's default chain (profile,
instance role).

TensorStore retries a failed GCS or S3 request 32 times by default, its delay doubling from 1 s
to 32 s: a bucket that stops answering mid-save holds the run for about a quarter of an hour
before the error. ``RETRIES`` bounds that (about a minute) through the TensorStore context Orbax
opens its stores with (``$JAXACCEL_BUCKET_RETRIES``, ``storage.RETRIES_ENV``, sets another
count); the save then fails with one line and the earlier checkpoints are untouched (a step is
a checkpoint only once its commit file is written, last).
"""
from __future__ import annotations

import os
import posixpath

from jaxaccel import storage

_enabled = False
RETRIES = {"max_retries": 6, "initial_delay": "1s", "max_delay": "16s"}
"""TensorStore's retries of a bucket request: 1 + 2 + 4 + 8 + 16 + 16 s of waiting at most."""


def kvstore(path: str) -> dict:
    """TensorStore's kvstore spec of ``s3://bucket/key``."""
    bucket, _, key = path[len("s3://"):].partition("/")
    spec = {"driver": "s3", "bucket": bucket, "path": key}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if endpoint:
        spec["endpoint"] = endpoint
    if region:
        spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        spec["aws_credentials"] = {"type": "environment"}
    return spec


def _retries() -> dict:
    """``RETRIES``, its count of tries (TensorStore's ``max_retries``: 1 or more) one more than
    ``$JAXACCEL_BUCKET_RETRIES`` where that is set (``storage.retries``)."""
    return {**RETRIES, "max_retries": storage.retries(RETRIES["max_retries"] - 1) + 1}


def enable(scheme: str) -> None:
    """Let Orbax write and read ``scheme://`` checkpoints in this process (idempotent): bounded
    retries for both, the ``s3`` mapping for S3."""
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
    for context in (getattr(ts_utils, "_BASE_TS_CONTEXT", None),
                    getattr(ts_utils, "_DEFAULT_OCDBT_TS_CONTEXT", None)):
        if isinstance(context, dict):
            context.setdefault(f"{'gcs' if scheme == 'gs' else 's3'}_request_retries",
                               _retries())
    if scheme == "s3":
        _enable_s3()


def _enable_s3() -> None:
    """The ``s3://`` mapping, once per process."""
    global _enabled
    if _enabled:
        return
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.path import gcs_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
    hooks = (getattr(ts_utils, "_normalize_path", None), getattr(ts_utils, "_use_gcs_driver", None),
             getattr(gcs_utils, "get_kvstore_for_gcs", None))
    if not all(callable(h) for h in hooks):
        raise ValueError(
            f"s3:// checkpoints need Orbax's TensorStore path mapping, which orbax-checkpoint "
            f"{getattr(ocp, '__version__', '?')} does not have where jaxaccel looks for it "
            "(orbax-checkpoint 0.12 does); install orbax-checkpoint 0.12.x, or keep the run "
            "folder on gs:// or a local disk.")
    normalize, use_remote, gcs_kvstore = hooks

    def normalized(path: str) -> str:
        if path.startswith("s3://"):
            return "s3://" + posixpath.normpath(path[len("s3://"):])
        return normalize(path)

    ts_utils._normalize_path = normalized
    ts_utils._use_gcs_driver = lambda d: d.startswith("s3://") or use_remote(d)
    gcs_utils.get_kvstore_for_gcs = lambda p: kvstore(p) if p.startswith("s3://") \
        else gcs_kvstore(p)
    _enabled = True
