"""Training-step benchmark: the thesis's main table (time, tokens/s, MFU per configuration).

    python bench/train_step.py                       # BERT-base, batch 32 x 128 tokens
    python bench/train_step.py --small               # hidden 256, 4 layers: a quick CPU run
    python bench/train_step.py --batch 32,256 --torch           # ours and PyTorch, two batches
    python bench/train_step.py --policies bf16 --profile --profile-dir /tmp/prof

One full optimizer step (forward, loss, backward, clipping, update) on a fixed synthetic batch,
jitted with the state donated, median of >= 20 after warm-up. Rows cross batch size, precision
policy (fp32, bf16, fp16, fp8), optimizer (adamw, adan) and attention implementation (xla; pallas and cudnn
on GPU, pallas on TPU); fused attention implementations run without attention dropout.
fp8 rows record ``fp8``: "native" when the optimized HLO holds cuBLASLt fp8 GEMMs
(``__cublas$lt$matmul$f8``, H100/Ada), else "emulated" (the same quantize-dequantize numerics
with the fp8 operands upcast: CPU, TPUs without an fp8 unit).

``--torch`` adds the strongest PyTorch setup a user has, in the same process: transformers'
BertForSequenceClassification with SDPA attention, bf16 autocast (CUDA; fp32 on a CPU), fused
AdamW and foreach clipping, eager and ``torch.compile``; with attention dropout as configured
and, when a fused JAX attention row is present, also at attention dropout 0. Every JAX row's
``speedup_vs_torch_compile`` is against the compiled PyTorch row of the same batch and
attention dropout (eager where compile was not run).

``--profile`` reads a profiler trace of each JAX row back per HLO op (bench/hlo_profile.py) and
prints device time per category (matmul, attention, scatter, reduction, elementwise, ...);
``--profile-dir`` keeps the traces and the optimized HLO.

``--lm PRESETS`` adds decoder rows (``llama-125m``, ``llama-350m``, ``llama-1b``: the default
on a GPU or TPU, none on a CPU) of the causal-LM step on packed rows of ``--lm-seq`` tokens
(2048), ``--lm-batch`` rows (8), with remat, per policy and attention implementation, AdamW.

Model FLOPs per step: ``jaxaccel.flops.train_flops`` (6 x matmul weights x tokens + 12 x
layers x seq^2 x heads x head_dim x batch, halved for causal attention; the decoder rows' LM
head, tied or not, is a matmul and counted); MFU = FLOPs / time / peak bf16 FLOP/s of the
device (``jaxaccel.flops.mfu_peak``, when known).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (add_out_argument, device_kind, markdown, per_call,  # noqa: E402
                          time_fn, write_results)
from jaxaccel.compare import energy  # noqa: E402
from bench.hlo_profile import profile_ops  # noqa: E402
from jaxaccel.flops import mfu_peak, model_shape, train_flops  # noqa: E402
from jaxaccel.models import (LLAMA_PRESETS, PRESETS, BertConfig, BertModel,  # noqa: E402
                             ModelSpec, build_model)
from jaxaccel import config as config_lib  # noqa: E402
from jaxaccel.precision import get_policy  # noqa: E402
from jaxaccel.train.run import assemble, resolve  # noqa: E402
from jaxaccel.train.tasks import TASKS  # noqa: E402


def model_flops(config: BertConfig, batch: int, seq: int, num_labels: int = 2) -> float:
    return train_flops(model_shape(ModelSpec(config, num_labels=num_labels)), batch, seq)


def batch_of(config, batch, seq):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, config.vocab_size, size=(batch, seq), dtype=np.int32)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids),
            "token_type_ids": np.zeros_like(ids),
            "labels": rng.integers(0, 2, size=batch, dtype=np.int32),
            "weights": np.ones(batch, np.float32)}


def lm_batch_of(config, batch, seq):
    """A causal-LM batch (``tasks.TASKS["causal_lm"]``): one document per row."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, config.vocab_size, size=(batch, seq + 1), dtype=np.int32)
    weights = np.ones((batch, seq), np.float32)
    weights[:, -1] = 0.0
    return {"input_ids": ids[:, :-1], "positions": np.tile(np.arange(seq, dtype=np.int32),
                                                           (batch, 1)),
            "segment_ids": np.ones((batch, seq), np.int32), "targets": ids[:, 1:],
            "target_weights": weights}


