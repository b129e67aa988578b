"""The training loop: config -> mesh -> model, optimizer, policy -> sharded state -> data -> steps.

``train(cfg)`` fine-tunes and evaluates; it checkpoints every ``train.checkpoint_every`` steps,
at each epoch end and at the end, resumes from the latest checkpoint of its run folder (model,
optimizer, RNG and data position, so losses equal an uninterrupted run's), saves and returns on
SIGTERM, and stops at the first non-finite loss keeping the last good checkpoint (under fp16 a
step with non-finite gradients is skipped instead, and ``precision.max_consecutive_skips`` of
them in a row stop the run).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxaccel import sharding as shd
from jaxaccel.config import Config
from jaxaccel.data import BatchIterator, load_text_dataset, load_tokenizer, synthetic, tokenize
from jaxaccel.models import create_model
from jaxaccel.models.fp8 import Fp8Meta
from jaxaccel.optim import make_optimizer, make_schedule, state_shardings
from jaxaccel.precision import LossScale, get_policy
from jaxaccel.train.checkpoint import Checkpointer, on_disk, restore_state
from jaxaccel.train.metrics import MetricsWriter
from jaxaccel.train.state import TrainState
from jaxaccel.train.step import is_state_metric, make_eval_step, make_train_step

log = logging.getLogger("jaxaccel")


class NonFiniteLoss(RuntimeError):
    """Raised when a training loss is NaN or infinite."""


@dataclasses.dataclass
class Run:
    """Everything built from a config before the first step."""

    cfg: Config
    run_dir: str
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    state: TrainState
    state_shardings: TrainState
    train_data: BatchIterator
    eval_data: BatchIterator
    schedule: object
    total_steps: int
    tokenizer: object
    tx: object
    architecture: dict
    label_names: tuple


def _data(cfg: Config, tokenizer, max_positions: int):
    """(train, eval) BatchIterators for this process, and the label names."""
    d, t = cfg.data, cfg.train
    if d.name == "synthetic":
        vocab = tokenizer.vocab_size if tokenizer is not None else 30522
        make = lambda split, seed: synthetic(vocab_size=vocab, seq_len=d.synthetic_seq_len,
                                             num_examples=d.synthetic_examples, seed=seed,
                                             num_classes=cfg.model.num_labels)
        train_tok, eval_tok = make("train", cfg.seed), make("test", cfg.seed + 1)
        label_names = tuple(str(i) for i in range(cfg.model.num_labels))
    else:
        ds = load_text_dataset(d.name, data_dir=d.data_dir or None,
                               manual_dir=d.manual_dir or None)
        if ds.num_classes > cfg.model.num_labels:
            raise ValueError(f"data {d.name!r} has {ds.num_classes} classes but "
                             f"model.num_labels={cfg.model.num_labels}.")
        train_tok = tokenize(tokenizer, *ds["train"], max_len=d.max_len,
                             max_positions=max_positions)
        eval_tok = tokenize(tokenizer, *ds[d.eval_split], max_len=d.max_len,
                            max_positions=max_positions)
        label_names = ds.label_names
    common = dict(pad_multiple=d.pad_multiple, process_index=jax.process_index(),
                  process_count=jax.process_count())
    train = BatchIterator(train_tok, t.batch_size, shuffle=True, seed=cfg.seed,
                          drop_remainder=True, bucket_window=50 if d.bucket else 0, **common)
    # Eval order does not matter: sort by length (one window over the split) to pad least.
    evals = BatchIterator(eval_tok, t.eval_batch_size, shuffle=False, drop_remainder=False,
                          bucket_window=len(eval_tok) // t.eval_batch_size + 1, **common)
    return train, evals, label_names


def build(cfg: Config, devices=None) -> Run:
    """Build mesh (over ``devices``, default all), model, optimizer, sharded state and data."""
    run_dir = os.path.join(cfg.workdir, cfg.name)
    mesh = shd.make_mesh(dict(cfg.mesh), devices)
    policy = dataclasses.replace(get_policy(cfg.precision.policy),
                                 amax_history_length=cfg.precision.fp8_amax_history)
    model, tokenizer_dir = create_model(cfg.model, policy, cfg.seed)
    shd.check_model_fits(model.config, mesh)
    tokenizer = load_tokenizer(tokenizer_dir) if cfg.data.name != "synthetic" else None
    train_data, eval_data, label_names = _data(cfg, tokenizer,
                                               model.config.max_position_embeddings)

    t = cfg.train
    total_steps = t.max_steps if t.max_steps > 0 else t.epochs * train_data.steps_per_epoch
    schedule = make_schedule(t.schedule, t.learning_rate, total_steps,
                             int(t.warmup_ratio * total_steps))
    graphdef, params_state, fp8_state = nnx.split(model, nnx.Param, Fp8Meta)
    fp8 = nnx.to_pure_dict(fp8_state) if policy.fp8 else None
    loss_scale = LossScale.create(cfg.precision.loss_scale_init,
                                  cfg.precision.loss_scale_growth_interval) \
        if policy.loss_scaling else None
    params = nnx.to_pure_dict(params_state)
    logical = nnx.to_pure_dict(nnx.get_partition_spec(params_state))
    param_shardings = shd.tree_shardings(mesh, logical, params)
    tx = make_optimizer(t.optimizer, schedule, weight_decay=t.weight_decay,
                        max_grad_norm=t.max_grad_norm, b1=t.b1, b2=t.b2, b3=t.b3, eps=t.eps,
                        impl=t.optimizer_impl, shardings=param_shardings,
                        zero_axes=shd.BATCH_AXES if cfg.sharding.zero1 else ())
    create = lambda p: TrainState.create(p, tx, cfg.seed, loss_scale, fp8)
    abstract = jax.eval_shape(create, params)
    opt_shardings = state_shardings(abstract.opt_state, param_shardings, mesh,
                                    zero1=cfg.sharding.zero1)
    replicated = lambda tree: jax.tree_util.tree_map(lambda _: shd.replicated(mesh), tree)
    shardings = TrainState(step=shd.replicated(mesh), params=param_shardings,
                           opt_state=opt_shardings, rng=shd.replicated(mesh),
                           loss_scale=replicated(abstract.loss_scale),
                           fp8=replicated(abstract.fp8))
    params = jax.device_put(params, param_shardings)
    state = jax.jit(create, out_shardings=shardings)(params)
    return Run(cfg, run_dir, mesh, graphdef, state, shardings, train_data, eval_data,
               schedule, total_steps, tokenizer, tx, dataclasses.asdict(model.config),
               label_names)


def _global_batch(batch: dict, sharding) -> dict:
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def evaluate(run: Run, params, eval_step=None, fp8=None) -> dict:
    """Accuracy and mean loss of ``params`` (and the fp8 state ``fp8``) on the eval split."""
    eval_step = eval_step or jax.jit(make_eval_step(run.graphdef))
    bsh = shd.batch_sharding(run.mesh)
    totals = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
    for batch in run.eval_data.batches(0):
        with jax.set_mesh(run.mesh):
            sums, _ = eval_step(params, _global_batch(batch, bsh), fp8)
        for k, v in jax.device_get(sums).items():
            totals[k] += float(v)
    n = max(totals["count"], 1.0)
    return {"accuracy": totals["correct"] / n, "loss": totals["loss_sum"] / n,
            "examples": int(totals["count"])}


class _Preemption:
    """Turns SIGTERM into a flag the loop polls after every step."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:          # not the main thread: no handler, nothing to restore
            self._previous = None
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _record(run: Run, epoch: int, step_in_epoch: int) -> dict:
    """The JSON saved beside each checkpoint: data position and what rebuilds the model."""
    return {"epoch": epoch, "step_in_epoch": step_in_epoch, "config": run.cfg.to_dict(),
            "architecture": run.architecture, "label_names": list(run.label_names)}


