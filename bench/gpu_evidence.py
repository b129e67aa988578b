"""GPU evidence in one command: what a lent GPU should tell us, in one process, under 7 minutes.

    bash bench/gpu_evidence.sh OUT_DIR                   # on the GPU machine (see the .sh)
    python bench/gpu_evidence.py --out DIR [--budget-s 400] [--parts bert,decoder]
    python bench/gpu_evidence.py --cpu-dry-run --out DIR # CI: tiny shapes, every part's code
                                                         # path and rows, no timing claims

A GPU is lent for minutes (../shared/gpu-checklist.md), so every part below runs in this one
process, most valuable first, and the results are rewritten after every part
(``evidence-<device>.json``: bench/results format, one row per measurement with its part and
the ``work`` that ``jaxaccel compare`` joins rows by; ``evidence-<device>.md``: one table per
part): a run cut off by its time limit keeps what it measured. A part runs its rows in order
of value and stops starting rows when the budget (``--budget-s``) would be overrun; what it
left out is named in the part's record.

Parts (checklist item -> part), with the expected duration on one H100/H200 (jax 0.11, warm
pip cache, cold compilation cache). The estimates come from the previous H100 numbers
(BERT-base step 14 ms at 32 x 128, 67 ms at 256 x 128; an XLA compile of the BERT-base step
~15-25 s with GEMM autotuning; torch.compile of a BERT-base or Llama-125m train step ~30-45 s;
Triton attention kernels 5-16 s each to compile) and the FLOPs (a timed row is 20 steps after
3 warm-up steps: under 3 s for every row here, e.g. llama-350m at 8 x 2048 is 6 x 0.35e9 x
16k = 35 TFLOP, ~0.1 s a step at 40% MFU):

| # | part | checklist | what | expected |
|---|---|---|---|---|
| 1 | smoke | 1 | ``pytest -m gpu_smoke`` (kernels and the train step against references at highest precision, on the device): a GPU number counts only where these pass | 90 s |
| 2 | bert | 2 | BERT-base train step at 32 and 256 x 128: ours (bf16 with cuDNN and Pallas attention, then fp8 with the faster) against torch.compile + SDPA + bf16 autocast + fused AdamW; MFU | 120 s |
| 3 | adan | 5 | one Adan update of the BERT-base tree: fused Pallas, XLA multi-tensor, per leaf, optax; HBM roofline | 25 s |
| 4 | attention | 4 | flash attention fwd and fwd+bwd, BERT (32 x 512 x 12 x 64, padded keys) and long causal (2 x 4096 x 16 x 128), bf16: ours, XLA, cuDNN | 45 s |
| 5 | decoder | 3 | llama-125m and llama-350m train steps at 8 x 2048: ours bf16 and fp8 against PyTorch's Llama (torch.compile, SDPA, bf16 autocast, fused AdamW); tokens/s, MFU | 110 s |
| 6 | planner | 6 | ``jaxaccel compile --topology local`` of the measured BERT-base and llama-125m configs: the forecast and its range and the planned memory beside the measured step and memory | 35 s |
| 7 | mae | 7 | Audio-MAE ViT-B/16 (1024 x 128 spectrograms, 80% masked) train step at batch 64, bf16 and fp8 | 35 s |
|   | total | | | 460 s; with ``--budget-s 400`` the last rows give way |

fp8 rows record whether the compiled step holds cuBLASLt fp8 GEMMs (``fp8: native``). PyTorch
has no fp8 row: transformers' models take fp8 only through Transformer Engine or torchao,
which the GPU image lacks, so ours at fp8 stands beside PyTorch at bf16.

In ``--cpu-dry-run`` every part runs its code on tiny shapes (a 2-layer BERT, ``llama-tiny``,
``vit-tiny``; torch eager instead of compiled; ``pytest --collect-only`` for the smoke tests)
and writes its rows; none of its times is a result.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree

# Torch and JAX share the GPU in this process: JAX takes half of its memory, not 75%.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

from bench import attention as attention_bench  # noqa: E402
from bench import optimizer as optimizer_bench  # noqa: E402
from bench import train_step as step_bench  # noqa: E402
from bench.common import (add_out_argument, device_kind, markdown, time_fn,  # noqa: E402
                          write_results)
from jaxaccel.flops import model_shape, peak_flops, train_flops  # noqa: E402
from jaxaccel.models import LLAMA_PRESETS, PRESETS, BertConfig, LlamaConfig, ModelSpec  # noqa
from jaxaccel.models.spec import VIT_PRESETS, ViTConfig  # noqa: E402
from jaxaccel.precision import get_policy  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shapes each part measures: the real ones, or the dry run's tiny ones."""
    bert: BertConfig
    bert_name: str
    bert_batches: tuple
    bert_seq: int
    llama: dict             # name -> LlamaConfig
    lm_batch: int
    lm_seq: int
    vit: tuple              # (name, ViTConfig)
    vit_batch: int
    attention: dict         # bench.attention shapes
    torch_mode: str
    n: int
    warmup: int
    plan_models: tuple = ("bert-base", "llama-125m")   # the planner's presets (bert, llama)


