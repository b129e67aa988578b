"""The third fault probe of the command line (issue 32), each item driven the way the probe's
user drove it: ``jaxaccel.cli.main([...])`` (or the public function the case named) on tiny
models and checkpoints written here; and the fourth probe's (issue 49) cases that need this
module's checkpoints and runs (the others: test_probe4.py)."""
import json
import os

import pytest

from jaxaccel import cli
from support import CONFIGS, TINY_CONFIG, needs_libtpu, run_cli

FINETUNE = os.path.join(CONFIGS, "canterbury_lm_finetune.py")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny Llama checkpoint folder (config.json + model.safetensors) in transformers' form."""
    from jaxaccel.models import LLAMA_PRESETS, ModelSpec, build_model, save_checkpoint
    path = str(tmp_path_factory.mktemp("probe") / "llama")
    save_checkpoint(build_model(ModelSpec(LLAMA_PRESETS["llama-tiny"])), path)
    return path


@pytest.fixture
def llama_copy(llama_dir, tmp_path):
    import shutil
    dest = str(tmp_path / "llama")
    shutil.copytree(llama_dir, dest)
    return dest


def edit_config(path, **changes):
    """Rewrite the checkpoint's config.json with ``changes`` (None removes a key)."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    for key, value in changes.items():
        cfg.pop(key, None) if value is None else cfg.__setitem__(key, value)
    with open(file, "w") as f:
        json.dump(cfg, f)


# ---- item 1: RoPE settings read the way transformers reads them ----

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
ROPE_FILES = {   # config.json RoPE keys, each as some transformers version writes or reads them
    "v5 default, its own theta over the top level":
        dict(rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, rope_theta=2e4),
    "v4 top-level theta": dict(rope_theta=500.0, rope_scaling=None),
    "v5 llama3": dict(rope_parameters={**LLAMA3, "rope_theta": 5e5}),
    "v4 llama3 beside a v5 default: rope_scaling wins":
        dict(rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
             rope_scaling=LLAMA3, rope_theta=2e4),
    "llama3 without its original length": dict(rope_scaling={
        k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}),
    "legacy 'type' key": dict(rope_scaling={"type": "default"}, rope_theta=300.0),
}


@pytest.mark.parametrize("rope", ROPE_FILES.values(), ids=ROPE_FILES.keys())
def test_llama_rope_settings_are_read_as_transformers_reads_them(rope):
    import transformers

    from jaxaccel.models import LLAMA_PRESETS, LlamaConfig
    d = {**LLAMA_PRESETS["llama-tiny"].to_hf(), "max_position_embeddings": 256,
         "rope_scaling": None, "rope_theta": None, **rope}
    d = {k: v for k, v in d.items() if v is not None}
    ours = LlamaConfig.from_dict(json.loads(json.dumps(d)))
    theirs = transformers.LlamaConfig.from_dict(json.loads(json.dumps(d))).rope_parameters
    assert ours.rope_theta == theirs["rope_theta"]
    kind = theirs["rope_type"]
    assert (ours.rope_scaling is None) == (kind == "default")
    if ours.rope_scaling is not None:
        assert dict(ours.rope_scaling) == {k: theirs[k] for k in dict(ours.rope_scaling)}


def test_a_linear_rope_scaling_beside_a_default_rope_parameters_is_refused(llama_copy, tmp_path,
                                                                         capsys):
    """The probe's file: transformers 5 reads rope_scaling (linear, factor 2) in place of
    rope_parameters (default); jaxaccel fine-tuned it with plain RoPE."""
    from jaxaccel.models.hf_llama import from_pretrained
    edit_config(llama_copy, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                rope_scaling={"rope_type": "linear", "factor": 2.0})
    message = (r"rope_scaling=\{'rope_type': 'linear', 'factor': 2.0\}: RoPE scaling 'linear' "
               r"is not supported .*transformers reads rope_scaling in place of "
               r"rope_parameters .*drop rope_scaling")
    with pytest.raises(ValueError, match=message):
        from_pretrained(llama_copy)
    assert cli.main(["train", "--config", FINETUNE, "--set", f"model.checkpoint={llama_copy}",
                     "--set", f"workdir={tmp_path / 'runs'}"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert "config.json: rope_scaling=" in err and "'linear' is not supported" in err, err


# ---- item 3: predict gives empty and whitespace-only texts an error record ----

@pytest.fixture(scope="module")
def classifier_run(tmp_path_factory):
    """A finished run folder of the tiny classifier (one epoch)."""
    from support import TINY
    workdir = tmp_path_factory.mktemp("cls_runs")
    sets = [*TINY, f"workdir={workdir}", "name=cls", "train.epochs=1"]
    assert cli.main(["train", *(a for s in sets for a in ("--set", s))]) == 0
    return str(workdir / "cls")


def test_predict_gives_empty_and_blank_texts_an_error_record(classifier_run, tmp_path, capsys):
    lines = tmp_path / "texts.txt"
    lines.write_bytes(b"3 5 7\n\n \t \n9 11\n")
    assert cli.main(["predict", "--checkpoint", classifier_run, "--input", str(lines), "",
                     "  ", "4 6"]) == cli.EXIT_ERROR
    out = capsys.readouterr()
    records = [json.loads(line) for line in out.out.splitlines()]
    assert [r["index"] for r in records] == list(range(7))
    errors = {r["index"]: r["error"] for r in records if "error" in r}
    assert sorted(errors) == [0, 1, 4, 5] and all("label" not in records[i] for i in errors)
    assert errors[0] == "input '' is empty or only whitespace: there is nothing to classify; " \
                        "not classified"
    assert errors[5] == "input ' \\t ' is empty or only whitespace: there is nothing to " \
                        "classify; not classified"
    assert [records[i]["text"] for i in (2, 3, 6)] == ["4 6", "3 5 7", "9 11"]
    assert all("label" in records[i] for i in (2, 3, 6))
    assert "error: input 5: input ' \\t ' is empty" in out.err
    # Nothing to classify at all: every text an error record, no model call.
    assert cli.main(["predict", "--checkpoint", classifier_run, " "]) == cli.EXIT_ERROR
    assert "error" in json.loads(capsys.readouterr().out)


# ---- item 4: a run stopped by SIGTERM exits with a status of its own ----

@pytest.mark.long
def test_a_run_stopped_by_sigterm_exits_with_the_resumable_status(tmp_path, capsys):
    """Exit 0 made `jaxaccel train ... && jaxaccel eval ...` and schedulers go on as if the
    run had finished; 75 (EX_TEMPFAIL) says stopped, resumable; the same command resumes."""
    from jaxaccel import config
    from jaxaccel.train import loop
    from support import TINY, sigterm_at
    sets = [*TINY, f"workdir={tmp_path}", "train.epochs=3"]
    train = ["train", *(a for s in sets for a in ("--set", s))]
    stopped = loop.train(config.build(sets=sets), sigterm_at(6))
    assert cli.train_outcome(stopped) == cli.EXIT_PREEMPTED == 75
    out = capsys.readouterr()
    assert json.loads(out.out)["status"] == "preempted"
    assert "SIGTERM: saved step 6" in out.err and "(exit status 75: stopped, resumable)" in out.err
    assert cli.main(train) == 0
    assert json.JSONDecoder().raw_decode(capsys.readouterr().out)[0]["status"] == "completed"


# ---- a trained LM run (the probe's LM job, shrunk): items 2 onwards ----

LM_CONFIG = os.path.join(CONFIGS, "canterbury_lm.py")


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory, brotli_sdist):
    from jaxaccel.data import canterbury
    tmp = tmp_path_factory.mktemp("canterbury")
    canterbury.prepare(str(tmp / "tfds"), source=brotli_sdist)
    return str(tmp / "tfds")


def lm_sets(workdir, corpus_dir, *more):
    """``--set`` flags of configs/canterbury_lm.py shrunk to seconds: 2 steps of 4 rows of 32
    tokens, a 512-token BPE, on the module's corpus folder."""
    sets = [f"workdir={workdir}", f"data.data_dir={corpus_dir}", "data.tokenizer_vocab=512",
            "data.max_len=32", "train.max_steps=2", "train.batch_size=8",
            "train.eval_batch_size=64", "train.progress=false", *more]
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory, corpus_dir):
    """A finished run folder of the LM job (llama-cpu, 2 steps)."""
    workdir = tmp_path_factory.mktemp("lm_runs")
    assert cli.main(["train", "--config", LM_CONFIG, *lm_sets(workdir, corpus_dir)]) == 0
    return str(workdir / "canterbury_lm")


