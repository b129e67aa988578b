"""GPU evidence in one command: what a lent GPU should tell us, aiming at under 7 minutes.

    bash bench/gpu_evidence.sh OUT_DIR                   # on the GPU machine (see the .sh)
    python bench/gpu_evidence.py --out DIR [--budget-s 400] [--parts bert,decoder]
    python bench/gpu_evidence.py --cpu-dry-run --out DIR # CI: tiny shapes, every part's code
                                                         # path and rows, no timing claims

A GPU is lent for minutes (../shared/gpu-checklist.md). Compiling, not timing, is what takes
them: on an H200 (jax 0.11.2, a58306b) one XLA compilation of a BERT-base or decoder train step
took ~40 s (GEMM autotuning included), ``torch.compile``'s first step 34-69 s, the smoke tests
73 s, while every timed row (3 warm-up + 20 steps) takes seconds. Run one thing after another,
the list took ~12 minutes there. So everything is started at once (``prepare``): the smoke
tests in a child process, one PyTorch worker process per model family
(``bench/torch_worker.py``: it compiles and warms up its steps at once), and every JAX train
step and plan, lowered here and compiled by ``compile_threads`` threads (XLA compiles without
the GIL). Then, once nothing else runs (``Evidence.quiet``), each step is timed alone, in turn,
PyTorch's through its worker. The attention and Adan benches, whose compilations are short,
compile and time in turn at the end. Results are rewritten after every part
(``evidence-<device>.json``: bench/results format, one row per measurement with its part and
the ``work`` that ``jaxaccel compare`` joins rows by; ``evidence-<device>.md``: one table per
part), so a run cut off keeps what it measured; a row that fails is named in its part's
``errors`` and the rest go on; the sequential parts stop starting benches when the budget
(``--budget-s``) would be overrun.

Parts in the order they report (checklist item -> part), the time each took on the H200 when
run one after another (a58306b), and its plan within the 7 minutes of device time that
``bash bench/gpu_evidence.sh OUT`` is given (``--budget-s 400``, counted from the script's start;
the other ~20 s are the start, imports and nvidia-smi, and the last page written):

| part | checklist | what | H200, in turn | plan of the 7 minutes |
|---|---|---|---|---|
| smoke | 1 | ``pytest -m gpu_smoke`` (kernels and the train step against references at highest precision, on the device): a GPU number counts only where these pass | 73 s | in the compile phase (waited for at most the budget left, 60 s at least) |
| bert | 2 | BERT-base train step at 32 and 256 x 128: ours (bf16 with our attention and cuDNN's, fp8) against torch.compile + SDPA + bf16 autocast + fused AdamW; MFU | 284 s (7 of 8 rows) | in the compile phase, then ~8 s timing |
| decoder | 3 | llama-125m and llama-350m train steps at 8 x 2048: ours bf16 and fp8 against PyTorch's Llama (torch.compile, SDPA, bf16 autocast, fused AdamW); tokens/s, MFU | 277 s | in the compile phase, then ~12 s timing |
| mae | 7 | Audio-MAE ViT-B/16 (1024 x 128 spectrograms, 80% masked) train step at batch 64, bf16 and fp8 | not reached | in the compile phase, then ~2 s timing |
| planner | 6 | ``jaxaccel compile --topology local`` of the BERT-base (256 x 128) and llama-125m configs: the forecast, its range and the planned memory beside the measured step and memory | not reached | in the compile phase, ~0 s after it |
| attention | 4 | flash attention fwd and fwd+bwd, BERT (32 x 512 x 12 x 64, padded keys) and long causal (2 x 4096 x 16 x 128), bf16: ours, XLA, cuDNN | 30 s | 30 s; a shape starts only with 20 s of the budget left |
| adan | 5 | one Adan update of the BERT-base tree: fused Pallas, XLA multi-tensor, per leaf, optax; HBM roofline | 42 s | 42 s; starts only with 45 s of the budget left |

The compile phase holds 10 train steps and 2 plans (4 programs) for XLA, ~40 s each on 4
threads, beside the PyTorch workers' 80 s (BERT) and 103 s (Llama) of compilation and the
smoke tests: ~150-200 s if XLA's compilations overlap as the host's 16 cores allow (its GEMM
autotuning runs on the one GPU, which may serialise part of it). The plan: <= 200 s compiling,
~22 s timing the steps, 30 s attention, 42 s Adan: **~5 minutes, ~100 s inside the budget; not
yet measured** (the first GPU run after this change is its test). Where compiling runs over,
attention and then Adan are cut (their part says so) rather than the run passing the budget.
Compiling while the smoke tests and PyTorch's warm-up use the GPU can only make XLA's
autotuning choose worse kernels for us, never better.

fp8 rows record whether the compiled step holds cuBLASLt fp8 GEMMs (``fp8: native``). PyTorch
has no fp8 row: transformers' models take fp8 only through Transformer Engine or torchao,
which the GPU image lacks, so ours at fp8 stands beside PyTorch at bf16.

In ``--cpu-dry-run`` every part runs its code on tiny one-layer models (BERT, Llama, ViT-MAE),
PyTorch eager in one single-threaded worker, ``pytest --collect-only`` for the smoke tests,
everything compiled with XLA:CPU's faster-compiling older fusion emitters (``DRY``), and writes
its rows; none of its times is a result. It takes ~65 s of CPU, 36 s of wall time on an idle
2-core VM (the test, tests/test_bench.py), not 130 s of CPU as before these choices.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from concurrent.futures import Future, ThreadPoolExecutor, wait

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
from jaxaccel.flops import mfu_peak, model_shape, train_flops  # noqa: E402
from jaxaccel.models import LLAMA_PRESETS, PRESETS, BertConfig, LlamaConfig, ModelSpec  # noqa
from jaxaccel.models.architectures import VIT_PRESETS, ViTConfig  # noqa: E402
from bench.torch_worker import TorchWorker  # noqa: E402
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
    compile_threads: int = 4  # XLA compilations at a time (a GPU host has the cores)
    torch_workers: int = 2    # PyTorch processes compiling at once (one per model family)
    compiler_options: dict | None = None  # XLA options of every step, plan and bench here
    torch_threads: int | None = None      # the PyTorch workers' CPU threads (None: torch's)


GPU = Sizes(bert=PRESETS["bert-base"], bert_name="bert-base", bert_batches=(32, 256),
            bert_seq=128, llama={k: LLAMA_PRESETS[k] for k in ("llama-125m", "llama-350m")},
            lm_batch=8, lm_seq=2048, vit=("audiomae-b16", VIT_PRESETS["audiomae-b16"]),
            vit_batch=64, attention=attention_bench.SHAPES, torch_mode="compile", n=20,
            warmup=3)
# One layer of everything: the dry run checks code paths, and compiling is its cost. Batches
# of 8 rows split over the 8 CPU devices the test suite forces (the planner uses them all).
# XLA:CPU's older fusion emitters compile these programs ~3x faster than its MLIR ones (the
# fp8 MAE step: 4.6 s of CPU against 13 s), and one PyTorch thread runs the tiny eager steps
# in ~25 ms where two, spinning on a busy 2-core CI machine, took ~400 ms.
DRY = Sizes(bert=BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=64),
            bert_name="bert-dry", bert_batches=(8,), bert_seq=8,
            llama={"llama-dry": LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=2,
                                            num_key_value_heads=1, max_position_embeddings=64,
                                            tie_word_embeddings=True)},
            lm_batch=8, lm_seq=16,
            vit=("vit-dry", ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64, image_size=(16, 16), patch_size=8,
                                      num_channels=1, decoder_num_attention_heads=2,
                                      decoder_hidden_size=32, decoder_num_hidden_layers=1,
                                      decoder_intermediate_size=64, mask_ratio=0.5)),
            vit_batch=2, attention={"tiny": (1, 64, 2, 32, False, True),
                                    "tiny_causal": (1, 64, 2, 32, True, False)},
            torch_mode="eager", n=2, warmup=1, plan_models=("tiny", "llama-cpu"),
            compile_threads=2, torch_workers=1,
            compiler_options={"xla_cpu_use_fusion_emitters": False}, torch_threads=1)


def dry_sizes() -> Sizes:
    """``DRY``, without its XLA options where this jaxlib lacks them (jax 0.12's XLA:CPU has
    only the MLIR fusion emitters)."""
    try:
        jax.jit(lambda: 0, compiler_options=DRY.compiler_options).lower().compile()
    except jax.errors.JaxRuntimeError:
        return dataclasses.replace(DRY, compiler_options=None)
    return DRY


class OutOfTime(Exception):
    """The budget leaves no room for the next row."""


class Evidence:
    """The run: its budget, what was started ahead (compilations, the PyTorch workers, the
    smoke tests), its rows and per-part records, written after every part."""

    def __init__(self, out: str, budget_s: float, sizes: Sizes, dry_run: bool):
        self.out, self.budget_s, self.sizes, self.dry_run = out, budget_s, sizes, dry_run
        self.t0 = time.perf_counter()
        self.rows: list[dict] = []
        self.parts: dict[str, dict] = {}
        self.smoke: dict = {}
        self.environment = gpu_environment(imported=not dry_run)
        self.pool = ThreadPoolExecutor(max_workers=sizes.compile_threads)
        self.steps: dict[str, Future] = {}      # key -> Future of a compiled train_step.Step
        self.plans: dict[str, Future] = {}      # part -> Future of (plan, config, sets)
        self.torch: dict[str, TorchWorker] = {}   # key -> the worker holding that step
        self.smoke_proc = None
        self.prepared_s = None
        self.errors: dict[str, list[str]] = {}

    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def need(self, seconds: float, what: str) -> None:
        """Start ``what`` only when ``seconds`` are left (the dry run always starts it)."""
        if not self.dry_run and self.left_s() < seconds:
            raise OutOfTime(f"{what}: {self.left_s():.0f} s left of the budget, it needs "
                            f"~{seconds:.0f} s")

    def compile_later(self, key: str, lower) -> None:
        """Lower now (tracing holds the GIL), compile in the pool (XLA does not)."""
        try:
            step = lower()
        except Exception as e:  # noqa: BLE001 (the row that needs it reports it)
            failed = Future()
            failed.set_exception(e)
            self.steps[key] = failed
            return
        self.steps[key] = self.pool.submit(step.compile, self.sizes.compiler_options)

    def quiet(self) -> None:
        """Wait until nothing started ahead still runs (compilations, the PyTorch workers'
        compilation and warm-up, the smoke tests): from then on one thing at a time uses the
        GPU, so every timing is of that thing alone."""
        if self.prepared_s is not None:
            return
        wait(list(self.steps.values()) + list(self.plans.values()))
        for worker in set(self.torch.values()):
            try:
                worker.ready()
            except RuntimeError as e:
                print(f"PyTorch worker: {e}", flush=True)
        if self.smoke_proc is not None:
            finish_smoke(self)
        self.prepared_s = time.perf_counter() - self.t0
        print(f"== everything compiled, {self.prepared_s:.0f} s after the start", flush=True)

    def add(self, part: str, work: dict, row) -> None:
        """Add the row ``row()`` returns; a row that fails is named in ``errors`` and the part
        goes on."""
        try:
            got = row()
        except Exception as e:  # noqa: BLE001
            self.errors.setdefault(part, []).append(f"{work}: {type(e).__name__}: {e}")
            print(traceback.format_exc(), flush=True)
            return
        self.rows.append({**got, "part": part, "work": {"part": part, **work}})

    def write(self) -> str:
        extra = {"budget_s": self.budget_s, "elapsed_s": time.perf_counter() - self.t0,
                 "compiled_after_s": self.prepared_s, "cpu_dry_run": self.dry_run,
                 "parts": self.parts, "smoke": self.smoke, "gpu": self.environment}
        if self.dry_run:
            extra["note"] = ("CPU dry run: tiny shapes, every part's code path; no time here "
                             "is a result.")
        path = write_results("evidence", self.rows, extra, out=self.out)
        with open(path[:-len(".json")] + ".md", "w") as f:
            f.write(report(self))
        return path

    def close(self) -> None:
        for worker in set(self.torch.values()):
            worker.close()
        if self.smoke_proc is not None and self.smoke_proc.poll() is None:
            self.smoke_proc.kill()
        self.pool.shutdown(wait=False, cancel_futures=True)


def gpu_environment(imported: bool = True) -> dict:
    """Driver, GPU name and memory (nvidia-smi), torch / transformers / triton versions: those
    the packages give once imported, or (``imported=False``: the dry run, where importing them
    here costs seconds) their installed metadata's."""
    env = {"python": platform.python_version()}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                              "power.limit", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.strip()
        env["nvidia_smi"] = out or None
    except (OSError, subprocess.TimeoutExpired):
        env["nvidia_smi"] = None
    for name in ("torch", "transformers", "triton"):
        try:
            env[name] = (__import__(name).__version__ if imported
                         else importlib.metadata.version(name))
        except Exception:  # noqa: BLE001 (absent, or broken: either way not there)
            env[name] = None
    return env