GPU = Sizes(bert=PRESETS["bert-base"], bert_name="bert-base", bert_batches=(32, 256),
            bert_seq=128, llama={k: LLAMA_PRESETS[k] for k in ("llama-125m", "llama-350m")},
            lm_batch=8, lm_seq=2048, vit=("audiomae-b16", VIT_PRESETS["audiomae-b16"]),
            vit_batch=64, attention=attention_bench.SHAPES, torch_mode="compile", n=20,
            warmup=3)
# One layer of everything: the dry run checks code paths, and compiling is its cost.
DRY = Sizes(bert=BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=64),
            bert_name="bert-dry", bert_batches=(2,), bert_seq=8,
            llama={"llama-dry": LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=2,
                                            num_key_value_heads=1, max_position_embeddings=64,
                                            tie_word_embeddings=True)},
            lm_batch=2, lm_seq=16,
            vit=("vit-dry", ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64, image_size=(16, 16), patch_size=8,
                                      num_channels=1, decoder_num_attention_heads=2,
                                      decoder_hidden_size=32, decoder_num_hidden_layers=1,
                                      decoder_intermediate_size=64, mask_ratio=0.5)),
            vit_batch=2, attention={"tiny": (1, 64, 2, 32, False, True),
                                    "tiny_causal": (1, 64, 2, 32, True, False)},
            torch_mode="eager", n=2, warmup=1, plan_models=("tiny", "llama-cpu"))


class OutOfTime(Exception):
    """The budget leaves no room for the next row."""


class Evidence:
    """The run: its budget, its rows and per-part records, written after every part."""

    def __init__(self, out: str, budget_s: float, sizes: Sizes, dry_run: bool):
        self.out, self.budget_s, self.sizes, self.dry_run = out, budget_s, sizes, dry_run
        self.t0 = time.perf_counter()
        self.rows: list[dict] = []
        self.parts: dict[str, dict] = {}
        self.smoke: dict = {}
        self.environment = gpu_environment()

    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def need(self, seconds: float, what: str) -> None:
        """Start ``what`` only when ``seconds`` are left (the dry run always starts it)."""
        if not self.dry_run and self.left_s() < seconds:
            raise OutOfTime(f"{what}: {self.left_s():.0f} s left of the budget, it needs "
                            f"~{seconds:.0f} s")

    def add(self, part: str, work: dict, row: dict) -> None:
        self.rows.append({**row, "part": part, "work": {"part": part, **work}})

    def write(self) -> str:
        extra = {"budget_s": self.budget_s, "elapsed_s": time.perf_counter() - self.t0,
                 "cpu_dry_run": self.dry_run, "parts": self.parts, "smoke": self.smoke,
                 "gpu": self.environment}
        if self.dry_run:
            extra["note"] = ("CPU dry run: tiny shapes, every part's code path; no time here "
                             "is a result.")
        path = write_results("evidence", self.rows, extra, out=self.out)
        with open(path[:-len(".json")] + ".md", "w") as f:
            f.write(report(self))
        return path