# ---- item 2: generate refuses a temperature that is not a finite number ----

@pytest.mark.parametrize("temperature", ["nan", "inf", "-inf"])
def test_generate_refuses_a_non_finite_temperature(lm_run, capsys, temperature):
    assert cli.main(["generate", "--checkpoint", lm_run, f"--temperature={temperature}",
                     "Alice was"]) == cli.EXIT_ERROR
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1, out
    assert f"temperature={float(temperature)} must be a finite number >= 0" in out.err


@pytest.mark.parametrize("seed", [2 ** 32, 99999999999999999999999, -1])
def test_generate_refuses_a_seed_outside_32_bits(lm_run, capsys, seed):
    """Issue 49 item 5: 2**32 printed seed 0's text (kept modulo 2**32), a larger seed was an
    OverflowError traceback."""
    assert cli.main(["generate", "--checkpoint", lm_run, f"--seed={seed}", "Alice was"]) == \
        cli.EXIT_ERROR
    out = capsys.readouterr()
    assert out.out == "" and out.err == f"error: seed={seed} is outside [0, 2**32) = [0, " \
        "4294967295] (a seed is 32 bits: 2**32 would draw seed 0's sample); give a seed in " \
        "that range.\n", out


# ---- item 6: a damaged checkpoint folder is one error naming the file ----

