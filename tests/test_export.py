"""``jaxaccel export`` (``train/export.py``): a run folder of each family leaves as a Hugging
Face checkpoint that transformers' ``from_pretrained`` loads (every tensor, none missing or
unexpected) with its tokenizer and label names, and whose PyTorch model computes the run's
outputs within 1e-4 (float32, CPU, as the readers' parity tests):

* BERT: the trainer's run folder of a classifier trained two steps, exported by the command;
  and the main job's kind (mean pooling) with ``--custom-code``, loaded by
  ``AutoModelForSequenceClassification`` with ``trust_remote_code=True``;
* Llama: a decoder with untied embeddings on 2 pipeline stages in Adan's flat layout, and one
  with tied embeddings;
* ViT: a classifier under the fp8 policy (its scaling state is no part of the export, whose
  outputs are the fp32 model's), a mean-pooling classifier with custom code, the encoder of an
  MAE with a windowed decoder on a non-square grid (``--encoder``, as ``ViTModel``), and
  (-m slow) a square MAE with its decoder (given masking noise);

each trained two steps; and what it refuses: a model transformers would run with other outputs
(a mean-pooling classifier without ``--custom-code``, a windowed MAE without ``--encoder``),
``--encoder`` of a text model, a text run without its tokenizer, a non-empty ``--out`` unless
``--overwrite``, an ``--out`` holding the run. The writers' own tests (every head, random
weights; what transformers does with a custom-code folder without ``trust_remote_code``) are in
test_model.py, test_llama.py and test_vit_hf.py."""
import dataclasses
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxaccel import config
from jaxaccel.data import load_tokenizer
from jaxaccel.models import ModelSpec, build_model, hf, load_checkpoint, model_spec
from jaxaccel.models.architectures import VIT_PRESETS, ViTConfig
from jaxaccel.train import loop, rundir
from jaxaccel.train import run as run_lib
from jaxaccel.train.checkpoint import Checkpointer, on_disk
from jaxaccel.train.export import export_run
from jaxaccel.train.saved import load_run
from jaxaccel.train.state import TrainState
from support import DEVICES, ROOT, docs, packed, run_cli, tiny_cfg

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("on_eight_devices")   # DEVICES: the module's 8 devices

TOL = 1e-4
PIPELINED = ["mesh.stage=2", "mesh.data=-1", "train.flat_params=true", "train.optimizer=adan",
             "train.optimizer_impl=xla"]
TEXTS = ["a gripping, beautifully shot film", "dull", "the plot is thin but the cast is great"]


# ---- helpers ----

def _transformers_model(out, auto=None, **options):
    """transformers' class named by the export's config.json (or the Auto class ``auto`` with
    ``options``, e.g. trust_remote_code), loaded from it; every tensor read (none missing,
    unexpected or of another shape)."""
    architecture = json.load(open(os.path.join(out, "config.json")))["architectures"][0]
    model, info = getattr(transformers, auto or architecture).from_pretrained(
        out, output_loading_info=True, **options)
    assert type(model).__name__ == architecture
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def _fp32_export(out, spec):
    """The export read back by jaxaccel's reader under the fp32 policy."""
    return load_checkpoint(out, spec, "fp32")


def _same_params(a, b):
    pa, pb = hf.flat_params(a), hf.flat_params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(np.asarray(pa[k]), np.asarray(pb[k]), err_msg=k)


def _close(got, want):
    err = float(np.abs(np.asarray(got) - np.asarray(want)).max())
    assert err < TOL, err


def _highest(fn):
    with jax.default_matmul_precision("highest"):
        return fn()


def _save_run(run_dir, state, cfg, spec, label_names=(), tokenizer=None, step=2):
    """A run folder as the trainer writes it (``on_disk(state)`` with its record, config.json,
    the tokenizer's files)."""
    os.makedirs(run_dir, exist_ok=True)
    rundir.write_files(run_dir, cfg.to_dict(), tokenizer)
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"))
    ckpt.save(step, on_disk(state), {
        "epoch": 0, "step_in_epoch": step, "step": step, "config": cfg.to_dict(),
        "architecture": spec.to_dict(), "label_names": list(label_names)})
    ckpt.wait()
    ckpt.close()
    return run_dir


def _untrained_run(tmp_path, name, *sets, label_names=()):
    """The tiny BERT's run folder holding its random initialisation, without a tokenizer."""
    cfg = tiny_cfg(tmp_path, f"name={name}", *sets)
    spec = model_spec(cfg.model)
    params = nnx.to_pure_dict(nnx.state(build_model(spec), nnx.Param))
    return _save_run(str(tmp_path / name), TrainState.create(params, optax.sgd(0.1), 0), cfg,
                     spec, label_names)


