"""The fourth fault probe of the command line (issue 49), each item driven the way the probe's
user drove it: ``jaxaccel.cli.main([...])`` (or the public function the case named) on tiny
models and runs written here. The audio inputs of ``predict`` (items 2-4, 12, 13) are in
test_predict_audio.py, the pipeline's preemption and compositions in test_pipeline_cli.py."""
import dataclasses
import json
import logging

import pytest

from jaxaccel import cli, config
from jaxaccel.train import loop, run as run_lib
from support import TINY, TINY_CONFIG, run_cli


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    """What ``jaxaccel train`` printed of the tiny classifier on synthetic tokens (the
    probe's ``runs/r9``): one epoch, 4 steps."""
    workdir = tmp_path_factory.mktemp("r9")
    result = loop.train(config.build(sets=[*TINY, f"workdir={workdir}", "name=r9",
                                           "train.epochs=1"]))
    assert cli.train_outcome(result) == 0
    return result


@pytest.fixture(scope="module")
def tiny_run(tiny_result):
    """The run folder of ``tiny_result``."""
    return tiny_result["run_dir"]


def train_cli(capsys, workdir, *sets):
    """``jaxaccel train`` on the tiny config: (exit status, stdout, stderr)."""
    return run_cli(capsys, "train", "--config", TINY_CONFIG, "--set", f"workdir={workdir}",
                   "--set", "train.progress=false", *(a for s in sets for a in ("--set", s)))


# ---- item 1: a mesh axis of -1 is the devices the others leave, for every axis ----

def test_a_pipeline_of_minus_one_stages_takes_the_devices_left(tmp_path, caplog, eight_devices):
    """``mesh.stage=-1 mesh.data=1`` made a stage axis of every device and no pipeline (the
    pipeline read -1 as "no stages"): each device computed the whole batch."""
    cfg = config.build(sets=TINY + [f"workdir={tmp_path}", "mesh.stage=-1", "mesh.data=4"])
    with caplog.at_level(logging.INFO, "jaxaccel"):
        r = run_lib.resolve(cfg, eight_devices)
    assert r.stages is not None and r.stages.stages == 2 and r.cfg.mesh.stage == 2
    assert "mesh stage=2, data=4, fsdp=1, tensor=1 over 8 devices (mesh.stage=-1 is 2: the " \
        "devices the other axes leave)" in caplog.text


def test_minus_one_stages_that_the_model_cannot_fill_are_refused(tmp_path, capsys,
                                                                 eight_devices):
    """Through the command: 8 stages for the tiny model's 2 layers (it trained, unpipelined)."""
    code, out, err = train_cli(capsys, tmp_path, "mesh.stage=-1", "mesh.data=1")
    assert code == cli.EXIT_ERROR and out == ""
    assert "the model's 2 layers do not fill mesh.stage=8 stages" in err, err


@pytest.mark.parametrize("axis,size", [("stage", 0), ("data", -2), ("tensor", 0)])
def test_zero_and_negative_mesh_sizes_are_refused(tmp_path, capsys, axis, size):
    code, _, err = train_cli(capsys, tmp_path, f"mesh.{axis}={size}")
    assert code == cli.EXIT_ERROR
    assert f"mesh.{axis}={size}: use a positive size or -1 (fill)." in err


# ---- item 5 (the training side): a seed is 32 bits ----

def test_a_training_seed_outside_32_bits_is_refused(tmp_path, capsys):
    """generate's seeds: test_probe.py (its LM run); a run's seed 2**32 initialised the model
    as seed 0 does, while its data order differed."""
    code, _, err = train_cli(capsys, tmp_path, f"seed={2 ** 32}")
    assert code == cli.EXIT_ERROR
    assert "seed=4294967296 is outside [0, 2**32) = [0, 4294967295]" in err, err


# ---- item 8: a pipeline batch that does not split names each number ----

