"""A run that lives in a bucket (gs://, s3://) on real local storage servers
(tests/storage_servers.py): trained, checkpointed, resumed, evaluated and exported there; two
processes that share no local folder; a process killed without warning; the bucket's faults.

Every command runs in a subprocess given the server's environment (its endpoint and test
credentials), as a user's would on a VM."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxaccel import cli, config, storage
from jaxaccel.train import loop
from jaxaccel.train.inference import evaluate_run
from jaxaccel.train.metrics import read_metrics
from storage_servers import refusing_gcs_endpoint, start_moto_server
from support import ADAN, CLI, LONG_WAIT_S, TINY_CONFIG, cpu_env

# The tiny BERT, a checkpoint every 2 steps, every step logged.
SETS = ("train.checkpoint_every=2", "train.log_every=1", "train.progress=false",
        "train.schedule=constant", "train.warmup_ratio=0.0")


def jaxaccel(server, *argv, status=0, cwd=None, **env):
    """``jaxaccel *argv`` against ``server``, in the folder ``cwd``: (stdout, stderr); the exit
    status must be ``status``."""
    done = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=LONG_WAIT_S,
                          env=cpu_env(**{**server.env, **env}), cwd=cwd)
    assert done.returncode == status, done.stderr[-3000:]
    return done.stdout, done.stderr


def train(server, workdir, *sets, status=0, cwd=None, **env):
    return jaxaccel(server, "train", "--config", TINY_CONFIG, f"--set=workdir={workdir}",
                    *(f"--set={s}" for s in (*SETS, *sets)), status=status, cwd=cwd, **env)


def losses(fs, run_url) -> dict[int, float]:
    """``{step: train loss}`` of the run's metrics.jsonl in the bucket."""
    rows = [json.loads(line) for line in fs.cat_file(run_url).decode().splitlines() if line]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


@pytest.fixture(scope="module")
def trained_in_bucket(gcs_server, s3_server, tmp_path_factory):
    """``trained_in_bucket(scheme)``: the tiny run trained 4 steps into a new bucket of that
    scheme's server by a command run in a new empty folder, once a module (the tests that read
    such a run share it): (server, bucket, the command's result, that folder)."""
    runs = {}

    def trained(scheme):
        if scheme not in runs:
            server = gcs_server if scheme == "gs" else s3_server
            bucket, cwd = server.create_bucket(), tmp_path_factory.mktemp(f"cwd-{scheme}")
            out = train(server, f"{bucket}/runs", "train.max_steps=4", cwd=cwd)[0]
            runs[scheme] = server, bucket, json.loads(out), cwd
        return runs[scheme]
    return trained


@pytest.mark.parametrize("scheme", ["gs", "s3"])
@pytest.mark.long
def test_a_run_lives_in_a_bucket(scheme, trained_in_bucket):
    """Trained, resumed (a longer run; gs), evaluated, asked to predict (gs) and exported with
    every file in the bucket; nothing is written to the local folder the commands run in."""
    server, bucket, first, tmp_path = trained_in_bucket(scheme)
    fs = server.filesystem()
    run = f"{bucket}/runs/tiny_synthetic"
    assert first["status"] == "completed" and first["checkpoint_dir"] == f"{run}/checkpoints"
    end = 4
    if scheme == "gs":      # s3's resume: the two processes' test below
        resumed = json.loads(train(server, f"{bucket}/runs", "train.max_steps=6",
                                   cwd=tmp_path)[0])
        assert resumed["status"] == "completed" and resumed["step"] == end + 2
        end, first = end + 2, resumed
    assert sorted(losses(fs, f"{run}/metrics.jsonl")) == list(range(1, end + 1))
    assert fs.exists(f"{run}/checkpoints/{end}/commit_success.txt")
    assert not fs.exists(f"{run}/lock")                 # released
    assert fs.find(f"{run}/tensorboard") and fs.exists(f"{run}/tokenizer/tokenizer.json")
    assert fs.cat_file(f"{run}/confusion_matrix.png").startswith(b"\x89PNG")
    evaluated = json.loads(jaxaccel(server, "eval", "--checkpoint", run, cwd=tmp_path)[0])
    assert evaluated["step"] == end and evaluated["accuracy"] == first["eval_accuracy"]
    if scheme == "gs":          # predict reads the run as eval does (its tokenizer copied)
        predicted = json.loads(jaxaccel(server, "predict", "--checkpoint", run, "a film",
                                        cwd=tmp_path)[0])
        assert predicted["label"] in evaluated["label_names"]
    exported = json.loads(jaxaccel(server, "export", "--checkpoint", run, "--out",
                                   f"{bucket}/hf/tiny", cwd=tmp_path)[0])
    assert exported["out"] == f"{bucket}/hf/tiny"
    assert {os.path.basename(p) for p in fs.ls(f"{bucket}/hf/tiny")} >= {
        "config.json", "model.safetensors", "tokenizer.json"}
    assert os.listdir(tmp_path) == []