def gpu_environment() -> dict:
    """Driver, GPU name and memory (nvidia-smi), torch / transformers / triton versions."""
    env = {"python": platform.python_version()}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                              "power.limit", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.strip()
        env["nvidia_smi"] = out or None
    except (OSError, subprocess.TimeoutExpired):
        env["nvidia_smi"] = None
    for name in ("torch", "transformers", "triton", "jax_cuda13_plugin", "jax_cuda12_plugin"):
        try:
            env[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 (absent, or broken: either way not there)
            env[name] = None
    return env


# ---- the parts ----------------------------------------------------------------------------

def smoke(ev: Evidence) -> None:
    """``pytest -m gpu_smoke`` in a child process (before this process takes GPU memory),
    over the test files that hold such tests; counts and failures from its JUnit XML."""
    files = sorted(os.path.join("tests", f) for f in os.listdir(os.path.join(ROOT, "tests"))
                   if f.startswith("test_") and "gpu_smoke" in open(
                       os.path.join(ROOT, "tests", f)).read())
    xml = os.path.join(tempfile.mkdtemp(prefix="evidence-smoke-"), "smoke.xml")
    argv = [sys.executable, "-m", "pytest", "-q", "-m", "gpu_smoke", "-p", "no:cacheprovider",
            f"--junitxml={xml}", *files] + (["--collect-only"] if ev.dry_run else [])
    t0 = time.perf_counter()
    # This process holds half the GPU's memory already: the tests allocate as they go.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=max(min(ev.left_s(), 180), 60))
    ev.smoke = {"command": " ".join(argv[1:]), "exit_status": proc.returncode,
                "seconds": time.perf_counter() - t0, "tail": proc.stdout[-3000:]
                + proc.stderr[-2000:], **junit_counts(xml)}
    print(f"smoke: exit {proc.returncode}, {ev.smoke.get('passed')} passed, "
          f"{ev.smoke.get('failed')} failed, {ev.smoke.get('skipped')} skipped", flush=True)


def junit_counts(path: str) -> dict:
    """passed / failed / skipped and the failing tests' ids of a JUnit XML file."""
    if not os.path.exists(path):
        return {}
    cases = list(ElementTree.parse(path).getroot().iter("testcase"))
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in cases
              if c.find("failure") is not None or c.find("error") is not None]
    skipped = sum(c.find("skipped") is not None for c in cases)
    return {"passed": len(cases) - len(failed) - skipped, "failed": len(failed),
            "skipped": skipped, "failures": failed}


def _mfu(flops: float, seconds: float, policy: str) -> dict:
    peak = peak_flops(device_kind(), policy)
    bf16 = peak_flops(device_kind(), "bf16")
    return {"model_tflops": flops / seconds / 1e12,
            "mfu": flops / seconds / bf16 if bf16 else None,
            "mfu_of_policy_peak": flops / seconds / peak if peak else None}


def _memory() -> dict:
    stats = jax.devices()[0].memory_stats() or {}
    return {"peak_bytes_in_use": stats.get("peak_bytes_in_use")}


def _jax_row(ev, run, data, hlo, name, policy, flops, tokens) -> dict:
    t = time_fn(run, data, n=ev.sizes.n, warmup=ev.sizes.warmup)
    row = {"name": name, **t, "tokens_per_s": tokens / t["median_s"],
           **_mfu(flops, t["median_s"], policy), **_memory()}
    if get_policy(policy).fp8:
        row["fp8"] = "native" if "__cublas$lt$matmul$f8" in hlo else "emulated"
    print(f"  {name}: {t['median_s'] * 1e3:.2f} ms", flush=True)
    return row