class Step:
    """The trainer's train step lowered for one fixed batch, holding its state: ``compile()``
    (may run in a thread: XLA compiles without the GIL; ``compiler_options``: XLA options to
    compile with), then ``run(data)`` steps the state with the compiled executable (donated, as
    the trainer does)."""

    def __init__(self, trainer, data, lowered):
        self.state, self.data, self.lowered = trainer.state, data, lowered
        self.compiled = self.hlo = None

    def compile(self, compiler_options: dict | None = None) -> "Step":
        self.compiled = self.lowered.compile(compiler_options)
        self.hlo = self.compiled.as_text()
        return self

    def run(self, d):
        self.state, metrics = self.compiled(self.state, d)
        return metrics


def bert_lowered(config, policy, optimizer, attention, batch, seq) -> Step:
    """One donated BERT classification train step on a fixed batch, as the trainer jits it,
    lowered. Fused attention implementations have no attention dropout, so their model drops
    it."""
    cfg = config if attention == "xla" else dataclasses.replace(
        config, attention_probs_dropout_prob=0.0)
    model = BertModel(ModelSpec(cfg, num_labels=2, attention_impl=attention), policy)
    return _step(model, policy, optimizer, batch_of(config, batch, seq))


def lm_lowered(config, policy, optimizer, attention, batch, seq, remat=True) -> Step:
    """``bert_lowered``'s for a decoder and its causal-LM task."""
    model = build_model(ModelSpec(config, attention_impl=attention, remat=remat), policy)
    return _step(model, policy, optimizer, lm_batch_of(config, batch, seq))


def mae_lowered(config, policy, attention, batch) -> Step:
    """``bert_lowered``'s for a ViT masked autoencoder (``task="mae"``), AdamW."""
    model = build_model(ModelSpec(config, attention_impl=attention, task="mae"), policy)
    return _step(model, policy, "adamw", mae_batch_of(model.spec, batch))


def _compiled(step: Step):
    step.compile()
    return step.run, step.data, step.hlo


def jax_step(config, policy, optimizer, attention, batch, seq):
    """``(run, data, hlo_text)`` of ``bert_lowered``'s step, compiled."""
    return _compiled(bert_lowered(config, policy, optimizer, attention, batch, seq))


def lm_step(config, policy, optimizer, attention, batch, seq, remat=True):
    """``(run, data, hlo_text)`` of ``lm_lowered``'s step, compiled."""
    return _compiled(lm_lowered(config, policy, optimizer, attention, batch, seq, remat))


def mae_batch_of(spec, batch):
    """An MAE batch (``tasks.TASKS["mae"]``): pixels ~ N(0, 1) (a normalised spectrogram's
    scale), every row weighted."""
    rng = np.random.default_rng(0)
    shapes = TASKS["mae"].batch_shapes(spec, batch, 0)
    return {"pixels": rng.normal(size=shapes["pixels"][0]).astype(np.float32),
            "weights": np.ones(batch, np.float32)}


