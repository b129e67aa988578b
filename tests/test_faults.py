"""Run folders that cannot be lost (issue 13), driven the way a user drives them: the
``jaxaccel`` command in subprocesses on the tiny synthetic config.

One trained run (module fixture) is shared; tests that change a run work on a copy. The
fixture's model comes from a Hugging Face checkpoint folder that is deleted after training, so
every eval/predict here also checks that a run folder is self-contained. The subprocesses share
the session's persistent compilation cache (conftest), so each compiles the tiny model's steps
only once instead of once per command.
"""
import collections
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from jaxaccel import cli
from support import CLI, LONG_WAIT_S, ROOT, TINY_CONFIG, cpu_env

ENV = cpu_env(PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
              TOKENIZERS_PARALLELISM="false", SLURM_NTASKS="4")   # stray: a single-process run must ignore it (item 8)
# A train state as far as Checkpointer is concerned (it checks ``params`` are finite).
State = collections.namedtuple("State", "params")


def jaxaccel(*args, stdin=None, env=None):
    return subprocess.run([*CLI, *args], input=stdin, capture_output=True, env=env or ENV,
                          timeout=LONG_WAIT_S)


def start(*args):
    return subprocess.Popen([*CLI, *args], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def train_args(workdir, *sets):
    out = ["train", "--config", TINY_CONFIG, "--set", f"workdir={workdir}",
           "--set", "train.progress=false"]
    for s in sets:
        out += ["--set", s]
    return out


def text(proc):
    return proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")


def evaluate(run_dir):
    proc = jaxaccel("eval", "--checkpoint", run_dir)
    assert proc.returncode == 0, text(proc)
    return json.loads(proc.stdout), proc.stderr.decode()


def evaluate_here(run_dir, capsys, caplog):
    """``jaxaccel eval`` in this process, where no trainer runs (the process boundary is not
    what the caller tests): its result, and its stderr and log lines."""
    code = cli.main(["eval", "--checkpoint", run_dir])
    out, err = capsys.readouterr()
    assert code == 0, err + caplog.text
    return json.loads(out), err + caplog.text


def steps(run_dir):
    return sorted(int(s) for s in os.listdir(os.path.join(run_dir, "checkpoints"))
                  if s.isdigit())


def write_hf_checkpoint(path):
    """A tiny random BERT as a Hugging Face folder (config, safetensors, tokenizer)."""
    import transformers
    from jaxaccel.models import packaged_minilm_dir
    config = transformers.BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128,
                                     max_position_embeddings=128)
    transformers.BertModel(config).save_pretrained(path, safe_serialization=True)
    transformers.AutoTokenizer.from_pretrained(packaged_minilm_dir()).save_pretrained(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished run (2 epochs = 32 steps; checkpoints 16 and 32) whose model.checkpoint
    folder no longer exists."""
    tmp = tmp_path_factory.mktemp("faults")
    hf = str(tmp / "hf_tiny")
    write_hf_checkpoint(hf)
    proc = jaxaccel(*train_args(tmp / "runs", f"model.checkpoint={hf}"))
    assert proc.returncode == 0, text(proc)
    shutil.rmtree(hf)
    run_dir = str(tmp / "runs" / "tiny_synthetic")
    assert steps(run_dir) == [16, 32]
    return run_dir


@pytest.fixture
def run_copy(trained, tmp_path):
    dest = str(tmp_path / "runs" / "tiny_synthetic")
    shutil.copytree(trained, dest)
    return dest


@pytest.mark.long
def test_readers_open_read_only_while_a_trainer_saves(tmp_path, capsys):
    """Item 1: eval beside a trainer saving every step (the readers' checkpoint managers
    cleaned the writer's unfinished save away and the trainer died)."""
    writer = start(*train_args(tmp_path, "train.checkpoint_every=1", "train.max_steps=32",
                               "train.keep_checkpoints=3"))
    run_dir = tmp_path / "tiny_synthetic"
    while not (run_dir / "checkpoints").is_dir() or not steps(str(run_dir)):
        assert writer.poll() is None, writer.communicate()
        time.sleep(0.2)
    proc = jaxaccel("eval", "--checkpoint", str(run_dir))
    assert proc.returncode == 0, text(proc)
    out, err = writer.communicate()
    assert writer.returncode == 0, (out + err).decode()

    # Deterministically: a reader leaves a writer's unfinished save (temporary folder) alone.
    pending = run_dir / "checkpoints" / "33.orbax-checkpoint-tmp-1234567"
    pending.mkdir()
    # jaxaccel eval in this process: no trainer runs now, so no second start-up is needed.
    code = cli.main(["eval", "--checkpoint", str(run_dir)])
    assert code == 0, capsys.readouterr()
    assert pending.is_dir(), "a reader deleted a writer's unfinished save"


def test_resume_false_on_a_used_folder_is_refused_or_overwritten(run_copy, capsys):
    """Item 2: never mix two runs in one folder. (The refusal in process: it comes before
    anything is built.)"""
    workdir = os.path.dirname(run_copy)
    assert cli.main(train_args(workdir, "train.resume=false", "train.max_steps=2")) == \
        cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert "already holds a run" in err and "train.overwrite=true" in err, err
    assert steps(run_copy) == [16, 32]

    proc = jaxaccel(*train_args(workdir, "train.resume=false", "train.overwrite=true",
                                "train.max_steps=2"))
    assert proc.returncode == 0, text(proc)
    assert steps(run_copy) == [2]
    with open(os.path.join(run_copy, "metrics.jsonl")) as f:
        assert max(json.loads(line)["step"] for line in f) == 2


@pytest.mark.slow   # 35-50 s; the rule itself: test_loop_events' keep_good cases, without training
def test_nonfinite_stop_keeps_a_checkpoint_that_evaluates(tmp_path):
    """Item 3: with warm-up, step 1 is still at the initial parameters and step 2 has
    diverged (~3e29, finite, but step 3's loss is NaN): the last good checkpoint is step 1,
    and it evaluates to a finite loss."""
    proc = jaxaccel(*train_args(tmp_path, "train.learning_rate=1e30",
                                "train.checkpoint_every=1"))
    assert proc.returncode == cli.EXIT_NONFINITE, text(proc)
    run_dir = str(tmp_path / "tiny_synthetic")
    assert json.loads(proc.stdout)["last_good_checkpoint"] == 1
    assert "Last good checkpoint: step 1" in text(proc) and steps(run_dir) == [1]
    assert os.path.isdir(os.path.join(run_dir, "skipped_checkpoints", "2"))
    ev, _ = evaluate(run_dir)
    assert ev["step"] == 1 and ev["loss"] < 10, ev


def test_nonfinite_stop_without_a_good_checkpoint_says_so(tmp_path):
    """Item 3, the issue's command: step 2 was the only save and its parameters give NaN."""
    proc = jaxaccel(*train_args(tmp_path, "train.learning_rate=1e30",
                                "train.checkpoint_every=2"))
    assert proc.returncode == cli.EXIT_NONFINITE, text(proc)
    assert "No good checkpoint" in text(proc), text(proc)
    assert steps(str(tmp_path / "tiny_synthetic")) == []


@pytest.mark.parametrize("vanished", [FileNotFoundError, NotADirectoryError])
def test_a_step_vanishing_while_listing_is_listed_again_by_readers_only(tmp_path, vanished):
    """Orbax raises FileNotFoundError, or NotADirectoryError (the folder went between its
    ``exists()`` and ``is_dir()``: seen once in ~3,000 reads of the test below under load), when
    a step folder disappears while it lists the steps. A reader lists again; the writer raises."""
    import jax.numpy as jnp

    from jaxaccel.train import checkpoint
    folder = str(tmp_path / "checkpoints")
    writer = checkpoint.Checkpointer(folder, async_save=False)
    writer.save(3, State({"w": jnp.full(4, 3.0)}), {"step": 3})
    writer.close()
    failures = []

    def vanishing_once(*args, **kwargs):
        if not failures:
            failures.append(vanished)
            raise vanished(f"{folder}/2")
        return checkpoint.Manager(*args, **kwargs)
    reader = checkpoint.Checkpointer(folder, read_only=True, manager=vanishing_once)
    items, meta = reader.restore_items(("params",))
    reader.close()
    assert failures == [vanished] and meta["step"] == 3 and float(items["params"]["w"][0]) == 3.0
    failures.clear()
    with pytest.raises(vanished):
        checkpoint.Checkpointer(folder, async_save=False, manager=vanishing_once)


@pytest.mark.long
def test_readers_list_again_when_the_trainer_deletes_a_step_under_them(tmp_path):
    """A reader lists the steps while the writer deletes its oldest (keep_checkpoints): the
    vanished folder raised FileNotFoundError in the reader (4-9 of 150 reads before the fix,
    once in test_readers_open_read_only_while_a_trainer_saves). Readers list again; every read
    gets a whole step."""
    import threading

    import jax.numpy as jnp

    from jaxaccel.train.checkpoint import Checkpointer
    folder = str(tmp_path / "checkpoints")
    writer = Checkpointer(folder, keep=2, async_save=False)
    writer.save(0, State({"w": jnp.zeros(256)}), {"step": 0})
    done, errors, got = threading.Event(), [], []

    def train():
        step = 1
        while not done.is_set():
            writer.save(step, State({"w": jnp.full(256, float(step))}), {"step": step})
            step += 1
    thread = threading.Thread(target=train)
    thread.start()
    try:
        for _ in range(200):
            try:
                reader = Checkpointer(folder, read_only=True)
                items, meta = reader.restore_items(("params",))
                reader.close()
                got.append((float(items["params"]["w"][0]), meta["step"]))
            except Exception as e:  # noqa: BLE001 -- any failure of a read counts
                errors.append(repr(e))
    finally:
        done.set()
        thread.join()
    writer.close()
    assert not errors, (len(errors), errors[:3])
    assert all(value == step for value, step in got)     # never a mix of two steps
    assert got[-1][1] > 1


def test_nonfinite_parameters_are_never_saved(tmp_path):
    import types

    import jax.numpy as jnp

    from jaxaccel.train.checkpoint import Checkpointer, NonFiniteState
    ckpt = Checkpointer(str(tmp_path / "checkpoints"))
    state = types.SimpleNamespace(params={"w": jnp.array([1.0, jnp.inf])})
    with pytest.raises(NonFiniteState, match="step 5"):
        ckpt.save(5, state, {})
    assert ckpt.all_steps() == []


def test_async_save_holds_its_own_copy_and_reads_wait_for_it(tmp_path):
    """``save`` returns while the write goes on in the background; it has copied the state to
    host memory by then, so the caller may donate (here: delete) the arrays; a read in the same
    process waits for the write and sees the saved values."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxaccel.train.checkpoint import Checkpointer, abstract_like
    state = State({"w": jnp.arange(1 << 20, dtype=jnp.float32), "b": jnp.ones(3)})
    expected = jax.device_get(state)
    abstract = abstract_like(state, jax.tree_util.tree_map(lambda x: x.sharding, state))
    ckpt = Checkpointer(str(tmp_path / "checkpoints"))
    ckpt.save(4, state, {"epoch": 1})
    for x in jax.tree_util.tree_leaves(state):
        x.delete()
    restored, meta = ckpt.restore(abstract)
    assert meta == {"epoch": 1} and ckpt.all_steps() == [4]
    for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_array_equal(a, b)
    ckpt.close()


def _truncate_largest(folder):
    files = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs]
    victim = max(files, key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 3)


@pytest.mark.long
def test_corrupt_latest_checkpoint_falls_back(run_copy, capsys, caplog):
    """Item 4: a truncated data file of the newest step: eval and resume use step 16, naming
    the skipped step; resume sets it aside and saves step 32 again."""
    _truncate_largest(os.path.join(run_copy, "checkpoints", "32", "state"))
    ev, err = evaluate_here(run_copy, capsys, caplog)
    assert ev["step"] == 16 and "step 32" in err and "skipped" in err, err
    proc = jaxaccel(*train_args(os.path.dirname(run_copy)))
    assert proc.returncode == 0, text(proc)
    assert "step 32" in text(proc) and steps(run_copy) == [16, 32]
    assert os.path.isdir(os.path.join(run_copy, "skipped_checkpoints", "32"))


def test_corrupt_metadata_falls_back_and_readers_leave_unfinished_saves(run_copy):
    """Items 4 and 1: predict skips a step whose JSON record is empty, and leaves a writer's
    unfinished save (its temporary folder) alone."""
    with open(os.path.join(run_copy, "checkpoints", "32", "meta", "metadata"), "w") as f:
        f.write("")
    pending = os.path.join(run_copy, "checkpoints", "33.orbax-checkpoint-tmp-1234567")
    os.makedirs(pending)
    proc = jaxaccel("predict", "--checkpoint", run_copy, "--input", "-", stdin=b"a text\n")
    assert proc.returncode == 0, text(proc)
    assert "step 32" in proc.stderr.decode() and "Traceback" not in text(proc), text(proc)
    assert os.path.isdir(pending), "a reader deleted a writer's unfinished save"


@pytest.mark.long
def test_changed_config_resume(run_copy, capsys):
    """Item 5: a model change is refused before anything is written, naming the key; more
    epochs continue the run on the schedule of the new length. (The refusals in process:
    they come before anything is built.)"""
    workdir = os.path.dirname(run_copy)
    with open(os.path.join(run_copy, "config.json")) as f:
        saved = f.read()
    assert cli.main(train_args(workdir, "model.hidden_dropout=0.2", "train.b1=0.8")) == \
        cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert "model.hidden_dropout: None -> 0.2" in err and "train.b1: None -> 0.8" in err, err
    assert "Traceback" not in err
    with open(os.path.join(run_copy, "config.json")) as f:
        assert f.read() == saved

    proc = jaxaccel(*train_args(workdir, "train.epochs=3"))
    assert proc.returncode == 0, text(proc)
    assert "train.epochs: 2 -> 3" in text(proc) and "total of 48 steps" in text(proc)
    assert steps(run_copy) == [32, 48]
    with open(os.path.join(run_copy, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    lrs = [r["train/learning_rate"] for r in rows if "train/learning_rate" in r and r["step"] > 32]
    assert lrs and all(b < a for a, b in zip(lrs, lrs[1:])), lrs   # decays, no jump back up

    assert cli.main(train_args(workdir, "train.epochs=1")) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert "ends at step 16" in err, err
    with open(os.path.join(run_copy, "config.json")) as f:      # second probe, item 2
        assert json.load(f)["train"]["epochs"] == 3, "a refused resume rewrote config.json"


@pytest.mark.long
def test_one_writer_per_run_folder(run_copy):
    """Item 6: a live holder is refused (named); a dead one's lock is stale and taken over."""
    workdir = os.path.dirname(run_copy)
    lock = os.path.join(run_copy, "lock")
    import socket
    with open(lock, "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
    proc = jaxaccel(*train_args(workdir))
    assert proc.returncode == cli.EXIT_ERROR
    assert f"pid {os.getpid()}" in text(proc) and "in use" in text(proc), text(proc)

    dead = subprocess.Popen(["true"])
    dead.wait()
    with open(lock, "w") as f:
        json.dump({"pid": dead.pid, "host": socket.gethostname()}, f)
    proc = jaxaccel(*train_args(workdir))
    assert proc.returncode == 0, text(proc)
    assert "stale lock" in text(proc) and not os.path.exists(lock)


@pytest.mark.long
def test_ctrl_c_saves_and_exits_cleanly(tmp_path):
    """Item 9: SIGINT is handled like SIGTERM: save the current step, exit with the status of
    a stopped, resumable run (issue 32 item 4: not 0, which `&&` and schedulers read as
    finished)."""
    proc = start(*train_args(tmp_path, "train.epochs=40", "train.log_every=1"))
    metrics = tmp_path / "tiny_synthetic" / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=LONG_WAIT_S)
    assert proc.returncode == cli.EXIT_PREEMPTED == 75, (out + err).decode()
    saved = json.loads(out)["step"]
    assert b"SIGINT: saved step" in err and b"Traceback" not in err
    assert steps(str(tmp_path / "tiny_synthetic"))[-1] == saved


def test_second_ctrl_c_aborts():
    from jaxaccel.train.preemption import Preemption
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with Preemption() as p:
        assert not p.reached()
        os.kill(os.getpid(), signal.SIGINT)
        assert p.requested == "SIGINT" and p.reached() and p.reached()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_predict_at_scale(trained, tmp_path, capsys):
    """Items 8 and 11: texts from a file, batched, JSON lines in input order; a non-UTF-8 line
    is reported and the other texts are still classified. (In process: no trainer runs.)"""
    lines = [f'review "{i}"\t' + "word " * (i % 40) for i in range(300)]
    data = "\n".join(lines[:150]).encode() + b"\nbad \xff\xfe bytes\n" + \
        "\n".join(lines[150:]).encode() + b"\n"
    path = tmp_path / "texts.txt"
    path.write_bytes(data)
    code = cli.main(["predict", "--checkpoint", trained, "--input", str(path),
                     "--batch-size", "64"])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_ERROR, out + err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in records] == list(range(301))
    assert "not valid UTF-8" in records[150]["error"] and "input 150" in err
    good = records[:150] + records[151:]
    assert [r["text"] for r in good] == lines
    assert all(r["label"] in ("0", "1") and 0.5 <= r["probability"] <= 1 for r in good)


def test_missing_peer_times_out_naming_the_coordinator(trained):
    env = {**ENV, "JAXACCEL_COORDINATOR": "localhost:29519", "JAXACCEL_NUM_PROCESSES": "2",
           "JAXACCEL_PROCESS_ID": "1", "JAXACCEL_INIT_TIMEOUT": "3"}
    proc = jaxaccel("eval", "--checkpoint", trained, env=env)
    assert proc.returncode == cli.EXIT_ERROR
    assert "coordinator localhost:29519" in text(proc) and "within 3 s" in text(proc)
    assert "waiting up to 3 s" in text(proc)       # second probe, item 8: said at the start


def test_prediction_record_nan_is_null():
    from jaxaccel.train.inference import prediction_record
    assert json.loads(json.dumps(prediction_record("t", "pos", float("nan")),
                                 allow_nan=False))["probability"] is None


@pytest.mark.parametrize("sets,message", [
    (["train=3"], "'train' is a section"),
    (["train.epochs=none"], "'train.epochs' cannot be None"),
    (["model.name=null"], "'model.name' cannot be None"),
    (["train.keep_checkpoints=0"], "train.keep_checkpoints=0 must be >= 1"),
    (["train.checkpoint_every=-1"], "train.checkpoint_every=-1 must be >= 0"),
    (["train.b1=2.0"], "train.b1=2.0 must be in [0, 1)"),
    (["model.hidden_dropout=2.0"], "model.hidden_dropout=2.0 must be in [0, 1)"),
    (["train.batch_size=12"], "train.batch_size=12 does not split over the 8 devices"),
    # second probe, item 10: the key named; no other key's hint in the message
    (["seed=-1"], "seed=-1 must be >= 0 (the seed of"),
    (["train.weight_decay=-1"], "train.weight_decay=-1.0 must be >= 0 (0: no weight decay)."),
])
def test_bad_values_are_clear_errors(capsys, tmp_path, sets, message):
    """Items 7 and 8 (in process: these fail before anything is built; 8 fake devices)."""
    argv = train_args(tmp_path, *sets)
    assert cli.main(argv) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not os.path.exists(tmp_path / "tiny_synthetic" / "checkpoints")


@pytest.mark.parametrize("body,message", [
    ("def get_config(:\n", "syntax error at line 1"),
    ("def get_config():\n    return 1 / 0\n", "get_config() raised ZeroDivisionError"),
    ("def get_config():\n    return None\n", "expected a dict of overrides"),
    ("import no_such_module\n", "failed to run: ModuleNotFoundError"),
    ("def get_config():\n    return {1: 2}\n", "gave the key(s) [1]"),     # second probe, 6
])
def test_broken_config_files_are_clear_errors(capsys, tmp_path, body, message):
    path = tmp_path / "bad.py"
    path.write_text(body)
    assert cli.main(["train", "--config", str(path)]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert message in err and str(path) in err, err


def test_occupied_output_path_is_a_clear_error(capsys, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    assert cli.main(train_args(tmp_path / "file")) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert "cannot write the run folder" in err and "workdir=" in err, err


# Second fault probe (issue 23).

FP16_DIVERGING = ("precision.policy=fp16", "train.learning_rate=1e30")


@pytest.mark.long
def test_fp16_nan_loss_is_divergence_and_the_last_good_checkpoint_evaluates(tmp_path, capsys,
                                                                            caplog):
    """Item 1: under fp16 a NaN loss was taken for an overflow (skipped step), 25 of them
    stopped the run and the NaN-giving checkpoint of step 26 was called good."""
    proc = jaxaccel(*train_args(tmp_path, *FP16_DIVERGING, "train.checkpoint_every=1"))
    assert proc.returncode == cli.EXIT_NONFINITE, text(proc)
    result = json.loads(proc.stdout)
    assert result["error"] == "loss is nan at step 3", result
    run_dir = str(tmp_path / "tiny_synthetic")
    assert result["last_good_checkpoint"] == 1 and steps(run_dir) == [1], result
    assert os.path.isdir(os.path.join(run_dir, "skipped_checkpoints", "2"))
    ev, _ = evaluate_here(run_dir, capsys, caplog)
    assert ev["step"] == 1 and math.isfinite(ev["loss"]), ev


def test_fp16_stop_at_a_huge_initial_loss_scale_names_that_knob(tmp_path):
    """Item 9: every step skipped because precision.loss_scale_init=1e30 overflows fp16; the
    message blamed train.learning_rate. (Same compiled step as the test above.)"""
    proc = jaxaccel(*train_args(tmp_path, *FP16_DIVERGING, "precision.loss_scale_init=1e30",
                                "precision.max_consecutive_skips=3"))
    assert proc.returncode == cli.EXIT_NONFINITE, text(proc)
    error = json.loads(proc.stdout)["error"]
    assert "Lower precision.loss_scale_init" in error and "learning_rate" not in error, error


def test_resume_without_config_json_compares_with_the_checkpoint_record(run_copy, capsys):
    """Item 2: with config.json gone, a changed optimizer called both good checkpoints
    unreadable and advised deleting them; the correct command was refused afterwards. (The
    refusal in process: it comes before anything is built.)"""
    os.remove(os.path.join(run_copy, "config.json"))
    workdir = os.path.dirname(run_copy)
    assert cli.main(train_args(workdir, "train.optimizer=adan")) == cli.EXIT_ERROR
    out, err = capsys.readouterr()
    assert "train.optimizer: 'adamw' -> 'adan'" in err, out + err
    assert "cannot be read" not in out + err and "Traceback" not in out + err
    assert steps(run_copy) == [16, 32] and not os.path.exists(os.path.join(run_copy, "config.json"))
    assert not os.path.exists(os.path.join(run_copy, "skipped_checkpoints"))
    proc = jaxaccel(*train_args(workdir))
    assert proc.returncode == 0, text(proc)
    assert os.path.exists(os.path.join(run_copy, "config.json"))


@pytest.mark.parametrize("override", ["model.num_labels=5", "precision.policy=bf16",
                                      "train.learning_rate=0.1"])
def test_eval_refuses_overrides_it_cannot_honour(trained, capsys, override):
    """Item 4: a 2-label model scored on 5-label data (loss NaN), a policy silently ignored."""
    assert cli.main(["eval", "--checkpoint", trained, "--set", override]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert f"eval cannot honour --set {override}" in err and "checkpoint" in err, err


def test_a_used_folder_without_checkpoints_is_not_resumed(tmp_path, capsys):
    """Item 5: metrics but an empty checkpoints/ was "resumed" from step 0, appending to the
    old run's metrics."""
    run_dir = tmp_path / "tiny_synthetic"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 4, "train/loss": 0.7}\n')
    assert cli.main(train_args(tmp_path, "train.learning_rate=0.01")) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert "no finished checkpoint to resume from" in err and "train.overwrite=true" in err, err
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 4, "train/loss": 0.7}\n'


def test_json_config_files(tmp_path, capsys):
    """Item 6: a .json config gave an AttributeError traceback; now it is a config file (a run
    folder's config.json is one), and broken JSON is named with its line."""
    from jaxaccel import config
    good = tmp_path / "run.json"
    good.write_text(json.dumps({"name": "j", "train": {"epochs": 3}, "model.num_labels": 3}))
    cfg = config.load(str(good))
    assert (cfg.name, cfg.train.epochs, cfg.model.num_labels) == ("j", 3, 3)
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "j",\n "train": }')
    assert cli.main(["train", "--config", str(bad)]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert f"config file {str(bad)!r} is not valid JSON" in err and "line 2" in err, err


def test_a_known_config_by_its_bare_name(capsys):
    """Item 7: --config tiny_synthetic was "not found" while listed as known."""
    from jaxaccel import config
    assert config.load("tiny_synthetic") == config.load(TINY_CONFIG)
    assert cli.main(["train", "--config", "tiny_synthetc"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert "'tiny_synthetc' not found" in err and "'tiny_synthetic'" in err, err


def test_flat_params_and_optax_adan_resume_each_other():
    """Item 9: the README says the flat-buffer Adan and the optax Adan resume each other's
    checkpoints (tested in test_flat.test_checkpoints_cross_paths_and_meshes), but switching
    train.flat_params was refused."""
    from jaxaccel import config
    from jaxaccel.train import rundir
    adan = ["train.optimizer=adan", "train.optimizer_impl=xla"]
    optax_path = config.build(None, adan).to_dict()
    flat_path = config.build(None, [*adan, "train.flat_params=true"]).to_dict()
    assert rundir.check_resume_config(flat_path, optax_path) == {
        "train.flat_params": (True, False)}
    assert rundir.check_resume_config(optax_path, flat_path) == {
        "train.flat_params": (False, True)}


def test_a_key_added_to_the_base_later_resumes_at_its_default():
    """A run folder saved before a base key existed (here data.tokenizer_vocab) resumes when
    the key keeps its default, and is refused when it changes."""
    from jaxaccel import config
    from jaxaccel.train import rundir
    new = config.build(None, []).to_dict()
    old = config.build(None, []).to_dict()
    del old["data"]["tokenizer_vocab"]
    assert rundir.check_resume_config(old, new) == {}
    changed = config.build(None, ["data.tokenizer_vocab=4096"]).to_dict()
    with pytest.raises(rundir.RunFolderError, match=r"data.tokenizer_vocab: 8192 -> 4096"):
        rundir.check_resume_config(old, changed)


def test_train_without_config_says_it_trains_the_base(tmp_path, caplog):
    """Item 9: no --config silently trained the base config."""
    argv = ["train", "--set", f"workdir={tmp_path}", "--set", "train.batch_size=12"]
    assert cli.main(argv) == cli.EXIT_ERROR            # 12 rows do not split over 8 devices
    assert "no --config: training the base config" in caplog.text, caplog.text


def test_unknown_dataset_names_the_key_and_what_to_type():
    """Item 10: data.name=foo listed `synthetic(...)`, not a value to type."""
    from jaxaccel.data import load_text_dataset
    with pytest.raises(ValueError, match=r"data.name='foo' .*imdb_reviews, canterbury, bfsong, synthetic "):
        load_text_dataset("foo")


def test_a_missing_data_file_is_one_warning_line_with_the_details_in_the_log(run_copy):
    """Item 11: a step whose largest data file is gone fell back correctly, but eval printed
    ~1,260 stderr lines (20 tracebacks, "Event loop is closed", TensorStore specs)."""
    folder = os.path.join(run_copy, "checkpoints", "32", "state")
    os.remove(max((os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs),
                  key=os.path.getsize))
    ev, err = evaluate(run_copy)
    assert ev["step"] == 16 and "Traceback" not in err and "Event loop" not in err, err
    lines = [line for line in err.splitlines() if "step 32" in line]
    assert len(lines) == 1 and "skipped (using step 16)" in lines[0], err
    log = os.path.join(run_copy, "library.log")
    assert log in err
    with open(log) as f:
        assert "Traceback" in f.read()


def test_disk_full_while_saving_is_one_error_naming_folder_size_and_intact_steps(run_copy):
    """Item 11: a save failing with ENOSPC (injected into Orbax's background write) ended a
    resumed run after ~700 lines of Orbax tracebacks and no advice."""
    inject = """
import errno, sys
import orbax.checkpoint as ocp

class Full:
    def result(self, timeout=None):
        raise OSError(errno.ENOSPC, "No space left on device", "ocdbt.process_0/d/0")

    def cancel(self):
        pass

async def full(self, *args, **kwargs):
    return [Full()]

ocp.StandardCheckpointHandler.async_save = full
from jaxaccel import cli
sys.exit(cli.main(sys.argv[1:]))
"""
    proc = subprocess.run([sys.executable, "-c", inject,
                           *train_args(os.path.dirname(run_copy), "train.epochs=3")],
                          capture_output=True, env=ENV, timeout=LONG_WAIT_S)
    assert proc.returncode == cli.EXIT_ERROR, text(proc)
    err = proc.stderr.decode()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    folder = os.path.join(run_copy, "checkpoints")
    assert f"no space left on the device of {folder} to save checkpoint step 48" in errors[0]
    assert "MiB free" in errors[0] and "[16, 32] are intact" in errors[0], errors[0]
    assert steps(run_copy) == [16, 32]
    with open(os.path.join(run_copy, "library.log")) as f:
        assert "No space left on device" in f.read()