@pytest.mark.parametrize("sets,says", [
    (["train.batch_size=32", "train.grad_accum=2", "train.microbatches=3"],
     "train.batch_size=32 / train.grad_accum=2: a train step of 16 rows does not split into "
     "train.microbatches=3 micro-batches; use a multiple of 3 rows, or a number of "
     "micro-batches that divides 16."),
    (["train.batch_size=48", "train.eval_batch_size=40", "train.microbatches=3"],
     "train.eval_batch_size=40: an eval step of 40 rows does not split into "
     "train.microbatches=3 micro-batches"),
    (["train.batch_size=15", "mesh.tensor=4", "mesh.data=1"],
     "train.batch_size=15: a train step of 15 rows does not split into 2 "
     "(train.microbatches=0: one per stage of mesh.stage=2) micro-batches"),
])
def test_a_pipeline_batch_that_does_not_split_names_each_number(tmp_path, capsys,
                                                               eight_devices, sets, says):
    """It said `train.batch_size / train.grad_accum=16`, as if grad_accum were 16."""
    code, _, err = train_cli(capsys, tmp_path, "mesh.stage=2", *sets)
    assert code == cli.EXIT_ERROR and says in err, err


# ---- item 9: pipeline settings without a pipeline are not ignored silently ----

def test_pipeline_settings_without_a_pipeline_are_warned_of(tmp_path, capsys, caplog):
    """train.microbatches, model.pipeline_repeats and sharding.pipeline_gather_once were
    ignored without a word with mesh.stage=1. (The batch larger than the data stops the run
    after resolve has warned, so nothing trains.)"""
    with caplog.at_level(logging.WARNING, "jaxaccel"):
        code, _, err = train_cli(capsys, tmp_path, "train.microbatches=4",
                                 "model.pipeline_repeats=2", "sharding.pipeline_gather_once=true",
                                 "train.batch_size=4096")
    assert code == cli.EXIT_ERROR and "train.batch_size=4096" in err
    assert "train.microbatches=4, model.pipeline_repeats=2, sharding.pipeline_gather_once=True: " \
        "pipeline settings, ignored with mesh.stage=1 (no pipeline); set mesh.stage > 1 to " \
        "pipeline, or drop them." in caplog.messages


# ---- item 10: model.init_from problems name the key, and take a checkpoints folder ----

def test_init_from_a_run_never_trained_names_the_key(tmp_path, capsys):
    """It said `no checkpoint folder .../runs/bfsong_mae/checkpoints.`, naming no key."""
    missing = str(tmp_path / "bfsong_mae")
    code, _, err = train_cli(capsys, tmp_path, f"model.init_from={missing}")
    assert code == cli.EXIT_ERROR
    assert err == f"error: model.init_from={missing!r}: {missing!r} is not a run folder: it " \
        "has no checkpoints/ folder. Pass the folder `jaxaccel train` printed.\n"


def test_init_from_takes_a_runs_checkpoints_folder(tiny_run, tmp_path, capsys, caplog):
    """``runs/r9/checkpoints`` became ``.../checkpoints/checkpoints``, though eval, predict and
    generate take that form."""
    with caplog.at_level(logging.INFO, "jaxaccel"):
        code, _, err = train_cli(capsys, tmp_path, *TINY, "train.max_steps=1",
                                 f"model.init_from={tiny_run}/checkpoints")
    assert code == 0, err
    assert any(m.startswith(f"model.init_from={tiny_run}/checkpoints: ") and "parameters from "
               "the run" in m for m in caplog.messages), caplog.messages


# ---- item 11: eval on data the model cannot read names texts and arrays ----

def test_eval_on_arrays_of_a_text_model_names_texts_and_arrays(tiny_run, capsys):
    """It said a "classification model" does not fit "mae/classification batches"."""
    code, out, err = run_cli(capsys, "eval", "--checkpoint", tiny_run, "--set",
                             "data.name=bfsong")
    assert code == cli.EXIT_ERROR and out == ""
    assert err == "error: data.name='bfsong' holds arrays but the model (model.name='tiny') " \
        "reads tokens: it takes a model of the vit family.\n"


# ---- items 6, 7: eval names the split it scored, and never scores training examples ----

def test_an_eval_split_holding_training_examples_is_refused(tiny_run, capsys):
    """Item 6: validation_size=10 held out of the training split of a run trained with
    validation_size=0 was scored without a word: all 10 were trained on."""
    code, out, err = run_cli(capsys, "eval", "--checkpoint", tiny_run, "--set",
                             "data.eval_split=validation", "--set", "data.validation_size=10")
    assert code == cli.EXIT_ERROR and out == ""
    assert err.startswith("error: the eval split 'validation' (data.eval_split='validation', "
                          "data.holdout=0.0, data.validation_size=10) holds 10 of the 10 "
                          "examples it would score from the training split the model trained "
                          "on (data.eval_split='test', data.holdout=0.0, "
                          "data.validation_size=0): a held-out split holds none of them"), err