def _step(model, policy, optimizer, batch) -> Step:
    """The trainer's run of ``model`` on one device (``train.run``: resolved and assembled as
    ``jaxaccel train`` does it, with no data described or read), AdamW/Adan at a constant lr
    1e-4, weight decay 0.01, clipping at 1, lowered for ``batch``. fp8 runs every block Dense
    layer in fp8 (``precision.fp8_layers=all``, as ``model`` is built from the policy's name):
    the default rule keeps these models' layers in bf16 on an H100, which the bf16 rows
    measure."""
    rows = next(iter(batch.values())).shape[0]
    cfg = config_lib.build(sets=[
        f"precision.policy={policy}", "precision.fp8_layers=all", f"train.optimizer={optimizer}",
        "train.schedule=constant",
        "train.learning_rate=1e-4", "train.weight_decay=0.01", "train.max_grad_norm=1.0",
        "train.max_steps=1", f"train.batch_size={rows}", "train.unpad=false", "mesh.data=1"])
    r = resolve(cfg, jax.devices()[:1], spec=model.spec, data=False)
    trainer = assemble(r, model=model, data=False)
    data = trainer.put_batch(batch)
    return Step(trainer, data, trainer.train_step.lower(trainer.state, data))


def torch_bert_step(config, batch, seq, mode, attention_dropout):
    """``(step, name)``: one optimizer step of transformers' PyTorch
    BertForSequenceClassification on a fixed batch, the strongest setup a PyTorch user has:
    SDPA attention, bf16 autocast (CUDA; fp32 on a CPU), fused AdamW, foreach clipping, and
    ``torch.compile`` (default mode) for the model when ``mode`` is "compile"."""
    import torch
    import transformers
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    d = {k: torch.as_tensor(v).to(dev) for k, v in batch_of(config, batch, seq).items()}
    d["labels"] = d["labels"].long()
    torch.manual_seed(0)
    hf_cfg = transformers.BertConfig(
        **{**config.__dict__, "attention_probs_dropout_prob": attention_dropout},
        num_labels=2, attn_implementation="sdpa")
    model = transformers.BertForSequenceClassification(hf_cfg).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=cuda)
    fwd = torch.compile(model) if mode == "compile" else model

    def step():
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=cuda):
            loss = fwd(input_ids=d["input_ids"], attention_mask=d["attention_mask"],
                       token_type_ids=d["token_type_ids"], labels=d["labels"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=cuda)
        opt.step()
        opt.zero_grad(set_to_none=True)
    name = f"torch.{mode}.{'bf16' if cuda else 'fp32'}.adamw.sdpa"
    name += "" if attention_dropout == config.attention_probs_dropout_prob else \
        f".attn_drop{attention_dropout:g}"
    return step, name


def torch_llama_step(config, batch, seq, mode):
    """``(step, name)``: one optimizer step of transformers' PyTorch ``LlamaForCausalLM`` at the
    shape of ``config`` (a ``LlamaConfig``): SDPA (causal), bf16 autocast (CUDA; fp32 on a CPU),
    fused AdamW at lr 1e-4 and weight decay 0.01, foreach clipping at 1, ``torch.compile`` of
    the model when ``mode`` is "compile"; no activation checkpointing (fastest where it fits).
    The rows of ``lm_batch_of`` (``labels = input_ids``: transformers shifts them)."""
    import torch
    import transformers
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    ids = torch.as_tensor(lm_batch_of(config, batch, seq)["input_ids"]).long().to(dev)
    torch.manual_seed(0)
    hf = {k: v for k, v in config.to_hf().items() if k != "architectures"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **hf, attn_implementation="sdpa")).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=cuda)
    fwd = torch.compile(model) if mode == "compile" else model

    def step():
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=cuda):
            loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=cuda)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, f"torch.{mode}.{'bf16' if cuda else 'fp32'}.adamw.sdpa"


def torch_time(step, n, warmup: int = 3, first: bool = True) -> dict:
    """A row's timing of a PyTorch ``step``: ``first_step_s`` (compilation; when ``first``),
    ``warmup`` untimed steps, then median/min/max of ``n`` and energy per step over them
    (``bench.common.time_fn``'s fields, NVML where there is a GPU)."""
    import torch
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = {}
    if first:
        t0 = time.perf_counter()
        step()
        sync()
        out["first_step_s"] = time.perf_counter() - t0
    for _ in range(warmup):
        step()
    sync()
    times = []
    with energy.Meter("gpu" if cuda else "cpu") as meter:
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
    return {"median_s": float(np.median(times)), "min_s": float(np.min(times)),
            "max_s": float(np.max(times)), "n": n, **out, "torch": torch.__version__,
            **per_call(meter, n)}