def _stepped_run(cfg, spec=None, batches=None, tokenizer=None):
    """The run of ``cfg`` (``spec``: another model than the config's) on two of the module's
    devices, after two steps of the trainer's own step (``Run.train_step``) on ``batches``
    (default its first training batches), saved as the trainer saves; its folder."""
    resolved = run_lib.resolve(cfg, DEVICES[:2], spec=spec)
    run = run_lib.assemble(resolved, data=batches is None)
    batches = batches or run.train_data.batches(0)
    state = run.state
    with jax.set_mesh(run.mesh):
        for batch in itertools.islice(batches, 2):
            state, _ = run.train_step(state, run.put_batch(batch))
    return _save_run(run.run_dir, state, cfg, resolved.spec, run.label_names,
                     tokenizer or run.tokenizer)


# ---- BERT ----

@pytest.fixture(scope="module")
def bert_run(tmp_path_factory):
    """The trainer's run folder of two steps of the tiny BERT classifier (3 classes, synthetic
    ids, the MiniLM tokenizer)."""
    tmp = tmp_path_factory.mktemp("bert")
    return loop.train(tiny_cfg(tmp, "name=bert", "model.num_labels=3",
                               "train.max_steps=2"))["run_dir"]


def test_a_bert_classifier_run_exports_with_its_tokenizer_and_labels(bert_run, tmp_path,
                                                                    capsys):
    out = str(tmp_path / "hf")
    code, stdout, _ = run_cli(capsys, "export", "--checkpoint", bert_run, "--out", out)
    assert code == 0
    summary = json.loads(stdout)
    assert summary["architectures"] == ["BertForSequenceClassification"]
    assert summary["step"] == 2 and summary["labels"] == ["0", "1", "2"]
    assert "tokenizer.json" in summary["tokenizer_files"]
    umask = os.umask(0)
    os.umask(umask)
    assert {os.stat(os.path.join(out, n)).st_mode & 0o777 for n in os.listdir(out)} == \
        {0o666 & ~umask} and os.stat(out).st_mode & 0o777 == 0o777 & ~umask
    config_json = json.load(open(os.path.join(out, "config.json")))
    assert config_json["id2label"] == {"0": "0", "1": "1", "2": "2"}
    assert config_json["label2id"] == {"0": 0, "1": 1, "2": 2}

    ours, _, _ = load_run(bert_run)
    _same_params(ours, _fp32_export(out, ours.spec))
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    batch = tokenizer(TEXTS, padding=True, return_tensors="np")
    mine = load_tokenizer(os.path.join(bert_run, "tokenizer"))(TEXTS, padding=True,
                                                               return_tensors="np")
    np.testing.assert_array_equal(batch["input_ids"], mine["input_ids"])
    got = _highest(lambda: ours(jnp.asarray(batch["input_ids"]),
                                jnp.asarray(batch["attention_mask"])).logits)
    with torch.no_grad():
        want = _transformers_model(out)(**{k: torch.from_numpy(v).long()
                                           for k, v in batch.items()}).logits.numpy()
    _close(got, want)