def _port():
    import socket
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.long
def test_two_hosts_that_share_no_disk_stop_together_and_resume_exactly(s3_server, tmp_path):
    """Two processes (2 CPU devices each, gloo collectives, a (data=2, fsdp=2) mesh with the
    fused Adan state sharded over it) whose HOME, TMPDIR and cache folders are their own, the
    run folder in a bucket: SIGTERM to process 1 alone once a checkpoint is in the bucket; both
    stop after the same step (JAX's preemption sync point), save it together and exit 75; two
    fresh processes (new empty folders) resume from the bucket and finish, with the losses of
    one process with 4 devices run without a break (metrics written once, by process 0), and
    the checkpoint they wrote evaluates on one device to the accuracy that run reached.

    The stop waits on events, not on time: JAX's notifier looks for the signal once a second,
    so the run is long enough never to end first, and the learning rate constant, so that the
    resumed run, ended two steps after the stop, and the reference of that length take the
    same steps. (The same rules on a shared local disk: test_distributed.py, under -m slow.)"""
    cpu = jax.devices("cpu")
    if len(cpu) < 4:
        pytest.skip(f"the one-process reference needs 4 CPU devices; this process has {len(cpu)}")
    fs, bucket = s3_server.filesystem(), s3_server.create_bucket()
    sets = ("train.max_steps=1000", "mesh.fsdp=2", "train.checkpoint_every=1", *ADAN)

    def host(name, i, port):
        root = tmp_path / name
        folders = {k: str(root / k) for k in ("home", "tmp", "cache")}
        for f in folders.values():
            os.makedirs(f)
        env = cpu_env(2, **s3_server.env, HOME=folders["home"], TMPDIR=folders["tmp"],
                      XDG_CACHE_HOME=folders["cache"], JAXACCEL_DATA_CACHE=folders["cache"],
                      JAXACCEL_COORDINATOR=f"localhost:{port}", JAXACCEL_NUM_PROCESSES="2",
                      JAXACCEL_PROCESS_ID=str(i))
        return env, str(root)

    def start_two(tag, *extra):
        port = _port()
        procs = []
        for i in range(2):
            env, cwd = host(f"{tag}{i}", i, port)
            procs.append(subprocess.Popen(
                [*CLI, "train", "--config", TINY_CONFIG, f"--set=workdir={bucket}/runs",
                 *(f"--set={s}" for s in (*SETS, *sets, *extra))],
                cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return procs

    def finish(procs, status):
        records = []
        for p in procs:
            out, err = p.communicate(timeout=LONG_WAIT_S)
            assert p.returncode == status, err[-3000:]
            records.append(json.loads(out))
        return records

    run = f"{bucket}/runs/tiny_synthetic"
    procs = start_two("first")
    while not fs.exists(f"{run}/metrics.jsonl"):
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.1)
        fs.invalidate_cache()
    procs[1].send_signal(signal.SIGTERM)
    stopped = finish(procs, cli.EXIT_PREEMPTED)
    assert [r["status"] for r in stopped] == ["preempted"] * 2, stopped
    step = stopped[0]["step"]
    assert [r["step"] for r in stopped] == [step, step] and step < 1000, stopped
    steps = step + 2
    resumed = start_two("again", f"train.max_steps={steps}")
    # The reference in this process (no third start-up of jax), on 4 of its CPU devices, while
    # the two resume.
    with jax.default_device(cpu[0]):
        loop.train(config.load(TINY_CONFIG, [f"workdir={tmp_path / 'one'}", *SETS, "mesh.fsdp=2",
                                             *ADAN, f"train.max_steps={steps}"], device_count=4),
                   devices=cpu[:4])
    assert [r["status"] for r in finish(resumed, 0)] == ["completed"] * 2
    two = losses(fs, f"{run}/metrics.jsonl")
    assert sorted(two) == list(range(1, steps + 1))
    one_rows = read_metrics(str(tmp_path / "one" / "tiny_synthetic"))
    one = {r["step"]: r["train/loss"] for r in one_rows if "train/loss" in r}
    np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(one)],
                               rtol=1e-5)
    # The bucket's run folder, copied here, evaluated in this process on one CPU device; the
    # confusion matrix the two counted over their shares of the eval split: exact.
    local = tmp_path / "copied"
    fs.get(run, str(local), recursive=True)
    with jax.default_device(cpu[0]):
        ev = evaluate_run(str(local), devices=cpu[:1])
    final = [r["eval/accuracy"] for r in one_rows if "eval/accuracy" in r][-1]
    assert ev["accuracy"] == pytest.approx(final, abs=1e-6)
    gathered = [r for r in read_metrics(str(local)) if "eval/confusion_matrix" in r][-1]
    assert gathered["eval/confusion_matrix"] == ev["confusion_matrix"]
    assert sum(map(sum, ev["confusion_matrix"])) == ev["examples"]