def train(cfg: Config) -> dict:
    """Fine-tune as configured; returns the final metrics (and ``status``)."""
    run = build(cfg)
    t = cfg.train
    main = jax.process_index() == 0
    os.makedirs(run.run_dir, exist_ok=True)
    if main:
        with open(os.path.join(run.run_dir, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=2)
        if run.tokenizer is not None:
            run.tokenizer.save_pretrained(os.path.join(run.run_dir, "tokenizer"))
    ckpt = Checkpointer(os.path.join(run.run_dir, "checkpoints"), keep=t.keep_checkpoints)
    writer = MetricsWriter(run.run_dir)

    state = run.state
    if t.resume and ckpt.latest_step() is not None:
        state, _ = restore_state(ckpt, state, run.state_shardings)
        log.info("resumed from %s at step %d", ckpt.directory, int(state.step))
    start = int(jax.device_get(state.step))
    steps_per_epoch = run.train_data.steps_per_epoch
    bsh = shd.batch_sharding(run.mesh)
    train_step = jax.jit(make_train_step(run.graphdef, run.tx, t.grad_accum),
                         in_shardings=(run.state_shardings, bsh),
                         out_shardings=(run.state_shardings, shd.replicated(run.mesh)),
                         donate_argnums=0)
    eval_step = jax.jit(make_eval_step(run.graphdef))

    def save(step):
        e, s = divmod(step, steps_per_epoch)
        ckpt.save(step, on_disk(state), _record(run, e, s))

    result = {"status": "completed", "run_dir": run.run_dir,
              "checkpoint_dir": ckpt.directory, "metrics_file": writer.path}
    bar = tqdm(total=run.total_steps, initial=start, disable=not (t.progress and main),
               unit="step", dynamic_ncols=True, file=sys.stderr)
    window, pending, step = [], None, start
    t_last = time.perf_counter()
    last_good = ckpt.latest_step()

    def drain(pending):
        """Fetch one step's metrics (one step late, so the device stays busy)."""
        nonlocal t_last
        step_no, metrics, rows = pending
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        skips = m.get("consecutive_skips", 0)      # fp16: this step was skipped, not applied
        if skips >= cfg.precision.max_consecutive_skips:
            raise NonFiniteLoss(
                f"fp16: {int(skips)} steps in a row had non-finite gradients (loss scale now "
                f"{m['loss_scale'] * 0.5:g}) up to step {step_no}; the run is diverging, not "
                "overflowing: lower train.learning_rate or use precision.policy=bf16.")
        if not skips and not math.isfinite(m["loss"]):
            raise NonFiniteLoss(f"loss is {m['loss']} at step {step_no}")
        now = time.perf_counter()
        dt, t_last = now - t_last, now
        window.append(m)
        bar.update(1)
        bar.set_postfix(loss=f"{m['loss']:.4f}", step_ms=f"{dt * 1e3:.0f}",
                        ex_s=f"{rows / dt:.0f}")
        if step_no % t.log_every == 0 or step_no == run.total_steps:
            mean = {k: window[-1][k] if is_state_metric(k)
                    else float(np.mean([w[k] for w in window])) for k in window[0]}
            mean["learning_rate"] = float(run.schedule(step_no - 1))
            mean["examples_per_s"] = rows / dt
            writer.write(step_no, mean, prefix="train/")
            window.clear()

    try:
        with _Preemption() as preempt:
            epoch = start // steps_per_epoch
            while step < run.total_steps and not preempt.requested:
                for batch in run.train_data.batches(epoch, step - epoch * steps_per_epoch):
                    rows = batch["weights"].shape[0] * jax.process_count()
                    with jax.set_mesh(run.mesh):
                        state, metrics = train_step(state, _global_batch(batch, bsh))
                    step += 1
                    if pending is not None:
                        drain(pending)
                    pending = (step, metrics, rows)
                    if t.checkpoint_every and step % t.checkpoint_every == 0:
                        drain(pending)
                        pending = None
                        save(step)
                        last_good = step
                    if step >= run.total_steps or preempt.requested:
                        break
                if pending is not None:
                    drain(pending)
                    pending = None
                epoch += 1
                if step % steps_per_epoch == 0 or step >= run.total_steps:
                    save(step)
                    last_good = step
                    if t.eval_every_epoch and step < run.total_steps:
                        ev = evaluate(run, state.params, eval_step, state.fp8)
                        writer.write(step, ev, prefix="eval/")
                        if main:
                            tqdm.write(f"epoch {epoch}: eval accuracy {ev['accuracy']:.4f} "
                                       f"loss {ev['loss']:.4f}", file=sys.stderr)
            if preempt.requested:
                save(step)
                result.update(status="preempted", step=step)
                return result
        bar.close()
        final = evaluate(run, state.params, eval_step, state.fp8)
        writer.write(step, final, prefix="eval/")
        result.update(step=step, eval_accuracy=final["accuracy"], eval_loss=final["loss"],
                      eval_examples=final["examples"])
        return result
    except NonFiniteLoss as e:
        result.update(status="nonfinite", error=str(e), step=step,
                      last_good_checkpoint=last_good)
        return result
    finally:
        bar.close()
        writer.close()
        ckpt.close()
