"""The training loop: config -> mesh -> model, optimizer, policy -> sharded state -> data -> steps.

``train(cfg)`` fine-tunes and evaluates; it checkpoints every ``train.checkpoint_every`` steps,
at each epoch end and at the end, resumes from the newest readable checkpoint of its run folder
(model, optimizer, RNG and data position, so losses equal an uninterrupted run's), saves and
returns on SIGTERM or a first Ctrl-C (a second Ctrl-C aborts), and stops at the first
non-finite loss keeping the last good checkpoint (under fp16 a step with non-finite gradients
is skipped instead, and ``precision.max_consecutive_skips`` of them in a row stop the run). The
run folder's rules (one writer, no mixed runs, which config changes a resume allows) are in
``jaxaccel.train.rundir``.

A checkpoint is *good* when its parameters are finite and the loss computed from them (the
next step's loss) is finite too: non-finite parameters are never saved, and when a loss turns
non-finite the checkpoint of the step just before it, whose parameters gave that loss, is set
aside to ``skipped_checkpoints/``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
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
from jaxaccel.models import ModelSpec, create_model
from jaxaccel.models.fp8 import Fp8Meta
from jaxaccel.optim import make_onepass, make_optimizer, make_schedule, state_shardings
from jaxaccel.precision import LossScale, get_policy
from jaxaccel.train import onepass, rundir
from jaxaccel.train.checkpoint import Checkpointer, NonFiniteState, on_disk, restore_state
from jaxaccel.train.metrics import MetricsWriter
from jaxaccel.train.preemption import Preemption
from jaxaccel.train.state import TrainState
from jaxaccel.train.step import is_state_metric, make_eval_step, make_train_step

log = logging.getLogger("jaxaccel")


class NonFiniteLoss(RuntimeError):
    """Raised when the training loss of ``step`` (computed from step ``step - 1``'s
    parameters) is NaN or infinite."""

    def __init__(self, step: int, loss: float):
        super().__init__(f"loss is {loss} at step {step}")
        self.step = step


class TooManySkippedSteps(RuntimeError):
    """fp16: ``precision.max_consecutive_skips`` steps in a row had non-finite gradients.
    Skipped steps never touch the parameters, so every saved checkpoint stays good."""


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
    spec: ModelSpec
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


def check_batch_fits(cfg: Config, mesh) -> None:
    """Each global batch (and micro-batch) must split evenly over the batch axes' devices."""
    shards = math.prod(mesh.shape[a] for a in shd.BATCH_AXES)
    t = cfg.train
    sizes = {"train.batch_size": t.batch_size, "train.eval_batch_size": t.eval_batch_size,
             "train.batch_size / train.grad_accum": t.batch_size // t.grad_accum}
    for key, size in sizes.items():
        if size % shards:
            raise ValueError(
                f"{key}={size} does not split over the {shards} devices of the mesh's batch "
                f"axes {dict((a, mesh.shape[a]) for a in shd.BATCH_AXES)}; use a multiple of "
                f"{shards} (e.g. {-(-size // shards) * shards}), or set the mesh (mesh.data=...).")


def build(cfg: Config, devices=None, model=None, tokenizer_dir: str | None = None) -> Run:
    """Build mesh (over ``devices``, default all), model, optimizer, sharded state and data.

    ``model`` and ``tokenizer_dir`` (eval of a run folder) replace what ``cfg.model`` names,
    so a run folder needs neither the original checkpoint nor its tokenizer."""
    run_dir = os.path.join(cfg.workdir, cfg.name)
    mesh = shd.make_mesh(dict(cfg.mesh), devices)
    check_batch_fits(cfg, mesh)
    policy = dataclasses.replace(get_policy(cfg.precision.policy),
                                 amax_history_length=cfg.precision.fp8_amax_history)
    if model is None:
        model, default_tokenizer_dir = create_model(cfg.model, policy, cfg.seed)
        tokenizer_dir = tokenizer_dir or default_tokenizer_dir
    shd.check_model_fits(model.config, mesh)
    tokenizer = load_tokenizer(tokenizer_dir)
    train_data, eval_data, label_names = _data(
        cfg, tokenizer if cfg.data.name != "synthetic" else None,
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
    # flat_params: the one-pass Adan (train/onepass.py), same arguments, its own state layout.
    tx = (make_onepass if t.flat_params else make_optimizer)(
        t.optimizer, schedule, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
        b1=t.b1, b2=t.b2, b3=t.b3, eps=t.eps, impl=t.optimizer_impl, shardings=param_shardings,
        zero_axes=shd.BATCH_AXES if cfg.sharding.zero1 else ())
    params = jax.device_put(params, param_shardings)
    if t.flat_params:
        state, shardings = onepass.init_state(tx, params, cfg.seed, mesh)
    else:
        create = lambda p: TrainState.create(p, tx, cfg.seed, loss_scale, fp8)
        abstract = jax.eval_shape(create, params)
        opt_shardings = state_shardings(abstract.opt_state, param_shardings, mesh,
                                        zero1=cfg.sharding.zero1)
        replicated = lambda tree: jax.tree_util.tree_map(lambda _: shd.replicated(mesh), tree)
        shardings = TrainState(step=shd.replicated(mesh), params=param_shardings,
                               opt_state=opt_shardings, rng=shd.replicated(mesh),
                               loss_scale=replicated(abstract.loss_scale),
                               fp8=replicated(abstract.fp8))
        state = jax.jit(create, out_shardings=shardings)(params)
    return Run(cfg, run_dir, mesh, graphdef, state, shardings, train_data, eval_data,
               schedule, total_steps, tokenizer, tx, model.spec, label_names)


def step_builders(cfg: Config):
    """``(make_train_step, make_eval_step)`` of the configured trainer path (the eval step
    takes the state's ``params``)."""
    if cfg.train.flat_params:
        return onepass.make_train_step, onepass.make_eval_step
    return make_train_step, make_eval_step


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


def _record(run: Run, epoch: int, step_in_epoch: int) -> dict:
    """The JSON saved beside each checkpoint: data position and what rebuilds the model (its
    spec, under "architecture")."""
    return {"epoch": epoch, "step_in_epoch": step_in_epoch, "config": run.cfg.to_dict(),
            "architecture": run.spec.to_dict(), "label_names": list(run.label_names)}


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def train(cfg: Config) -> dict:
    """Fine-tune as configured; returns the final metrics (and ``status``). Process 0 holds
    the run folder's lock for the whole run."""
    run_dir = os.path.join(cfg.workdir, cfg.name)
    main = jax.process_index() == 0
    if main:
        rundir.make_run_dir(run_dir)
    with rundir.RunLock(run_dir) if main else contextlib.nullcontext():
        changes = rundir.prepare(run_dir, cfg.to_dict()) if main else {}
        _sync("jaxaccel_run_dir_ready")
        return _train(build(cfg), changes)


def _resume_note(run: Run, start: int, changes: dict) -> None:
    """Say how a resumed run continues; refuse one whose new length ends before ``start``."""
    if start > run.total_steps:
        raise rundir.RunFolderError(
            f"the run's checkpoint is at step {start} but the config now ends at step "
            f"{run.total_steps} (train.epochs={run.cfg.train.epochs}, train.max_steps="
            f"{run.cfg.train.max_steps}); give at least as many steps, or a new name=...")
    if changes:
        log.info("resuming with config changes: %s",
                 "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items()))
    if {"train.epochs", "train.max_steps"} & changes.keys():
        t = run.cfg.train
        log.info("the learning-rate schedule (%s) is defined over the run's total of %d steps "
                 "(warm-up %d); continuing at step %d with learning rate %.3g", t.schedule,
                 run.total_steps, int(t.warmup_ratio * run.total_steps), start,
                 float(run.schedule(start)))


def _train(run: Run, changes: dict) -> dict:
    cfg, t = run.cfg, run.cfg.train
    main = jax.process_index() == 0
    if main:
        rundir.write_files(run.run_dir, cfg.to_dict(), run.tokenizer)
    ckpt = Checkpointer(os.path.join(run.run_dir, "checkpoints"), keep=t.keep_checkpoints)
    writer = MetricsWriter(run.run_dir)

    state = run.state
    if t.resume and ckpt.latest_step() is not None:
        restored = restore_state(ckpt, state, run.state_shardings)
        if restored is not None:
            state = restored[0]
            log.info("resumed from %s at step %d", ckpt.directory, int(state.step))
    start = int(jax.device_get(state.step))
    _resume_note(run, start, changes)
    steps_per_epoch = run.train_data.steps_per_epoch
    bsh = shd.batch_sharding(run.mesh)
    make_train, make_eval = step_builders(cfg)
    train_step = jax.jit(make_train(run.graphdef, run.tx, t.grad_accum),
                         in_shardings=(run.state_shardings, bsh),
                         out_shardings=(run.state_shardings, shd.replicated(run.mesh)),
                         donate_argnums=0)
    eval_step = jax.jit(make_eval(run.graphdef))

    def save(step):
        e, s = divmod(step, steps_per_epoch)
        ckpt.save(step, on_disk(state), _record(run, e, s))

    result = {"status": "completed", "run_dir": run.run_dir,
              "checkpoint_dir": ckpt.directory, "metrics_file": writer.path}
    bar = tqdm(total=run.total_steps, initial=start, disable=not (t.progress and main),
               unit="step", dynamic_ncols=True, file=sys.stderr)
    window, pending, step = [], None, start
    t_last = time.perf_counter()

    def drain(pending):
        """Fetch one step's metrics (one step late, so the device stays busy)."""
        nonlocal t_last
        step_no, metrics, rows = pending
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        skips = m.get("consecutive_skips", 0)      # fp16: this step was skipped, not applied
        if skips >= cfg.precision.max_consecutive_skips:
            raise TooManySkippedSteps(
                f"fp16: {int(skips)} steps in a row had non-finite gradients (loss scale now "
                f"{m['loss_scale'] * 0.5:g}) up to step {step_no}; the run is diverging, not "
                "overflowing: lower train.learning_rate or use precision.policy=bf16.")
        if not skips and not math.isfinite(m["loss"]):
            raise NonFiniteLoss(step_no, m["loss"])
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
        with Preemption() as preempt:
            epoch = start // steps_per_epoch
            while step < run.total_steps and not preempt.stop:
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
                    if preempt.reached() or step >= run.total_steps:
                        break
                if pending is not None:
                    drain(pending)
                    pending = None
                epoch += 1
                if step % steps_per_epoch == 0 or step >= run.total_steps:
                    save(step)
                    if t.eval_every_epoch and step < run.total_steps:
                        ev = evaluate(run, state.params, eval_step, state.fp8)
                        writer.write(step, ev, prefix="eval/")
                        if main:
                            tqdm.write(f"epoch {epoch}: eval accuracy {ev['accuracy']:.4f} "
                                       f"loss {ev['loss']:.4f}", file=sys.stderr)
            if preempt.stop:
                save(step)
                ckpt.wait()
                result.update(status="preempted", signal=preempt.requested, step=step)
                return result
        bar.close()
        final = evaluate(run, state.params, eval_step, state.fp8)   # while the last save writes
        ckpt.wait()
        writer.write(step, final, prefix="eval/")
        result.update(step=step, eval_accuracy=final["accuracy"], eval_loss=final["loss"],
                      eval_examples=final["examples"])
        return result
    except (NonFiniteLoss, NonFiniteState, TooManySkippedSteps) as e:
        # The loss of step k is computed from the parameters saved as step k - 1.
        bad = e.step - 1 if isinstance(e, NonFiniteLoss) else None
        if bad in ckpt.all_steps():
            ckpt.set_aside(bad, f"its parameters give a non-finite loss ({e})")
        good = [s for s in ckpt.all_steps() if bad is None or s < bad]
        result.update(status="nonfinite", error=str(e), step=step,
                      last_good_checkpoint=good[-1] if good else None)
        return result
    finally:
        bar.close()
        writer.close()
        ckpt.close()