def test_an_existing_folder_is_replaced_only_when_asked(bert_run, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, stdout, stderr = run_cli(capsys, "export", "--checkpoint", bert_run, "--out", str(out))
    assert code == 2 and stdout == ""
    assert "is not empty; name a new or empty folder, or pass --overwrite" in stderr
    assert os.listdir(out) == ["notes.txt"]
    code, _, _ = run_cli(capsys, "export", "--checkpoint", bert_run, "--out", str(out),
                         "--overwrite")
    assert code == 0
    assert "notes.txt" not in os.listdir(out) and "model.safetensors" in os.listdir(out)
    assert not [n for n in os.listdir(tmp_path) if ".export-" in n]     # no staging left
    empty = tmp_path / "empty"
    empty.mkdir()
    export_run(bert_run, str(empty))
    assert "config.json" in os.listdir(empty)
    for into in (bert_run, os.path.dirname(bert_run)):
        with pytest.raises(ValueError, match="is or holds the run folder"):
            export_run(bert_run, into, overwrite=True)
    assert os.path.isdir(os.path.join(bert_run, "checkpoints"))


def test_a_mean_pooling_classifier_is_refused_and_nothing_is_written(tmp_path, capsys):
    """transformers has no BERT class that pools by the mean: without --custom-code the export
    says so, names the flag and leaves no folder; --encoder is a ViT run's."""
    run_dir = _untrained_run(tmp_path, "mean", "model.pooling=mean")
    out = tmp_path / "hf"
    code, stdout, stderr = run_cli(capsys, "export", "--checkpoint", run_dir, "--out", str(out))
    assert code == 2 and stdout == ""
    assert "pooling='mean': transformers' BertForSequenceClassification classifies BERT's " \
        "pooler output" in stderr and "jaxaccel export --custom-code" in stderr
    with pytest.raises(ValueError, match="--encoder writes a ViT run's encoder alone"):
        export_run(run_dir, str(out), encoder=True)
    assert os.listdir(tmp_path) == ["mean"]


@pytest.fixture(scope="module")
def mean_run(tmp_path_factory):
    """The trainer's run folder of two steps of the tiny BERT classifying the mean of its last
    hidden states (the main job's model.pooling=mean; 3 classes, the MiniLM tokenizer)."""
    tmp = tmp_path_factory.mktemp("mean")
    return loop.train(tiny_cfg(tmp, "name=mean", "model.num_labels=3", "model.pooling=mean",
                               "train.max_steps=2"))["run_dir"]


def test_the_main_jobs_mean_pooling_classifier_exports_with_custom_code(mean_run, tmp_path,
                                                                        capsys):
    """--custom-code: the folder ships modeling_bert_mean_pooling.py; AutoTokenizer gives the
    run's ids and AutoModelForSequenceClassification (trust_remote_code=True) the run's
    logits, padding included; jaxaccel reads every parameter back."""
    out = str(tmp_path / "hf")
    code, stdout, _ = run_cli(capsys, "export", "--checkpoint", mean_run, "--out", out,
                              "--custom-code")
    assert code == 0
    summary = json.loads(stdout)
    assert summary["architectures"] == ["BertMeanPoolingForSequenceClassification"]
    assert summary["model_code"] == ["modeling_bert_mean_pooling.py"]
    assert summary["labels"] == ["0", "1", "2"] and "tokenizer.json" in summary["tokenizer_files"]

    ours, _, _ = load_run(mean_run)
    assert ours.spec.pooling == "mean"
    _same_params(ours, _fp32_export(out, ours.spec))
    batch = transformers.AutoTokenizer.from_pretrained(out)(TEXTS, padding=True,
                                                            return_tensors="np")
    assert not batch["attention_mask"].all()          # rows of other lengths: padding pooled out
    got = _highest(lambda: ours(jnp.asarray(batch["input_ids"]),
                                jnp.asarray(batch["attention_mask"])).logits)
    model = _transformers_model(out, "AutoModelForSequenceClassification",
                                trust_remote_code=True)
    with torch.no_grad():
        want = model(**{k: torch.from_numpy(v).long() for k, v in batch.items()}).logits.numpy()
    _close(got, want)


def test_the_runs_label_names_become_id2label(tmp_path, minilm_dir):
    """A run's label names are the export's id2label / label2id; a text run without its
    tokenizer/ folder is refused, writing nothing."""
    run_dir = _untrained_run(tmp_path, "named", label_names=("negative", "positive"))
    with pytest.raises(FileNotFoundError, match="has no tokenizer/ folder"):
        export_run(run_dir, str(tmp_path / "hf"))
    assert os.listdir(tmp_path) == ["named"]
    load_tokenizer(minilm_dir).save_pretrained(os.path.join(run_dir, "tokenizer"))
    assert export_run(run_dir, str(tmp_path / "hf"))["labels"] == ["negative", "positive"]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf")
    assert model.config.id2label == {0: "negative", 1: "positive"}
    assert model.config.label2id == {"negative": 0, "positive": 1}


# ---- Llama ----

LLAMA = ["model.name=llama-tiny", "data.name=canterbury", "model.tokenizer=unused",
         "data.max_len=16", "train.batch_size=16", "train.eval_batch_size=16",
         "train.max_steps=2", "train.learning_rate=3e-3", "train.progress=false"]
WORDS = ["[UNK]", "</s>"] + [f"w{i}" for i in range(60)]


def _word_tokenizer():
    import tokenizers
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                                                eos_token="</s>")