@pytest.mark.parametrize("trained,asked,overlap", [
    (("data.validation_size=10",), ("data.validation_size=6", "data.eval_split=validation"), 0),
    (("data.validation_size=10",), ("data.validation_size=14", "data.eval_split=validation"),
     4),
    (("data.holdout=0.25", "data.eval_split=dev"), ("data.holdout=0.1",
                                                   "data.eval_split=dev"), 0),
    (("data.holdout=0.1", "data.eval_split=dev"), ("data.holdout=0.25",
                                                  "data.eval_split=dev"), 10),
    ((), ("data.eval_split=train",), None)])
def test_a_held_out_split_up_to_the_runs_own_is_scored(trained, asked, overlap):
    """The rows a validation_size or holdout cuts are the first of a fixed permutation: a
    smaller cut is some of the run's held-out rows, a larger one holds the difference of
    training rows (the training split itself, asked by name, is scored)."""
    from jaxaccel.data import splits
    from jaxaccel.data.spec import DataError, Settings
    data = run_lib.resolve(config.build(sets=[*TINY, *asked]), training=False).data
    data = dataclasses.replace(data, splits=("train", "test"),  # a source without a "dev"
                               trained=Settings(config.build(sets=[*TINY, *trained]).data))
    if overlap:
        with pytest.raises(DataError, match=f"holds {overlap} of the"):
            splits.split_rows(data, data.eval_split, 64)
    else:
        splits.split_rows(data, data.eval_split, 64)


def test_every_eval_report_names_the_split_it_scored(tiny_result, tiny_run, capsys):
    """Item 7: on synthetic data eval_split=validation gave the test split's numbers, and the
    JSON named no split (nor did train's, whose last line said "test" whatever it scored)."""
    reports = {}
    for split in ("test", "validation"):
        code, out, err = run_cli(capsys, "eval", "--checkpoint", tiny_run, "--set",
                                 f"data.eval_split={split}")
        assert code == 0, err
        reports[split] = json.loads(out)
        assert reports[split]["split"] == split
    assert reports["test"]["loss"] != reports["validation"]["loss"]
    assert tiny_result["eval_split"] == "test"
    assert tiny_result["eval_loss"] == pytest.approx(reports["test"]["loss"], rel=1e-5)
    assert tiny_result["summary"].startswith("final test accuracy: ")


# ---- items 14-18: compile checks its arguments before compiling, and says what it did ----

def compile_cli(capsys, *argv):
    return run_cli(capsys, "compile", "--config", TINY_CONFIG, *argv)


@pytest.mark.parametrize("topology", ["v9,foo", "v9", "v9,local"])
def test_a_bad_topology_name_refuses_the_command_however_many_are_given(capsys, topology):
    """Item 14: `v9,foo` exited 4 (does not fit) while `v9` exited 2; `v9,local` compiled
    local before saying v9 is unknown."""
    code, out, err = compile_cli(capsys, "--topology", topology)
    assert code == cli.EXIT_ERROR and out == ""
    assert err.startswith("error: unknown topology 'v9' (no target 'v9'); known: "), err


def test_a_config_every_target_refuses_exits_as_for_one_target(capsys, eight_devices):
    """Item 14: one target refusing the config exits 2; several each refusing it exited 4."""
    code, out, err = compile_cli(capsys, "--topology", "local", "--set", "mesh.tensor=3")
    assert code == cli.EXIT_ERROR and "does not divide the 8 devices" in err
    code, out, err = compile_cli(capsys, "--topology", "local,local", "--set", "mesh.tensor=3")
    assert code == cli.EXIT_ERROR, (out, err)
    assert err.count("error: local: ") == 2 and "does not divide the 8 devices" in err


@pytest.mark.parametrize("memory", ["0", "-1", "nan", "inf"])
@pytest.mark.parametrize("fit", [(), ("--fit",)])
def test_memory_is_checked_before_compiling(capsys, memory, fit):
    """Item 15: 0 compiled, then a ZeroDivisionError traceback (with --fit too); -1 and nan
    compiled and then did not fit, with advice that cannot help; inf printed `headroom inf GB
    (nan%)`."""
    code, out, err = compile_cli(capsys, "--topology", "local", "--memory", memory, *fit)
    assert code == cli.EXIT_ERROR and out == ""
    assert err == f"error: --memory {float(memory)}: the memory per device to plan against, " \
        "in GB, must be a finite number > 0 (e.g. --memory 16).\n"