@pytest.fixture
def bert_copy(tmp_path):
    """A tiny random BERT as transformers saves it (config.json + model.safetensors)."""
    import transformers
    path = str(tmp_path / "bert")
    transformers.BertModel(transformers.BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64)).save_pretrained(path)
    return path


def truncate(file):
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)


def test_a_truncated_safetensors_file_is_named(bert_copy, llama_copy):
    from jaxaccel.models import from_pretrained as bert_from_pretrained
    from jaxaccel.models.hf_llama import from_pretrained
    for path, load in ((bert_copy, bert_from_pretrained), (llama_copy, from_pretrained)):
        file = os.path.join(path, "model.safetensors")
        truncate(file)
        size = os.path.getsize(file)
        with pytest.raises(ValueError, match=f"{file} \\({size:,} bytes\\) is not a readable "
                                             "safetensors file .* truncated or damaged; copy or "
                                             "download the checkpoint again"):
            load(path)


def test_a_config_json_that_is_not_json_is_named(bert_copy, llama_copy):
    from jaxaccel.models import from_pretrained as bert_from_pretrained
    from jaxaccel.models.hf_llama import from_pretrained
    for path, load in ((bert_copy, bert_from_pretrained), (llama_copy, from_pretrained)):
        file = os.path.join(path, "config.json")
        with open(file, "w") as f:
            f.write('{\n  model_type: "llama"}')      # edited by hand: a key without quotes
        with pytest.raises(ValueError, match=f"{file} is not valid JSON \\(Expecting property "
                                             "name enclosed in double quotes at line 2, column "
                                             "3\\); .* copy or download that file again"):
            load(path)