def _release_torch():
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def torch_rows(config, batch, seq, n, modes, attention_dropouts):
    """``torch_bert_step``'s rows: one per mode (eager, compile) and attention dropout."""
    rows = []
    for attn_drop in attention_dropouts:
        for mode in modes:
            step, name = torch_bert_step(config, batch, seq, mode, attn_drop)
            rows.append({"name": name, "batch": batch, "attention_dropout": attn_drop,
                         **torch_time(step, n)})
            print(f"  {name} b{batch}: {rows[-1]['median_s'] * 1e3:.1f} ms", flush=True)
            del step
            _release_torch()
    return rows


def torch_lm_rows(config, batch, seq, n, modes=("compile",)):
    """``torch_llama_step``'s rows, one per mode."""
    rows = []
    for mode in modes:
        step, name = torch_llama_step(config, batch, seq, mode)
        rows.append({"name": name, "batch": batch, "seq": seq, **torch_time(step, n)})
        print(f"  {name} b{batch}x{seq}: {rows[-1]['median_s'] * 1e3:.1f} ms", flush=True)
        del step
        _release_torch()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--torch", action="store_true",
                    help="add Hugging Face PyTorch rows (eager and torch.compile)")
    ap.add_argument("--torch-modes", default="eager,compile")
    ap.add_argument("--batch", default="32", help="comma-separated batch sizes, e.g. 32,256")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--policies", help="comma-separated subset of fp32,bf16,fp16,fp8")
    ap.add_argument("--optimizers", default="adamw,adan")
    ap.add_argument("--attention", help="comma-separated subset of xla,cudnn,pallas")
    ap.add_argument("--profile", action="store_true",
                    help="per-category device time of every jax row (bench/hlo_profile.py)")
    ap.add_argument("--profile-dir", help="also keep the traces and optimized HLO here")
    add_out_argument(ap)
    ap.add_argument("--lm", help="comma-separated decoder presets to add as rows (default on "
                    "GPU/TPU: llama-125m,llama-350m,llama-1b; none on CPU)")
    ap.add_argument("--lm-batch", type=int, default=8, help="decoder rows per step")
    ap.add_argument("--lm-seq", type=int, default=2048, help="decoder tokens per row")
    args = ap.parse_args(argv)
    if args.torch:     # leave the GPU's memory to both frameworks in one process
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")
    config = PRESETS["bert-base"] if not args.small else BertConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
    backend = jax.default_backend()
    attentions = {"gpu": ["xla", "cudnn", "pallas"], "tpu": ["xla", "pallas"]}.get(backend,
                                                                                    ["xla"])
    attentions = args.attention.split(",") if args.attention else attentions
    policies = ["fp32", "bf16", "fp16", "fp8"] if backend != "cpu" else ["fp32"]
    policies = args.policies.split(",") if args.policies else policies
    batches = [int(b) for b in args.batch.split(",")]
    peak = mfu_peak(device_kind(), "bf16")
    rows, profiles = [], {}
    lm = args.lm.split(",") if args.lm else ([] if backend == "cpu" else
                                            ["llama-125m", "llama-350m", "llama-1b"])
    for preset in lm:
        for policy in policies:
            for attention in attentions:
                if attention == "cudnn":
                    continue          # packed rows need segment ids: xla and pallas only
                name = f"jax.{policy}.adamw.{attention}.{preset}"
                cfg = LLAMA_PRESETS[preset]
                run, data, _ = lm_step(cfg, policy, "adamw", attention, args.lm_batch,
                                       args.lm_seq)
                rows.append({"name": name, "batch": args.lm_batch, "seq": args.lm_seq,
                             "model": preset, "attention_dropout": 0.0,
                             "flops_per_step": train_flops(model_shape(ModelSpec(cfg)),
                                                           args.lm_batch, args.lm_seq),
                             **time_fn(run, data, n=args.n)})
                print(f"  {name} b{args.lm_batch}x{args.lm_seq}: "
                      f"{rows[-1]['median_s'] * 1e3:.1f} ms", flush=True)
    for batch in batches:
        for policy in policies:
            for optimizer in args.optimizers.split(","):
                for attention in attentions:
                    if attention == "cudnn" and policy == "fp32":
                        continue          # cuDNN flash attention takes fp16/bf16 only
                    name = f"jax.{policy}.{optimizer}.{attention}"
                    run, data, hlo = jax_step(config, policy, optimizer, attention, batch,
                                              args.seq)
                    r = {"name": name, "batch": batch, "attention_dropout": 0.0
                         if attention != "xla" else config.attention_probs_dropout_prob,
                         **time_fn(run, data, n=args.n)}
                    if get_policy(policy).fp8:
                        r["fp8"] = "native" if "__cublas$lt$matmul$f8" in hlo else "emulated"
                    if args.profile:
                        trace_dir = None
                        if args.profile_dir:
                            trace_dir = os.path.join(args.profile_dir, f"{name}.b{batch}")
                            os.makedirs(trace_dir, exist_ok=True)
                            with open(os.path.join(trace_dir, "optimized_hlo.txt"), "w") as f:
                                f.write(hlo)
                        prof = profile_ops(run, data, hlo_text=hlo, trace_dir=trace_dir)
                        r["profile"] = prof.rows()
                        profiles[f"{name} b{batch}"] = prof
                    rows.append(r)
                    print(f"  {name} b{batch}: {r['median_s'] * 1e3:.1f} ms", flush=True)
        if args.torch:
            drops = sorted({config.attention_probs_dropout_prob}
                           | ({0.0} if set(attentions) - {"xla"} else set()), reverse=True)
            rows += torch_rows(config, batch, args.seq, args.n, args.torch_modes.split(","),
                               drops)
    for r in rows:
        flops = r.get("flops_per_step") or model_flops(config, r["batch"], args.seq)
        r["tokens_per_s"] = r["batch"] * r.get("seq", args.seq) / r["median_s"]
        r["model_tflops"] = flops / r["median_s"] / 1e12
        r["mfu"] = flops / r["median_s"] / peak if peak else None
        anchor = None if "model" in r else _anchor(rows, r["batch"], r["attention_dropout"])
        r["speedup_vs_torch_compile"] = anchor / r["median_s"] if anchor else None
    path = write_results("train_step", rows, {
        "model": "bert-base" if not args.small else "bert-small(256x4)",
        "batch": batches, "seq": args.seq,
        "model_flops_per_step": {b: model_flops(config, b, args.seq) for b in batches},
        "lm": {"presets": lm, "batch": args.lm_batch, "seq": args.lm_seq}},
        out=args.out)
    for key, prof in profiles.items():
        print(f"\n### {key}\n{prof.table(top=15)}")
    print(markdown(rows, ["name", "batch", "median_s", "min_s", "max_s", "tokens_per_s",
                          "model_tflops", "mfu", "speedup_vs_torch_compile"]))
    print(f"wrote {path}")


def _anchor(rows, batch, attention_dropout):
    """Median of the strongest PyTorch row of the same batch and attention dropout: compiled
    bf16 (fp32 where there is no GPU), else eager."""
    torch_rows_ = [r for r in rows if r["name"].startswith("torch.") and r["batch"] == batch
                   and r["attention_dropout"] == attention_dropout]
    for mode in ("compile", "eager"):
        for prec in ("bf16", "fp32"):
            got = [r for r in torch_rows_ if r["name"].startswith(f"torch.{mode}.{prec}.")]
            if got:
                return got[0]["median_s"]
    return None


if __name__ == "__main__":
    main()
