"""The Mosaic GPU flash attention (``kernels_pallas/attention_mgpu.py``): its forward, dQ and
dK/dV kernels against the reference in jax's Mosaic GPU interpreter (GPU shared memory,
warpgroups, barriers and TMA simulated on the CPU) over cases that together cover the axes the
Triton kernels are tested on (``test_attention.py``: sequence lengths and padding, key lengths
0 / partial / full, causal, queries longer and shorter than the keys, grouped-query heads,
head_dims 32 / 96 / 128, packed and paired segment ids, fp16 and bf16, a logits scale); the
compile for compile-only H100 devices (ptxas for sm_90a: no register spills); the registry's
view of it; and real runs when the default backend is a GPU.

float32 is not among the dtypes: the kernels decline it (Hopper's warpgroup MMA would take it
as TF32). The interpreter is slow (seconds per program and kernel; jax 0.10's is ~10x slower
than 0.12's), so the cases keep batch x heads small and cover several axes each."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compile_only
from kernels_pallas import attention as kernel
from kernels_pallas import mgpu
from kernels_pallas.attention import check_impl
from kernels_pallas.attention_mgpu import BlockSizes, default_block_sizes, mgpu_flash_attention
from kernels_pallas.attention_reference import segments
from test_attention import inputs, on_platform, out_and_grads, reference_out_and_grads, rel

pytestmark = pytest.mark.skipif(not mgpu.available(), reason="this jax has no Mosaic GPU")

# Norm-wise relative error of out, dq, dk, dv against the float32 reference at highest
# precision: the kernels round P and dS to the input dtype before their MMAs and round the
# outputs, as the Triton kernels do (test_attention.TOL: 2e-2 for half precision); dK/dV of
# grouped heads are rounded per query head before the group sum (one more rounding).
TOL = 2e-2

PACKED = jnp.array([[0] * 30 + [1] * 25 + [2] * 22])
CASES = {
    # Key lengths 0 / partial / full in one batch, causal, an odd length padded to 128.
    "lengths_0_partial_full_causal": dict(b=3, sq=77, key_lengths=[0, 23, 77], causal=True),
    "one_query_one_key": dict(sq=1),
    # Queries past the keys (Sq > Sk), causal: the first row's only key is masked by length 0.
    "more_queries_than_keys_causal": dict(b=2, sq=30, sk=10, key_lengths=[0, 10], causal=True),
    # Fewer queries than keys, 2 key blocks, grouped heads 2:1, head_dim 128, float16.
    "gqa_cross_d128_fp16": dict(sq=77, sk=150, hq=2, hkv=1, d=128, causal=True,
                                key_lengths=[147], dtype=jnp.float16),
    # (q, kv) segment-id pair with padded keys, head_dim 96 (padded to 128).
    "segment_pair_key_lengths_d96": dict(
        b=2, sq=33, sk=50, d=96, key_lengths=[45, 30],
        segment_ids=(jnp.array([[0] * 20 + [1] * 13, [1] * 33]),
                     jnp.array([[0] * 10 + [1] * 40, [0] * 25 + [1] * 25]))),
    # Packed segments, causal, head_dim 32 (padded to 64), a logits scale.
    "packed_segments_causal_d32_scale": dict(sq=77, d=32, causal=True, segment_ids=PACKED,
                                             scale=0.3),
    # Several query tiles and key blocks: a decoder's packed rows, grouped heads 2:1, D=128.
    "decoder_multi_tile_gqa_segments": dict(
        sq=300, hq=2, hkv=1, d=128, causal=True,
        segment_ids=jnp.concatenate([jnp.zeros((1, 100), jnp.int32),
                                     jnp.ones((1, 200), jnp.int32)], 1)),
}


def check(b=1, sq=77, sk=None, hq=1, hkv=None, d=64, dtype=jnp.bfloat16, causal=False,
          key_lengths=None, segment_ids=None, scale=None, block_sizes=None, on_gpu=False):
    """The kernels' output and gradients against the reference's (``TOL``), in the
    interpreter, or compiled when ``on_gpu``."""
    sk = sq if sk is None else sk
    q, k, v, do = inputs(b, sq, sk, hq, hkv or hq, d, dtype)
    lengths = None if key_lengths is None else jnp.asarray(key_lengths, jnp.int32)
    kw = dict(key_lengths=lengths, causal=causal, scale=scale)
    segs = segments(segment_ids, sq, sk)
    # Blocked on before the reference is dispatched: jax 0.10's interpreter dispatches
    # computations from its callbacks (kernels_pallas/mgpu.py).
    got = jax.block_until_ready(out_and_grads(lambda q, k, v: mgpu_flash_attention(
        q, k, v, segment_ids=segs, block_sizes=block_sizes, interpret=not on_gpu, **kw),
        q, k, v, do))
    want = reference_out_and_grads(q, k, v, do, segment_ids=segment_ids, **kw)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == dtype and g.shape == w.shape, name
        assert np.isfinite(np.asarray(g, np.float32)).all(), name
        assert rel(g, w) < TOL, f"{name}: rel err {rel(g, w):.2e} >= {TOL}"
    return got


# jax 0.10's interpreter took 25-175 s per case (a loaded 2-core CPU; 5-7x jax 0.12's): there
# the cases with more than a few programs per kernel run under -m slow. The kernels are the same
# on both; the code that differs by version (plain dots for the MMAs, no layout hints) runs in
# the light cases.
HEAVY_FOR_JAX_0_10 = ("decoder_multi_tile_gqa_segments", "gqa_cross_d128_fp16",
                      "lengths_0_partial_full_causal", "more_queries_than_keys_causal",
                      "segment_pair_key_lengths_d96")


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.slow) if c in HEAVY_FOR_JAX_0_10 and not
    mgpu.INTERPRETER_MMA else c for c in sorted(CASES)])
def test_interpreted_kernels_match_reference(case):
    got = check(**CASES[case])
    lengths = CASES[case].get("key_lengths")
    if lengths is not None and lengths[0] == 0:      # a row with no key: zeros, no gradient
        o, dq, dk, dv = (np.asarray(x[0], np.float32) for x in got)
        assert not o.any() and not dq.any() and not dk.any() and not dv.any()


def test_declines_what_it_does_not_compute():
    """float32 and mixed dtypes raise NotImplementedError (the registry then tries the next
    implementation); so does attention dropout, through the registry."""
    q, k, v, _ = inputs(1, 8, 8, 1, 1, 64, jnp.float32)
    with pytest.raises(NotImplementedError, match="bfloat16/float16"):
        mgpu_flash_attention(q, k, v)
    with pytest.raises(NotImplementedError, match="bfloat16/float16"):
        mgpu_flash_attention(q.astype(jnp.bfloat16), k, v)
    with pytest.raises(NotImplementedError, match="no attention dropout"):
        kernel.attention(q, k, v, dropout_rate=0.1, dropout_rng=jax.random.PRNGKey(0),
                         impl="mosaic_gpu")
    assert kernel.attention(q, k, v, impl=("mosaic_gpu", "xla")).dtype == jnp.float32


def test_registry_names_it_and_platforms_check_it():
    """"mosaic_gpu" is a registry name (config model.attention_impl), not in any default order
    until measured on a GPU, and runs on GPUs (and the CPU's interpreter) only."""
    assert "mosaic_gpu" in kernel.IMPLS
    assert all("mosaic_gpu" not in order for order in kernel.DEFAULT_ORDER.values())
    check_impl("mosaic_gpu", 0.0)
    with on_platform("tpu"), pytest.raises(ValueError, match="runs on \\('gpu', 'cpu'\\) only"):
        check_impl("mosaic_gpu", 0.0)
    with on_platform("gpu"), pytest.raises(ValueError, match="attention_impl='xla'"):
        check_impl("mosaic_gpu", 0.1)


def test_block_sizes_are_whole_warpgroup_tiles():
    with pytest.raises(ValueError, match="block_kv=96 must be a positive multiple of 64"):
        BlockSizes(block_kv=96)
    with pytest.raises(ValueError, match="stages"):
        BlockSizes(stages=1)
    assert default_block_sizes(64) == BlockSizes()
    assert default_block_sizes(128) == BlockSizes(block_kv=64)


# --- compiled for H100 on compile-only devices ---------------------------------------------

# Forward + backward per compile, the shapes of test_attention's GPU compiles in bf16.
COMPILES = {
    "bert_base": dict(shape=(2, 512, 12, 12, 64), causal=False, lengths=True, segments=False),
    "gqa_causal_segments_odd": dict(shape=(2, 300, 8, 2, 128), causal=True, lengths=True,
                                    segments=True),
    "d96_odd_causal": dict(shape=(1, 200, 4, 4, 96), causal=True, lengths=False,
                           segments=False),
}


# Bytes ptxas spills to local memory, at most, per kernel and case: none, but for the dK/dV
# kernel at D=128 with segment ids (44 bytes with jax 0.12: two float32 accumulators of
# 64 x 128, the scores and the segment masks exceed a compute warpgroup's registers by a few).
SPILLS = {("gqa_causal_segments_odd", "flash_attention_dkv_mgpu"): 64}


@pytest.mark.parametrize("case", sorted(COMPILES))
def test_compiles_for_h100_without_register_spills(compile_target, ptxas_reports, case):
    """impl="mosaic_gpu" forward and backward compiled for a compile-only H100: the three
    kernels are Mosaic GPU custom calls, compiled by ptxas for sm_90a without spilling
    registers (``SPILLS``)."""
    target = compile_target("h100:1x1")
    c = COMPILES[case]
    b, s, hq, hkv, d = c["shape"]
    m = compile_only.mesh(target)
    q, kv, lengths, seg = compile_only.replicated(
        m, *(jax.ShapeDtypeStruct(x, t) for x, t in (((b, s, hq, d), jnp.bfloat16),
                                                      ((b, s, hkv, d), jnp.bfloat16),
                                                      ((b,), jnp.int32), ((b, s), jnp.int32))))

    def fwd_bwd(q, k, v, do, lengths, seg):
        out, vjp = jax.vjp(lambda q, k, v: kernel.attention(
            q, k, v, key_lengths=lengths if c["lengths"] else None,
            segment_ids=seg if c["segments"] else None, causal=c["causal"],
            impl="mosaic_gpu"), q, k, v)
        return out, vjp(do)

    compiled, seconds = compile_only.compile_timed(fwd_bwd, q, kv, kv, q, lengths, seg, mesh=m)
    print(f"h100 {case} mosaic_gpu: compiled in {seconds:.1f} s")
    assert compiled.as_text().count(compile_only.KERNEL_CALL["mosaic_gpu"]) == 3
    reports = dict(ptxas_reports())
    assert sorted(reports) == ["flash_attention_dkv_mgpu", "flash_attention_dq_mgpu",
                               "flash_attention_fwd_mgpu"], sorted(reports)
    for name, text in reports.items():
        compile_only.assert_spills_at_most(name, text, SPILLS.get((case, name), 0))


# --- real runs on a GPU (skipped elsewhere) -------------------------------------------------

GPU_CASES = {
    "small": dict(b=2, sq=77, hq=4, key_lengths=[77, 40]),
    "bert_513": dict(b=3, sq=513, hq=12, key_lengths=[0, 200, 513]),
    "gqa_causal_cross_d128": dict(sq=300, sk=700, hq=8, hkv=2, d=128, causal=True),
    "segments_d96_fp16": dict(b=2, sq=77, hq=4, d=96, dtype=jnp.float16,
                              segment_ids=jnp.array([[0] * 40 + [1] * 37] * 2)),
}


@pytest.mark.parametrize("case", [
    pytest.param("small", marks=(pytest.mark.gpu, pytest.mark.gpu_smoke)),
    *(pytest.param(c, marks=pytest.mark.gpu) for c in sorted(GPU_CASES) if c != "small")])
def test_gpu_matches_reference(case):
    """The compiled kernels on the GPU (an H100 or H200: sm_90a), default blocks."""
    device = jax.devices()[0]
    if getattr(device, "compute_capability", None) != "9.0":
        pytest.skip(f"the Mosaic GPU kernels are written for Hopper (sm_90a); this is "
                    f"{device.device_kind}")
    check(**GPU_CASES[case], on_gpu=True)


# --- training steps compiled for H100 with the Mosaic GPU kernels ---------------------------
# (BERT-base's, with both kernels on FSDP-8: test_sharding.py.)


@pytest.mark.aot_compile
@pytest.mark.long
def test_decoder_train_step_compiles_for_h100_with_mosaic_gpu_kernels(compile_target):
    """The decoder job as committed (configs/canterbury_lm.py: llama-cpu, 4 query / 2 key-value
    heads, packed rows of 128 tokens; its corpus never read) in bf16 with Adan's one pass
    (parameters and state flat) on 8 H100s: its training step compiled with the Mosaic GPU
    attention (causal, segment ids, grouped heads; forward, dQ, dK/dV) and the Mosaic GPU
    one-pass Adan."""
    import os

    from jaxaccel import plan
    target = compile_target("h100:1x8")
    config = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "canterbury_lm.py")
    cfg = plan.load_config(config, [
        "precision.policy=bf16", "model.attention_impl=mosaic_gpu", "train.optimizer=adan",
        "train.optimizer_impl=mosaic_gpu", "train.flat_params=true"], target)
    run = plan.abstract_run(cfg, target)
    batch = plan.abstract_batch(run, cfg.train.batch_size)
    compiled, seconds = compile_only.compile_timed(run.train_step, run.state, batch,
                                                   mesh=run.mesh)
    print(f"canterbury_lm bf16 train step on h100:1x8 (Mosaic GPU): compiled in {seconds:.1f} s")
    calls = " ".join(compile_only.kernel_calls(compiled.as_text(), "mosaic_gpu"))
    for name in ("flash_attention_fwd_mgpu", "flash_attention_dq_mgpu",
                 "flash_attention_dkv_mgpu", "adan_apply_mgpu"):
        assert name in calls, name