def bert(ev: Evidence) -> None:
    """BERT-base steps: per batch, ours at bf16 (cuDNN and Pallas attention), PyTorch's
    compiled step, then ours at fp8 with the faster attention of the bf16 rows."""
    s = ev.sizes
    attentions = ["cudnn", "pallas"] if jax.default_backend() == "gpu" else ["xla"]
    for batch in s.bert_batches:
        work = {"model": s.bert_name, "batch": batch, "seq": s.bert_seq}
        flops = step_bench.model_flops(s.bert, batch, s.bert_seq)
        tokens = batch * s.bert_seq
        best = {}
        for policy, impls in (("bf16", attentions), ("fp8", None)):
            if impls is None:
                impls = [min(best, key=best.get)]
            for attention in impls:
                ev.need(30, f"bert b{batch} {policy} {attention}")
                run, data, hlo = step_bench.jax_step(s.bert, policy, "adamw", attention, batch,
                                                     s.bert_seq)
                row = _jax_row(ev, run, data, hlo, f"jax.{policy}.adamw.{attention}", policy,
                               flops, tokens)
                best[attention] = row["median_s"]
                ev.add("bert", work, {**row, "attention_dropout": 0.0})
                del run, data
            if policy == "bf16":
                ev.need(45, f"bert b{batch} torch.{s.torch_mode}")
                for row in step_bench.torch_rows(s.bert, batch, s.bert_seq, s.n,
                                                 [s.torch_mode], [0.0]):
                    ev.add("bert", work, {**row, "tokens_per_s": tokens / row["median_s"],
                                          **_mfu(flops, row["median_s"], "bf16")})
        _speedups(ev, "bert", work)


def _speedups(ev, part, work) -> None:
    """``speedup_vs_torch`` of each of ``part``'s JAX rows of ``work``: PyTorch's median /
    ours."""
    rows = [r for r in ev.rows if r["part"] == part and r["work"] == {"part": part, **work}]
    anchor = next((r["median_s"] for r in rows if r["name"].startswith("torch.")), None)
    for r in rows:
        if anchor and r["name"].startswith("jax."):
            r["speedup_vs_torch"] = anchor / r["median_s"]


def adan(ev: Evidence) -> None:
    """The optimizer bench on the BERT-base tree (bench/optimizer.py)."""
    ev.need(20, "adan")
    rows, about = optimizer_bench.measure(ev.sizes.bert, ev.sizes.n, warmup=ev.sizes.warmup)
    for row in rows:
        ev.add("adan", {"model": ev.sizes.bert_name, **about}, row)


def attention(ev: Evidence) -> None:
    """The attention bench (bench/attention.py): every implementation the registry has here,
    cuDNN included on a GPU."""
    for shape, dims in ev.sizes.attention.items():
        ev.need(20, f"attention {shape}")
        for row in attention_bench.measure({shape: dims}, ev.sizes.n, ev.sizes.warmup):
            ev.add("attention", {k: row[k] for k in ("shape", "mode", "B", "S", "H", "D",
                                                     "causal", "dtype")}, row)


def decoder(ev: Evidence) -> None:
    """Decoder train steps per preset: ours bf16 (no remat: it fits, and is what is fastest),
    PyTorch's compiled step, ours fp8."""
    s = ev.sizes
    attention = "pallas" if jax.default_backend() == "gpu" else "xla"
    for preset, cfg in s.llama.items():
        work = {"model": preset, "batch": s.lm_batch, "seq": s.lm_seq}
        flops = train_flops(model_shape(ModelSpec(cfg)), s.lm_batch, s.lm_seq)
        tokens = s.lm_batch * s.lm_seq
        for policy in ("bf16", "torch", "fp8"):
            if policy == "torch":
                ev.need(50, f"{preset} torch.{s.torch_mode}")
                for row in step_bench.torch_lm_rows(cfg, s.lm_batch, s.lm_seq, s.n,
                                                    (s.torch_mode,)):
                    ev.add("decoder", work, {**row, "tokens_per_s": tokens / row["median_s"],
                                             **_mfu(flops, row["median_s"], "bf16")})
                continue
            ev.need(30, f"{preset} {policy}")
            run, data, hlo = step_bench.lm_step(cfg, policy, "adamw", attention, s.lm_batch,
                                                s.lm_seq, remat=False)
            ev.add("decoder", work, _jax_row(ev, run, data, hlo,
                                             f"jax.{policy}.adamw.{attention}", policy, flops,
                                             tokens))
            del run, data
        _speedups(ev, "decoder", work)


