"""Where an fp8 train step's time goes, from its compiled program: fp8 against bf16, per step.

    JAX_PLATFORMS=cpu python bench/fp8_cost.py                     # compile-only H100, no GPU
    JAX_PLATFORMS=cpu python bench/fp8_cost.py --cases bert-base.b32 --gemms cublas
    python bench/fp8_cost.py --topology local --out DIR            # on a GPU: its own program

Each case (BERT-base 32 and 256 x 128, llama-125m and llama-350m 8 x 2048, AdamW, no remat,
XLA attention) is planned as ``jaxaccel compile`` plans it (``jaxaccel.plan.make_plan``: the
trainer's step compiled for ``--topology``) under bf16 and fp8, and its compiled train step is
cut into kernels (``jaxaccel.plan.kernels``): the GEMMs by operand dtype and form, everything
outside the GEMMs, and fp8's own work there (amax, scale, history, quantize, transposes and
copies of fp8 arrays) with how many of those kernels XLA fused into nothing else; whether
the fp8 GEMMs take their scales as operands and return their output's amax. Beside them, the
plan's bound (roofline: compute at the policy's matmul peak, HBM bytes at the bandwidth) and
its forecast. ``--gemms cublas`` compiles the GEMMs as cuBLAS calls (the compile-only target
has no GPU to autotune on, so it makes Triton GEMMs; a GPU's autotuner may pick cuBLASLt, as
the H200 run's fp8 steps did): there the fp8 GEMMs are ``__cublas$lt$matmul$f8`` and XLA's
GEMM rewriter shows what of the scaling it fuses into them. The steps are planned against an
H200's memory (``--memory``): llama-350m's step without remat, as the H200 ran it, holds more
than an H100's.

Writes ``<out>/fp8_cost-<target>[_compile_only][-cublas][-<tag>].json`` (bench/results format;
``device`` is the target's device kind, ``backend`` says compile-only) and prints a Markdown table. Bytes are
XLA's HloCostAnalysis per kernel times its runs per step (``jaxaccel.plan.hlo_cost``); no
timing: nothing runs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

from bench.common import git_sha, markdown  # noqa: E402
from jaxaccel import plan as plan_lib  # noqa: E402
from jaxaccel.plan import kernels  # noqa: E402

# name -> (config, sets): the H200 evidence's steps (bench/gpu_evidence.py), as configs.
CASES = {
    "bert-base.b32": ("configs/bert_base_imdb.py", ["model.name=bert-base",
                                                    "train.batch_size=32", "data.max_len=128"]),
    "bert-base.b256": ("configs/bert_base_imdb.py", ["model.name=bert-base",
                                                     "train.batch_size=256",
                                                     "data.max_len=128"]),
    "llama-125m.b8": ("configs/canterbury_lm.py", ["model.name=llama-125m", "train.batch_size=8",
                                                   "data.max_len=2048", "model.remat=false"]),
    "llama-350m.b8": ("configs/canterbury_lm.py", ["model.name=llama-350m", "train.batch_size=8",
                                                   "data.max_len=2048", "model.remat=false"]),
}
COMMON = ["train.optimizer=adamw", "train.max_steps=100", "model.attention_dropout=0.0",
          "model.attention_impl=xla"]
GEMMS = {"default": None, "cublas": plan_lib.CUBLAS_GEMMS}
# Bytes per device the steps are planned against: the H200's HBM (141 GB), where the evidence's
# steps ran without remat; the H100's 60 GB (75% of 80) does not hold llama-350m's.
H200_MEMORY = 141e9
COLUMNS = ["name", "kernels", "gemm_bytes", "outside_gemms_bytes", "fp8_work_kernels",
           "fp8_work_bytes", "fp8_alone_kernels", "fp8_gemms", "fp8_gemms_scaled",
           "fp8_gemms_amax", "bound_s", "bound", "forecast_s"]


def row(case: str, policy: str, plan) -> dict:
    """One case's plan and the kernels of its compiled train step."""
    split = kernels.summary(kernels.of(plan.train_hlo))
    e = plan.estimate
    gemm_bytes = sum(v["bytes"] for v in split["gemms"].values())
    return {"name": f"{case}.{policy}", "case": case, "policy": policy, "batch": plan.batch,
            "seq": plan.seq, "kernels": split["all"]["kernels"], "gemm_bytes": gemm_bytes,
            "outside_gemms_bytes": split["outside_gemms"]["bytes"],
            "fp8_work_kernels": split["fp8_work"]["kernels"],
            "fp8_work_bytes": split["fp8_work"]["bytes"],
            "fp8_alone_kernels": split["fp8_work"]["alone"]["kernels"],
            "fp8_gemms": split["fp8_gemms"]["kernels"],
            "fp8_gemms_scaled": split["fp8_gemms"]["with_scale_operands"],
            "fp8_gemms_amax": split["fp8_gemms"]["with_amax_output"],
            "bound_s": e["step_s"], "bound": e["bound"], "compute_s": e["compute_s"],
            "memory_s": e["memory_s"], "forecast_s": e.get("forecast_s"),
            "hbm_bytes": plan.hlo_cost.get("bytes accessed"), "kernels_split": split,
            "compile_s": plan.compile_s}