def test_train_from_a_damaged_checkpoint_is_one_error_line(bert_copy, tmp_path, capsys):
    """The probe's CLI case: model.checkpoint with a truncated model.safetensors (a
    SafetensorError traceback naming no file), then with a config.json that is not JSON."""
    train = ["train", "--config", TINY_CONFIG,
             "--set", f"model.checkpoint={bert_copy}", "--set", f"workdir={tmp_path / 'runs'}"]
    weights, config_json = (os.path.join(bert_copy, f) for f in ("model.safetensors",
                                                                 "config.json"))
    truncate(weights)
    assert cli.main(train) == cli.EXIT_ERROR
    assert f"error: {weights} (" in capsys.readouterr().err
    with open(config_json, "w") as f:
        f.write("{")
    assert cli.main(train) == cli.EXIT_ERROR
    assert f"error: {config_json} is not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("setting,says", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"head_dim": 15}, "head_dim=15 must be even"),
    ({"num_key_value_heads": 3}, "num_attention_heads=8 is not a multiple of "
                                 "num_key_value_heads=3"),
])
def test_a_checkpoint_config_refused_by_the_architecture_names_its_file(llama_copy, bert_copy,
                                                                        tmp_path, capsys,
                                                                        setting, says):
    """Issue 49 item 19: the checks of the architecture itself (``__post_init__``) named no
    file, where the loader's own checks did."""
    edit_config(llama_copy, **setting)
    assert cli.main(["train", "--config", FINETUNE, "--set", f"model.checkpoint={llama_copy}",
                     "--set", f"workdir={tmp_path / 'runs'}"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"error: {os.path.join(llama_copy, 'config.json')}: {says}"), err
    if "hidden_act" in setting:
        from jaxaccel.models import from_pretrained as bert_from_pretrained
        edit_config(bert_copy, hidden_act="swish")
        with pytest.raises(ValueError, match=f"^{os.path.join(bert_copy, 'config.json')}: "
                                             "hidden_act='swish' is not supported"):
            bert_from_pretrained(bert_copy)


# ---- item 5: eval refuses data.tokenizer_vocab, which it cannot honour ----

def test_eval_refuses_a_tokenizer_vocab_override(lm_run, capsys):
    assert cli.main(["eval", "--checkpoint", lm_run, "--set",
                     "data.tokenizer_vocab=300"]) == cli.EXIT_ERROR
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.strip() == (
        "error: eval cannot honour --set data.tokenizer_vocab=300: the texts are tokenized by "
        "the run's own tokenizer (its tokenizer/ folder), whatever vocabulary size is set. Drop "
        "the override, or train a run with that setting.")


# ---- item 5b: an LM eval batch larger than the eval split is clamped before any work ----

def final_eval(run_dir) -> dict:
    """The run's last evaluation as its metrics.jsonl logged it (batches of 64 rows)."""
    from jaxaccel.train.metrics import read_metrics
    return [r for r in read_metrics(run_dir) if "eval/loss" in r][-1]


def test_an_lm_eval_batch_larger_than_the_split_is_one_batch(lm_run, caplog, capsys):
    """The probe's eval --set train.eval_batch_size=100000 (a RESOURCE_EXHAUSTED traceback for
    485 GB of logits): the split's rows go in one batch, and the report is the training's own
    (batches of 64 rows)."""
    import logging
    with caplog.at_level(logging.INFO, logger="jaxaccel"):
        assert cli.main(["eval", "--checkpoint", lm_run, "--set",
                         "train.eval_batch_size=100000"]) == 0
    report, reference = json.loads(capsys.readouterr().out), final_eval(lm_run)
    assert report["tokens"] == reference["eval/tokens"]
    assert report["loss"] == pytest.approx(reference["eval/loss"], rel=1e-5)
    assert "train.eval_batch_size=100000 is more than the" in caplog.text
    assert "'validation' split: evaluating them in one batch of" in caplog.text


def test_training_with_an_eval_batch_larger_than_the_split(lm_run, tmp_path, corpus_dir,
                                                            capsys):
    """The same in train's own evaluation: the run of the lm_run fixture, but for its eval
    batch, ends with the same evaluation."""
    assert cli.main(["train", "--config", LM_CONFIG, *lm_sets(
        tmp_path, corpus_dir, "train.eval_batch_size=100000")]) == 0
    result = json.JSONDecoder().raw_decode(capsys.readouterr().out)[0]
    reference = final_eval(lm_run)
    assert result["status"] == "completed" and result["eval_tokens"] == reference["eval/tokens"]
    assert result["eval_loss"] == pytest.approx(reference["eval/loss"], rel=1e-5)


# ---- item 7: generate names a prompt that is not UTF-8, and a top-k past the vocabulary ----

def test_generate_refuses_a_prompt_that_is_not_utf8(lm_run, capsys):
    """An undecodable argument byte (argv holds it as a surrogate) was a 21-line TypeError
    traceback from the tokenizer."""
    assert cli.main(["generate", "--checkpoint", lm_run, "Alice was",
                     "bad \udcff bytes"]) == cli.EXIT_ERROR
    out = capsys.readouterr()
    assert out.out == "" and out.err.strip() == (
        "error: prompt 1 is not valid UTF-8 (surrogates not allowed at byte 4); give prompts "
        "as UTF-8 text.")


def test_generate_refuses_a_top_k_past_the_vocabulary(lm_run, capsys):
    """JAX's own "k argument to top_k must be no larger than size along axis" named neither
    the flag nor the limit."""
    assert cli.main(["generate", "--checkpoint", lm_run, "--top-k", "3000",
                     "Alice was"]) == cli.EXIT_ERROR
    out = capsys.readouterr()
    assert out.out == "" and out.err.strip() == (
        "error: top_k=3000 must be between 0 (no top-k cut) and the model's vocabulary of 2048 "
        "tokens; give at most 2048.")
    assert cli.main(["generate", "--checkpoint", lm_run, "--top-k", "2048",
                     "--max-new-tokens", "2", "Alice was"]) == 0


# ---- item 8: eval on data of another task says so ----

def test_eval_on_data_of_another_task_names_both_tasks(lm_run, classifier_run, capsys):
    """An LM run on labelled data printed `error: positions` (a bare KeyError); a classifier
    on the corpus blamed the tokenizer's EOS token."""
    assert cli.main(["eval", "--checkpoint", lm_run, "--set",
                     "data.name=rt_snippets"]) == cli.EXIT_ERROR
    assert capsys.readouterr().err.strip() == (
        f"error: eval --set data.name=rt_snippets: the run {lm_run!r} trained a causal_lm "
        "model (on data.name='canterbury'), but 'rt_snippets' gives classification batches; "
        "evaluate it on a corpus (e.g. data.name=canterbury).")
    assert cli.main(["eval", "--checkpoint", classifier_run, "--set",
                     "data.name=canterbury"]) == cli.EXIT_ERROR
    assert capsys.readouterr().err.strip() == (
        f"error: eval --set data.name=canterbury: the run {classifier_run!r} trained a "
        "classification model (on data.name='synthetic'), but 'canterbury' gives causal_lm "
        "batches; evaluate it on a labelled dataset (e.g. data.name=rt_snippets).")


# ---- item 9: no exception reaches the user as one bare word ----

def test_an_internal_key_error_is_a_sentence_naming_where(capsys):
    """compile of a decoder config printed `error: target_weights`: the catch-all printed an
    internal KeyError's key as the whole message (``lookup`` stands in for the lookup that
    failed, since fixed; the catch-all prints ``cli.error_message``)."""
    def lookup():
        return {}["target_weights"]
    with pytest.raises(KeyError) as e:
        lookup()
    line = lookup.__code__.co_firstlineno + 1
    assert cli.error_message(e.value) == (
        f"KeyError 'target_weights' at test_probe.py:{line} (lookup): jaxaccel should have "
        "refused this command with a sentence; please report it with the command line.")
    assert cli.main(["train", "--set", "trian.epochs=2"]) == cli.EXIT_ERROR   # a sentence
    assert capsys.readouterr().err.startswith("error: unknown config key 'trian.epochs'.")


# ---- item 10: compile names 'local' sizes, checks --out, and cuDNN against the target ----

def test_compile_refuses_a_sized_local_target(capsys):
    """'local:2' said there is no target 'local' while listing `local`."""
    code, out, err = run_cli(capsys, "compile", "--config", TINY_CONFIG, "--topology", "local:2")
    assert code == cli.EXIT_ERROR and out == ""
    assert err.strip() == (
        "error: topology 'local:2': 'local' takes no size: it is this machine's devices as "
        "they are (all of jax.devices()). Give --topology local, or a TPU slice or GPU hosts "
        "of the size wanted (e.g. v5e:2x4, h100:1x2).")


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_compile_checks_out_before_compiling(tmp_path, capsys, where):
    """--out naming an existing file was found only after the compile (the plan printed, then
    a FileExistsError)."""
    file = tmp_path / "plan.json"
    file.write_text("{}")
    out_dir = file if where == "a file" else file / "results"
    code, out, err = run_cli(capsys, "compile", "--config", TINY_CONFIG, "--topology", "local",
                             "--out", str(out_dir))
    assert code == cli.EXIT_ERROR and out == "", out       # nothing compiled, no plan
    assert err.strip() == (f"error: --out {str(out_dir)!r}: {str(file)!r} is a file, not a "
                           "folder; --out names the folder the result file is written into "
                           "(made if missing).")
    assert file.read_text() == "{}"


@needs_libtpu
@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_compile_refuses_cudnn_attention_for_a_tpu_first(capsys, policy):
    """cuDNN attention planned for a TPU named the target 'cpu' (bf16), or gave the fp32
    advice, after which bf16 was refused again: one refusal naming the target, whatever the
    policy."""
    code, out, err = run_cli(capsys, "compile", "--config", TINY_CONFIG, "--topology", "v5e-8",
                             "--set", "model.attention_impl=cudnn",
                             "--set", f"precision.policy={policy}")
    assert code == cli.EXIT_ERROR and out == ""
    assert err.strip() == (
        "error: model.attention_impl='cudnn' runs on GPUs only, and the devices of the "
        "target v5e:2x4 are TPUs: use model.attention_impl='auto' (the best kernel the target "
        "has), 'pallas' or 'xla'."), err


# ---- item 13: a command prints only what jaxaccel has to say ----

def jaxaccel_process(*argv, **env):
    """``jaxaccel *argv`` in a fresh process (start-up is the point): the CompletedProcess."""
    import subprocess

    from support import CLI, LONG_WAIT_S, cpu_env
    environ = {k: v for k, v in cpu_env().items() if k not in env}
    environ.update({k: v for k, v in env.items() if v is not None})
    return subprocess.run([*CLI, *argv], env=environ, capture_output=True, text=True,
                          timeout=LONG_WAIT_S)


@needs_libtpu
@pytest.mark.long
def test_compile_for_a_tpu_prints_no_start_up_noise():
    """With the aot extra, every CPU command printed the CUDA plugin's `cudart_stub ... Could
    not find cuda drivers` (4 times, each after absl's preamble) and a TPU compile libtpu's
    "Failed to find host bounds" and "E0000 ... unexpected worker hostname" lines, also with
    JAX_PLATFORMS=cpu (cpu_env) and on a successful compile."""
    done = jaxaccel_process("compile", "--config", TINY_CONFIG, "--topology", "v5e-8")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("target v5e:2x4: 8 x TPU v5 lite, 8 chips")
    assert all(line.startswith(("INFO jaxaccel: ", "WARNING jaxaccel: "))
               for line in done.stderr.splitlines()), done.stderr


def test_a_refused_command_prints_its_error_line_alone():
    """Without JAX_PLATFORMS (the CLI chooses the CPU where no accelerator is attached): the
    error line and nothing else."""
    done = jaxaccel_process("compile", "--config", TINY_CONFIG, "--topology", "local:2",
                            JAX_PLATFORMS=None)
    assert done.returncode == cli.EXIT_ERROR and done.stdout == ""
    assert done.stderr.splitlines() == [
        "error: topology 'local:2': 'local' takes no size: it is this machine's devices as "
        "they are (all of jax.devices()). Give --topology local, or a TPU slice or GPU hosts "
        "of the size wanted (e.g. v5e:2x4, h100:1x2)."]


def test_the_start_up_filter_drops_only_the_known_lines(capfd):
    """Exactly the known lines are dropped; a real native error, and Python's stderr, pass."""
    from jaxaccel.distributed import native_noise_filtered
    noise = (b"WARNING: All log messages before absl::InitializeLog() is called are written to "
             b"STDERR\n"
             b"I0000 00:00:1795626969.540827    4961 cudart_stub.cc:31] Could not find cuda "
             b"drivers on your machine, GPU will not be used.\n")
    real = (b"E0000 00:00:1795626970.654754    4961 common_lib.cc:554] INVALID_ARGUMENT: a real "
            b"error\n"
            b"I0000 00:00:1795626969.540827    4961 cudart_stub.cc:31] Could not find cuda "
            b"drivers on your machine, GPU will not be used. And more.\n")
    with native_noise_filtered():
        os.write(2, noise + real + noise)
        import sys
        sys.stderr.write("python's own stderr\n")     # one write: the pump runs meanwhile
    err = capfd.readouterr().err      # (capfd takes Python's stderr apart from descriptor 2)
    assert sorted(err.splitlines(True)) == sorted([*real.decode().splitlines(True),
                                                   "python's own stderr\n"]), err


# ---- item 11: a batch larger than the data names train.batch_size and the data's size ----

def test_a_train_batch_larger_than_the_data_names_the_key_and_the_size(tmp_path, capsys):
    """It named BatchIterator and drop_remainder, neither of them a config key."""
    from support import TINY
    sets = [*TINY, f"workdir={tmp_path}", "train.batch_size=4096"]
    code, out, err = run_cli(capsys, "train", *(a for s in sets for a in ("--set", s)))
    assert code == cli.EXIT_ERROR and out == ""
    assert err.strip() == (
        "error: train.batch_size=4096 is more than the 64 examples of the 'synthetic' 'train' "
        "split: no full batch to train on. Set train.batch_size to at most 64 (a multiple of "
        "the device count), or train on more data."), err


# ---- item 12: a refused command changes nothing, and leaves no folder it made ----

def test_refused_commands_leave_no_folder_and_no_events_file(tmp_path, capsys):
    """A batch the data cannot fill (refused when the data is read, after the folder was made)
    left an empty run folder; a resume refused for its length left a new TensorBoard events
    file in the run's folder."""
    from support import TINY
    args = [a for s in [*TINY, f"workdir={tmp_path}"] for a in ("--set", s)]
    code, _, _ = run_cli(capsys, "train", *args, "--set", "train.batch_size=4096")
    assert code == cli.EXIT_ERROR and not os.listdir(tmp_path)
    assert run_cli(capsys, "train", *args, "--set", "train.max_steps=4")[0] == 0
    events = sorted(os.listdir(tmp_path / "run" / "tensorboard"))
    code, _, err = run_cli(capsys, "train", *args, "--set", "train.max_steps=2")
    assert code == cli.EXIT_ERROR and "ends at step 2" in err, err
    assert sorted(os.listdir(tmp_path / "run" / "tensorboard")) == events


# ---- item 11: data.tokenizer_vocab is checked, by its name, before a BPE is trained ----

@pytest.mark.parametrize("vocab,says", [
    (5, "data.tokenizer_vocab=5 is too small: a byte-level BPE needs its 256 byte symbols"),
    (100000, "data.tokenizer_vocab=100000 is more than the model's vocab_size=256 "
             "(model.name='llama-tiny')")])
def test_the_bpe_size_is_refused_by_its_key_before_the_bpe_is_trained(tmp_path, capsys, vocab,
                                                                       says):
    """5 named BPE's vocab_size; 100000 was refused only after a BPE of that size had been
    trained and cached. Now both are refused before the corpus is read (none is built here)."""
    code, out, err = run_cli(capsys, "train", "--set", "model.name=llama-tiny", "--set",
                             "data.name=canterbury", "--set", f"data.data_dir={tmp_path}",
                             "--set", f"data.tokenizer_vocab={vocab}", "--set",
                             f"workdir={tmp_path}")
    assert code == cli.EXIT_ERROR and err.startswith(f"error: {says}"), err
    assert not os.listdir(tmp_path)


# ---- item 14: a failed save or read leaves no folder behind and prints nothing after the error ----

@pytest.fixture
def cls_copy(classifier_run, tmp_path):
    """A copy of the classifier run (checkpoint step 4), to change."""
    import shutil
    dest = str(tmp_path / "cls")
    shutil.copytree(classifier_run, dest)
    return dest


def cls_sets(run_dir, *more):
    from support import TINY
    return [a for s in [*TINY, f"workdir={os.path.dirname(run_dir)}", "name=cls", *more]
            for a in ("--set", s)]


def test_a_full_disk_leaves_no_unfinished_save(cls_copy, capsys, caplog, monkeypatch):
    """The probe's full disk kept `checkpoints/8.orbax-checkpoint-tmp` (on the disk that was
    full) after the error line. ENOSPC is injected into Orbax's background write, as in
    test_faults; the next resume also says which unfinished saves it removes (one left by a
    process killed while saving)."""
    import errno
    import logging

    import orbax.checkpoint as ocp

    from jaxaccel.train import checkpoint

    class Full:
        def result(self, timeout=None):
            raise OSError(errno.ENOSPC, "No space left on device", "ocdbt.process_0/d/0")

        def cancel(self):
            pass

    async def full(self, *args, **kwargs):
        return [Full()]
    folder = os.path.join(cls_copy, "checkpoints")
    with monkeypatch.context() as m:
        m.setattr(ocp.StandardCheckpointHandler, "async_save", full)
        code, out, err = run_cli(capsys, "train", *cls_sets(cls_copy, "train.epochs=2"))
    assert code == cli.EXIT_ERROR
    # Issue 49 item 19: the size is step 4's on disk (it said 23.3 MiB, the state's arrays in
    # memory, where a checkpoint took 8.9 MB).
    on_disk = sum(os.path.getsize(os.path.join(d, f))
                  for d, _, files in os.walk(os.path.join(folder, "4")) for f in files)
    assert on_disk < 20 * 2 ** 20
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: [Errno 28] no space left on the device of {folder} to save checkpoint step 8 "
        "(its unfinished folder 8.orbax-checkpoint-tmp was removed): one checkpoint needs "
        f"about {on_disk / 2 ** 20:.1f} MiB free (step 4's size on disk); the earlier step(s) "
        "[4] are intact (resume continues from step 4). Free that much space (or give "
        "workdir=... on a disk with room, copying the run folder there) and run the same "
        "command again."], err
    assert os.listdir(folder) == ["4"]
    os.makedirs(os.path.join(folder, "8.orbax-checkpoint-tmp", "state"))     # killed saving
    with caplog.at_level(logging.INFO, logger="jaxaccel"):
        checkpoint.Checkpointer(folder).close()         # as the resume opens it
    assert (f"removed 8.orbax-checkpoint-tmp in {folder}: unfinished save(s) of an earlier "
            "run (stopped, or out of disk space, while saving); the finished checkpoints are "
            "untouched") in caplog.text
    assert os.listdir(folder) == ["4"]


