"""The Llama-style decoder: attention isolation (causal, packed documents), grouped-query
attention and RoPE positions, parity with transformers' LlamaForCausalLM and the checkpoint
round trip, the causal-LM task, generation with a KV cache, and the family table's specs."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxaccel import config
from jaxaccel.models import (LLAMA_PRESETS, PRESETS, ModelSpec, architecture_of, build_model,
                             load_checkpoint, save_checkpoint, spec)
from jaxaccel.models.generate import Sampler, prompts_of
from jaxaccel.models.llama import rope, rope_frequencies
from jaxaccel.train.state import TrainState
from support import LM, docs, lm_loss, logits, packed

TINY = LLAMA_PRESETS["llama-tiny"]


@pytest.fixture(scope="module")
def model():
    return build_model(ModelSpec(TINY), None, 0)


# ---- attention isolation, GQA, RoPE ----

def test_packed_documents_are_isolated_and_positions_restart(model):
    """In a packed row, document A's logits do not change when document B changes, and B's
    logits (positions restarting at 0) equal those of B alone; without the segment ids B
    attends to A and its logits change (the check can fail)."""
    a, b, b2 = docs(0, 7, 9, 9)
    row, alone = logits(model, packed([[a, b], [b]], 16))        # every call is [2, 16]
    unsegmented = packed([[a, b2], [a, b]], 16)
    unsegmented["segment_ids"][1] = 1
    other, unsegmented = logits(model, unsegmented)
    np.testing.assert_array_equal(row[:7], other[:7])
    np.testing.assert_allclose(row[7:16], alone[:9], atol=1e-5)
    assert np.abs(unsegmented[7:16] - alone[:9]).max() > 1e-2


def test_attention_is_causal(model):
    ids = np.asarray(docs(1, 16) * 2, np.int32)
    ids[1, 10] = (ids[1, 10] + 1) % TINY.vocab_size
    before, after = np.asarray(model(ids).logits)
    np.testing.assert_array_equal(before[:10], after[:10])
    assert np.abs(before[10:] - after[10:]).max() > 1e-3


def test_grouped_query_attention_equals_repeated_key_value_heads(model):
    """8 query heads sharing 4 key/value heads (query head h reads kv head h // 2) compute what
    an 8-kv-head model with each kv head's projection repeated for its group computes."""
    mha = build_model(ModelSpec(dataclasses.replace(TINY, num_key_value_heads=8)), None, 1)
    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    groups, d = TINY.num_attention_heads // TINY.num_key_value_heads, TINY.head_dim
    for layer in state["layers"].values():
        for name in ("k_proj", "v_proj"):
            w = np.asarray(layer["self_attn"][name]["kernel"])
            w = w.reshape(w.shape[0], TINY.num_key_value_heads, d)
            layer["self_attn"][name]["kernel"] = np.repeat(w, groups, axis=1).reshape(
                w.shape[0], -1)
    target = nnx.state(mha, nnx.Param)
    nnx.replace_by_pure_dict(target, state)
    nnx.update(mha, target)
    batch = packed([docs(2, 5, 11), docs(3, 16)], 16)
    np.testing.assert_allclose(logits(mha, batch), logits(model, batch), atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_is_the_pairwise_rotation_bit_for_bit(dtype):
    """``rope`` (the whole head at once) equals the pairwise rotation of its docstring,
    (x_i cos a - x_{i+d/2} sin a, x_{i+d/2} cos a + x_i sin a) in float32, exactly, and so
    do their gradients."""
    x = jax.random.normal(jax.random.key(0), (2, 9, 4, TINY.head_dim)).astype(dtype)
    w = jax.random.normal(jax.random.key(1), x.shape)
    positions = jnp.asarray(np.random.default_rng(0).integers(0, 500, (2, 9)), jnp.int32)
    freq = rope_frequencies(TINY)

    def pairwise(x, positions, freq):
        a = positions.astype(jnp.float32)[..., None, None] * freq
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * jnp.cos(a) - x2 * jnp.sin(a),
                                x2 * jnp.cos(a) + x1 * jnp.sin(a)], -1).astype(x.dtype)

    outputs = [jax.jit(jax.value_and_grad(
        lambda x, f=f: jnp.sum(f(x, positions, freq).astype(jnp.float32) * w)))(x)
        for f in (rope, pairwise)]
    for got, want in zip(*outputs):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(rope(x, positions, freq), np.float32),
                                  np.asarray(pairwise(x, positions, freq), np.float32))