def compare(rows: list[dict]) -> list[dict]:
    """Per case, fp8 against bf16: bytes outside the GEMMs (fp8 / bf16), and the bounds'."""
    by = {(r["case"], r["policy"]): r for r in rows}
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        bf16, fp8 = by.get((case, "bf16")), by.get((case, "fp8"))
        if bf16 and fp8:
            out.append({"case": case, "outside_gemms_ratio": fp8["outside_gemms_bytes"]
                        / bf16["outside_gemms_bytes"],
                        "bound_ratio": fp8["bound_s"] / bf16["bound_s"],
                        "forecast_ratio": fp8["forecast_s"] / bf16["forecast_s"]
                        if fp8["forecast_s"] and bf16["forecast_s"] else None})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    p.add_argument("--policies", default="bf16,fp8")
    p.add_argument("--topology", default="h100:1x1")
    p.add_argument("--gemms", choices=sorted(GEMMS), default="default")
    p.add_argument("--memory", type=float, default=H200_MEMORY,
                   help="bytes per device to plan against (default: an H200's HBM)")
    p.add_argument("--set", action="append", default=[], dest="sets",
                   help="a config key=value for every case (repeat)")
    p.add_argument("--tag", default="", help="a word for the result file's name (e.g. "
                   "what --set changed)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = p.parse_args(argv)
    rows = []
    for case in args.cases.split(","):
        config, sets = CASES[case]
        for policy in args.policies.split(","):
            t0 = time.perf_counter()
            plan = plan_lib.make_plan(os.path.join(ROOT, config),
                                      [*sets, *COMMON, f"precision.policy={policy}",
                                       *args.sets], args.topology,
                                      device_memory=args.memory,
                                      compiler_options=GEMMS[args.gemms])
            rows.append(row(case, policy, plan))
            print(f"{case} {policy}: {time.perf_counter() - t0:.0f} s", flush=True)
    target = plan.target
    compile_only = target.name != "local"
    slug = "-".join([plan_lib.slug(target.name) + ("_compile_only" if compile_only else ""),
                     *([] if args.gemms == "default" else [args.gemms]),
                     *([args.tag] if args.tag else [])])
    result = {"bench": "fp8_cost", "device": target.device_kind,
              "backend": f"{target.platform} (compile-only)" if compile_only
              else target.platform, "topology": target.name, "jax": jax.__version__,
              "jaxaccel": git_sha(), "date": datetime.date.today().isoformat(),
              "gemms": args.gemms, "sets": args.sets, "device_memory": args.memory,
              "comparison": compare(rows),
              "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"fp8_cost-{slug}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(markdown(rows, COLUMNS))
    print(markdown(result["comparison"], ["case", "outside_gemms_ratio", "bound_ratio",
                                          "forecast_ratio"]))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