@pytest.mark.parametrize("tied,layout", [(False, PIPELINED), (True, ())])
@pytest.mark.long
def test_a_llama_run_exports_as_llama_for_causal_lm(tmp_path, tied, layout):
    """Two steps of the tiny decoder, untied on 2 pipeline stages in Adan's flat layout, or
    with tied embeddings; the export's LlamaForCausalLM gives the run's logits, and its
    tokenizer the run's ids."""
    cfg = config.build(sets=LLAMA + list(layout) + [f"workdir={tmp_path}", "name=lm"])
    spec = model_spec(cfg.model)
    spec = dataclasses.replace(spec, architecture=dataclasses.replace(
        spec.architecture, tie_word_embeddings=tied))
    batches = [packed([docs(16 * i + r, 5, 9) for r in range(16)], 16) for i in range(2)]
    run_dir = _stepped_run(cfg, spec, batches, _word_tokenizer())

    out = str(tmp_path / "hf")
    summary = export_run(run_dir, out)
    assert summary["architectures"] == ["LlamaForCausalLM"] and summary["labels"] is None
    config_json = json.load(open(os.path.join(out, "config.json")))
    assert config_json["tie_word_embeddings"] is tied
    ours, _, _ = load_run(run_dir)
    _same_params(ours, _fp32_export(out, ours.spec))
    ids = transformers.AutoTokenizer.from_pretrained(out)(
        ["w1 w2 w3 w4 w5 w6", "w9 w8 w7 w40 w50 w59"], return_tensors="np")["input_ids"]
    assert ids.tolist()[0] == [WORDS.index(f"w{i}") for i in range(1, 7)]
    got = _highest(lambda: ours(jnp.asarray(ids)).logits)
    with torch.no_grad():
        want = _transformers_model(out)(torch.from_numpy(ids).long()).logits.numpy()
    _close(got, want)


# ---- ViT ----

VIT = ["model.name=vit-tiny", "data.name=synthetic", "data.synthetic_examples=32",
       "train.batch_size=16", "train.eval_batch_size=32", "train.max_steps=2",
       "train.learning_rate=3e-3", "train.progress=false"]


def _pixels(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _torch_pixels(x):
    """Our channel-last pixels [B, H, W] (one channel) as transformers' [B, 1, H, W]."""
    return torch.from_numpy(np.ascontiguousarray(x[:, None]))


@pytest.mark.long
def test_an_fp8_vit_classifier_run_exports_its_float32_weights(tmp_path):
    """The vit-tiny classifier (a 5 x 3 grid, one channel) trained two steps under the fp8
    policy: the export holds its float32 parameters (no fp8 scaling state) and
    ViTForImageClassification computes the fp32 model's logits."""
    run_dir = _stepped_run(config.build(sets=VIT + [
        f"workdir={tmp_path}", "name=vit", "model.task=classification", "model.num_labels=3",
        "precision.policy=fp8"]))
    out = str(tmp_path / "hf")
    summary = export_run(run_dir, out)
    assert summary["architectures"] == ["ViTForImageClassification"]
    assert summary["labels"] == ["0", "1", "2"] and summary["tokenizer_files"] == []
    ours, _, _ = load_run(run_dir)
    assert ours.policy.fp8
    fp32 = _fp32_export(out, ours.spec)
    _same_params(ours, fp32)
    x = _pixels((3, 40, 24))
    got = _highest(lambda: fp32(jnp.asarray(x)).logits)
    with torch.no_grad():
        want = _transformers_model(out)(_torch_pixels(x)).logits.numpy()
    _close(got, want)


def test_a_custom_code_folders_tokenizer_loads_without_the_prompt(mean_run, tmp_path,
                                                                   monkeypatch):
    """AutoTokenizer reads config.json first, whose auto_map makes transformers ask "Do you
    wish to run the custom code? [y/N]" on a terminal (issue 57 item 17); the export guide's call,
    ``trust_remote_code=False``, loads the tokenizer without asking or running the code."""
    out = str(tmp_path / "hf")
    export_run(mean_run, out, custom_code=True)
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "n")
    transformers.AutoTokenizer.from_pretrained(out)
    assert asked and "Do you wish to run the custom code?" in asked[0]
    asked.clear()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=False)
    assert not asked and tokenizer("a film")["input_ids"]
    with open(os.path.join(ROOT, "docs", "guides", "export.md")) as f:
        assert "AutoTokenizer.from_pretrained(DIR, trust_remote_code=False)" in f.read()