_CLOSED_LOOP = """
import asyncio, errno, gc, logging, sys, threading
import tensorstore as ts
from jaxaccel.train import checkpoint
logged = []


class Kept(logging.Handler):
    def emit(self, record):
        logged.append(record)


logging.getLogger("asyncio").addHandler(Kept())
promise, in_flight = ts.Promise.new()

async def failing():
    raise OSError(errno.ENOSPC, "No space left on device")

async def operation():
    await asyncio.gather(failing(), in_flight)
loop = asyncio.new_event_loop()
try:
    loop.run_until_complete(operation())
except OSError:
    pass
loop.close()
reports = []
sys.unraisablehook = reports.append
ending = threading.Timer(0.2, promise.set_result, [None])
ending.start()
checkpoint.quiet_leftovers()
ending.join()
assert in_flight.done()         # waited for
gc.collect()
print(repr([(r.exc_value, r.object) for r in reports]), len(logged))
"""


def test_results_reaching_a_closed_orbax_loop_print_nothing():
    """The probe's "Event loop is closed" tracebacks after the error line: Orbax runs an
    operation on an event loop of its own and closes it when the operation raises (its
    asyncio_utils.run_sync), while TensorStore still writes the operation's other arrays; as
    each write ends, TensorStore's thread hands the result to the closed loop. Here that write
    is a TensorStore promise that ends 0.2 s after the failure. In a fresh interpreter: in this
    one, the background threads of an earlier test's Orbax saves may still close loops of their
    own and report into this test's hook."""
    import subprocess
    import sys
    from support import LONG_WAIT_S
    out = subprocess.run([sys.executable, "-c", _CLOSED_LOOP], capture_output=True, text=True,
                         timeout=LONG_WAIT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["[]", "0"], out.stdout + out.stderr[-3000:]


def truncate_arrays(step_dir):
    """Cut every array file of a checkpoint step, and its Orbax metadata, in half."""
    for d, _, files in os.walk(step_dir):
        for name in files:
            if os.path.basename(d) == "d" or name == "_CHECKPOINT_METADATA":
                truncate(os.path.join(d, name))


@pytest.fixture
def truncated_lm(lm_run, tmp_path):
    """A copy of the LM run whose only checkpoint (step 2) is truncated."""
    import shutil
    dest = str(tmp_path / "lm")
    shutil.copytree(lm_run, dest)
    truncate_arrays(os.path.join(dest, "checkpoints", "2"))
    return dest


def test_a_failed_read_leaves_nothing_to_report_later(truncated_lm, monkeypatch, caplog,
                                                      capsys):
    """What a failed read leaves (Orbax's tasks and coroutines in reference cycles) printed
    "Task exception was never retrieved" and "Exception ignored in: <coroutine ...>" tracebacks
    whenever it was collected: after the error line, or at exit. Now it is collected while the
    read fails, its reports in library.log."""
    import gc
    import sys
    reports = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)
    code, out, err = run_cli(capsys, "generate", "--checkpoint", truncated_lm, "Alice was")
    assert code == cli.EXIT_ERROR and out == ""
    assert err.startswith(f"error: no checkpoint in {truncated_lm}/checkpoints can be read: "
                          "step 2: "), err
    gc.collect()
    assert reports == [], [(r.exc_value, r.object) for r in reports]
    assert not [r for r in caplog.records if r.name in ("asyncio", "absl")], caplog.text
    with open(os.path.join(truncated_lm, "library.log")) as f:
        assert "Traceback" in f.read()


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_a_truncated_only_checkpoint_is_one_error_line(truncated_lm, command):
    """The probe's generate on a folder whose only checkpoint is truncated printed Orbax's
    errors ("Failed to json parse Metadata file") and, in two runs of four, asyncio's tracebacks
    after the error line; a fresh process each, as the user runs it."""
    argv = ["--checkpoint", truncated_lm] + (["Alice was"] if command == "generate" else [])
    done = jaxaccel_process(command, *argv)
    assert done.returncode == cli.EXIT_ERROR and done.stdout == ""
    for noise in ("Traceback", "Event loop is closed", "Exception ignored", "never retrieved",
                  "ERROR absl"):
        assert noise not in done.stderr, done.stderr
    log = os.path.join(truncated_lm, "library.log")
    details, error = done.stderr.splitlines()
    assert details.startswith("INFO jaxaccel: Orbax/absl/TensorStore logged ")
    assert details.endswith(f"error(s) or traceback(s), kept off the console: they are in "
                            f"{log}"), details
    assert error.startswith(f"error: no checkpoint in {truncated_lm}/checkpoints can be read: "
                            "step 2: "), error



