"""BERT model: HF parity, checkpoint layouts, bad checkpoints, the writer, precision policies.

Every float32 computation compared with a reference runs at ``precision="highest"`` (a GPU's
default float32 matmul is TF32, 10-bit mantissa), and so does the reference; ``TOL`` holds the
bounds."""
import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxaccel import config
from jaxaccel.models import (PRESETS, ModelSpec, architecture_of, architectures, bert,
                             create_model, from_pretrained, hf, layers, load_checkpoint,
                             save_checkpoint)
from kernels_pallas import registry
from support import assert_custom_code_not_loaded_silently

PLATFORM = registry.platform()
# Bounds by (platform, compute dtype) against: "torch" PyTorch's BertModel (float32, CPU);
# "same" the same math written another way (a numpy head, the flash kernel vs XLA); "fp32" the
# float32 model. At precision="highest" a GPU differs from the CPU only in summation order and
# its exp/erf/rsqrt (a few float32 ulp), so the platforms share the bounds; at the GPU's TF32
# default none of the float32 ones would hold (inputs rounded to 2^-11 relative).
# * "same" 1e-5: ~100 float32 ulp at the outputs' scale, for reordered sums over 384 features.
# * "torch" 1e-4 (the README's promise): two libraries' GELU, layer norm and softmax over six
#   layers, elementwise.
# * "fp32" 3e-2 norm-wise: bfloat16 rounds every matmul input to 2^-9 relative, six layers deep.
TOL = {
    ("cpu", jnp.float32): {"torch": 1e-4, "same": 1e-5},
    ("gpu", jnp.float32): {"torch": 1e-4, "same": 1e-5},
    ("cpu", jnp.bfloat16): {"fp32": 3e-2},
    ("gpu", jnp.bfloat16): {"fp32": 3e-2},
}
F32, BF16 = TOL[PLATFORM, jnp.float32], TOL[PLATFORM, jnp.bfloat16]


def _tiny(policy=None, **options):
    """The tiny preset with ``ModelSpec`` options."""
    return bert.BertModel(ModelSpec(PRESETS["tiny"], **options), policy)


def _inputs():
    ids = np.array([[101, 2023, 3185, 2001, 6429, 1010, 2307, 3772, 102, 0, 0, 0],
                    [101, 1037, 11771, 1998, 21425, 2143, 1012, 2009, 2001, 2204, 1012, 102]],
                   np.int32)
    return ids, (ids > 0).astype(np.int32)