def test_a_mean_pooling_vit_classifier_run_exports_with_custom_code(tmp_path):
    """bfsong_finetune's kind: the vit-tiny classifier (5 x 3 grid) on the mean of its patch
    tokens, trained two steps; refused without custom_code, and with it
    AutoModelForImageClassification (trust_remote_code=True) computes the run's logits."""
    run_dir = _stepped_run(config.build(sets=VIT + [
        f"workdir={tmp_path}", "name=vit", "model.task=classification", "model.num_labels=3",
        "model.pooling=mean"]))
    out = str(tmp_path / "hf")
    with pytest.raises(ValueError, match="ViTForImageClassification classifies the CLS token; "
                                         r"custom_code=True \(jaxaccel export --custom-code\)"):
        export_run(run_dir, out)
    summary = export_run(run_dir, out, custom_code=True)
    assert summary["architectures"] == ["ViTMeanPoolingForImageClassification"]
    assert summary["model_code"] == ["modeling_vit_mean_pooling.py"]
    assert summary["labels"] == ["0", "1", "2"]
    ours, _, _ = load_run(run_dir)
    _same_params(ours, _fp32_export(out, ours.spec))
    x = _pixels((3, 40, 24))
    got = _highest(lambda: ours(jnp.asarray(x)).logits)
    model = _transformers_model(out, "AutoModelForImageClassification", trust_remote_code=True)
    with torch.no_grad():
        want = model(_torch_pixels(x)).logits.numpy()
    _close(got, want)


def test_a_windowed_mae_run_on_a_non_square_grid_exports_its_encoder(tmp_path):
    """vit-tiny's MAE (5 x 3 grid) with a windowed decoder, trained two steps: transformers'
    ViT-MAE cannot run it, so it is refused whole, naming --encoder; --encoder writes its
    encoder as ViTModel, whose last_hidden_state is the run's encoder output on all the
    patches (the run's MAE forward with nothing masked, in order)."""
    arch = dataclasses.replace(VIT_PRESETS["vit-tiny"], decoder_window=(2, 2))
    run_dir = _stepped_run(config.build(sets=VIT + [f"workdir={tmp_path}", "name=mae",
                                                    "model.task=mae"]),
                           ModelSpec(arch, task="mae"))
    out = str(tmp_path / "hf")
    with pytest.raises(ValueError, match=r"decoder_window=\(2, 2\).*jaxaccel export --encoder"):
        export_run(run_dir, out)
    assert os.listdir(tmp_path) == ["mae"]
    summary = export_run(run_dir, out, encoder=True)
    assert summary["architectures"] == ["ViTModel"] and summary["labels"] is None
    assert summary["model_code"] == []

    ours, _, _ = load_run(run_dir)
    unmasked = build_model(ModelSpec(dataclasses.replace(arch, mask_ratio=0.0), task="mae"))
    nnx.update(unmasked, nnx.state(ours, nnx.Param))
    x = _pixels((2, 40, 24))
    in_order = jnp.tile(jnp.arange(arch.num_patches, dtype=jnp.float32), (2, 1))
    got = _highest(lambda: unmasked(jnp.asarray(x), noise=in_order).last_hidden_state)
    model, info = transformers.ViTModel.from_pretrained(out, add_pooling_layer=False,
                                                        output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        want = model.eval()(_torch_pixels(x)).last_hidden_state.numpy()
    _close(got, want)


# The MAE writer's parity with transformers is test_vit_hf's; this run adds 15-25 s of CPU.
@pytest.mark.slow
def test_a_square_mae_run_exports_as_vit_mae_for_pretraining(tmp_path):
    """Two MAE steps of a square 4 x 4 grid (the presets' grids are not square, which
    transformers' ViT-MAE cannot run); the export's ViTMAEForPreTraining gives the run's
    reconstruction and mask under the same noise."""
    arch = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, image_size=16, patch_size=4, num_channels=1,
                     decoder_hidden_size=16, decoder_num_hidden_layers=1,
                     decoder_num_attention_heads=2, decoder_intermediate_size=32,
                     mask_ratio=0.5, norm_pix_loss=True)
    run_dir = _stepped_run(config.build(sets=VIT + [f"workdir={tmp_path}", "name=mae",
                                                    "model.task=mae"]),
                           ModelSpec(arch, task="mae"))
    out = str(tmp_path / "hf")
    assert export_run(run_dir, out)["architectures"] == ["ViTMAEForPreTraining"]
    ours, _, _ = load_run(run_dir)
    _same_params(ours, _fp32_export(out, ours.spec))
    x, noise = _pixels((2, 16, 16)), _pixels((2, 16), 1)
    got = _highest(lambda: ours(jnp.asarray(x), noise=jnp.asarray(noise)))
    with torch.no_grad():
        want = _transformers_model(out)(_torch_pixels(x), noise=torch.from_numpy(noise))
    _close(got.logits, want.logits.numpy())
    _close(got.mask, want.mask.numpy())