def test_batched_token_matmuls_compute_the_flat_ones(model):
    """``flat_tokens=False`` (the TPU layout: Dense layers on [batch, seq, features]) gives the
    flat layout's logits and gradients: the same matmuls, another shape."""
    batched = build_model(ModelSpec(TINY, flat_tokens=False), None, 0)
    assert not batched.layers[0].mlp.flat and model.layers[0].mlp.flat
    batch = packed([docs(4, 6, 10), docs(5, 16)], 16)
    np.testing.assert_allclose(logits(batched, batch), logits(model, batch), atol=1e-5)
    grad = lambda m: nnx.grad(lambda m: jnp.mean(m(batch["input_ids"], positions=batch[
        "positions"], segment_ids=batch["segment_ids"]).logits ** 2))(m)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 nnx.to_pure_dict(grad(batched)), nnx.to_pure_dict(grad(model)))


def test_pallas_attention_gives_the_reference_logits_and_decoding(model):
    """The flash kernel (interpreted on CPU) on packed causal rows, and on cached decoding
    (one query against the cache's filled slots by segment pair), equals the reference."""
    pallas = build_model(ModelSpec(TINY, attention_impl="pallas"), None, 0)
    batch = packed([docs(0, 7, 9), docs(3, 16)], 16)
    np.testing.assert_allclose(logits(pallas, batch), logits(model, batch), atol=1e-5)
    assert_decoding_equals_uncached(Sampler(pallas), model, docs(7, 3, 9), 3)


# ---- Hugging Face checkpoints ----

# Llama 3's RoPE scaling at a scale where all three of its frequency bands occur (head_dim 8,
# theta 500: wavelengths 6.3 | 30 | 140, 662 against 32/4 and 32/1).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def _hf_model(tmp_path, tie: bool, rope_scaling):
    import torch
    import transformers
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=tie, rope_scaling=rope_scaling)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    path = str(tmp_path / "hf")
    ref.save_pretrained(path, max_shard_size="20KB")
    return ref, path


def _torch_logits(ref, ids, positions=None):
    import torch
    with torch.no_grad():
        kw = {} if positions is None else {"position_ids": torch.as_tensor(positions).long()}
        return ref(torch.as_tensor(ids).long(), **kw).logits.numpy()