def planner(ev: Evidence) -> None:
    """``jaxaccel compile --topology local`` of the largest BERT batch and the first decoder
    measured above (the dry run plans small presets instead), beside the measurement."""
    from jaxaccel import plan
    s = ev.sizes
    gpu = jax.default_backend() == "gpu"
    bert_model, lm = s.plan_models
    bert_batch = s.bert_batches[-1]
    cases = [("bert", "configs/bert_base_imdb.py", [
        f"model.name={bert_model}", f"train.batch_size={bert_batch}",
        f"data.max_len={s.bert_seq}", "model.attention_dropout=0.0",
        f"model.attention_impl={'cudnn' if gpu else 'xla'}"],
        {"model": s.bert_name, "batch": bert_batch, "seq": s.bert_seq}),
        ("decoder", "configs/canterbury_lm.py", [
            f"model.name={lm}", f"train.batch_size={s.lm_batch}", f"data.max_len={s.lm_seq}",
            "model.remat=false", f"model.attention_impl={'pallas' if gpu else 'xla'}"],
         {"model": lm, "batch": s.lm_batch, "seq": s.lm_seq})]
    for part, config, sets, work in cases:
        ev.need(30, f"plan {config}")
        sets += ["precision.policy=bf16", "train.max_steps=100"]
        p = plan.make_plan(os.path.join(ROOT, config), sets, "local")
        measured = [r for r in ev.rows if r["part"] == part and r["work"] == {"part": part,
                                                                                **work}
                    and r["name"].startswith("jax.bf16.")]
        m = min((r["median_s"] for r in measured), default=None)
        row = plan.result(p)["rows"][0]
        ev.add("planner", work, {
            "name": f"plan.{part}", "time_s": p.time_s, "time_source": row["time_source"],
            "forecast_s": p.estimate.get("forecast_s"), "bound_s": p.estimate["step_s"],
            "forecast_low_s": row["forecast_low_s"], "forecast_high_s": row["forecast_high_s"],
            "planned_total_bytes": p.memory["total"], "planned_temp_bytes": p.memory["temp"],
            "measured_median_s": m, "measured_peak_bytes": max(
                (r.get("peak_bytes_in_use") or 0 for r in measured), default=None),
            "forecast_over_measured": p.time_s / m if p.time_s and m else None,
            "config": config, "sets": sets, "compile_s": p.compile_s})
        print(f"  plan {config}: forecast {p.time_s}, measured {m}", flush=True)


def mae(ev: Evidence) -> None:
    """Audio-MAE B/16 train steps, bf16 then fp8."""
    s = ev.sizes
    name, cfg = s.vit
    attention = "cudnn" if jax.default_backend() == "gpu" else "xla"
    spec = ModelSpec(cfg, task="mae")
    flops = train_flops(model_shape(spec), s.vit_batch, 0)
    work = {"model": name, "batch": s.vit_batch}
    for policy in ("bf16", "fp8"):
        ev.need(30, f"mae {policy}")
        run, data, hlo = step_bench.mae_step(cfg, policy, attention, s.vit_batch)
        ev.add("mae", work, _jax_row(ev, run, data, hlo, f"jax.{policy}.adamw.{attention}",
                                     policy, flops, s.vit_batch))
        del run, data
    rows = [r for r in ev.rows if r["part"] == "mae"]
    if len(rows) == 2:
        rows[1]["speedup_vs_bf16"] = rows[0]["median_s"] / rows[1]["median_s"]


