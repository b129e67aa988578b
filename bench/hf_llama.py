"""Our decoder train step beside the stock Hugging Face Llama loops, at equal shapes, in one run.

    python bench/hf_llama.py                  # step medians at the job's shape and at 512 tokens
    python bench/hf_llama.py --job --seeds 0,1   # also the whole jobs at equal tokens
    jaxaccel bench hf_llama [flags]           # the same

Ours: the trainer's own jitted ``Run.train_step`` (``train.run.resolve`` / ``assemble`` of
``--config``, default configs/canterbury_lm.py: the ``llama-cpu`` preset, fp32 on a CPU, AdamW
with the config's schedule, b2, weight decay and clipping) on packed rows of the Canterbury
corpus (documents laid end to end, attention within a document: ``segment_ids``, positions
restarting per document), one device. Each shape of ``--shapes`` is set as
``train.batch_size`` x ``data.max_len``; the default is the job's (the config's batch and row
length, 16 x 128) and rows of 512 tokens holding as many tokens (4 x 512).

Stock sides (``--stock``), on the same token rows:

* ``hf_flax``: transformers 4.57.6's ``FlaxLlamaForCausalLM`` (the last transformers with
  Flax models; the virtual environment bench/hf_flax.py makes, reused: this script runs itself
  again in it) with the same architecture, random initialisation, trained as the example
  ``examples/flax/language-modeling/run_clm_flax.py`` does: ``labels = input_ids``, the
  shifted one-hot cross entropy, ``optax.adamw`` with the example's decay mask, a dropout key
  split per step, no clipping, jitted with the state donated. Two differences from our rows
  that the model forces: it has no packed-segment support (plain causal rows: a token attends
  to the earlier documents of its row too, and the loss also counts the targets across
  document boundaries), and it ignores ``tie_word_embeddings`` (it always builds an
  ``lm_head``), so the step ties it by hand: the head's kernel is the embedding transposed,
  one parameter, as in ours and in PyTorch.
* ``torch_eager`` / ``torch_compile`` (``--torch-modes``): transformers 5.24's PyTorch
  ``LlamaForCausalLM`` (this interpreter's) in float32 with SDPA attention (plain causal rows,
  as above), ``torch.optim.AdamW`` (``--torch-adamw``: fused, the faster on this CPU, or
  foreach) with no decay on norms, the config's schedule and clipping (the HF Trainer's
  default, and our recipe's), eager and under ``torch.compile`` (a compile that fails is
  recorded in the result with its error, not fatal), ``torch.set_num_threads`` = the usable
  cores. It runs in a child process (two transformers versions cannot share one), stepped in
  lock-step with this one: never at the same time as another side.

Step timing: after 2 warm-up steps each (the first one's wall time is ``first_call_s``:
compilation), ``--rounds`` interleaved rounds of ``--steps`` steps per side, the order reversed
on every other round (``bench.common.interleave``); per step the wall time and the process CPU
time of the side's process (``cpu_median_s``: the work done, less sensitive to other jobs on a
shared CPU). Rows ``jaxaccel step``, ``hf_flax step``, ``torch eager step``, ``torch compile
step`` per shape, each with ``work`` = {what, model, batch, seq} (``jaxaccel compare`` joins the
rows of one shape); ``speedup[shape][side]`` = the side's median / ours (wall and CPU time).

Job (``--job``): our whole job (``jaxaccel.train.loop.train`` of ``--config``: corpus, BPE,
packing, compilation, ``train.max_steps`` steps, checkpoint, validation) against the stock
loops doing the same at equal tokens: load the corpus, tokenize it with the same BPE (each
document ending with EOS), concatenate and cut into rows (run_clm's ``group_texts``), shuffle
the rows per epoch, train the same steps of the same batch, then the validation perplexity on
exactly our targets (our packed validation rows' next tokens within a document, weighted as
ours; the stock model reads the rows causally). Rows ``jaxaccel job`` and ``<side> job`` with
``time_s``, ``final_perplexity`` and ``final_loss``, once per seed of ``--seeds``; ``--sides``
(default ``jaxaccel,fastest``: ours and the stock side whose step was fastest at the config's
shape, every stock side of ``--stock`` if that shape was not timed). ``job_speedup[side]``: the
side's time / ours (first seed). Our job evaluates once at the end, as the stock loops do
(``train.eval_every_epoch=False``), and still writes its run folder and a checkpoint at each
epoch end (in a temporary workdir); the stock loops keep nothing.

On a CPU shared with other jobs PyTorch's OpenMP threads, which spin while they wait, stall
each other (steps 10-15x slower here, ours unaffected): ``--torch-omp-wait passive`` there; an
idle machine's measurement keeps OpenMP's default.

``--profile``: per-HLO-op time of our step (and the Flax step) at each shape
(bench/hlo_profile.py), printed. Writes ``<out>/hf_llama-<device>.json`` with the host load
average before and after (on a shared CPU only the ratios of one run are results).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.hf_flax import HF_VERSION, decay_mask, hf_schedule, our_job  # noqa: E402

IN_VENV = "JAXACCEL_HF_LLAMA_VENV"
# Our job evaluates once, at the end, as the stock loops do (the config may evaluate after every
# epoch); it still saves its checkpoint at each epoch end.
OUR_JOB_SETS = ("train.eval_every_epoch=False",)
TORCH_PYTHON = "JAXACCEL_HF_LLAMA_TORCH_PYTHON"   # the interpreter with transformers >= 5
WORKER_FLAG = "--torch-worker"
STOCK = ("hf_flax", "torch")
SIDE_NAMES = {"jaxaccel": "jaxaccel", "hf_flax": "hf_flax", "torch_eager": "torch eager",
              "torch_compile": "torch compile"}


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"8x128,4x512"`` -> [(8, 128), (4, 512)] (rows x tokens per row)."""
    try:
        shapes = [tuple(int(n) for n in s.lower().split("x")) for s in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise SystemExit(f"--shapes {text!r}: expected ROWSxLENGTH[,ROWSxLENGTH...], e.g. "
                         "8x128,4x512.")
    return shapes


def default_shapes(rows: int, length: int, long: int = 512) -> list[tuple[int, int]]:
    """The job's shape and rows of ``long`` tokens holding as many tokens (at least one row)."""
    longer = (max(rows * length // long, 1), long)
    return [(rows, length)] + ([longer] if length < long else [])


def recipe_of(cfg, total_steps: int) -> dict:
    """Our config's optimizer recipe, for the stock sides (plain numbers: it crosses to the
    PyTorch process as JSON)."""
    t = cfg.train
    return {"learning_rate": t.learning_rate, "b1": 0.9 if t.b1 is None else t.b1,
            "b2": 0.999 if t.b2 is None else t.b2, "eps": 1e-8 if t.eps is None else t.eps,
            "weight_decay": t.weight_decay, "max_grad_norm": t.max_grad_norm,
            "schedule": t.schedule, "total_steps": total_steps,
            "warmup_steps": int(t.warmup_ratio * total_steps)}


def lr_factor(step: int, recipe: dict) -> float:
    """``hf_schedule``'s multiplier of the learning rate at ``step`` (PyTorch's LambdaLR)."""
    total, warmup = recipe["total_steps"], recipe["warmup_steps"]
    if step < warmup:
        return step / warmup
    frac = min(step - warmup, total - warmup) / max(total - warmup, 1)
    return 1.0 - frac if recipe["schedule"] == "linear" else 0.5 * (1 + math.cos(math.pi * frac))


# ----------------------------------------------------------------------------- data


def packed_batches(resolved, n: int) -> list[dict]:
    """The first ``n`` training batches the resolved run's loop would step on (packed rows of
    the corpus, numpy), across epochs if one has fewer."""
    from jaxaccel.data import load_tokenizer, run_tokenizer, splits
    tokenizer = load_tokenizer(run_tokenizer.tokenizer_dir(resolved.data))
    data, _ = splits.train_batches(resolved.data, tokenizer)
    epochs = (data.batches(e) for e in itertools.count())
    return list(itertools.islice(itertools.chain.from_iterable(epochs), n))


def stock_rows(tokenizer_dir: str, data: dict) -> tuple[np.ndarray, dict]:
    """The stock loops' data: ``(train rows [R, L] int32, validation rows)``. Train: every
    document tokenized (ending with EOS), concatenated and cut into rows of ``max_len``, the
    remainder dropped (run_clm's ``group_texts``); validation: our packed rows
    (``packing.pack`` in document order), whose weighted targets both sides are scored on."""
    from jaxaccel.data import load_corpus, load_tokenizer
    from jaxaccel.data.packing import pack, tokenize_documents
    texts = load_corpus(data["name"], data_dir=data["data_dir"] or None,
                        splits=("train", data["eval_split"]))
    tok = load_tokenizer(tokenizer_dir)
    stream, length = np.concatenate(tokenize_documents(tok, texts["train"])), data["max_len"]
    rows = stream[: len(stream) // length * length].reshape(-1, length)
    return rows, pack(tokenize_documents(tok, texts[data["eval_split"]]), length)


def stock_batches(rows: int, batch: int, steps: int, seed: int):
    """Row indices of ``steps`` batches: each epoch a permutation of the rows from (seed,
    epoch), cut into whole batches."""
    done = 0
    for epoch in itertools.count():
        perm = np.random.default_rng((seed, epoch)).permutation(rows)
        for idx in perm[: rows // batch * batch].reshape(-1, batch):
            yield idx
            done += 1
            if done == steps:
                return


def eval_batches(rows: dict, size: int):
    """(input_ids, targets, weights) of ``size`` rows each, the last filled with weight-0 rows
    (one compiled shape)."""
    n = len(rows["input_ids"])
    for i in range(0, n, size):
        part = {k: rows[k][i:i + size] for k in ("input_ids", "targets", "target_weights")}
        short = size - len(part["input_ids"])
        if short:
            part = {k: np.concatenate([v, np.zeros((short, v.shape[1]), v.dtype)])
                    for k, v in part.items()}
        yield part["input_ids"], part["targets"], part["target_weights"]


# ----------------------------------------------------------------------------- HF Flax


def flax_model_and_state(architecture, recipe: dict, seed: int):
    """``(model, state)``: ``FlaxLlamaForCausalLM`` of ``architecture`` (random, ``seed``),
    its ``lm_head`` left out of the parameters when the embeddings are tied (``tie_head`` puts
    it back in the step), and run_clm_flax's AdamW on our recipe."""
    import jax.numpy as jnp
    import optax
    from flax.training import train_state
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    model = FlaxLlamaForCausalLM(LlamaConfig.from_dict(architecture.to_hf()), seed=seed,
                                 dtype=jnp.float32)
    params = dict(model.params)
    if architecture.tie_word_embeddings:
        params.pop("lm_head")
    r = recipe
    tx = optax.adamw(hf_schedule(r["learning_rate"], r["total_steps"], r["warmup_steps"],
                                 r["schedule"]), b1=r["b1"], b2=r["b2"], eps=r["eps"],
                     weight_decay=r["weight_decay"],
                     mask=decay_mask(("layernorm", "layer_norm", "ln")))
    return model, train_state.TrainState.create(apply_fn=model.__call__, params=params, tx=tx)


def tie_head(params):
    """The parameters with the LM head's kernel = the embedding transposed (tied), if the
    head is not among them."""
    if "lm_head" in params:
        return params
    return {**params, "lm_head": {"kernel": params["model"]["embed_tokens"]["embedding"].T}}


def flax_train_step(state, batch, dropout_rng):
    """run_clm_flax's train_step on one device (no pmean): the shifted one-hot cross entropy
    of ``labels = input_ids``, its gradient, the AdamW update."""
    import jax
    import optax
    from flax.training.common_utils import onehot
    dropout_rng, new_rng = jax.random.split(dropout_rng)

    def loss_fn(params):
        logits = state.apply_fn(input_ids=batch["input_ids"],
                                attention_mask=batch["attention_mask"], params=tie_head(params),
                                dropout_rng=dropout_rng, train=True)[0]
        shift_logits, shift_labels = logits[..., :-1, :], batch["input_ids"][..., 1:]
        return optax.softmax_cross_entropy(
            shift_logits, onehot(shift_labels, shift_logits.shape[-1])).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}, new_rng


def flax_batch(input_ids) -> dict:
    return {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids)}


def flax_job(architecture, recipe: dict, seed: int, tokenizer_dir: str, data: dict) -> dict:
    """The stock Flax loop (``stock_rows``, ``flax_train_step``), then the validation loss on
    our targets. Returns time, steps, final perplexity and loss."""
    import jax
    import jax.numpy as jnp
    import optax

    start = time.perf_counter()
    rows, val = stock_rows(tokenizer_dir, data)
    model, state = flax_model_and_state(architecture, recipe, seed)
    step = jax.jit(flax_train_step, donate_argnums=(0,))
    rng = jax.random.PRNGKey(seed)
    done = 0
    for idx in stock_batches(len(rows), data["batch"], recipe["total_steps"], seed):
        state, _, rng = step(state, flax_batch(rows[idx]), rng)
        done += 1

    @jax.jit
    def sums(params, ids, targets, weights):
        logits = model(input_ids=ids, params=tie_head(params), train=False)[0]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                             targets)
        return jnp.sum(ce * weights), jnp.sum(weights)

    loss_sum = count = 0.0
    for ids, targets, weights in eval_batches(val, data["eval_batch"]):
        s, c = sums(state.params, ids, targets, weights)
        loss_sum, count = loss_sum + float(s), count + float(c)
    loss = loss_sum / count
    return {"time_s": time.perf_counter() - start, "steps": done,
            "final_perplexity": math.exp(min(loss, 700.0)), "final_loss": loss}


# ----------------------------------------------------------------------------- PyTorch


class TorchSide:
    """transformers' PyTorch ``LlamaForCausalLM`` (fp32, SDPA) trained as a PyTorch user
    would: ``model(input_ids, labels=input_ids).loss``, backward, clipping (where the recipe
    clips), AdamW (no decay on norms), LambdaLR; ``torch.compile`` of the model in mode
    ``compile``. Runs in the child process (``worker``)."""

    def __init__(self, hf_config: dict, recipe: dict, seed: int, mode: str, adamw: str):
        import torch
        import transformers
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(**{k: v for k, v in hf_config.items()
                                             if k not in ("architectures", "model_type")},
                                          attn_implementation="sdpa")
        self.model = transformers.LlamaForCausalLM(config).train()
        named = list(self.model.named_parameters())
        plain = [p for n, p in named if "norm" in n or n.endswith("bias")]
        decayed = [p for n, p in named if not ("norm" in n or n.endswith("bias"))]
        r = recipe
        self.opt = torch.optim.AdamW(
            [{"params": decayed, "weight_decay": r["weight_decay"]},
             {"params": plain, "weight_decay": 0.0}], lr=r["learning_rate"],
            betas=(r["b1"], r["b2"]), eps=r["eps"], fused=adamw == "fused",
            foreach=adamw == "foreach")
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, r))
        self.forward = torch.compile(self.model) if mode == "compile" else self.model
        self.clip = r["max_grad_norm"]

    def step(self, input_ids):
        import torch
        loss = self.forward(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    def eval_sums(self, ids, targets, weights) -> tuple[float, float]:
        import torch
        with torch.no_grad():
            logits = self.model(input_ids=torch.as_tensor(ids, dtype=torch.long)).logits
            logp = torch.log_softmax(logits.float(), -1)
            picked = logp.gather(-1, torch.as_tensor(targets, dtype=torch.long)[..., None])
            w = torch.as_tensor(weights)
            return float(-(picked[..., 0] * w).sum()), float(w.sum())


def torch_job(hf_config: dict, recipe: dict, seed: int, mode: str, adamw: str,
              tokenizer_dir: str, data: dict) -> dict:
    """The stock PyTorch loop (``stock_rows``, ``TorchSide``), then the validation loss on
    our targets (the eager model, no_grad)."""
    import torch
    start = time.perf_counter()
    rows, val = stock_rows(tokenizer_dir, data)
    side = TorchSide(hf_config, recipe, seed, mode, adamw)
    done = 0
    for idx in stock_batches(len(rows), data["batch"], recipe["total_steps"], seed):
        side.step(torch.as_tensor(rows[idx], dtype=torch.long))
        done += 1
    side.model.eval()
    loss_sum = count = 0.0
    for ids, targets, weights in eval_batches(val, data["eval_batch"]):
        s, c = side.eval_sums(ids, targets, weights)
        loss_sum, count = loss_sum + s, count + c
    loss = loss_sum / count
    return {"time_s": time.perf_counter() - start, "steps": done,
            "final_perplexity": math.exp(min(loss, 700.0)), "final_loss": loss}


def worker() -> None:
    """The PyTorch child process: one JSON request a line on stdin, one JSON reply a line on
    the original stdout (everything else printed goes to stderr). Requests: ``setup`` (a
    ``TorchSide`` named ``name`` on the batches of the .npz ``batches``, then its first step:
    the compilation, timed), ``steps`` (``[[wall, cpu], ...]`` of the given batch indices),
    ``drop``, ``job`` (``torch_job``). A failure replies ``{"error": ...}``."""
    import traceback

    import torch
    reply_to = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    torch.set_num_threads(cores())
    sides, batches = {}, {}
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            cmd = msg["cmd"]
            if cmd == "setup":
                with np.load(msg["batches"]) as f:
                    batches[msg["name"]] = torch.as_tensor(f["input_ids"], dtype=torch.long)
                side = TorchSide(msg["config"], msg["recipe"], msg["seed"], msg["mode"],
                                 msg["adamw"])
                t0 = time.perf_counter()
                side.step(batches[msg["name"]][0])
                sides[msg["name"]] = side
                reply = {"first_call_s": time.perf_counter() - t0}
            elif cmd == "steps":
                side, ids, samples = sides[msg["name"]], batches[msg["name"]], []
                for i in msg["indices"]:
                    t0, c0 = time.perf_counter(), time.process_time()
                    side.step(ids[i])
                    samples.append((time.perf_counter() - t0, time.process_time() - c0))
                reply = {"samples": samples}
            elif cmd == "drop":
                sides.pop(msg["name"], None)
                batches.pop(msg["name"], None)
                reply = {}
            elif cmd == "job":
                reply = torch_job(**msg["args"])
            elif cmd == "versions":
                import transformers
                reply = {"torch": torch.__version__, "transformers": transformers.__version__}
            else:
                raise ValueError(f"unknown request {cmd!r}")
        except Exception as e:   # noqa: BLE001 -- the parent records it (torch.compile)
            traceback.print_exc()
            reply = {"error": f"{type(e).__name__}: {e}".strip()[:2000]}
        reply_to.write(json.dumps(reply) + "\n")


class TorchWorker:
    """The parent's handle on the PyTorch child process (``worker``)."""

    def __init__(self, python: str, omp_wait_policy: str | None = None):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [ROOT, os.environ.get("PYTHONPATH", "")])}
        env.pop(IN_VENV, None)
        if omp_wait_policy:
            env["OMP_WAIT_POLICY"] = omp_wait_policy.upper()
        self.omp_wait_policy = env.get("OMP_WAIT_POLICY")
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), WORKER_FLAG],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)

    def call(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the PyTorch process ended (status {self.proc.wait()}); its "
                               "messages are above.")
        return json.loads(line)

    def side(self, name: str):
        """An ``interleave`` side: the child times its own steps."""
        def run(indices):
            reply = self.call(cmd="steps", name=name, indices=list(indices))
            if "error" in reply:
                raise RuntimeError(f"torch side {name}: {reply['error']}")
            return [tuple(s) for s in reply["samples"]]
        return run

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