def _copy_checkpoint(src, dst, edit):
    os.makedirs(dst)
    for f in ("config.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, f), dst)
    tensors = edit(load_file(os.path.join(src, "model.safetensors")))
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def test_hf_parity_with_pytorch(minilm_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ids, mask = _inputs()
    with jax.default_matmul_precision("highest"):
        ours = from_pretrained(minilm_dir)(jnp.asarray(ids), jnp.asarray(mask))
    ref = transformers.BertModel.from_pretrained(minilm_dir).eval()
    with torch.no_grad():
        out = ref(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long())
    real = mask.astype(bool)
    tol = F32["torch"]
    np.testing.assert_allclose(np.asarray(ours.last_hidden_state)[real],
                               out.last_hidden_state.numpy()[real], atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(ours.pooler_output), out.pooler_output.numpy(),
                               atol=tol, rtol=tol)


def test_prefixed_layout_with_classifier_loads_head(minilm_dir, tmp_path):
    rng = np.random.default_rng(0)
    head = {"classifier.weight": rng.normal(size=(3, 384)).astype(np.float32),
            "classifier.bias": rng.normal(size=(3,)).astype(np.float32)}
    path = _copy_checkpoint(minilm_dir, str(tmp_path / "ckpt"),
                            lambda t: {**{f"bert.{k}": v for k, v in t.items()}, **head})
    model = from_pretrained(path, num_labels=3)
    np.testing.assert_array_equal(np.asarray(model.classifier.kernel[...]),
                                  head["classifier.weight"].T)
    plain = from_pretrained(minilm_dir)
    ids, mask = _inputs()
    np.testing.assert_allclose(model(ids, mask).pooler_output, plain(ids, mask).pooler_output,
                               atol=1e-6)
    out = model(ids, mask)
    assert out.logits.shape == (2, 3) and out.logits.dtype == jnp.float32


def test_unexpected_tensor_is_named(minilm_dir, tmp_path):
    path = _copy_checkpoint(minilm_dir, str(tmp_path / "ckpt"),
                            lambda t: {**t, "encoder.layer.0.attention.self.rotary.weight":
                                       np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="encoder.layer.0.attention.self.rotary.weight"):
        from_pretrained(path)


def test_missing_tensor_is_named(minilm_dir, tmp_path):
    path = _copy_checkpoint(minilm_dir, str(tmp_path / "ckpt"),
                            lambda t: {k: v for k, v in t.items()
                                       if k != "encoder.layer.3.output.dense.weight"})
    with pytest.raises(ValueError, match="encoder.layer.3.output.dense.weight"):
        from_pretrained(path)


def test_wrong_head_shape_is_an_error(minilm_dir, tmp_path):
    head = {"classifier.weight": np.zeros((5, 384), np.float32),
            "classifier.bias": np.zeros((5,), np.float32)}
    path = _copy_checkpoint(minilm_dir, str(tmp_path / "ckpt"), lambda t: {**t, **head})
    with pytest.raises(ValueError, match="classifier.weight.*num_labels=2"):
        from_pretrained(path, num_labels=2)


def test_non_bert_config_is_rejected(minilm_dir, tmp_path):
    path = _copy_checkpoint(minilm_dir, str(tmp_path / "ckpt"), lambda t: t)
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["model_type"] = "gpt2"
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match="model_type='gpt2' is not a BERT-family model"):
        from_pretrained(path)


def test_missing_directory_and_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_pretrained(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        from_pretrained(str(tmp_path / "empty"))


def test_config_spec_loads_the_checkpoint_and_its_architecture_is_checked(minilm_dir):
    """``create_model`` builds the spec from ``cfg.model`` and the checkpoint's config.json
    (dropouts overridden), ``load_checkpoint`` takes it; a spec of another architecture is
    refused before any weight is read."""
    cfg = config.build(sets=["model.hidden_dropout=0.0", "model.pooling=mean"])
    model = create_model(cfg.model, None, 1)
    arch = architecture_of(minilm_dir)
    assert model.spec == ModelSpec(dataclasses.replace(arch, hidden_dropout_prob=0.0),
                                   num_labels=2, pooling="mean")
    assert model.classifier_dropout.rate == 0.0 and model.embeddings.dropout.rate == 0.0
    weights = load_file(os.path.join(minilm_dir, "model.safetensors"))
    np.testing.assert_array_equal(model.layers[5].output.kernel[...],
                                  weights["encoder.layer.5.output.dense.weight"].T)
    other = dataclasses.replace(model.spec, architecture=dataclasses.replace(
        arch, layer_norm_eps=1e-5))
    with pytest.raises(ValueError, match=r"layer_norm_eps=1e-12 \(spec: 1e-05\).*architecture_of"):
        load_checkpoint(minilm_dir, other)


def _random_tiny(seed=0, **options):
    """The tiny preset with every parameter ~ N(0, 0.2) (biases and norms included), so that
    a tensor written or read in the wrong place shows in the outputs."""
    model = _tiny(**options)
    flat = hf.flat_params(model)
    rng = np.random.default_rng(seed)
    hf.assign(model, {k: rng.normal(0, 0.2, v.shape).astype(np.float32)
                      for k, v in flat.items()}, {k: (k, False) for k in flat})
    return model


# (ModelSpec options, transformers class, its output compared)
HEADS = {"classifier": ({"num_labels": 3}, "BertForSequenceClassification", "logits"),
         "mlm": ({"mlm_head": True}, "BertForMaskedLM", "logits"),
         "none": ({}, "BertModel", "pooler_output")}


@pytest.mark.parametrize("head", HEADS)
def test_writer_round_trips_and_transformers_reads_it(tmp_path, head):
    """A random tiny BERT of each head written by ``save_checkpoint`` (sharded once) reads back
    bit-exactly (the MLM model's unused pooler aside), and transformers' class of that head loads every tensor (none missing,
    unexpected or of another shape) and computes our outputs within 1e-4."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    options, cls, output = HEADS[head]
    ours = _random_tiny(**options)
    save_checkpoint(ours, tmp_path, max_shard_size=4_000_000 if head == "mlm" else None)
    written = json.load(open(tmp_path / "config.json"))
    assert written["architectures"] == [cls] and written["model_type"] == "bert"
    back = load_checkpoint(tmp_path, ours.spec)
    mine = {k: np.asarray(v) for k, v in hf.flat_params(back).items()}
    for k, v in hf.flat_params(ours).items():     # BertForMaskedLM has no pooler
        if not (head == "mlm" and k.startswith("pooler/")):
            np.testing.assert_array_equal(mine[k], np.asarray(v), err_msg=k)
    ref, info = getattr(transformers, cls).from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids, mask = _inputs()
    types = np.repeat(np.arange(2, dtype=np.int32), 6)[None].repeat(2, axis=0)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(getattr(ours(ids, mask, types), output))
    with torch.no_grad():
        want = getattr(ref.eval()(input_ids=torch.tensor(ids).long(),
                                  attention_mask=torch.tensor(mask).long(),
                                  token_type_ids=torch.tensor(types).long()), output).numpy()
    real = mask.astype(bool) if got.ndim == 3 else slice(None)
    np.testing.assert_allclose(got[real], want[real], atol=F32["torch"], rtol=F32["torch"])


def test_a_mean_pooling_classifier_is_written_with_a_warning_or_refused(tmp_path, caplog):
    """transformers' BertForSequenceClassification classifies the pooler output: a classifier
    of mean pooling is written for jaxaccel (read back with pooling="mean") with a warning,
    and refused with exact=True before anything is written."""
    model = _random_tiny(num_labels=2, pooling="mean")
    with pytest.raises(ValueError, match="pooling='mean': transformers' "
                                         "BertForSequenceClassification classifies BERT's "
                                         "pooler output"):
        save_checkpoint(model, tmp_path / "exact", exact=True)
    assert not (tmp_path / "exact").exists()
    save_checkpoint(model, tmp_path / "loose")
    assert "transformers' outputs differ from this model's" in caplog.text
    back = load_checkpoint(tmp_path / "loose", model.spec)
    ids, mask = _inputs()
    np.testing.assert_array_equal(np.asarray(back(ids, mask).logits),
                                  np.asarray(model(ids, mask).logits))


def test_writer_custom_code_writes_a_mean_pooling_classifier_transformers_runs(tmp_path):
    """With custom_code=True a classifier of mean pooling is written with its own class
    (modeling_bert_mean_pooling.py, auto_map): AutoModelForSequenceClassification with
    trust_remote_code=True loads every tensor and computes our logits within 1e-4 (padding
    included); jaxaccel reads it back bit-exactly, as a mean-pooling model. Without
    trust_remote_code the folder is refused, and transformers' own class built from it directly
    reports the head missing and unexpected instead of loading a CLS-pooling model silently."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ours = _random_tiny(num_labels=3, pooling="mean")
    save_checkpoint(ours, tmp_path, exact=True, custom_code=True)
    written = json.load(open(tmp_path / "config.json"))
    assert written["model_type"] == "bert_mean_pooling"
    assert written["auto_map"]["AutoModelForSequenceClassification"] == \
        "modeling_bert_mean_pooling.BertMeanPoolingForSequenceClassification"
    assert (tmp_path / "modeling_bert_mean_pooling.py").is_file()
    back = from_pretrained(tmp_path, num_labels=3)
    assert back.spec.pooling == "mean"
    for k, v in hf.flat_params(ours).items():
        np.testing.assert_array_equal(np.asarray(hf.flat_params(back)[k]), np.asarray(v), k)

    ref, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path, trust_remote_code=True, output_loading_info=True)
    assert type(ref).__name__ == "BertMeanPoolingForSequenceClassification"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids, mask = _inputs()
    with jax.default_matmul_precision("highest"):
        got = np.asarray(ours(ids, mask).logits)
    with torch.no_grad():
        want = ref.eval()(input_ids=torch.tensor(ids).long(),
                          attention_mask=torch.tensor(mask).long()).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

    assert_custom_code_not_loaded_silently(tmp_path, "AutoModelForSequenceClassification",
                                           "BertForSequenceClassification")


def test_every_hidden_act_has_an_implementation():
    assert set(layers.ACTIVATIONS) == set(architectures.HIDDEN_ACTS)


def test_every_parameter_has_logical_axes():
    model = _tiny(num_labels=2)
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for axes, p in zip(jax.tree_util.tree_leaves(nnx.to_pure_dict(specs),
                                                 is_leaf=lambda x: isinstance(x, tuple)),
                       jax.tree_util.tree_leaves(params)):
        assert len(axes) == p.ndim


def test_bf16_policy_is_close_to_fp32(minilm_dir):
    ids, mask = _inputs()
    with jax.default_matmul_precision("highest"):
        fp32 = from_pretrained(minilm_dir, num_labels=2)(ids, mask)
    bf16_model = from_pretrained(minilm_dir, num_labels=2, policy="bf16")
    assert bf16_model.layers[0].intermediate.kernel[...].dtype == jnp.float32
    bf16 = bf16_model(ids, mask)
    assert bf16.last_hidden_state.dtype == jnp.float32
    real = mask.astype(bool)
    err = np.linalg.norm(np.asarray(bf16.last_hidden_state - fp32.last_hidden_state)[real])
    assert err / np.linalg.norm(np.asarray(fp32.last_hidden_state)[real]) < BF16["fp32"]


def test_mlm_head_shapes():
    model = _tiny(mlm_head=True)
    out = model(jnp.ones((2, 5), jnp.int32))
    assert out.logits.shape == (2, 5, 30522)


def test_dropout_needs_rngs_and_is_random():
    model = _tiny(num_labels=2)
    ids = jnp.ones((2, 8), jnp.int32)
    with pytest.raises(ValueError, match="rngs"):
        model(ids, deterministic=False)
    a = model(ids, deterministic=False, rngs=nnx.Rngs(dropout=0)).logits
    b = model(ids, deterministic=False, rngs=nnx.Rngs(dropout=1)).logits
    assert not np.allclose(a, b)


def test_too_long_sequence_is_an_error():
    model = _tiny()
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=128"):
        model(jnp.ones((1, 129), jnp.int32))


def test_fused_attention_refuses_dropout_when_built():
    with pytest.raises(ValueError, match="attention_impl='xla'"):
        _tiny(attention_impl="pallas")


def test_mean_pooling_head_reads_masked_mean():
    model = _tiny(num_labels=2, pooling="mean")
    ids, mask = _inputs()
    with jax.default_matmul_precision("highest"):
        out = model(ids, mask)
    x = np.asarray(out.last_hidden_state)
    w = mask[..., None].astype(np.float32)
    mean = (x * w).sum(1) / w.sum(1)
    head = model.classifier
    expected = mean @ np.asarray(head.kernel[...]) + np.asarray(head.bias[...])
    np.testing.assert_allclose(np.asarray(out.logits), expected, rtol=F32["same"],
                               atol=F32["same"])


def test_pallas_attention_matches_xla(minilm_dir):
    """attention_impl="pallas" (the flash kernel: interpreted on CPU, the float32 Triton
    forward kernel on a GPU, one shape) vs the XLA path."""
    ids, mask = _inputs()
    with jax.default_matmul_precision("highest"):
        xla = from_pretrained(minilm_dir)(ids, mask)
        no_dropout = dataclasses.replace(architecture_of(minilm_dir),
                                         attention_probs_dropout_prob=0.0)
        pallas = load_checkpoint(minilm_dir, ModelSpec(no_dropout, attention_impl="pallas"),
                                 None, 0)(ids, mask)
    real = mask.astype(bool)
    a = np.asarray(pallas.last_hidden_state)[real]
    b = np.asarray(xla.last_hidden_state)[real]
    tol = F32["same"]
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < tol
    np.testing.assert_allclose(pallas.pooler_output, xla.pooler_output, rtol=tol, atol=tol)


def _naive_attention(q, k, v, mask):
    """The textbook formula in float32 at highest precision, differentiated by autodiff."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * q.shape[-1] ** -0.5
    s = jnp.where(mask[:, None, None, :].astype(bool), s, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v, precision="highest")


@pytest.mark.parametrize("dtype,against", [(jnp.float32, "same"), (jnp.bfloat16, "fp32")])
def test_xla_attention_gradients(dtype, against):
    """The XLA attention's hand-written backward against autodiff of the textbook formula:
    the same math in float32, within bf16 rounding of dS, P and the outputs in bfloat16."""
    from jaxaccel.models.attention import attention
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (2, 16, 4, 32)) for x in ks)
    mask = jnp.asarray(np.arange(16)[None, :] < np.array([[16], [11]]), jnp.int32)
    with jax.default_matmul_precision("highest"):
        _, vjp = jax.vjp(lambda *a: attention(*a, mask).astype(jnp.float32),
                         *(x.astype(dtype) for x in (q, k, v)))
        got = vjp(do.astype(dtype).astype(jnp.float32))
    _, vjp = jax.vjp(lambda *a: _naive_attention(*a, mask), q, k, v)
    want = vjp(do)
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == dtype, name
        err = float(jnp.abs(g.astype(jnp.float32) - w).max() / jnp.abs(w).max())
        assert err < TOL[PLATFORM, dtype][against], (name, err)


def test_bf16_step_runs_every_activation_matmul_in_bf16():
    """Forward and backward: no [b, s, ...] matmul of the bf16 model takes float32 operands
    (autodiff of float32-accumulated scores would run the attention backward in float32)."""
    import re
    model = _tiny("bf16", num_labels=2)
    graphdef, params = nnx.split(model, nnx.Param)
    ids, mask = (jnp.asarray(x) for x in _inputs())

    def loss(params):
        return nnx.merge(graphdef, params)(ids, mask).logits.sum()
    text = jax.jit(jax.grad(loss)).lower(params).as_text()
    operands = re.findall(r"stablehlo\.dot_general.*?: \(tensor<([^>]*)>, tensor<([^>]*)>\)",
                          text)
    batched = [(a, b) for a, b in operands if a.count("x") >= 3 or b.count("x") >= 3]
    assert len(batched) >= 2 * 6 * 3, operands          # fwd + bwd matmuls of both layers
    assert all(a.endswith("bf16") and b.endswith("bf16") for a, b in batched), batched