# ---- what is started ahead --------------------------------------------------------------

def start_smoke(ev: Evidence) -> None:
    """``pytest -m gpu_smoke`` in a child process over the test files that hold such tests
    (numerics only: it may share the GPU while things compile)."""
    files = sorted(os.path.join("tests", f) for f in os.listdir(os.path.join(ROOT, "tests"))
                   if f.startswith("test_") and "gpu_smoke" in open(
                       os.path.join(ROOT, "tests", f)).read())
    ev.smoke_xml = os.path.join(tempfile.mkdtemp(prefix="evidence-smoke-"), "smoke.xml")
    argv = [sys.executable, "-m", "pytest", "-q", "-m", "gpu_smoke", "-p", "no:cacheprovider",
            f"--junitxml={ev.smoke_xml}", *files] + (["--collect-only"] if ev.dry_run else [])
    # This process holds half the GPU's memory: the tests allocate as they go.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    ev.smoke = {"command": " ".join(argv[1:]), "started_s": time.perf_counter() - ev.t0}
    ev.smoke_proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)


def finish_smoke(ev: Evidence) -> None:
    try:
        out, _ = ev.smoke_proc.communicate(timeout=max(ev.left_s(), 60))
    except subprocess.TimeoutExpired:
        ev.smoke_proc.kill()
        out, _ = ev.smoke_proc.communicate()
    ev.smoke.update(exit_status=ev.smoke_proc.returncode, tail=out[-4000:],
                    seconds=time.perf_counter() - ev.t0 - ev.smoke["started_s"],
                    **junit_counts(ev.smoke_xml))
    ev.smoke_proc = None
    print(f"smoke: exit {ev.smoke['exit_status']}, {ev.smoke.get('passed')} passed, "
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


def bert_rows(s: Sizes, batch: int) -> list[tuple[str, str, str]]:
    """(key, policy, attention) of the BERT part's JAX rows at ``batch``, in timing order."""
    if jax.default_backend() != "gpu":
        return [(f"bert/{batch}/{p}/xla", p, "xla") for p in ("bf16", "fp8")]
    return [(f"bert/{batch}/{p}/{a}", p, a)
            for p, a in (("bf16", "pallas"), ("bf16", "cudnn"), ("fp8", "pallas"))]


def lm_attention() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def prepare(ev: Evidence, parts: list[str]) -> None:
    """Start everything the chosen parts will time: the smoke tests, the PyTorch workers (one
    per model family: they compile at once), and every JAX step and plan, lowered here and
    compiled in the pool."""
    s = ev.sizes
    if "smoke" in parts:
        start_smoke(ev)
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    if s.torch_threads:
        env["OMP_NUM_THREADS"] = str(s.torch_threads)
    specs = {"bert": [{"key": f"bert/{b}/torch", "kind": "bert", "batch": b,
                       "seq": s.bert_seq, "mode": s.torch_mode, "attention_dropout": 0.0,
                       "config": dataclasses.asdict(s.bert)} for b in s.bert_batches],
             "decoder": [{"key": f"decoder/{name}/torch", "kind": "llama",
                          "batch": s.lm_batch, "seq": s.lm_seq, "mode": s.torch_mode,
                          "attention_dropout": 0.0, "config": dataclasses.asdict(cfg)}
                         for name, cfg in s.llama.items()]}
    groups = [g for part, g in specs.items() if part in parts]
    if s.torch_workers == 1:
        groups = [[spec for g in groups for spec in g]] if groups else []
    for group in groups:
        worker = TorchWorker(group, env)
        ev.torch.update({spec["key"]: worker for spec in group})
    if "bert" in parts:
        for batch in s.bert_batches:
            for key, policy, attention in bert_rows(s, batch):
                ev.compile_later(key, functools.partial(
                    step_bench.bert_lowered, s.bert, policy, "adamw", attention, batch,
                    s.bert_seq))
    if "decoder" in parts:
        for name, cfg in s.llama.items():
            for policy in ("bf16", "fp8"):
                ev.compile_later(f"decoder/{name}/{policy}", functools.partial(
                    step_bench.lm_lowered, cfg, policy, "adamw", lm_attention(), s.lm_batch,
                    s.lm_seq, remat=False))
    if "mae" in parts:
        for policy in ("bf16", "fp8"):
            ev.compile_later(f"mae/{policy}", functools.partial(
                step_bench.mae_lowered, s.vit[1], policy, mae_attention(), s.vit_batch))
    if "planner" in parts:
        for part, config, sets, _ in plan_cases(s):
            ev.plans[part] = ev.pool.submit(make_plan, config, sets, s.compiler_options)


# ---- the parts ----------------------------------------------------------------------------

def _mfu(flops: float, seconds: float, policy: str) -> dict:
    peak = mfu_peak(device_kind(), policy)
    bf16 = mfu_peak(device_kind(), "bf16")
    return {"model_tflops": flops / seconds / 1e12,
            "mfu": flops / seconds / bf16 if bf16 else None,
            "mfu_of_policy_peak": flops / seconds / peak if peak else None}


def _jax_row(ev, key, name, policy, flops, tokens) -> dict:
    """Time the prepared step ``key`` (then let its state go)."""
    step = ev.steps.pop(key).result()
    t = time_fn(step.run, step.data, n=ev.sizes.n, warmup=ev.sizes.warmup)
    peak_bytes = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    row = {"name": name, **t, "tokens_per_s": tokens / t["median_s"],
           **_mfu(flops, t["median_s"], policy), "peak_bytes_in_use": peak_bytes}
    if get_policy(policy).fp8:
        row["fp8"] = "native" if "__cublas$lt$matmul$f8" in step.hlo else "emulated"
    print(f"  {key}: {t['median_s'] * 1e3:.2f} ms", flush=True)
    return row


def _torch_row(ev, key, flops, tokens) -> dict:
    row = ev.torch[key].time(key, ev.sizes.n)
    print(f"  {key}: {row['median_s'] * 1e3:.2f} ms", flush=True)
    return {**row, "tokens_per_s": tokens / row["median_s"],
            **_mfu(flops, row["median_s"], "bf16")}


def _speedups(ev, part, work) -> None:
    """``speedup_vs_torch`` of each of ``part``'s JAX rows of ``work``: PyTorch's median /
    ours."""
    rows = [r for r in ev.rows if r["part"] == part and r["work"] == {"part": part, **work}]
    anchor = next((r["median_s"] for r in rows if r["name"].startswith("torch.")), None)
    for r in rows:
        if anchor and r["name"].startswith("jax."):
            r["speedup_vs_torch"] = anchor / r["median_s"]


def smoke(ev: Evidence) -> None:
    """The smoke tests' result (they started first)."""
    ev.quiet()


def bert(ev: Evidence) -> None:
    """BERT-base steps per batch: ours (bf16 with our attention and cuDNN's, fp8), then
    PyTorch's compiled step."""
    ev.quiet()
    s = ev.sizes
    for batch in s.bert_batches:
        work = {"model": s.bert_name, "batch": batch, "seq": s.bert_seq}
        flops = step_bench.model_flops(s.bert, batch, s.bert_seq)
        for key, policy, attention in bert_rows(s, batch):
            ev.add("bert", work, lambda: {**_jax_row(
                ev, key, f"jax.{policy}.adamw.{attention}", policy, flops, batch * s.bert_seq),
                "attention_dropout": 0.0})
        ev.add("bert", work, lambda: _torch_row(ev, f"bert/{batch}/torch", flops,
                                                batch * s.bert_seq))
        _speedups(ev, "bert", work)


def decoder(ev: Evidence) -> None:
    """Decoder train steps per preset: ours bf16 and fp8 (no remat: it fits, and is what is
    fastest), then PyTorch's compiled step."""
    ev.quiet()
    s = ev.sizes
    for name, cfg in s.llama.items():
        work = {"model": name, "batch": s.lm_batch, "seq": s.lm_seq}
        flops = train_flops(model_shape(ModelSpec(cfg)), s.lm_batch, s.lm_seq)
        tokens = s.lm_batch * s.lm_seq
        for policy in ("bf16", "fp8"):
            ev.add("decoder", work, lambda: _jax_row(
                ev, f"decoder/{name}/{policy}", f"jax.{policy}.adamw.{lm_attention()}", policy,
                flops, tokens))
        ev.add("decoder", work, lambda: _torch_row(ev, f"decoder/{name}/torch", flops, tokens))
        _speedups(ev, "decoder", work)


def mae_attention() -> str:
    return "cudnn" if jax.default_backend() == "gpu" else "xla"


def mae(ev: Evidence) -> None:
    """Audio-MAE B/16 train steps, bf16 then fp8."""
    ev.quiet()
    s = ev.sizes
    name, cfg = s.vit
    flops = train_flops(model_shape(ModelSpec(cfg, task="mae")), s.vit_batch, 0)
    work = {"model": name, "batch": s.vit_batch}
    for policy in ("bf16", "fp8"):
        ev.add("mae", work, lambda: _jax_row(ev, f"mae/{policy}", f"jax.{policy}.adamw."
                                             f"{mae_attention()}", policy, flops, s.vit_batch))
    rows = [r for r in ev.rows if r["part"] == "mae"]
    if len(rows) == 2:
        rows[1]["speedup_vs_bf16"] = rows[0]["median_s"] / rows[1]["median_s"]


def plan_cases(s: Sizes) -> list[tuple]:
    """(part, config, sets, work) of what the planner plans: the largest BERT batch and the
    first decoder measured (the dry run plans small presets instead)."""
    gpu = jax.default_backend() == "gpu"
    bert_model, lm = s.plan_models
    batch = s.bert_batches[-1]
    common = ["precision.policy=bf16", "train.max_steps=100", "model.attention_dropout=0.0"]
    # Whole rows (train.unpad=false), as the measured step (bench/train_step.py) runs them: the
    # same work.
    return [("bert", "configs/bert_base_imdb.py", [
        f"model.name={bert_model}", f"train.batch_size={batch}", f"data.max_len={s.bert_seq}",
        f"model.attention_impl={'pallas' if gpu else 'xla'}", "train.unpad=false", *common],
        {"model": s.bert_name, "batch": batch, "seq": s.bert_seq}),
        ("decoder", "configs/canterbury_lm.py", [
            f"model.name={lm}", f"train.batch_size={s.lm_batch}", f"data.max_len={s.lm_seq}",
            "model.remat=false", f"model.attention_impl={lm_attention()}", *common],
         {"model": lm, "batch": s.lm_batch, "seq": s.lm_seq})]


def make_plan(config: str, sets: list[str], compiler_options: dict | None):
    from jaxaccel import plan
    return plan.make_plan(os.path.join(ROOT, config), sets, "local",
                          compiler_options=compiler_options)


def planner(ev: Evidence) -> None:
    """``jaxaccel compile --topology local`` of configs measured above, beside the
    measurement of the same work (a plan's row joins ours by ``work`` in ``compare``)."""
    ev.quiet()
    for part, config, sets, work in plan_cases(ev.sizes):
        ev.add("planner", work, functools.partial(_plan_row, ev, part, config, sets, work))


def _plan_row(ev, part, config, sets, work) -> dict:
    from jaxaccel import plan
    p = ev.plans.pop(part).result()
    measured = [r for r in ev.rows if r["part"] == part and r["name"].startswith("jax.bf16.")
                and {k: r["work"].get(k) for k in work} == work]
    m = min((r["median_s"] for r in measured), default=None)
    row = plan.result(p)["rows"][0]
    print(f"  plan {config}: forecast {p.time_s}, measured {m}", flush=True)
    return {"name": f"plan.{part}", "time_s": p.time_s, "time_source": row["time_source"],
            "forecast_s": p.estimate.get("forecast_s"), "bound_s": p.estimate["step_s"],
            "forecast_low_s": row["forecast_low_s"], "forecast_high_s": row["forecast_high_s"],
            "planned_total_bytes": p.memory["total"], "planned_temp_bytes": p.memory["temp"],
            "measured_median_s": m, "measured_peak_bytes": max(
                (r.get("peak_bytes_in_use") or 0 for r in measured), default=None),
            "forecast_over_measured": p.time_s / m if p.time_s and m else None,
            "config": config, "sets": sets, "compile_s": p.compile_s}



def attention(ev: Evidence) -> None:
    """The attention bench (bench/attention.py): every implementation the registry has here,
    cuDNN included on a GPU (compiled and timed in turn)."""
    ev.quiet()
    for shape, dims in ev.sizes.attention.items():
        ev.need(20, f"attention {shape}")
        for row in attention_bench.measure({shape: dims}, ev.sizes.n, ev.sizes.warmup,
                                           compiler_options=ev.sizes.compiler_options):
            ev.add("attention", {k: row[k] for k in ("shape", "mode", "B", "S", "H", "D",
                                                     "causal", "dtype")}, lambda row=row: row)


def adan(ev: Evidence) -> None:
    """The optimizer bench on the BERT-base tree (bench/optimizer.py)."""
    ev.quiet()
    ev.need(45, "adan")
    rows, about = optimizer_bench.measure(ev.sizes.bert, ev.sizes.n, warmup=ev.sizes.warmup,
                                          compiler_options=ev.sizes.compiler_options)
    for row in rows:
        ev.add("adan", {"model": ev.sizes.bert_name, **about}, lambda row=row: row)


PARTS = {"smoke": smoke, "bert": bert, "decoder": decoder, "mae": mae, "planner": planner,
         "attention": attention, "adan": adan}

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
    if "exit_status" in ev.smoke:
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
        lines += [f"- error: {e}" for e in record.get("errors", [])]
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
    ev = Evidence(args.out, args.budget_s, dry_sizes() if args.cpu_dry_run else GPU,
                  args.cpu_dry_run)
    try:
        prepare(ev, parts)
        run_parts(ev, parts)
    finally:
        ev.close()
    print(report(ev))
    failed = [p for p, r in ev.parts.items() if r["status"] == "failed" or r.get("errors")]
    return 1 if failed or ev.smoke.get("failed") else 0


def run_parts(ev: Evidence, parts: list[str]) -> None:
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
        if ev.errors.get(part):
            ev.parts[part]["errors"] = ev.errors[part]
        path = ev.write()
        print(f"   {part}: {ev.parts[part]['status']} in {ev.parts[part]['seconds']:.0f} s "
              f"-> {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