@pytest.mark.long
def test_a_process_killed_while_saving_leaves_the_last_complete_checkpoint(gcs_server, tmp_path):
    """SIGKILL (no handler runs) once checkpoints are being written every step, very likely in
    the middle of one: a step the process did not finish has no commit file and is never
    resumed from; the next run (same host: the dead trainer's lock is stale) removes it,
    resumes from the newest complete step and ends with the losses of a run never killed."""
    fs, bucket = gcs_server.filesystem(), gcs_server.create_bucket()
    run = f"{bucket}/runs/tiny_synthetic"
    proc = subprocess.Popen([*CLI, "train", "--config", TINY_CONFIG, f"--set=workdir={bucket}/runs",
                             *(f"--set={s}" for s in (*SETS, "train.checkpoint_every=1",
                                                      "train.max_steps=1000"))],
                            env=cpu_env(**gcs_server.env), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    while not fs.exists(f"{run}/checkpoints/3/commit_success.txt"):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
        fs.invalidate_cache()
    proc.kill()
    proc.wait()
    fs.invalidate_cache()
    steps = sorted(int(p.rsplit("/", 1)[1]) for p in fs.ls(f"{run}/checkpoints"))
    complete = [s for s in steps if fs.exists(f"{run}/checkpoints/{s}/commit_success.txt")]
    assert complete and fs.exists(f"{run}/lock")
    if steps[-1] not in complete:       # killed mid-save: that step is not a checkpoint yet
        assert steps[-1] == complete[-1] + 1
    end = complete[-1] + 2
    out, err = train(gcs_server, f"{bucket}/runs", f"train.max_steps={end}",
                     "train.checkpoint_every=1")
    assert json.loads(out)["step"] == end
    assert f"resumed from {run}/checkpoints at step {complete[-1]}" in err
    cpu = jax.devices("cpu")
    with jax.default_device(cpu[0]):
        loop.train(config.load(TINY_CONFIG, [f"workdir={tmp_path}", *SETS,
                                             f"train.max_steps={end}"]), devices=cpu[:1])
    never_killed = {r["step"]: r["train/loss"] for r in read_metrics(
        str(tmp_path / "tiny_synthetic")) if "train/loss" in r}
    resumed = losses(fs, f"{run}/metrics.jsonl")
    for step in range(complete[-1] + 1, end + 1):
        assert resumed[step] == pytest.approx(never_killed[step], rel=1e-5), step


@pytest.mark.long
def test_a_bucket_that_stops_answering_mid_run_ends_it_with_one_line_soon(tmp_path):
    """The storage server dies once checkpoints are being written every step: the next save
    fails after the clients' bounded retries (one each here, ``JAXACCEL_BUCKET_RETRIES=1``:
    the defaults wait up to a minute), not Orbax's 300 s coordination time-out; the
    console gets one error line naming the step (clean-ups that fail after it are warnings),
    no traceback, no Orbax thread's report, and the metrics not uploaded are kept locally."""
    with start_moto_server() as server:
        fs, bucket = server.filesystem(), server.create_bucket()
        run = f"{bucket}/runs/tiny_synthetic"
        proc = subprocess.Popen(
            [*CLI, "train", "--config", TINY_CONFIG, f"--set=workdir={bucket}/runs",
             *(f"--set={s}" for s in (*SETS, "train.checkpoint_every=1", "train.max_steps=1000"))],
            env=cpu_env(**server.env, TMPDIR=str(tmp_path), JAXACCEL_BUCKET_RETRIES="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        while not fs.exists(f"{run}/checkpoints/2/commit_success.txt"):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.05)
            fs.invalidate_cache()
        server.proc.kill()
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=LONG_WAIT_S)
    assert proc.returncode == cli.EXIT_ERROR and out == "", err[-3000:]
    assert time.monotonic() - t0 < 200, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "could not be reached" in errors[0], err[-3000:]
    assert re.search(r"saving checkpoint step \d+|writing .*metrics\.jsonl", errors[0])
    for noise in ("Traceback", "never awaited", "Exception ignored", "TimeoutError"):
        assert noise not in err, err[-3000:]
    kept = re.search(r"What was not uploaded is kept in (\S+) ", err)
    assert kept and kept[1].startswith(str(tmp_path)), err[-3000:]
    assert os.path.exists(os.path.join(kept[1], "metrics.jsonl"))


# ---- the bucket's faults: one line each, before anything is compiled or written ----

def test_a_bucket_that_does_not_exist_is_named(storage_server, tmp_path):
    _, err = train(storage_server, f"{storage_server.scheme}://no-such-bucket-0/runs",
                   status=cli.EXIT_ERROR, cwd=tmp_path)
    assert "no-such-bucket-0 does not exist" in err and "compiled" not in err, err[-2000:]
    assert err.count("error:") == 1 and "Traceback" not in err
    assert os.listdir(tmp_path) == []


def test_a_missing_extra_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "s3fs", None)      # as if s3fs were not installed
    with pytest.raises(ValueError, match=r"pip install 'jaxaccel\[s3\]'"):
        config.build(sets=["workdir=s3://bucket/runs"])
    with pytest.raises(ValueError, match="ftp:// is not supported"):
        config.build(sets=["data.train_files=ftp://host/a.jsonl"])


def test_missing_credentials_say_where_they_were_looked_for(s3_server, tmp_path):
    bucket = s3_server.create_bucket()
    _, err = train(s3_server, f"{bucket}/runs", status=cli.EXIT_ERROR, cwd=tmp_path,
                   AWS_ACCESS_KEY_ID="", AWS_SECRET_ACCESS_KEY="")
    assert "no credentials" in err and "AWS_ACCESS_KEY_ID" in err, err[-2000:]


@pytest.mark.parametrize("status", [401, 403])
def test_gcs_without_credentials_or_a_role_is_one_line_naming_which(status, tmp_path):
    """No credentials anywhere: gcsfs goes on anonymously and the bucket answers 401, which
    is said as missing credentials with where to set them; a token without the role (403) is
    said as permission denied. Nothing compiled, nothing written locally."""
    with refusing_gcs_endpoint(status) as env:
        # a raw access token, its expiry not asked of Google's token service (no network)
        token = {"FSSPEC_GCS_TOKEN": "ya29.a-token-without-the-role",
                 "FETCH_RAW_TOKEN_EXPIRY": "false"} if status == 403 else {}
        done = subprocess.run([*CLI, "train", "--config", TINY_CONFIG,
                               "--set=workdir=gs://a-bucket/runs"], capture_output=True,
                              text=True, timeout=LONG_WAIT_S, cwd=tmp_path,
                              env=cpu_env(**env, **token))
    err = done.stderr
    assert done.returncode == cli.EXIT_ERROR and err.count("error:") == 1, err[-2000:]
    assert "Traceback" not in err and "compiled" not in err and os.listdir(tmp_path) == []
    if status == 401:
        assert "no credentials for gs://" in err and "GOOGLE_APPLICATION_CREDENTIALS" in err
    else:
        assert "permission denied on gs://a-bucket" in err and "roles/storage" in err


@pytest.mark.long
def test_a_read_only_bucket_is_refused_for_training_and_read_for_eval(trained_in_bucket):
    """The module's S3 run (4 steps), copied into a bucket of its own that is then made
    read-only: a longer run is refused before anything is compiled; eval reads it."""
    s3_server, source, _, _ = trained_in_bucket("s3")
    fs, bucket = s3_server.filesystem(), s3_server.create_bucket()
    fs.copy(f"{source}/runs/tiny_synthetic", f"{bucket}/runs/tiny_synthetic", recursive=True)
    s3_server.deny_writes(bucket.split("://")[1])
    _, err = train(s3_server, f"{bucket}/runs", "train.max_steps=6", status=cli.EXIT_ERROR)
    assert "permission denied" in err and "compiled" not in err, err[-2000:]
    evaluated = json.loads(jaxaccel(s3_server, "eval", "--checkpoint",
                                    f"{bucket}/runs/tiny_synthetic")[0])
    assert evaluated["step"] == 4


def test_an_unreachable_endpoint_is_one_line(s3_server, tmp_path):
    """Said once botocore's retries are spent (one here: its default backs off 4 times)."""
    closed = f"http://127.0.0.1:{_port()}"
    t0 = time.monotonic()
    _, err = train(s3_server, "s3://bucket/runs", status=cli.EXIT_ERROR, cwd=tmp_path,
                   AWS_ENDPOINT_URL=closed, AWS_ENDPOINT_URL_S3=closed,
                   FSSPEC_S3_ENDPOINT_URL=closed, JAXACCEL_BUCKET_RETRIES="1")
    assert "could not be reached" in err and err.count("error:") == 1, err[-2000:]
    assert time.monotonic() - t0 < 300


def test_the_bucket_retries_are_the_clients_own_unless_the_environment_sets_them(monkeypatch):
    monkeypatch.delenv(storage.RETRIES_ENV, raising=False)
    assert storage.retries(storage.RETRIES) == storage.RETRIES
    monkeypatch.setenv(storage.RETRIES_ENV, "0")
    assert storage.retries(storage.RETRIES) == 0
    monkeypatch.setenv(storage.RETRIES_ENV, "-1")
    with pytest.raises(ValueError, match="JAXACCEL_BUCKET_RETRIES='-1' is not a whole number"):
        storage.retries(storage.RETRIES)


@pytest.mark.long
def test_a_run_folder_another_trainer_holds_is_refused_until_its_lease_ends(s3_server):
    fs, bucket = s3_server.filesystem(), s3_server.create_bucket()
    lock = f"{bucket}/runs/tiny_synthetic/lock"
    holder = {"pid": 1, "host": "another-vm", "started": time.time(), "token": "t"}
    fs.pipe_file(lock, json.dumps({**holder, "renewed": time.time()}).encode())
    _, err = train(s3_server, f"{bucket}/runs", "train.max_steps=2", status=cli.EXIT_ERROR)
    assert "in use by another trainer (pid 1 on host another-vm" in err, err[-2000:]
    fs.pipe_file(lock, json.dumps({**holder, "renewed": time.time() - 3600}).encode())
    _, err = train(s3_server, f"{bucket}/runs", "train.max_steps=2")
    assert "taking over the stale lock of pid 1 on another-vm" in err


def test_a_released_bucket_lock_is_not_written_again_by_its_renewal():
    """The lock's renewal thread, caught between reading the lock and writing it again while
    the trainer releases it, wrote it back after its removal (a finished run left its lock;
    seen once in the suite on S3). Renewing all the time (a lease of 0.1 ms), no release
    leaves it behind."""
    from jaxaccel import storage
    from jaxaccel.train.runlock import RunLock
    storage.filesystem("memory://lockrace").mkdir("lockrace")
    left = 0
    for _ in range(300):
        lock = RunLock("memory://lockrace/run", lease_s=1e-4)
        lock.acquire()
        time.sleep(0.001)
        lock.release()
        time.sleep(0.001)
        if storage.exists(lock.path):
            left += 1
            storage.remove(lock.path)
    assert left == 0


def test_a_plan_and_a_benchmark_are_written_to_a_bucket(gcs_server):
    fs, bucket = gcs_server.filesystem(), gcs_server.create_bucket()
    out, _ = jaxaccel(gcs_server, "compile", "--config", TINY_CONFIG, "--topology", "local",
                      "--out", f"{bucket}/plans")
    written = [p for p in fs.find(f"{bucket}/plans") if p.endswith(".json")]
    assert len(written) == 1 and f"wrote gs://{written[0]}" in out
    assert json.loads(fs.cat_file(written[0]))["bench"] == "plan"
    _, err = jaxaccel(gcs_server, "compile", "--config", TINY_CONFIG, "--topology", "local",
                      "--out", "gs://no-such-bucket-1/plans", status=cli.EXIT_ERROR)
    assert "no-such-bucket-1 does not exist" in err and "compiled" not in err


@pytest.mark.long
def test_data_files_and_class_folders_are_read_from_a_bucket(s3_server, tmp_path):
    """A glob of JSONL files and a folder of class folders in a bucket: read from their local
    copies, the class folders keeping their names; trained on, with the run in the bucket too;
    a token cache in a bucket is refused with why."""
    fs, bucket = s3_server.filesystem(), s3_server.create_bucket()
    for split, n in (("train", 32), ("test", 8)):
        fs.pipe_file(f"{bucket}/reviews/{split}-0.jsonl", "".join(
            json.dumps({"text": f"{split} row {i} of the bucket", "label": "ab"[i % 2]}) + "\n"
            for i in range(n)).encode())
    for label in ("pos", "neg"):
        for i in range(8):
            fs.pipe_file(f"{bucket}/texts/{label}/day{i % 2}/{i}.txt", f"{label} {i}".encode())
    files = (f"--set=data.train_files={bucket}/reviews/train-*.jsonl",
             f"--set=data.eval_files={bucket}/reviews/test-*.jsonl")
    sets = ("--set=model.name=tiny", "--set=train.batch_size=8", "--set=train.eval_batch_size=8",
            "--set=train.max_steps=2", "--set=train.progress=false")
    config_file = os.path.join(os.path.dirname(TINY_CONFIG), "files_classifier.py")
    cwd, copies = tmp_path / "cwd", str(tmp_path / "copies")
    cwd.mkdir()
    shown, _ = jaxaccel(s3_server, "data", "show", "--config", config_file, "-n", "40", *sets,
                        f"--set=data.train_files={bucket}/texts", "--set=data.eval_files=",
                        "--set=data.holdout=0.5", cwd=cwd, XDG_CACHE_HOME=copies)
    assert set(re.findall(r"label '(\w+)'", shown)) == {"pos", "neg"}, shown[:800]
    trained = json.loads(jaxaccel(s3_server, "train", "--config", config_file, *files, *sets,
                                  f"--set=workdir={bucket}/runs", cwd=cwd, XDG_CACHE_HOME=copies)[0])
    assert trained["status"] == "completed" and trained["eval_examples"] == 8
    _, err = jaxaccel(s3_server, "train", "--config", config_file, *files, *sets,
                      f"--set=data.cache_dir={bucket}/cache", status=cli.EXIT_ERROR,
                      cwd=cwd, XDG_CACHE_HOME=copies)
    assert "the token cache lives on each host's own disk" in err
    assert os.listdir(cwd) == [] and os.listdir(os.path.join(copies, "jaxaccel", "remote"))
