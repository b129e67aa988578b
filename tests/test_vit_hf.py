"""ViT-family Hugging Face checkpoints (``models.hf_vit``): parity with transformers'
``ViTMAEForPreTraining`` (logits, mask and loss under given noise, square and non-square
grids) and ``ViTForImageClassification`` (non-square images, 3 channels and 1), the sin-cos
tables against an independent re-implementation of Audio-MAE's
``get_2d_sincos_pos_embed_flexible``, exact round trips (ours -> ours, ours -> transformers),
fine-tuning from an MAE checkpoint, and the refusals. transformers' models are tiny, random
(``torch.manual_seed``), float32, on CPU; the tolerance is 1e-4 max abs.

transformers 5.24's ViT-MAE (found here, see hf_vit's module doc): a fresh
``ViTMAEForPreTraining`` has both position tables (and the CLS and mask tokens) zero, so every
reference model here gets its tables set explicitly; a non-square grid whose patch count is not
a square cannot be built, and its forward refuses non-square pixel values."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxaccel.models import hf, hf_vit, hf_vit_names, vit
from jaxaccel.models.architectures import ViTConfig
from jaxaccel.models.spec import ModelSpec
from support import assert_custom_code_not_loaded_silently

TOL = 1e-4
MAE_KW = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              patch_size=4, decoder_hidden_size=16, decoder_num_hidden_layers=2,
              decoder_num_attention_heads=2, decoder_intermediate_size=32)
VIT_KW = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              patch_size=4, image_size=[16, 8])


# ---- helpers ----

def _audiomae_sincos(embed_dim, grid_size, cls_token=True):
    """Audio-MAE's util/pos_embed.py ``get_2d_sincos_pos_embed_flexible`` (grid_size = (rows,
    cols) of patches), re-implemented from the paper's code, independent of ``models.vit``."""
    def one_d(dim, pos):
        omega = np.arange(dim // 2, dtype=np.float64) / (dim / 2.0)
        omega = 1.0 / 10000 ** omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    grid_h = np.arange(grid_size[0], dtype=np.float32)
    grid_w = np.arange(grid_size[1], dtype=np.float32)
    grid = np.stack(np.meshgrid(grid_w, grid_h), axis=0).reshape(2, 1, *grid_size)
    emb = np.concatenate([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])],
                         axis=1)
    if cls_token:
        emb = np.concatenate([np.zeros((1, embed_dim)), emb], axis=0)
    return emb


def _randomise(module, seed, std=0.2):
    """Every weight of a torch module ~ N(0, std), position tables left alone."""
    import torch
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "pos_embed" not in name and "position_embeddings" not in name:
                p.normal_(0.0, std)


def _hf_mae(image_size, channels, seed=0, **kw):
    """A random transformers ViTMAEForPreTraining with the Audio-MAE sin-cos tables."""
    import torch
    import transformers
    cfg = transformers.ViTMAEConfig(image_size=image_size, num_channels=channels,
                                    **{**MAE_KW, **kw})
    model = transformers.ViTMAEForPreTraining(cfg).eval()
    _randomise(model, seed)
    size = image_size if isinstance(image_size, (list, tuple)) else (image_size, image_size)
    grid = (size[0] // cfg.patch_size, size[1] // cfg.patch_size)
    with torch.no_grad():
        model.vit.embeddings.position_embeddings.copy_(
            torch.from_numpy(_audiomae_sincos(cfg.hidden_size, grid))[None])
        model.decoder.decoder_pos_embed.copy_(
            torch.from_numpy(_audiomae_sincos(cfg.decoder_hidden_size, grid))[None])
    return model


def _hf_vit(channels, seed=0, num_labels=3):
    import transformers
    cfg = transformers.ViTConfig(num_channels=channels, num_labels=num_labels, **VIT_KW)
    model = transformers.ViTForImageClassification(cfg).eval()
    _randomise(model, seed)
    with __import__("torch").no_grad():     # learned positions: random too
        model.vit.embeddings.position_embeddings.normal_(0.0, 0.2)
    return model


def _pixels(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _torch(x):
    """Our channel-last pixels [B, H, W(, C)] as transformers' [B, C, H, W]."""
    import torch
    x = x[..., None] if x.ndim == 3 else x
    return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))


def _run(model, x, **kw):
    with jax.default_matmul_precision("highest"):
        return model(jnp.asarray(x), **kw)