@pytest.mark.parametrize("tie,rope_scaling", [(False, None), (True, LLAMA3_ROPE)])
def test_transformers_parity_and_exact_round_trip(tmp_path, tie, rope_scaling):
    """A random GQA Llama written by transformers (sharded; tied embeddings and Llama 3 RoPE
    scaling in the second case) loads with logits within 1e-4 of PyTorch's (fp32); ours saved
    back (sharded) loads in transformers with the same logits and loads back into ours
    bit-exactly. Positions restarting mid-row (no segment ids, so the second document attends
    to the first) match transformers' position_ids."""
    ref, path = _hf_model(tmp_path, tie, rope_scaling)
    arch = architecture_of(path)
    assert (arch.rope_scaling is None) == (rope_scaling is None)
    if rope_scaling:     # all three bands: kept, interpolated, slowed by the factor 8
        plain = np.asarray(rope_frequencies(dataclasses.replace(arch, rope_scaling=None)))
        scaled = np.asarray(rope_frequencies(arch))
        assert scaled[0] == plain[0] and plain[1] / 8 < scaled[1] < plain[1]
        np.testing.assert_allclose(scaled[2:], plain[2:] / 8, rtol=1e-6)
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    ours = load_checkpoint(path, ModelSpec(architecture_of(path)))
    ids = np.asarray(docs(3, 40, vocab=96) + docs(4, 40, vocab=96), np.int32)
    positions = np.tile(np.r_[np.arange(15), np.arange(25)], (2, 1)).astype(np.int32)
    for pos in (None, positions):
        got = np.asarray(ours(ids, positions=pos).logits)
        err = np.abs(got - _torch_logits(ref, ids, pos)).max()
        assert err < 1e-4, err
    shifted = np.asarray(ours(ids).logits)
    assert np.abs(shifted - np.asarray(ours(ids, positions=positions).logits)).max() > 1e-3

    out = str(tmp_path / "ours")
    save_checkpoint(ours, out, max_shard_size=20_000)
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    import transformers
    back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    np.testing.assert_allclose(_torch_logits(back, ids), _torch_logits(ref, ids), atol=0)
    again = load_checkpoint(out, ModelSpec(architecture_of(out)))
    for x, y in zip(jax.tree_util.tree_leaves(nnx.state(ours, nnx.Param)),
                    jax.tree_util.tree_leaves(nnx.state(again, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture
def saved_tiny(tmp_path, model):
    path = str(tmp_path / "tiny")
    save_checkpoint(model, path)
    return path


def _edit(path, config_edit=None, tensors_edit=None):
    if config_edit:
        cfg = json.load(open(os.path.join(path, "config.json")))
        config_edit(cfg)
        json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    if tensors_edit:
        from safetensors.numpy import load_file, save_file
        file = os.path.join(path, "model.safetensors")
        tensors = load_file(file)
        tensors_edit(tensors)
        save_file(tensors, file)


@pytest.mark.parametrize("config_edit,tensors_edit,message", [
    (lambda c: c.update(model_type="gpt2", architectures=["GPT2LMHeadModel"]), None,
     r"model_type='gpt2' \(architectures \['GPT2LMHeadModel'\]\) is not a family jaxaccel "
     r"reads; known families .*'llama': \('llama',\)"),
    (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 8.0}), None,
     r"RoPE scaling 'yarn' is not supported \(plain RoPE or \('llama3',\)\)"),
    (None, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": np.ones(8, np.float32)}),
     r"tensors a Llama model of this architecture does not have: "
     r"\['model.layers.0.self_attn.q_norm.weight'\]"),
    (None, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
     r"lacks tensors the model needs: \['model.layers.1.mlp.up_proj.weight'\]"),
])
def test_bad_checkpoints_are_named(saved_tiny, config_edit, tensors_edit, message):
    _edit(saved_tiny, config_edit, tensors_edit)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(saved_tiny, ModelSpec(architecture_of(saved_tiny)))


def test_checkpoint_of_another_architecture_than_the_spec(saved_tiny):
    wider = ModelSpec(dataclasses.replace(TINY, intermediate_size=256))
    with pytest.raises(ValueError, match=r"intermediate_size=128 \(spec: 256\)"):
        load_checkpoint(saved_tiny, wider)


# ---- the causal-LM task ----

def test_causal_lm_loss_is_the_weighted_next_token_cross_entropy(model):
    """fp32 next-token cross entropy over target_weights: padding and each document's last
    token (no next token of the same document) do not count (the train step's use of it:
    tests/test_llama_sharding.py)."""
    batch = packed([docs(5, 6, 8), docs(6, 10)], 16)
    out = jnp.asarray(logits(model, batch))
    loss_sum, correct, count = LM.sums(out, batch)
    assert count == batch["target_weights"].sum() == 5 + 7 + 9
    np.testing.assert_allclose(loss_sum / count, lm_loss(model, batch), rtol=1e-6)
    junk = dict(batch, targets=np.where(batch["target_weights"] > 0, batch["targets"], 7))
    assert LM.sums(out, junk)[0] == loss_sum
    assert correct == np.sum((np.argmax(out, -1) == batch["targets"]) * batch["target_weights"])


def test_the_token_argmax_is_numpys_on_the_cpu_and_plain_on_accelerators(compile_target):
    """``tasks.argmax`` (the accuracy metric's): numpy's indices over a vocabulary of 8 blocks,
    ties across blocks (the first wins) and rows holding NaN (the first NaN wins) included; on
    a TPU the plain ``jnp.argmax``, without the CPU's two-pass ``cond``, which keeps the whole
    logits as its operand (9.5 against 6.2 GB of temporaries in a pipelined llama-350m step
    on v5e-8)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxaccel.train.tasks import argmax
    x = np.random.default_rng(0).standard_normal((3, 5, 1024)).astype(np.float32)
    x[0, 0, [130, 700]] = 9.0                 # a tie in two blocks
    x[1, 2, [5, 900]] = np.nan                # NaNs: jnp.argmax's first NaN
    for has_nan in (None, jnp.any(jnp.isnan(x))):
        np.testing.assert_array_equal(jax.jit(argmax)(x, has_nan), np.argmax(x, -1))
    clean = np.nan_to_num(x)
    assert "cond" in str(jax.make_jaxpr(argmax)(clean))
    tpu = compile_target("v5e-8")
    placed = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
        jax.sharding.Mesh(np.asarray(tpu.devices[:1]), ("x",)), P()))
    assert "cond" not in str(jax.make_jaxpr(argmax)(placed))


# ---- generation ----

def assert_decoding_equals_uncached(sampler, model, prompts, steps):
    """Greedy cached decoding: each step's logits equal ``model``'s over the row's prompt and
    generated tokens alone (right-padded into one [2, 16] batch, which a causal model
    ignores)."""
    new, seen = sampler(prompts, steps, return_logits=True)
    ids = np.zeros((len(prompts), 16), np.int32)
    for i, (p, n) in enumerate(zip(prompts, new)):
        ids[i, :len(p) + len(n)] = p + n
    full = np.asarray(model(ids).logits)
    for i, (p, n) in enumerate(zip(prompts, new)):
        np.testing.assert_allclose(seen[i], full[i, len(p) - 1:len(p) - 1 + len(n)], atol=1e-5)


def test_cached_decoding_equals_the_uncached_model(model):
    """Prompts of different lengths, left-padded into one batch and sampled with the KV cache:
    every step's logits equal the full (uncached) forward pass over the row's prompt +
    generated tokens alone, without left padding (right-padded, which a causal model
    ignores)."""
    prompts = docs(7, 3, 9)
    assert_decoding_equals_uncached(Sampler(model), model, prompts, 6)
    # A right-padded batch gives the same prompts back.
    ids = np.zeros((2, 11), np.int32)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, :len(p)], mask[i, :len(p)] = p, 1
    assert prompts_of(ids, mask) == prompts


def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    sampler = Sampler(model)
    prompts = docs(8, 4, 4)
    hot = dict(temperature=1.5, top_k=50)
    assert sampler(prompts, 8, seed=1, **hot) == sampler(prompts, 8, seed=1, **hot)
    assert sampler(prompts, 8, seed=1, **hot) != sampler(prompts, 8, seed=2, **hot)
    assert sampler(prompts, 8, temperature=1.0, top_k=1, seed=3) == sampler(prompts, 8)
    eos = sampler(prompts, 8)[0][2]
    assert len(sampler(prompts, 8, eos_id=eos)[0]) <= 2


def test_too_long_a_prompt_is_refused_before_any_work(model):
    with pytest.raises(ValueError, match=r"prompt 1 has 100 tokens; with max_new_tokens=29 "
                                         r"that is 129 positions, more than the model's "
                                         r"max_position_embeddings=128"):
        Sampler(model)([[1, 2], [3] * 100], 29)


# ---- the family table and specs ----

def test_llama_presets_build_specs_and_round_trip_as_json():
    cfg = config.build(sets=["model.name=llama-tiny", "model.remat=true",
                             "model.attention_impl=pallas"])
    s = spec.from_config(cfg.model)
    assert s == ModelSpec(TINY, remat=True, attention_impl="pallas", task="causal_lm")
    assert s.family.name == "llama" and s.num_labels is None      # model.num_labels ignored
    d = json.loads(json.dumps(s.to_dict()))
    assert d["family"] == "llama" and d["task"] == "causal_lm"
    assert spec.from_saved(d, cfg.model) == ModelSpec.from_dict(d) == s
    with pytest.raises(ValueError, match=r"model.hidden_dropout=0.1: the llama family has no "
                                         r"such dropout"):
        spec.from_config(config.build(sets=["model.name=llama-tiny",
                                            "model.hidden_dropout=0.1"]).model)
    with pytest.raises(ValueError, match=r"the llama family's causal_lm model takes no option\(s\) "
                                         r"\['num_labels'\]"):
        ModelSpec(TINY, num_labels=2)
    with pytest.raises(ValueError, match="heads for \\('classification',\\) only"):
        ModelSpec(PRESETS["tiny"], task="causal_lm")


def test_the_token_layout_is_chosen_per_platform_and_not_saved():
    """``flat_tokens``: batched on TPUs, flat elsewhere, only for the families that take it
    (the BERT spec is returned as it is), a given choice kept; ``to_dict`` leaves it out, so
    a TPU run's checkpoint restores anywhere."""
    s = ModelSpec(TINY)
    assert s.for_platform("tpu").flat_tokens is False
    assert s.for_platform("cpu").flat_tokens is s.for_platform("gpu").flat_tokens is True
    assert ModelSpec(TINY, flat_tokens=True).for_platform("tpu").flat_tokens is True
    bert = ModelSpec(PRESETS["tiny"], num_labels=2)
    assert bert.for_platform("tpu") is bert
    assert "flat_tokens" not in s.for_platform("tpu").to_dict()
    assert ModelSpec.from_dict(s.for_platform("tpu").to_dict()) == s


def test_bert_specs_saved_before_families_still_load():
    """Run folders written before the family table hold spec dicts without "family" and
    "task" (and older ones the bare BertConfig): both give the BERT classification spec."""
    cfg = config.build(sets=["model.name=tiny", "model.num_labels=3"])
    arch = {"vocab_size": 30522, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128, "hidden_act": "gelu",
            "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
            "max_position_embeddings": 128, "type_vocab_size": 2, "layer_norm_eps": 1e-12,
            "pad_token_id": 0, "initializer_range": 0.02}
    before = {"architecture": arch, "num_labels": 3, "pooling": "cls", "attention_impl": "xla",
              "remat": False, "mlm_head": False}
    expected = ModelSpec(PRESETS["tiny"], num_labels=3)
    assert spec.from_saved(before, cfg.model) == expected
    assert spec.from_saved(arch, cfg.model) == expected
    assert expected.task == "classification" and expected.to_dict()["family"] == "bert"


# ---- a causal-LM run folder: eval and generate ----

WORDS = ["[UNK]", "</s>"] + [f"w{i}" for i in range(60)]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory, model):
    """A run folder as the trainer writes it (checkpoint with its record, tokenizer/) holding
    the tiny decoder and a 62-word word-level tokenizer."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    from jaxaccel.train.checkpoint import Checkpointer, on_disk
    run_dir = tmp_path_factory.mktemp("lm") / "run"
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>") \
        .save_pretrained(str(run_dir / "tokenizer"))
    cfg = config.build(sets=["model.name=llama-tiny", "data.name=canterbury",
                             f"workdir={run_dir.parent}", "name=run"])
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    ckpt = Checkpointer(str(run_dir / "checkpoints"))
    ckpt.save(3, on_disk(TrainState.create(params, optax.sgd(0.1), 0)),
              {"epoch": 0, "step_in_epoch": 3, "step": 3, "config": cfg.to_dict(),
               "architecture": model.spec.to_dict(), "label_names": []})
    ckpt.wait()
    ckpt.close()
    return str(run_dir)


class _Batches:
    def __init__(self, batches):
        self._batches = batches

    def batches(self, epoch):
        return iter(self._batches)


def test_eval_of_a_causal_lm_run_reports_loss_and_perplexity(lm_run, model, monkeypatch,
                                                             capsys):
    """``jaxaccel eval`` on an LM run folder goes through the causal-LM task: the weighted
    next-token loss over the eval batches and its exponential (eval batches stand in for the
    LM corpus here)."""
    from jaxaccel import cli
    from jaxaccel.data import splits
    batches = [packed([docs(20 + r, 6, 9) for r in range(8)], 16),
               packed([docs(40 + r, 12) for r in range(8)], 16)]
    monkeypatch.setattr(splits, "eval_batches", lambda *a: (_Batches(batches), ()))
    assert cli.main(["eval", "--checkpoint", lm_run]) == 0
    report = json.loads(capsys.readouterr().out)
    sums = [LM.sums(jnp.asarray(logits(model, b)), b) for b in batches]
    loss = sum(float(s[0]) for s in sums) / sum(float(s[2]) for s in sums)
    assert report["tokens"] == 8 * (5 + 8) + 8 * 11 and report["step"] == 3
    np.testing.assert_allclose(report["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(report["perplexity"], np.exp(loss), rtol=1e-5)


def test_generate_continues_prompts_from_a_run_folder(lm_run, model, capsys):
    from jaxaccel import cli
    from jaxaccel.data import load_tokenizer
    prompts = ["w1 w2 w3", "w7 w8 w9 w10 w11 w12"]
    assert cli.main(["generate", "--checkpoint", lm_run, "--greedy", "--max-new-tokens", "4",
                     *prompts]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ids = [[WORDS.index(w) for w in p.split()] for p in prompts]
    expected = Sampler(model)(ids, 4, eos_id=WORDS.index("</s>"))
    assert [r["prompt"] for r in records] == prompts
    tokenizer = load_tokenizer(os.path.join(lm_run, "tokenizer"), light=True)
    assert [r["text"] for r in records] == [tokenizer.decode(n, skip_special_tokens=True)
                                            for n in expected]
    assert any(r["text"] for r in records)
    # Too long for the model (128 positions): one error line, nothing on standard output.
    assert cli.main(["generate", "--checkpoint", lm_run, "--max-new-tokens", "100",
                     " ".join(["w3"] * 40)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1
    assert "max_position_embeddings=128" in out.err
    assert cli.main(["predict", "--checkpoint", lm_run, "w1"]) == 2
    assert "trained a causal_lm model; predict classifies texts. Use `jaxaccel generate`" in \
        capsys.readouterr().err


def test_a_tokenizer_larger_than_the_vocabulary_is_refused():
    from jaxaccel.models import check_vocab
    check_vocab(256, TINY, "tok")
    with pytest.raises(ValueError, match=r"the tokenizer 'tok' has 257 tokens but the model's "
                                         r"vocab_size is 256"):
        check_vocab(257, TINY, "tok")


@pytest.mark.parametrize("name,published", [("llama3-8b", 8_030_261_248),
                                            ("llama2-70b", 68_976_648_192)])
def test_the_presets_at_scale_have_the_published_parameter_counts(name, published):
    """Meta-Llama-3-8B and Llama-2-70b-hf's parameter counts (their safetensors index's
    total_size / 2 bytes), from the abstract parameters (nothing allocated) of the preset with
    one and two of its identical layers (80 built abstractly take ~15 CPU s)."""
    arch = LLAMA_PRESETS[name]

    def count(layers):
        spec = ModelSpec(dataclasses.replace(arch, num_hidden_layers=layers))
        state = nnx.state(nnx.eval_shape(lambda: build_model(spec, "bf16")), nnx.Param)
        return sum(x.size for x in jax.tree_util.tree_leaves(state))

    one, two = count(1), count(2)
    assert one + (arch.num_hidden_layers - 1) * (two - one) == published
