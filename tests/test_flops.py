"""jaxaccel.flops: the analytic training FLOPs, the peak table, the throughput meter."""
import numpy as np
import pytest

from jaxaccel import flops
from jaxaccel.models import PRESETS, ModelSpec

SHAPE = flops.Shape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16,
                    mlp_matrices=3, head_weights=8 * 100, causal=True, pre_norm=True)


def test_train_flops_by_hand():
    # Per layer: q, o 8x8 each; k, v 8x(1x4) each; gated MLP 3 x 8x16. Head 8x100.
    n = 2 * (64 + 64 + 32 + 32 + 3 * 128) + 800
    assert SHAPE.matmul_weights == n
    attention = 12 * 2 * 10 * 10 * (2 * 4) * 3 / 2       # causal: halved
    assert flops.train_flops(SHAPE, batch=3, seq=10) == 6 * n * 3 * 10 + attention
    bidirectional = flops.Shape(**{**SHAPE.__dict__, "causal": False})
    assert flops.train_flops(bidirectional, 3, 10) - flops.train_flops(SHAPE, 3, 10) == attention


def test_bert_base_shape():
    shape = flops.model_shape(ModelSpec(PRESETS["bert-base"], num_labels=2))
    h = 768
    assert shape.matmul_weights == 12 * (4 * h * h + 2 * h * 3072) + h * h + 2 * h  # ~85.6M
    assert not shape.causal and shape.kv_heads == shape.heads == 12
    mlm = flops.model_shape(ModelSpec(PRESETS["bert-base"], mlm_head=True))
    assert mlm.head_weights == h * 30522 + h * h


@pytest.mark.parametrize("kind, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12), ("NVIDIA H100 80GB HBM3", "fp8", 1979e12),
    ("NVIDIA H100 PCIe", "bf16", 756e12), ("NVIDIA H200", "bf16", 989e12),
    ("NVIDIA A100-SXM4-40GB", "fp32", 156e12), ("NVIDIA A100-SXM4-80GB", "fp8", None),
    ("TPU v4", "bf16", 275e12), ("TPU v5 lite", "bf16", 197e12), ("TPU v5", "bf16", 459e12),
    ("TPU v6 lite", "bf16", 918e12), ("TPU v5 lite", "fp16", None), ("cpu", "fp32", None),
])
def test_peak_table(kind, dtype, peak):
    assert flops.mfu_peak(kind, dtype) == peak


def test_throughput_skips_the_compile_step_and_reports_mfu_only_with_a_peak():
    batch = {"input_ids": np.zeros((4, 10), np.int32),
             "segment_ids": np.array([[1] * 10, [1] * 6 + [0] * 4, [0] * 10, [2] * 10])}
    meter = flops.Throughput(SHAPE, "bf16", "NVIDIA H100 80GB HBM3", devices=8, processes=2)
    meter.add(batch, 100.0)                      # compile step: ignored
    assert meter.flush() == {}
    meter.add(batch, 1.0)
    meter.add(batch, 3.0)
    out = meter.flush()
    model = 2 * flops.train_flops(SHAPE, 8, 10)   # 2 steps of 2 processes x 4 rows
    assert out["tokens_per_s"] == 2 * 2 * 26 / 4.0
    assert out["processed_tokens_per_s"] == 2 * 2 * 40 / 4.0
    assert out["model_tflops_per_device"] == pytest.approx(model / 4.0 / 8 / 1e12)
    assert out["mfu"] == pytest.approx(model / 4.0 / (8 * 989e12))
    cpu = flops.Throughput(SHAPE, "fp32", "cpu", devices=1)
    cpu.add(batch, 1.0)
    cpu.add({"input_ids": batch["input_ids"], "attention_mask": np.ones((4, 10))}, 2.0)
    assert set(cpu.flush()) == {"tokens_per_s", "processed_tokens_per_s",
                                "model_tflops_per_device"}


@pytest.mark.parametrize("tied", [False, True])
def test_llama_shape_counts_the_models_matmul_weights(tied):
    """N = every 2-D weight of the built model but the embedding table (a lookup), which
    counts once as the output projection when tied."""
    import dataclasses

    import jax
    from flax import nnx

    from jaxaccel.models import LLAMA_PRESETS, build_model
    arch = dataclasses.replace(LLAMA_PRESETS["llama-tiny"], tie_word_embeddings=tied)
    spec = ModelSpec(arch)
    model = build_model(spec)
    weights = [x for x in jax.tree_util.tree_leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
               if x.ndim >= 2]
    lookup = 0 if tied else arch.vocab_size * arch.hidden_size
    shape = flops.model_shape(spec)
    assert shape.matmul_weights == sum(x.size for x in weights) - lookup
    assert shape.causal and shape.kv_heads == 4 and shape.heads == 8 and shape.mlp_matrices == 3