def _mae_loss(model, x, out):
    t = model.target(jnp.asarray(x))
    per_patch = jnp.mean((out.logits - t) ** 2, -1)
    return float(jnp.sum(per_patch * out.mask) / jnp.sum(out.mask))


def _params(model):
    return {k: np.asarray(v) for k, v in hf.flat_params(model).items()}


def _assert_same_params(a, b, prefix=""):
    pa, pb = _params(a), _params(b)
    keys = [k for k in pa if k.startswith(prefix)]
    assert keys
    for k in keys:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


def _random_ours(spec, seed=0):
    """Our model with every parameter ~ N(0, 0.2) (biases, norms and tokens included)."""
    model = vit.ViTModel(spec, None, nnx.Rngs(params=seed))
    flat = hf.flat_params(model)
    rng = np.random.default_rng(seed)
    mapping = {k: (k, False) for k in flat}
    values = {k: rng.normal(0, 0.2, v.shape).astype(np.float32) for k, v in flat.items()}
    hf.assign(model, values, mapping)
    return model


# ---- tensor names and position tables ----

def test_key_map_covers_transformers_names(tmp_path):
    """transformers 5.24 names a block's tensors ``vit.layers.{i}.attention.q_proj`` /
    ``mlp.fc1`` in memory, and its save_pretrained writes the hub's ``vit.encoder.layer.{i}.
    attention.attention.query`` for the encoder but ``decoder.decoder_encoder.layer.{i}...``
    for the decoder: all three spellings normalise onto key_map's names, one for one."""
    from safetensors.numpy import load_file
    ref = _hf_mae(16, 3, mask_ratio=0.6)
    memory = set(ref.state_dict())
    assert "vit.layers.0.attention.q_proj.weight" in memory
    assert "decoder.decoder_layers.1.mlp.fc2.bias" in memory
    ref.save_pretrained(tmp_path)
    saved = set(load_file(os.path.join(tmp_path, "model.safetensors")))
    assert "vit.encoder.layer.0.attention.attention.query.weight" in saved
    assert "decoder.decoder_encoder.layer.1.output.dense.bias" in saved
    arch = hf_vit.architecture_of(tmp_path)
    expected = set(hf_vit.key_map(arch, "mae"))
    for names in (memory, saved):
        assert {hf_vit_names.normalise(n) for n in names} == expected
    vit_ref = _hf_vit(3)
    clf = hf_vit.key_map(ViTConfig.from_dict(vit_ref.config.to_dict()), "classification", 3)
    assert {hf_vit_names.normalise(n) for n in vit_ref.state_dict()} == set(clf)
    assert "classifier.weight" in clf and "decoder.mask_token" not in clf