# ---- item 15: eval of a run folder it cannot write says where its log goes ----

def test_eval_of_a_read_only_run_folder_logs_elsewhere_and_says_where(cls_copy, tmp_path,
                                                                      monkeypatch, caplog,
                                                                      capsys):
    """eval wrote library.log into the run folder; a read-only one was evaluated with Orbax's
    errors on the console instead, and no word of where its log went. The newest step (8, a
    copy of 4) is unreadable here, so there are tracebacks to log. The folder is made
    read-only; a test running as root, whom permissions do not stop, also has
    ``rundir.writable`` answer as permissions answer other users."""
    import logging
    import shutil
    import stat

    from jaxaccel.train import rundir
    step_8 = os.path.join(cls_copy, "checkpoints", "8")
    shutil.copytree(os.path.join(cls_copy, "checkpoints", "4"), step_8)
    truncate_arrays(step_8)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    if os.geteuid() == 0:
        monkeypatch.setattr(rundir, "writable",
                            lambda folder: bool(os.stat(folder).st_mode & stat.S_IWUSR))
    mode = os.stat(cls_copy).st_mode
    os.chmod(cls_copy, mode & ~0o222)
    try:
        log = rundir.library_log_path(cls_copy)
        with caplog.at_level(logging.INFO, logger="jaxaccel"):
            code, out, err = run_cli(capsys, "eval", "--checkpoint", cls_copy)
    finally:
        os.chmod(cls_copy, mode)
    assert code == 0, err
    assert json.loads(out)["step"] == 4
    assert log.startswith(str(tmp_path / "cache" / "jaxaccel" / "logs" / "cls-"))
    console = [r.getMessage() for r in caplog.records if r.name in ("jaxaccel", "absl",
                                                                     "orbax", "asyncio")]
    assert console[0] == (f"the run folder {cls_copy} is not writable: what "
                          f"Orbax/absl/TensorStore log goes to {log} instead of its library.log")
    assert "checkpoint step 8 in" in console[1] and "skipped (using step 4)" in console[1]
    assert console[2].endswith(f"kept off the console: they are in {log}"), console
    assert len(console) == 3, console
    assert "library.log" not in os.listdir(cls_copy)
    with open(log) as f:
        assert "Traceback" in f.read()