def test_fit_on_a_config_that_is_no_valid_run_exits_with_the_reason(capsys, eight_devices):
    """Item 16: `--fit 2` said "nothing tried fits" and "2 configurations compiled" (none
    was) and exited 4; without --fit the same config exits 2 with the reason."""
    sets = ("--set", "mesh.stage=2", "--set", "train.microbatches=1")
    plain = compile_cli(capsys, "--topology", "local", *sets)
    fit = compile_cli(capsys, "--topology", "local", *sets, "--fit", "2")
    assert plain == fit
    assert fit[0] == cli.EXIT_ERROR and fit[1] == ""
    assert fit[2].startswith("error: train.microbatches=1 is fewer than mesh.stage=2")


def test_the_fit_summary_counts_what_was_compiled():
    """Item 16: refused candidates (not valid runs, steps that cannot be built) were counted
    as compiled."""
    from jaxaccel.plan import search
    tried = [search.Candidate({}, None, "the TPU compiler refuses it", "train"),
             search.Candidate({"train.grad_accum": 2}, None, "not a valid run: ...",
                              compiled=False)]
    summary = search.Search("v5e:1x1", tried, None, None).summary()
    assert summary.startswith("fit search on v5e:1x1: 2 configurations tried, 1 compiled\n")
    assert search.Search("v5e:1x1", tried[:1], None, None).summary().startswith(
        "fit search on v5e:1x1: 1 configurations compiled\n")


@pytest.mark.parametrize("suite", ["backtest", "pipeline"])
def test_bench_checks_its_output_folder_before_any_work(tmp_path, capsys, suite):
    """Item 17: `bench backtest --out afile` did all the work, then failed with a raw errno.
    (The suites that write a result file take --out through bench.common, checked when the
    flags are read: argparse's usage error, exit 2.)"""
    afile = tmp_path / "afile"
    afile.write_text("")
    try:
        code, out, err = run_cli(capsys, "bench", suite, "--out", str(afile))
    except SystemExit as e:
        code, (out, err) = e.code, capsys.readouterr()
    assert code == cli.EXIT_ERROR and out == "", out
    assert f"--out {str(afile)!r}: {str(afile)!r} is a file, not a folder" in err, err


# ---- item 19: what is left of the last round ----

@pytest.fixture
def r9_copy(tiny_run, tmp_path):
    import shutil
    shutil.copytree(tiny_run, tmp_path / "r9")
    return str(tmp_path / "r9")


def test_a_refused_resume_does_not_say_it_resumed(r9_copy, capsys, caplog):
    """`INFO resumed from ... at step 40` was printed just before the resume was refused."""
    sets = [*TINY, f"workdir={r9_copy[:-3]}", "name=r9"]
    with caplog.at_level(logging.INFO, "jaxaccel"):
        code, _, err = train_cli(capsys, r9_copy[:-3], *sets, "train.max_steps=2")
    assert code == cli.EXIT_ERROR and "ends at step 2" in err
    assert not [m for m in caplog.messages if m.startswith("resumed from")], caplog.messages
    with caplog.at_level(logging.INFO, "jaxaccel"):
        code, _, err = train_cli(capsys, r9_copy[:-3], *sets, "train.max_steps=5")
    assert code == 0, err
    assert f"resumed from {r9_copy}/checkpoints at step 4" in caplog.messages


def test_a_user_without_torch_sees_no_notice_about_it(tiny_run):
    """`[transformers] PyTorch was not found. Models won't be available ...` was printed by
    most commands (transformers says it when imported without torch); torch is hidden from a
    fresh process here, as if not installed."""
    import subprocess
    import sys

    from support import LONG_WAIT_S, cpu_env
    script = ("import sys; sys.modules['torch'] = None\n"
              "from jaxaccel import cli; sys.exit(cli.main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", script, "predict", "--checkpoint", tiny_run,
                           "3 5 7"], env=cpu_env(), capture_output=True, text=True,
                          timeout=LONG_WAIT_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith('{"index": 0, "text": "3 5 7", "label": ')
    assert "torch" not in done.stderr.lower(), done.stderr