@pytest.mark.parametrize("grid", [(4, 4), (4, 2), (64, 8), (3, 5)])
def test_sincos_equals_audiomae_flexible(grid):
    """vit.sincos_positions equals Audio-MAE's get_2d_sincos_pos_embed_flexible on square and
    non-square grids, and (re-laid out as transformers does) transformers 5.24's
    build_2d_sinusoidal_position_embedding."""
    import torch
    from transformers.models.vit_mae.modeling_vit_mae import \
        build_2d_sinusoidal_position_embedding as build
    for dim in (16, 32):
        ours = vit.sincos_positions(dim, *grid)
        np.testing.assert_allclose(ours, _audiomae_sincos(dim, grid), atol=1e-6, rtol=0)
        table = build(height=grid[0], width=grid[1], embed_dim=dim, cls_token=True)
        table = torch.cat([table[..., dim // 2:], table[..., :dim // 2]], dim=-1).numpy()
        np.testing.assert_allclose(ours, table, atol=1e-6, rtol=0)


# ---- parity with transformers ----

@pytest.mark.parametrize("norm_pix_loss", [True, False])
def test_mae_parity_square(tmp_path, norm_pix_loss):
    """ViTMAEForPreTraining (4 x 4 grid, 3 channels, mask_ratio 0.6, global decoder) saved by
    transformers loads here; logits, mask and loss under the same noise agree."""
    import torch
    ref = _hf_mae(16, 3, mask_ratio=0.6, norm_pix_loss=norm_pix_loss)
    ref.save_pretrained(tmp_path)
    ours = hf_vit.from_pretrained(tmp_path)
    assert ours.spec.task == "mae" and ours.config.mask_ratio == 0.6
    x, noise = _pixels((2, 16, 16, 3)), _pixels((2, 16), 1)
    with torch.no_grad():
        want = ref(_torch(x), noise=torch.from_numpy(noise))
    got = _run(ours, x, noise=jnp.asarray(noise))
    errors = {"logits": np.abs(np.asarray(got.logits) - want.logits.numpy()).max(),
              "mask": np.abs(np.asarray(got.mask) - want.mask.numpy()).max(),
              "loss": abs(_mae_loss(ours, x, got) - want.loss.item())}
    print(f"mae square norm_pix_loss={norm_pix_loss}: {errors}")
    assert int(np.asarray(got.mask).sum(1)[0]) == 16 - int(16 * 0.4)
    assert max(errors.values()) < TOL, errors


def test_mae_parity_non_square(tmp_path):
    """A non-square grid (32 x 8 one-channel inputs: 8 x 2 patches; 16 patches, so
    transformers can build it) through transformers' own encoder and decoder (its full forward
    refuses non-square pixels; its loss target taken with patchify's square check off) agrees
    with ours; a 4 x 2 grid cannot even be built there."""
    import torch
    import transformers
    with pytest.raises(RuntimeError):      # its sin-cos init: a sqrt(8) x sqrt(8) table
        transformers.ViTMAEForPreTraining(transformers.ViTMAEConfig(
            image_size=[16, 8], num_channels=1, **MAE_KW))
    ref = _hf_mae([32, 8], 1, mask_ratio=0.6, norm_pix_loss=True)
    x, noise = _pixels((2, 32, 8)), _pixels((2, 16), 1)
    with torch.no_grad(), pytest.raises(ValueError, match="squared size"):
        ref(_torch(x), noise=torch.from_numpy(noise))
    ref.save_pretrained(tmp_path)
    ours = hf_vit.from_pretrained(tmp_path)
    assert ours.config.grid == (8, 2)
    with torch.no_grad():
        enc = ref.vit(_torch(x), noise=torch.from_numpy(noise))
        logits = ref.decoder(enc.last_hidden_state, enc.ids_restore).logits
        target = ref.patchify(_torch(x), interpolate_pos_encoding=True)
        mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
        target = (target - mean) / (var + 1e-6) ** 0.5
        loss = (((logits - target) ** 2).mean(-1) * enc.mask).sum() / enc.mask.sum()
    got = _run(ours, x, noise=jnp.asarray(noise))
    errors = {"logits": np.abs(np.asarray(got.logits) - logits.numpy()).max(),
              "mask": np.abs(np.asarray(got.mask) - enc.mask.numpy()).max(),
              "target": np.abs(np.asarray(ours.target(jnp.asarray(x))) - target.numpy()).max(),
              "loss": abs(_mae_loss(ours, x, got) - loss.item())}
    print(f"mae non-square 8x2: {errors}")
    assert max(errors.values()) < TOL, errors


@pytest.mark.parametrize("channels", [3, 1])
def test_vit_classification_parity_non_square(tmp_path, channels):
    """ViTForImageClassification on 16 x 8 images (4 x 2 patches of 4), learned positions:
    logits agree."""
    import torch
    ref = _hf_vit(channels)
    ref.save_pretrained(tmp_path)
    ours = hf_vit.from_pretrained(tmp_path)
    assert ours.spec.task == "classification" and ours.spec.num_labels == 3
    assert ours.config.position_embedding_type == "learned"
    x = _pixels((2, 16, 8, 3) if channels == 3 else (2, 16, 8))
    with torch.no_grad():
        want = ref(_torch(x)).logits.numpy()
    err = np.abs(np.asarray(_run(ours, x).logits) - want).max()
    print(f"vit classification 16x8 channels={channels}: logits {err}")
    assert err < TOL, err


def test_bare_vit_model_checkpoint(tmp_path):
    """A ViTModel checkpoint (no ``vit.`` prefix, with a pooler) reads into a classification
    spec: its pooler is ignored, the encoder's last hidden state agrees."""
    import torch
    import transformers
    ref = transformers.ViTModel(transformers.ViTConfig(num_channels=3, **VIT_KW)).eval()
    _randomise(ref, 4)
    ref.save_pretrained(tmp_path)
    ours = hf_vit.from_pretrained(tmp_path, num_labels=2)
    x = _pixels((2, 16, 8, 3))
    with torch.no_grad():
        want = ref(_torch(x)).last_hidden_state.numpy()
    err = np.abs(np.asarray(_run(ours, x).last_hidden_state) - want).max()
    print(f"bare ViTModel 16x8: last_hidden_state {err}")
    assert err < TOL, err


# ---- round trips ----

def test_mae_round_trip_and_transformers_reads_it(tmp_path):
    """Ours (random, square) -> save_checkpoint (sharded) -> load_checkpoint is bit-exact in
    parameters and outputs; transformers' from_pretrained of it loads every tensor (none
    missing or unexpected) and gives our logits, mask and loss."""
    import torch
    import transformers
    arch = ViTConfig(image_size=16, num_channels=3, mask_ratio=0.6, norm_pix_loss=True, **MAE_KW)
    ours = _random_ours(ModelSpec(arch, task="mae"))
    hf_vit.save_checkpoint(ours, tmp_path, max_shard_size=20_000)
    assert os.path.isfile(os.path.join(tmp_path, "model.safetensors.index.json"))
    config = json.load(open(os.path.join(tmp_path, "config.json")))
    assert config["model_type"] == "vit_mae"
    assert config["architectures"] == ["ViTMAEForPreTraining"]
    back = hf_vit.load_checkpoint(tmp_path, ModelSpec(hf_vit.architecture_of(tmp_path),
                                                      task="mae"))
    _assert_same_params(ours, back)
    x, noise = _pixels((2, 16, 16, 3)), _pixels((2, 16), 1)
    a, b = _run(ours, x, noise=jnp.asarray(noise)), _run(back, x, noise=jnp.asarray(noise))
    np.testing.assert_array_equal(np.asarray(a.logits), np.asarray(b.logits))

    ref, info = transformers.ViTMAEForPreTraining.from_pretrained(tmp_path,
                                                                  output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        want = ref.eval()(_torch(x), noise=torch.from_numpy(noise))
    errors = {"logits": np.abs(np.asarray(a.logits) - want.logits.numpy()).max(),
              "mask": np.abs(np.asarray(a.mask) - want.mask.numpy()).max(),
              "loss": abs(_mae_loss(ours, x, a) - want.loss.item())}
    print(f"mae ours -> transformers: {errors}")
    assert max(errors.values()) < TOL, errors


def test_non_square_mae_round_trip(tmp_path):
    """The vit-tiny-like non-square (4 x 2, one channel) MAE with a windowed decoder writes
    and reads back bit-exactly (config.json keeps image_size and decoder_window)."""
    arch = ViTConfig(image_size=(16, 8), num_channels=1, mask_ratio=0.6, decoder_window=(2, 2),
                     **MAE_KW)
    ours = _random_ours(ModelSpec(arch, task="mae"), seed=3)
    hf_vit.save_checkpoint(ours, tmp_path)
    assert hf_vit.architecture_of(tmp_path) == arch
    back = hf_vit.from_pretrained(tmp_path)
    _assert_same_params(ours, back)
    x, noise = _pixels((2, 16, 8)), _pixels((2, 8), 1)
    np.testing.assert_array_equal(np.asarray(_run(ours, x, noise=jnp.asarray(noise)).logits),
                                  np.asarray(_run(back, x, noise=jnp.asarray(noise)).logits))


def test_classification_round_trip_and_transformers_reads_it(tmp_path):
    """A random non-square (16 x 8, 3 channels) classifier round-trips bit-exactly and
    transformers' ViTForImageClassification reads it with our logits."""
    import torch
    import transformers
    arch = ViTConfig(image_size=(16, 8), num_channels=3, position_embedding_type="learned",
                     **MAE_KW)
    ours = _random_ours(ModelSpec(arch, task="classification", num_labels=5), seed=1)
    hf_vit.save_checkpoint(ours, tmp_path)
    config = json.load(open(os.path.join(tmp_path, "config.json")))
    assert config["model_type"] == "vit"
    assert config["architectures"] == ["ViTForImageClassification"]
    back = hf_vit.from_pretrained(tmp_path)
    assert back.spec.num_labels == 5
    _assert_same_params(ours, back)
    x = _pixels((2, 16, 8, 3))
    got = np.asarray(_run(ours, x).logits)
    np.testing.assert_array_equal(got, np.asarray(_run(back, x).logits))
    ref, info = transformers.ViTForImageClassification.from_pretrained(
        tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        err = np.abs(got - ref.eval()(_torch(x)).logits.numpy()).max()
    print(f"classification ours -> transformers: logits {err}")
    assert err < TOL, err


def test_mae_checkpoint_into_classification(tmp_path):
    """Fine-tuning from MAE: a ViTMAEForPreTraining checkpoint read into a classification
    spec has exactly the encoder the MAE spec reads, a classifier as fresh from ``seed`` and
    no decoder; with learned positions the table starts as MAE's sin-cos one."""
    ref = _hf_mae(16, 3, mask_ratio=0.6)
    ref.save_pretrained(tmp_path)
    mae = hf_vit.from_pretrained(tmp_path)
    arch = hf_vit.architecture_of(tmp_path)
    spec = ModelSpec(arch, task="classification", num_labels=4)
    clf = hf_vit.load_checkpoint(tmp_path, spec, seed=7)
    assert clf.decoder is None
    for prefix in ("embeddings/", "layers/", "layernorm/"):
        _assert_same_params(mae, clf, prefix)
    _assert_same_params(clf, vit.ViTModel(spec, None, nnx.Rngs(params=7)), "classifier/")
    learned = hf_vit.load_checkpoint(
        tmp_path, ModelSpec(dataclasses.replace(arch, position_embedding_type="learned"),
                            task="classification", num_labels=4))
    np.testing.assert_allclose(np.asarray(learned.embeddings.position_embeddings[...])[0],
                               vit.sincos_positions(32, 4, 4), atol=1e-6)
    x = _pixels((2, 16, 16, 3))
    np.testing.assert_allclose(np.asarray(_run(learned, x).last_hidden_state),
                               np.asarray(_run(clf, x).last_hidden_state), atol=1e-5)


@pytest.mark.parametrize("spec,message", [
    (ModelSpec(ViTConfig(image_size=(16, 8), num_channels=1, **MAE_KW), task="mae"),
     "a ViT-MAE of a 4 x 2 patch grid: transformers' ViTMAEForPreTraining runs square grids"),
    (ModelSpec(ViTConfig(image_size=16, num_channels=1, decoder_window=(2, 2), **MAE_KW),
               task="mae"), r"decoder_window=\(2, 2\): transformers' ViTMAE decoder attends "
                            "globally"),
    (ModelSpec(ViTConfig(image_size=16, num_channels=1, **MAE_KW), task="classification",
               num_labels=2, pooling="mean"),
     "pooling='mean': transformers' ViTForImageClassification classifies the CLS token")],
    ids=["non_square_mae", "windowed_mae", "mean_pooling"])
def test_what_transformers_computes_otherwise_is_refused_when_exact(tmp_path, caplog, spec,
                                                                    message):
    """A model transformers' class would run with other outputs, or not at all, is written
    with a warning (jaxaccel reads it back) and refused with exact=True, writing nothing."""
    model = vit.ViTModel(spec)
    with pytest.raises(ValueError, match=message):
        hf_vit.save_checkpoint(model, tmp_path / "exact", exact=True)
    assert not (tmp_path / "exact").exists()
    hf_vit.save_checkpoint(model, tmp_path / "loose")
    assert "transformers' outputs differ from this model's" in caplog.text
    _assert_same_params(model, hf_vit.load_checkpoint(tmp_path / "loose", spec))


def test_custom_code_writes_a_mean_pooling_classifier_transformers_runs(tmp_path):
    """bfsong_finetune's kind of classifier (mean pooling, sin-cos positions, one channel; a
    non-square 4 x 2 grid here) written with custom_code=True: AutoModelForImageClassification
    with trust_remote_code=True loads every tensor of it and computes our logits; jaxaccel reads
    it back bit-exactly, as a mean-pooling model. Without trust_remote_code the folder is
    refused, and ViTForImageClassification built from it directly reports the head missing and
    unexpected rather than loading a CLS-pooling model silently."""
    import torch
    import transformers
    spec = ModelSpec(ViTConfig(image_size=(16, 8), num_channels=1, **MAE_KW),
                     task="classification", num_labels=3, pooling="mean")
    ours = _random_ours(spec, seed=2)
    hf_vit.save_checkpoint(ours, tmp_path, exact=True, custom_code=True)
    config = json.load(open(os.path.join(tmp_path, "config.json")))
    assert config["model_type"] == "vit_mean_pooling"
    assert config["architectures"] == ["ViTMeanPoolingForImageClassification"]
    back = hf_vit.from_pretrained(tmp_path)
    assert (back.spec.task, back.spec.num_labels, back.spec.pooling) == \
        ("classification", 3, "mean")
    _assert_same_params(ours, back)

    ref, info = transformers.AutoModelForImageClassification.from_pretrained(
        tmp_path, trust_remote_code=True, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    x = _pixels((2, 16, 8))
    with torch.no_grad():
        err = np.abs(np.asarray(_run(ours, x).logits) - ref.eval()(_torch(x)).logits.numpy())
    print(f"mean-pooling classifier ours -> transformers (custom code): logits {err.max()}")
    assert err.max() < TOL, err.max()

    assert_custom_code_not_loaded_silently(tmp_path, "AutoModelForImageClassification",
                                           "ViTForImageClassification")


def test_the_encoder_of_a_windowed_non_square_mae_is_transformers_vit_model(tmp_path):
    """save_encoder writes the encoder of an MAE transformers cannot run whole (a 4 x 2 grid,
    a windowed decoder) as ViTModel: with add_pooling_layer=False every tensor loads, and its
    last_hidden_state is our encoder's on all the patches (our MAE forward with nothing
    masked, in order); AutoModel's ViTModel adds a pooler, the only tensors missing. jaxaccel
    reads the encoder back into a classifier (fine-tuning from it)."""
    import torch
    import transformers
    arch = ViTConfig(image_size=(16, 8), num_channels=1, mask_ratio=0.75, decoder_window=(2, 2),
                     **MAE_KW)
    ours = _random_ours(ModelSpec(arch, task="mae"), seed=4)
    hf_vit.save_encoder(ours, tmp_path)
    config = json.load(open(os.path.join(tmp_path, "config.json")))
    assert config["architectures"] == ["ViTModel"] and config["image_size"] == [16, 8]
    assert "decoder_window" not in config and "id2label" not in config
    ref, info = transformers.ViTModel.from_pretrained(tmp_path, add_pooling_layer=False,
                                                      output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    _, info = transformers.AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == {"pooler.dense.weight", "pooler.dense.bias"}
    assert not info["unexpected_keys"]

    unmasked = vit.ViTModel(ModelSpec(dataclasses.replace(arch, mask_ratio=0.0), task="mae"))
    nnx.update(unmasked, nnx.state(ours, nnx.Param))
    x, in_order = _pixels((2, 16, 8)), jnp.tile(jnp.arange(8.0), (2, 1))
    got = np.asarray(_run(unmasked, x, noise=in_order).last_hidden_state)
    with torch.no_grad():
        err = np.abs(got - ref.eval()(_torch(x)).last_hidden_state.numpy()).max()
    print(f"windowed non-square MAE's encoder ours -> ViTModel: last_hidden_state {err}")
    assert err < TOL, err

    clf = hf_vit.load_checkpoint(tmp_path, ModelSpec(hf_vit.architecture_of(tmp_path),
                                                     task="classification", num_labels=2))
    for prefix in ("embeddings/", "layers/", "layernorm/"):
        _assert_same_params(ours, clf, prefix)


# ---- refusals ----

@pytest.fixture(scope="module")
def small_mae(tmp_path_factory):
    """A tiny MAE checkpoint of ours (square, so the zero-table case is transformers')."""
    path = str(tmp_path_factory.mktemp("mae"))
    arch = ViTConfig(image_size=8, num_channels=1, **MAE_KW)
    hf_vit.save_checkpoint(_random_ours(ModelSpec(arch, task="mae"), seed=2), path)
    return path


def _copy(src, dst, config_edit=None, tensors_edit=None):
    from safetensors.numpy import load_file, save_file
    os.makedirs(dst, exist_ok=True)
    cfg = json.load(open(os.path.join(src, "config.json")))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    if config_edit:
        config_edit(cfg)
    if tensors_edit:
        tensors_edit(tensors)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return str(dst)


def test_refusals(tmp_path, small_mae):
    """Missing and unexpected tensors are named; a non-ViT model_type, another architecture,
    a classifier checkpoint read as an MAE, a position table other than the sin-cos one and a
    table of zeros (unless zero_positions='sincos') are refused with what to do."""
    spec = ModelSpec(hf_vit.architecture_of(small_mae), task="mae")
    name = "decoder.decoder_layers.1.attention.attention.key.weight"
    path = _copy(small_mae, tmp_path / "missing", tensors_edit=lambda t: t.pop(name))
    with pytest.raises(ValueError, match="lacks tensors.*" + name.replace(".", r"\.")):
        hf_vit.load_checkpoint(path, spec)
    path = _copy(small_mae, tmp_path / "extra",
                 tensors_edit=lambda t: t.update({"vit.embeddings.mask_token":
                                                  np.zeros((1, 1, 32), np.float32)}))
    with pytest.raises(ValueError, match=r"does not have: \['vit\.embeddings\.mask_token'\]"):
        hf_vit.load_checkpoint(path, spec)
    path = _copy(small_mae, tmp_path / "twice", tensors_edit=lambda t: t.update(
        {"vit.layers.0.mlp.fc1.bias": t["vit.encoder.layer.0.intermediate.dense.bias"]}))
    with pytest.raises(ValueError, match="twice"):
        hf_vit.load_checkpoint(path, spec)
    path = _copy(small_mae, tmp_path / "bert",
                 config_edit=lambda c: c.update(model_type="bert", architectures=["BertModel"]))
    with pytest.raises(ValueError, match="model_type='bert' is not a ViT-family model"):
        hf_vit.load_checkpoint(path, spec)
    with pytest.raises(ValueError, match=r"another architecture.*num_hidden_layers=2 "
                                         r"\(spec: 3\)"):
        hf_vit.load_checkpoint(small_mae, ModelSpec(dataclasses.replace(
            spec.architecture, num_hidden_layers=3), task="mae"))
    path = _copy(small_mae, tmp_path / "vit", config_edit=lambda c: c.update(
        model_type="vit", architectures=["ViTForImageClassification"]),
        tensors_edit=lambda t: [t.pop(k) for k in list(t) if k.startswith("decoder.")])
    with pytest.raises(ValueError, match="lacks tensors.*read into a 'classification' spec"):
        hf_vit.load_checkpoint(path, spec)
    assert hf_vit.from_pretrained(path, num_labels=2).decoder is None   # as classification

    def shift(t):
        t["vit.embeddings.position_embeddings"] = t["vit.embeddings.position_embeddings"] + 0.01
    path = _copy(small_mae, tmp_path / "shifted", tensors_edit=shift)
    with pytest.raises(ValueError, match="position_embeddings'.*by up to 0.01.*'learned'"):
        hf_vit.load_checkpoint(path, spec)
    assert hf_vit.load_checkpoint(path, ModelSpec(dataclasses.replace(
        spec.architecture, position_embedding_type="learned"), task="mae")) is not None

    def zero(t):
        t["decoder.decoder_pos_embed"] = np.zeros_like(t["decoder.decoder_pos_embed"])
    path = _copy(small_mae, tmp_path / "zeros", tensors_edit=zero)
    with pytest.raises(ValueError, match="decoder_pos_embed' is all zeros.*zero_positions"):
        hf_vit.load_checkpoint(path, spec)
    model = hf_vit.load_checkpoint(path, spec, zero_positions="sincos")
    _assert_same_params(model, hf_vit.load_checkpoint(small_mae, spec))


def test_untrained_transformers_mae_has_zero_tables(tmp_path):
    """transformers 5.24's fresh ViTMAEForPreTraining keeps zero position tables (and zero
    CLS / mask tokens); reading its save_pretrained needs zero_positions='sincos'."""
    import transformers
    ref = transformers.ViTMAEForPreTraining(transformers.ViTMAEConfig(
        image_size=8, num_channels=1, **MAE_KW))
    assert not ref.vit.embeddings.position_embeddings.any()
    assert not ref.decoder.decoder_pos_embed.any()
    assert not ref.decoder.mask_token.any() and not ref.vit.embeddings.cls_token.any()
    ref.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="all zeros"):
        hf_vit.from_pretrained(tmp_path)
    assert hf_vit.from_pretrained(tmp_path, zero_positions="sincos").spec.task == "mae"