# ----------------------------------------------------------------------------- measurements


def shape_sets(rows: int, length: int, workdir: str) -> list[str]:
    return [f"train.batch_size={rows}", f"data.max_len={length}", f"workdir={workdir!r}"]


def time_steps(config: str, sets: list[str], shape: tuple[int, int], stock: list[str],
               torch_modes: list[str], adamw: str, rounds: int, steps: int,
               torch_worker: TorchWorker | None, profile: bool = False) -> tuple[dict, dict]:
    """Rows of ours and each stock side at ``shape`` (rows x length), timed interleaved on
    the same batches; and ``{"speedup", "cpu_speedup", "errors", "profiles"}`` of the shape."""
    import jax

    from bench.common import interleave, step_row, timed
    from jaxaccel import config as config_lib
    from jaxaccel.train.run import assemble, resolve

    rows_n, length = shape
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_lib.load(config, sets + shape_sets(rows_n, length, tmp))
        run = assemble(resolve(cfg, jax.devices()[:1]), data=False)
        batches = packed_batches(run.resolved, rounds * steps + 2)
        recipe = recipe_of(cfg, run.total_steps)
        arch = run.spec.architecture
        sides, firsts, errors, profiles = {}, {}, {}, {}
        hf = flax_step = None
        with jax.set_mesh(run.mesh):
            ours = {"state": run.state}

            def ours_step(i):
                ours["state"], _ = run.train_step(ours["state"], run.put_batch(batches[i]))
                jax.block_until_ready(ours["state"])
            sides["jaxaccel"] = timed(ours_step)
            if "hf_flax" in stock:
                _, flax_state = flax_model_and_state(arch, recipe, cfg.seed)
                flax_step = jax.jit(flax_train_step, donate_argnums=(0,))
                hf = {"state": flax_state, "rng": jax.random.PRNGKey(cfg.seed)}

                def flax_step_i(i):
                    hf["state"], _, hf["rng"] = flax_step(
                        hf["state"], flax_batch(batches[i]["input_ids"]), hf["rng"])
                    jax.block_until_ready(hf["state"])
                sides["hf_flax"] = timed(flax_step_i)
            if "torch" in stock:
                path = os.path.join(tmp, "batches.npz")
                np.savez(path, input_ids=np.stack([b["input_ids"] for b in batches]))
                for mode in torch_modes:
                    name = f"torch_{mode}"
                    reply = torch_worker.call(cmd="setup", name=name, mode=mode, adamw=adamw,
                                              config=arch.to_hf(), recipe=recipe,
                                              seed=cfg.seed, batches=path)
                    if "error" in reply:
                        errors[name] = reply["error"]
                        print(f"{name} {rows_n}x{length}: {reply['error']}", flush=True)
                        torch_worker.call(cmd="drop", name=name)
                        continue
                    firsts[name] = reply["first_call_s"]
                    sides[name] = torch_worker.side(name)
            samples, first = interleave(sides, rounds, steps)
            if profile:
                profiles = profile_steps(run, ours, batches, hf, flax_step)
        for name in sides:
            if name.startswith("torch_"):
                torch_worker.call(cmd="drop", name=name)
    first.update(firsts)
    work = {"what": "train step", "model": cfg.model.name, "batch": rows_n, "seq": length}
    label = f"{rows_n}x{length}"
    out = {}
    for name in samples:
        row = step_row(f"{SIDE_NAMES[name]} step", samples[name], first[name],
                       rows_n * length, work)
        row["shape"] = label
        row["rows"] = "packed documents" if name == "jaxaccel" else "plain causal rows"
        out[name] = row
    base = out["jaxaccel"]
    return out, {"speedup": {n: r["median_s"] / base["median_s"] for n, r in out.items()
                             if n != "jaxaccel"},
                 "cpu_speedup": {n: r["cpu_median_s"] / base["cpu_median_s"]
                                 for n, r in out.items() if n != "jaxaccel"},
                 "errors": errors, "profiles": profiles}


