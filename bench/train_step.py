"""Training-step benchmark: the thesis's main table (time, tokens/s, MFU per configuration).

    python bench/train_step.py                 # BERT-base, batch 32 x 128 tokens
    python bench/train_step.py --small         # hidden 256, 4 layers: a quick CPU run
    python bench/train_step.py --torch         # add Hugging Face PyTorch rows (same machine)

One full optimizer step (forward, loss, backward, clipping, update) on a fixed synthetic batch,
jitted with the state donated, median of >= 20 after warm-up. Rows cross precision policy (fp32,
bf16), optimizer (adamw, adan) and attention implementation (xla; pallas and cudnn on GPU,
pallas on TPU). With ``--torch``, transformers' PyTorch BertForSequenceClassification with
torch.optim.AdamW (fp32, and AMP bf16 on CUDA) runs the same shapes in the same process, so the
ratio ours/PyTorch is measured on one machine.

Model FLOPs per step (analytic, DESIGN.md): 6 x non-embedding params x tokens + 12 x layers x
seq^2 x hidden x batch; MFU = FLOPs / time / peak bf16 FLOP/s of the device (when known).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import PEAK_BF16_FLOPS, device_kind, markdown, time_fn, write_results  # noqa
from jaxaccel.models.bert import PRESETS, BertConfig, BertModel  # noqa: E402
from jaxaccel.optim import make_optimizer  # noqa: E402
from jaxaccel.train.state import TrainState  # noqa: E402
from jaxaccel.train.step import make_train_step  # noqa: E402


def model_flops(config: BertConfig, batch: int, seq: int, num_labels: int = 2) -> float:
    h, f, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    non_embedding = layers * (4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h) + h * h + h \
        + h * num_labels + num_labels
    return 6.0 * non_embedding * batch * seq + 12.0 * layers * seq * seq * h * batch


def batch_of(config, batch, seq):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, config.vocab_size, size=(batch, seq), dtype=np.int32)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids),
            "token_type_ids": np.zeros_like(ids),
            "labels": rng.integers(0, 2, size=batch, dtype=np.int32),
            "weights": np.ones(batch, np.float32)}


def jax_row(config, policy, optimizer, attention, batch, seq, n):
    from flax import nnx
    cfg = config if attention == "xla" else BertConfig(
        **{**config.__dict__, "attention_probs_dropout_prob": 0.0})
    model = BertModel(cfg, num_labels=2, policy=policy, attention_impl=attention)
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    tx = make_optimizer(optimizer, 1e-4, weight_decay=0.01, max_grad_norm=1.0)
    state = TrainState.create(params, tx, 0)
    step = jax.jit(make_train_step(graphdef, tx), donate_argnums=0)
    data = jax.device_put(batch_of(config, batch, seq))
    box = [state]

    def run(d):
        box[0], metrics = step(box[0], d)
        return metrics
    return time_fn(run, data, n=n)


def torch_rows(config, batch, seq, n):
    import torch
    import transformers
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hf_cfg = transformers.BertConfig(**{k: v for k, v in config.__dict__.items()},
                                     num_labels=2)
    model = transformers.BertForSequenceClassification(hf_cfg).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    d = {k: torch.as_tensor(v).to(dev) for k, v in batch_of(config, batch, seq).items()}
    d["labels"] = d["labels"].long()
    rows = []
    for name, amp in [("torch.fp32.adamw", False)] + ([("torch.amp_bf16.adamw", True)]
                                                      if dev == "cuda" else []):
        def step():
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=amp):
                loss = model(input_ids=d["input_ids"], attention_mask=d["attention_mask"],
                             token_type_ids=d["token_type_ids"], labels=d["labels"]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if dev == "cuda":
                torch.cuda.synchronize()
        for _ in range(3):
            step()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        rows.append({"name": name, "median_s": float(np.median(times)),
                     "min_s": float(np.min(times)), "max_s": float(np.max(times)), "n": n})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--torch", action="store_true", help="add Hugging Face PyTorch rows")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--policies", help="comma-separated subset of fp32,bf16")
    ap.add_argument("--optimizers", default="adamw,adan")
    ap.add_argument("--attention", help="comma-separated subset of xla,cudnn,pallas")
    args = ap.parse_args(argv)
    config = PRESETS["bert-base"] if not args.small else BertConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
    backend = jax.default_backend()
    attentions = {"gpu": ["xla", "cudnn", "pallas"], "tpu": ["xla", "pallas"]}.get(backend,
                                                                                    ["xla"])
    attentions = args.attention.split(",") if args.attention else attentions
    policies = ["fp32", "bf16"] if backend != "cpu" else ["fp32"]
    policies = args.policies.split(",") if args.policies else policies
    flops = model_flops(config, args.batch, args.seq)
    peak = PEAK_BF16_FLOPS.get(device_kind())
    rows = []
    for policy in policies:
        for optimizer in args.optimizers.split(","):
            for attention in attentions:
                if attention == "cudnn" and policy == "fp32":
                    continue          # cuDNN flash attention takes fp16/bf16 only
                name = f"jax.{policy}.{optimizer}.{attention}"
                r = jax_row(config, policy, optimizer, attention, args.batch, args.seq, args.n)
                rows.append({"name": name, **r})
                print(f"  {name}: {r['median_s'] * 1e3:.1f} ms", flush=True)
    if args.torch:
        rows += torch_rows(config, args.batch, args.seq, args.n)
    base = next((r["median_s"] for r in rows if r["name"] == "torch.fp32.adamw"), None)
    for r in rows:
        r["tokens_per_s"] = args.batch * args.seq / r["median_s"]
        r["model_tflops"] = flops / r["median_s"] / 1e12
        r["mfu"] = flops / r["median_s"] / peak if peak else None
        r["speedup_vs_torch_fp32"] = base / r["median_s"] if base else None
    path = write_results("train_step", rows, {
        "model": "bert-base" if not args.small else "bert-small(256x4)",
        "batch": args.batch, "seq": args.seq, "model_flops_per_step": flops})
    print(markdown(rows, ["name", "median_s", "min_s", "max_s", "tokens_per_s", "model_tflops",
                          "mfu", "speedup_vs_torch_fp32"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
