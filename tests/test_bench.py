"""Benchmark helpers that carry logic: the backward-time estimator and the kernel counter."""
import os
import sys

import jax
import jax.numpy as jnp
import pytest

from support import ROOT

sys.path.insert(0, ROOT)

from bench.common import count_kernels  # noqa: E402
from bench.scaling import predict_backward  # noqa: E402


def test_estimator_overlaps_communication_with_compute():
    assert predict_backward(12, 1.0, 0.0) == 12.0                 # no communication
    assert predict_backward(12, 1.0, 0.5) == 12.5                 # hidden but the last one
    assert predict_backward(4, 1.0, 3.0) == 1.0 + 4 * 3.0         # channel-bound
    assert predict_backward(1, 2.0, 1.0) == 3.0


def test_kernel_counter_sees_fusions():
    f = jax.jit(lambda x, y: (jnp.sin(x) * 2 + y, jnp.cos(y).sum()))
    counts = count_kernels(f.lower(jnp.ones(128), jnp.ones(128)).compile())
    assert counts["fusions_and_custom_calls"] >= 1
    assert counts["entry_ops"] >= counts["fusions_and_custom_calls"]


def test_profile_reads_the_trace_back_per_op_and_category():
    from bench.hlo_profile import profile_ops
    f = jax.jit(lambda x, w: jnp.tanh(x @ w).sum(axis=0))
    x, w = jnp.ones((256, 256)), jnp.ones((256, 256))
    prof = profile_ops(f, x, w, steps=3)
    cats = {r["category"]: r for r in prof.rows()}
    assert "matmul" in cats and cats["matmul"]["ms"] > 0, prof.table()
    assert abs(sum(r["share"] for r in prof.rows()) - 1) < 1e-6
    assert all(k in f.lower(x, w).compile().as_text() for k in prof.per_op)


def test_categories_follow_what_a_fusion_contains():
    from bench.hlo_profile import categorize, hlo_index
    hlo = """HloModule m
%fused_scatter (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %s = f32[8]{0} scatter(%p0, %p0, %p0), to_apply=%add
}
ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %fusion = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_scatter
  %cc = f32[8]{0} custom-call(%a), custom_call_target="__cudnn$fmhaSoftmax"
  ROOT %t = f32[8]{0} transpose(%fusion), dimensions={0}
}
"""
    instrs, comps = hlo_index(hlo)
    assert categorize("fusion", instrs, comps) == "scatter"
    assert categorize("cc", instrs, comps) == "attention (cuDNN)"
    assert categorize("t", instrs, comps) == "copy/transpose/slice"
    assert categorize("missing", instrs, comps) == "other"


SUITES = ("train_step", "attention", "optimizer", "job", "scaling", "checkpoint_save", "hf_flax",
          "hf_llama", "pipeline", "gpu_evidence", "bucket_io")


def test_results_go_where_the_user_says_never_to_committed_results(tmp_path, monkeypatch,
                                                                    capsys):
    """Fault probe 2, item 3: `jaxaccel bench train_step --small` overwrote the committed
    bench/results/train_step-cpu.json. By default a measurement goes under runs/bench/ of the
    current folder; --out DIR elsewhere; every suite takes --out."""
    import importlib

    from bench import common
    committed = os.path.join(os.path.dirname(common.__file__), "results")
    before = {f: os.path.getmtime(os.path.join(committed, f)) for f in os.listdir(committed)}
    monkeypatch.chdir(tmp_path)
    for suite in SUITES:
        with pytest.raises(SystemExit):
            importlib.import_module(f"bench.{suite}").main(["--help"])
        assert "--out DIR" in capsys.readouterr().out, suite
    rows = [{"name": "x", "median_s": 1.0, "min_s": 1.0, "max_s": 1.0, "n": 1}]
    path = common.write_results("train_step", rows, out=common.DEFAULT_OUT)
    assert path == str(tmp_path / "runs" / "bench" / os.path.basename(path))
    mine = common.write_results("train_step", rows, out=str(tmp_path / "mine"))
    assert os.path.dirname(mine) == str(tmp_path / "mine")
    after = {f: os.path.getmtime(os.path.join(committed, f)) for f in os.listdir(committed)}
    assert after == before


@pytest.mark.long
def test_gpu_evidence_dry_run_runs_every_part_and_writes_its_rows(tmp_path):
    """Issue 50: `bench/gpu_evidence.py --cpu-dry-run` (what keeps the GPU command alive between
    GPU loans) runs every part's code on tiny shapes: the smoke tests collected in a child
    process, the PyTorch worker, the prepared JAX steps and plans, the benches; every part is
    done and has its rows, in the JSON and the Markdown page."""
    import json

    from bench import gpu_evidence
    assert gpu_evidence.main(["--cpu-dry-run", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "evidence-cpu.json").read_text())
    assert result["cpu_dry_run"] and "no time here is a result" in result["note"]
    assert {p: r["status"] for p, r in result["parts"].items()} == dict.fromkeys(
        gpu_evidence.PARTS, "done")
    assert result["smoke"]["exit_status"] == 0 and "-m gpu_smoke" in result["smoke"]["command"]
    names = {(r["part"], r["name"]) for r in result["rows"]}
    for part, name in [("bert", "jax.bf16.adamw.xla"), ("bert", "jax.fp8.adamw.xla"),
                       ("bert", "torch.eager.fp32.adamw.sdpa.attn_drop0"),
                       ("decoder", "jax.fp8.adamw.xla"), ("decoder", "torch.eager.fp32.adamw.sdpa"),
                       ("mae", "jax.fp8.adamw.xla"), ("planner", "plan.bert"),
                       ("planner", "plan.decoder"), ("attention", "tiny_causal/xla/fwd+bwd"),
                       ("adan", "onepass.xla")]:
        assert (part, name) in names, (part, name)
    bert = [r for r in result["rows"] if r["part"] == "bert"]
    assert all(r["median_s"] > 0 and r["work"]["model"] == "bert-dry" for r in bert)
    assert [r.get("fp8") for r in bert if "fp8" in r["name"]] == ["emulated"]
    assert all("speedup_vs_torch" in r for r in bert if r["name"].startswith("jax."))
    page = (tmp_path / "evidence-cpu.md").read_text()
    assert all(f"## {part}" in page for part in gpu_evidence.PARTS)