def profile_steps(run, ours: dict, batches: list, hf: dict | None, flax_step) -> dict:
    """Per-op profiles (bench/hlo_profile.py) of our step and the Flax step on batch 0."""
    import jax

    from bench.hlo_profile import profile_ops
    batch = run.put_batch(batches[0])
    out = {}

    def ours_fn(b):
        ours["state"], metrics = run.train_step(ours["state"], b)
        return metrics
    hlo = run.train_step.lower(ours["state"], batch).compile().as_text()
    out["jaxaccel"] = profile_ops(ours_fn, batch, hlo_text=hlo)
    if hf is not None:
        fb = flax_batch(batches[0]["input_ids"])
        hlo = flax_step.lower(hf["state"], fb, hf["rng"]).compile().as_text()

        def flax_fn(b):
            hf["state"], metrics, hf["rng"] = flax_step(hf["state"], b, hf["rng"])
            return metrics
        out["hf_flax"] = profile_ops(flax_fn, fb, hlo_text=hlo)
    jax.block_until_ready(ours["state"])
    return out


def jobs(config: str, sets: list[str], seeds: str | None, sides: list[str], adamw: str,
         torch_worker: TorchWorker | None, extra: dict) -> list[dict]:
    """Rows ``<side> job`` of each seed for ``sides`` (``jaxaccel``, ``hf_flax``,
    ``torch_eager``, ``torch_compile``) at our config's batch, row length and steps;
    ``extra["job_speedup"][side]`` for the first seed where ours and the side ran."""
    from jaxaccel import config as config_lib
    from jaxaccel.data import run_tokenizer
    from jaxaccel.models import model_spec
    from jaxaccel.train.run import resolve
    base = config_lib.load(config, sets)
    t, d = base.train, base.data
    if t.max_steps < 1:
        raise SystemExit("--job needs train.max_steps in the config (the steps both sides "
                         "train).")
    data = {"name": d.name, "data_dir": d.data_dir, "eval_split": d.eval_split,
            "max_len": d.max_len, "batch": t.batch_size, "eval_batch": t.eval_batch_size}
    arch = model_spec(base.model).architecture
    recipe = recipe_of(base, t.max_steps)
    tokenizer_dir = run_tokenizer.tokenizer_dir(resolve(base).data)   # the BPE, built once,
    # outside timing
    rows, speedups = [], extra.setdefault("job_speedup", {})
    for seed in ([base.seed] if seeds is None else [int(s) for s in seeds.split(",")]):
        work = {"what": "job", "model": base.model.name, "data": d.name, "batch": t.batch_size,
                "seq": d.max_len, "steps": t.max_steps, "seed": seed}
        got = {}
        for side in sides:
            if side == "jaxaccel":
                got[side], _ = our_job(config, sets + [f"seed={seed}", *OUR_JOB_SETS],
                                       ("perplexity", "loss"))
            elif side == "hf_flax":
                got[side] = flax_job(arch, recipe, seed, tokenizer_dir, data)
            else:
                reply = torch_worker.call(cmd="job", args={
                    "hf_config": arch.to_hf(), "recipe": recipe, "seed": seed,
                    "mode": side.split("_", 1)[1], "adamw": adamw,
                    "tokenizer_dir": tokenizer_dir, "data": data})
                if "error" in reply:
                    raise RuntimeError(f"{side} job: {reply['error']}")
                got[side] = reply
            rows.append({"name": f"{SIDE_NAMES[side]} job", "n": 1, **got[side],
                         "work": work})
        print(f"seed {seed}: " + ", ".join(
            f"{s} perplexity {r['final_perplexity']:.1f} in {r['time_s']:.1f} s"
            for s, r in got.items()), flush=True)
        for s, r in got.items():
            if s != "jaxaccel" and "jaxaccel" in got and s not in speedups:
                speedups[s] = r["time_s"] / got["jaxaccel"]["time_s"]
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [WORKER_FLAG]:
        return worker()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "canterbury_lm.py"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override our config (the stock sides take its architecture, recipe, "
                    "batch, length, steps and seed)")
    ap.add_argument("--shapes", default=None, metavar="ROWSxLEN[,...]",
                    help="step shapes, rows x tokens per row (default: the config's, and rows "
                    "of 512 tokens holding as many tokens)")
    ap.add_argument("--stock", default="hf_flax,torch", metavar="hf_flax,torch",
                    help="stock sides (default both)")
    ap.add_argument("--torch-modes", default="eager,compile", metavar="eager,compile")
    ap.add_argument("--torch-adamw", default="fused", choices=("fused", "foreach"),
                    help="PyTorch AdamW implementation (default fused: faster on a CPU)")
    ap.add_argument("--torch-omp-wait", default=None, choices=("passive", "active"),
                    help="OMP_WAIT_POLICY of the PyTorch process (default: the environment's, "
                    "else OpenMP's own, which spins; passive keeps its steps from stalling "
                    "on a CPU shared with other jobs)")
    ap.add_argument("--rounds", type=int, default=6,
                    help="interleaved rounds of the step timing (default 6; 0: no step timing)")
    ap.add_argument("--steps", type=int, default=5, help="steps per side per round")
    ap.add_argument("--profile", action="store_true",
                    help="print the per-op profile of our step and the Flax step per shape")
    ap.add_argument("--job", action="store_true", help="also time the whole jobs")
    ap.add_argument("--seeds", default=None, metavar="S[,S...]",
                    help="--job: once per seed (default: the config's seed)")
    ap.add_argument("--sides", default="jaxaccel,fastest", metavar="SIDE[,SIDE...]",
                    help="--job: jaxaccel, hf_flax, torch_eager, torch_compile, or fastest "
                    "(the stock side with the fastest step at the config's shape); default "
                    "jaxaccel,fastest")
    from bench.common import add_out_argument
    add_out_argument(ap)
    args = ap.parse_args(argv)
    stock = [s for s in args.stock.split(",") if s]
    modes = [m for m in args.torch_modes.split(",") if m]
    if set(stock) - set(STOCK) or set(modes) - {"eager", "compile"}:
        raise SystemExit(f"--stock {args.stock} --torch-modes {args.torch_modes}: expected "
                         "hf_flax,torch and eager,compile.")
    sides = [s for s in args.sides.split(",") if s]
    known = set(SIDE_NAMES) | {"fastest"}
    if set(sides) - known:
        raise SystemExit(f"--sides {args.sides}: expected some of {', '.join(sorted(known))}.")
    shapes = parse_shapes(args.shapes) if args.rounds > 0 and args.shapes else []
    from jaxaccel.distributed import cpu_without_accelerator
    cpu_without_accelerator()      # before any backend starts, here and in the child processes
    if ("hf_flax" in stock or "hf_flax" in sides) and os.environ.get(IN_VENV) != "1":
        from bench.common import ensure_venv
        python = ensure_venv(HF_VERSION)
        env = {**os.environ, IN_VENV: "1", TORCH_PYTHON: sys.executable,
               "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
        os.execve(python, [python, os.path.abspath(__file__), *argv], env)

    import jax

    from bench.common import markdown, write_results
    from jaxaccel import config as config_lib

    load_before = os.getloadavg()
    torch_worker = None
    if "torch" in stock or any(s.startswith("torch") for s in sides):
        torch_worker = TorchWorker(os.environ.get(TORCH_PYTHON, sys.executable),
                                   args.torch_omp_wait)
    rows, extra = [], {"speedup": {}, "cpu_speedup": {}}
    try:
        if torch_worker is not None:
            versions = torch_worker.call(cmd="versions")
            extra.update(torch=versions.get("torch"),
                         transformers_torch=versions.get("transformers"),
                         torch_threads=cores(), torch_adamw=args.torch_adamw,
                         torch_omp_wait_policy=torch_worker.omp_wait_policy)
        base = config_lib.load(args.config, args.set)
        job_shape, fastest = f"{base.train.batch_size}x{base.data.max_len}", None
        if args.rounds > 0 and not args.shapes:
            shapes = default_shapes(base.train.batch_size, base.data.max_len)
        for shape in shapes:
            got, info = time_steps(args.config, args.set, shape, stock, modes,
                                   args.torch_adamw, args.rounds, args.steps, torch_worker,
                                   args.profile)
            label = f"{shape[0]}x{shape[1]}"
            rows += list(got.values())
            extra["speedup"][label] = info["speedup"]
            extra["cpu_speedup"][label] = info["cpu_speedup"]
            for name, err in info["errors"].items():
                extra.setdefault("errors", {})[f"{name} {label}"] = err
            for name, prof in info["profiles"].items():
                print(f"\n### {name} step {label}\n{prof.table(top=25)}", flush=True)
                got[name]["profile"] = prof.rows()
            if label == job_shape and info["speedup"]:
                fastest = min(info["speedup"], key=info["speedup"].get)
        if args.job:
            if "fastest" in sides:
                stock_sides = [f"torch_{m}" for m in modes] if "torch" in stock else []
                stock_sides = (["hf_flax"] if "hf_flax" in stock else []) + stock_sides
                sides = [s for s in sides if s != "fastest"] + \
                    ([fastest] if fastest else stock_sides)
            rows += jobs(args.config, args.set, args.seeds, list(dict.fromkeys(sides)),
                         args.torch_adamw, torch_worker, extra)
    finally:
        if torch_worker is not None:
            torch_worker.close()
    if "hf_flax" in stock or "hf_flax" in sides:
        extra["transformers_flax"] = HF_VERSION
    extra.update(config=args.config, config_sets=args.set, load_average_before=load_before,
                 load_average_after=os.getloadavg(), jax_devices=str(jax.devices()[:1]))
    path = write_results("hf_llama", rows, extra, out=args.out)
    print(markdown(rows, ["name", "shape", "median_s", "cpu_median_s", "min_s", "max_s", "n",
                          "time_s", "final_perplexity"]))
    for label, s in extra["speedup"].items():
        print(f"{label}: speedup (side median / ours) " + ", ".join(
            f"{n} {v:.3f} wall, {extra['cpu_speedup'][label][n]:.3f} CPU"
            for n, v in s.items()))
    for n, v in extra.get("job_speedup", {}).items():
        print(f"job speedup ({n} time / ours): {v:.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