PARTS = {"smoke": smoke, "bert": bert, "adan": adan, "attention": attention,
         "decoder": decoder, "planner": planner, "mae": mae}
COLUMNS = {"bert": ["name", "batch", "median_s", "tokens_per_s", "mfu", "fp8",
                    "speedup_vs_torch"],
           "adan": ["name", "median_s", "achieved_GBps", "roofline_fraction",
                    "speedup_vs_per_leaf"],
           "attention": ["name", "median_s", "tflops", "mfu", "rel_err"],
           "decoder": ["name", "model", "median_s", "tokens_per_s", "mfu", "fp8",
                       "speedup_vs_torch"],
           "planner": ["name", "forecast_s", "forecast_low_s", "forecast_high_s",
                       "measured_median_s", "forecast_over_measured", "planned_total_bytes",
                       "measured_peak_bytes"],
           "mae": ["name", "median_s", "tokens_per_s", "mfu", "fp8", "speedup_vs_bf16"]}


def report(ev: Evidence) -> str:
    """The Markdown page: environment, the smoke tests, one table per part."""
    lines = [f"# GPU evidence: {device_kind()}", "",
             f"jax {jax.__version__}, {json.dumps(ev.environment)}", "",
             f"budget {ev.budget_s:.0f} s, elapsed {time.perf_counter() - ev.t0:.0f} s"
             + (" (CPU dry run: no time here is a result)" if ev.dry_run else ""), ""]
    if ev.smoke:
        lines += ["## smoke", "", f"`{ev.smoke['command']}`: exit {ev.smoke['exit_status']}, "
                  f"{ev.smoke.get('passed')} passed, {ev.smoke.get('failed')} failed, "
                  f"{ev.smoke.get('skipped')} skipped in {ev.smoke['seconds']:.0f} s", ""]
        lines += [f"- failed: {f}" for f in ev.smoke.get("failures", [])]
    for part, record in ev.parts.items():
        if part == "smoke":
            continue
        rows = [{**r, "model": r["work"].get("model"), "batch": r["work"].get("batch")}
                for r in ev.rows if r["part"] == part]
        lines += ["", f"## {part}", "", f"{record['status']} in {record['seconds']:.0f} s"
                  + (f": {record['why']}" if record.get("why") else ""), ""]
        if rows:
            lines.append(markdown(rows, COLUMNS[part]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=400.0,
                    help="seconds for the whole run; rows that would overrun it are left out")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated subset of {','.join(PARTS)}, run in this order")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="tiny shapes, torch eager, smoke tests collected only: checks that "
                    "every part runs and writes its rows (CI); no time is a result")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"--parts: unknown {unknown}; choose from {list(PARTS)}")
    if not args.cpu_dry_run and jax.default_backend() != "gpu":
        ap.error(f"the default backend is {jax.default_backend()!r}, not a GPU: run with "
                 "--cpu-dry-run to check the script without one")
    ev = Evidence(args.out, args.budget_s, DRY if args.cpu_dry_run else GPU, args.cpu_dry_run)
    path = None
    for part in parts:
        t0 = time.perf_counter()
        print(f"== {part} ({ev.left_s():.0f} s left)", flush=True)
        try:
            PARTS[part](ev)
            ev.parts[part] = {"status": "done"}
        except OutOfTime as e:
            ev.parts[part] = {"status": "cut", "why": str(e)}
        except Exception as e:  # noqa: BLE001 (a failed part must not lose the others)
            ev.parts[part] = {"status": "failed", "why": f"{type(e).__name__}: {e}",
                              "traceback": traceback.format_exc()[-4000:]}
            print(traceback.format_exc(), flush=True)
        ev.parts[part]["seconds"] = time.perf_counter() - t0
        path = ev.write()
        print(f"   {part}: {ev.parts[part]['status']} in {ev.parts[part]['seconds']:.0f} s "
              f"-> {path}", flush=True)
    print(report(ev))
    failed = [p for p, r in ev.parts.items() if r["status"] == "failed"]
    return 1 if failed or ev.smoke.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
