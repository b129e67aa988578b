"""The training loop: config -> mesh -> model, optimizer, policy -> sharded state -> data -> steps.

``train(cfg)`` fine-tunes and evaluates; it checkpoints every ``train.checkpoint_every`` steps,
at each epoch end and at the end, resumes from the newest readable checkpoint of its run folder
(model, optimizer, RNG and data position, so losses equal an uninterrupted run's), saves and
returns on SIGTERM or a first Ctrl-C (a second Ctrl-C aborts), and stops at the first
non-finite loss, under every policy, keeping the last good checkpoint (under fp16 a step whose
gradients are non-finite but whose loss is finite is an overflow: it is skipped, and
``precision.max_consecutive_skips`` of them in a row stop the run). The
run folder's rules (one writer, no mixed runs, which config changes a resume allows) are in
``jaxaccel.train.rundir``.

A checkpoint is *good* when its parameters are finite and the loss computed from them (the
next step's loss) is finite too: non-finite parameters are never saved, and when a loss turns
non-finite the checkpoint of the step just before it, whose parameters gave that loss, is set
aside to ``skipped_checkpoints/``.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import os
import sys
import time

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxaccel import flops
from jaxaccel import sharding as shd
from jaxaccel.config import Config
from jaxaccel.data import BatchIterator, load_tokenizer, splits
from jaxaccel.data.packing import PackedBatches
from jaxaccel.models import ModelSpec, check_vocab, create_model
from jaxaccel.models.fp8 import Fp8Meta
from jaxaccel.models.unpad import Capacity
from jaxaccel.optim import make_onepass, make_optimizer, make_schedule, state_shardings
from jaxaccel.precision import LossScale, get_policy
from jaxaccel.train import onepass, rundir
from jaxaccel.train.checkpoint import Checkpointer, NonFiniteState, on_disk, restore_state
from jaxaccel.train.metrics import MetricsWriter
from jaxaccel.train.preemption import Preemption
from jaxaccel.train.state import TrainState
from jaxaccel.train.step import is_state_metric, make_eval_step, make_train_step
from jaxaccel.train.tasks import TASKS, Task

log = logging.getLogger("jaxaccel")


class NonFiniteLoss(RuntimeError):
    """Raised when the training loss of ``step`` (computed from step ``step - 1``'s
    parameters) is NaN or infinite."""

    def __init__(self, step: int, loss: float):
        super().__init__(f"loss is {loss} at step {step}")
        self.step = step


class TooManySkippedSteps(RuntimeError):
    """fp16: ``precision.max_consecutive_skips`` steps in a row had non-finite gradients (and
    finite losses: a non-finite loss is ``NonFiniteLoss``). Skipped steps never touch the
    parameters, so every saved checkpoint stays good."""


@dataclasses.dataclass
class Run:
    """A model on a mesh with its data, and the jitted steps over them.

    ``build`` makes a training run (optimizer, train state, both splits); ``build_eval`` one
    that only evaluates (a checkpoint's parameters and the eval split: ``state`` holds only
    ``params`` and ``fp8``, and ``tx``, ``schedule``, ``train_data`` are None). The steps are
    jitted once with the state's shardings; ``train`` and ``evaluate_run`` enter
    ``jax.set_mesh(run.mesh)`` once around the whole run (the kernels run per shard over the
    ambient mesh, else over the one their operands are placed on: ``sharding.current_mesh``).
    """

    cfg: Config
    run_dir: str
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    state: TrainState
    state_shardings: TrainState
    eval_data: BatchIterator | PackedBatches
    tokenizer: object
    spec: ModelSpec
    label_names: tuple
    train_data: BatchIterator | PackedBatches | None = None
    tx: object = None
    schedule: object = None
    total_steps: int = 0
    unpad: Capacity | None = None

    @property
    def task(self) -> Task:
        """The training task of the model (``tasks.TASKS[spec.task]``)."""
        return TASKS[self.spec.task]

    @functools.cached_property
    def batch_sharding(self) -> jax.sharding.NamedSharding:
        return shd.batch_sharding(self.mesh)

    def put_batch(self, batch: dict) -> dict:
        """This process's rows of a batch (numpy, from ``train_data``/``eval_data``) as global
        arrays split over the mesh's batch axes (refused if it does not fit the unpadding
        plan: ``unpad.Capacity.check``)."""
        if self.unpad is not None:
            self.unpad.check(batch["attention_mask"], jax.process_count())
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v)
                for k, v in batch.items()}

    @functools.cached_property
    def train_step(self):
        """``train_step(state, batch) -> (state, metrics)`` of the configured trainer path,
        jitted: the state donated and laid out as ``state_shardings``, metrics replicated."""
        make = onepass.make_train_step if self.cfg.train.flat_params else make_train_step
        step = make(self.graphdef, self.tx, self.cfg.train.grad_accum, self.task,
                    self.spec.family.resolve("model").fp8_group, self.unpad)
        return jax.jit(step,
                       in_shardings=(self.state_shardings, self.batch_sharding),
                       out_shardings=(self.state_shardings, shd.replicated(self.mesh)),
                       donate_argnums=0)

    @functools.cached_property
    def eval_step(self):
        """``eval_step(params, batch, fp8) -> sums`` (``step.make_eval_step``), jitted: sums
        replicated."""
        make = onepass.make_eval_step if self.cfg.train.flat_params else make_eval_step
        return jax.jit(make(self.graphdef, self.task, self.unpad),
                       in_shardings=(self.state_shardings.params, self.batch_sharding,
                                     self.state_shardings.fp8),
                       out_shardings=shd.replicated(self.mesh))

    def evaluate(self, state: TrainState | None = None) -> dict:
        """The task's report (``Task.report``: classification accuracy and mean loss, causal
        LM loss and perplexity) on the eval split of ``state``'s parameters and fp8 state
        (default ``self.state``), from the weighted sums over every eval batch."""
        state = self.state if state is None else state
        totals = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
        for batch in self.eval_data.batches(0):
            sums = self.eval_step(state.params, self.put_batch(batch), state.fp8)
            for k, v in jax.device_get(sums).items():
                totals[k] += float(v)
        return self.task.report(totals)


def _in_mesh(mesh, fn):
    with jax.set_mesh(mesh):          # the ambient mesh is per thread and part of jit's key
        return fn()


def compile_ahead(run: Run, state: TrainState, start: int) -> int:
    """Compile the train step for every padded length of the steps ``start`` to the run's end
    and the eval step for every eval length, in parallel threads (XLA compiles a program on
    one core), before the first step; the jitted steps then find them compiled (or read them
    from the persistent compilation cache). Returns how many programs were compiled."""
    def specs(data, batch_size, start, stop):
        """Global batches as put_batch makes them, of each length of steps start..stop: the
        keys, dtypes and row shapes of the iterator's own first batch (the task's batch)."""
        first = next(data.batches(0))
        return [{k: jax.ShapeDtypeStruct((batch_size, n, *v.shape[2:]) if v.ndim > 1
                                         else (batch_size,), v.dtype, sharding=run.batch_sharding)
                 for k, v in first.items()} for n in sorted(data.batch_lengths(start, stop))]
    t = run.cfg.train
    jobs = [functools.partial(run.train_step.lower, state, batch)
            for batch in specs(run.train_data, t.batch_size, start, run.total_steps)]
    jobs += [functools.partial(run.eval_step.lower, state.params, batch, state.fp8)
             for batch in specs(run.eval_data, t.eval_batch_size, 0,
                                run.eval_data.steps_per_epoch)]
    with concurrent.futures.ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
        list(pool.map(lambda lower: _in_mesh(run.mesh, lambda: lower().compile()), jobs))
    return len(jobs)


def _policy(cfg: Config):
    return dataclasses.replace(get_policy(cfg.precision.policy),
                               amax_history_length=cfg.precision.fp8_amax_history)


def _mesh(cfg: Config, devices, training: bool) -> jax.sharding.Mesh:
    """The configured mesh over ``devices`` (default all), checked against the batch sizes."""
    mesh = shd.make_mesh(dict(cfg.mesh), devices)
    splits.check_batch_fits(cfg.train, {a: mesh.shape[a] for a in shd.BATCH_AXES},
                            training=training)
    return mesh


def _split_model(model, mesh):
    """``(graphdef, params, fp8, param_shardings)``: the model's parameters and fp8 state as
    pure dicts, and the parameters' shardings on ``mesh`` by the logical-axis rules."""
    shd.check_model_fits(model.config, mesh)
    graphdef, params_state, fp8_state = nnx.split(model, nnx.Param, Fp8Meta)
    params = nnx.to_pure_dict(params_state)
    logical = nnx.to_pure_dict(nnx.get_partition_spec(params_state))
    return graphdef, params, nnx.to_pure_dict(fp8_state), shd.tree_shardings(mesh, logical,
                                                                              params)


def build(cfg: Config, devices=None) -> Run:
    """A training run: mesh (over ``devices``, default all), model, optimizer, sharded train
    state and both splits' batches, built under the mesh."""
    mesh = _mesh(cfg, devices, training=True)
    with jax.set_mesh(mesh):
        return _build(cfg, mesh)


def _build(cfg: Config, mesh) -> Run:
    policy = _policy(cfg)
    model, tokenizer_dir = create_model(cfg.model, policy, cfg.seed)
    splits.check_task(cfg, model.spec.task)
    graphdef, params, fp8, param_shardings = _split_model(model, mesh)
    fp8 = fp8 if policy.fp8 else None
    tokenizer_dir = splits.tokenizer_dir(cfg, tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    check_vocab(len(tokenizer), model.config, tokenizer_dir)
    max_positions = model.config.max_position_embeddings
    train_data, label_names = splits.train_batches(cfg, tokenizer, max_positions)
    eval_data, _ = splits.eval_batches(cfg, tokenizer, max_positions)

    t = cfg.train
    total_steps = t.max_steps if t.max_steps > 0 else t.epochs * train_data.steps_per_epoch
    tx, schedule, create, shardings = make_state(cfg, mesh, model.spec, params, fp8,
                                                 param_shardings, total_steps)
    params = jax.device_put(params, param_shardings)
    state = jax.jit(create, out_shardings=shardings)(params, fp8)
    unpad = _unpad_plan(cfg, mesh, model.spec, eval_data, train_data, total_steps)
    return Run(cfg, os.path.join(cfg.workdir, cfg.name), mesh, graphdef, state, shardings,
               eval_data, tokenizer, model.spec, label_names,
               train_data=train_data, tx=tx, schedule=schedule, total_steps=total_steps,
               unpad=unpad)


def _unpad_plan(cfg: Config, mesh, spec: ModelSpec, eval_data, train_data=None,
                train_steps: int = 0) -> Capacity | None:
    """The run's unpadding plan (``models.unpad``) over one pass of ``eval_data`` and the
    first ``train_steps`` batches of ``train_data`` (if any), or None: ``train.unpad`` off, a
    task without padded rows, gradient accumulation, or batches from an iterator that cannot
    plan (packed LM rows)."""
    if not (cfg.train.unpad and TASKS[spec.task].unpads and cfg.train.grad_accum == 1):
        return None
    sources = [eval_data] + ([] if train_data is None else [train_data])
    if not all(isinstance(data, BatchIterator) for data in sources):
        return None
    groups = shd.batch_shards(mesh)
    largest = {}
    for data, stop in zip(sources, (eval_data.steps_per_epoch, train_steps)):
        for shape, most in data.token_capacity(0, stop, groups).items():
            largest[shape] = max(largest.get(shape, 0), most)
    return Capacity.of(groups, largest)


def make_state(cfg: Config, mesh, spec: ModelSpec, params, fp8, param_shardings,
               total_steps: int):
    """``(tx, schedule, create, shardings)``: the configured optimizer (for ``spec``'s model)
    and schedule over ``total_steps``, and the train state's initialiser ``create(params, fp8) -> TrainState``
    with the state's shardings on ``mesh``. ``params`` and ``fp8`` (None unless the policy is
    fp8) may be abstract (``jax.ShapeDtypeStruct``): nothing is computed here."""
    t = cfg.train
    schedule = make_schedule(t.schedule, t.learning_rate, total_steps,
                             int(t.warmup_ratio * total_steps))
    loss_scale = LossScale.create(cfg.precision.loss_scale_init,
                                  cfg.precision.loss_scale_growth_interval) \
        if _policy(cfg).loss_scaling else None
    # flat_params: the one-pass Adan (train/onepass.py), same arguments, its own state layout
    # (no layer decay: config.validate refuses it).
    kw = dict(weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm, b1=t.b1, b2=t.b2,
              b3=t.b3, eps=t.eps, impl=t.optimizer_impl, shardings=param_shardings,
              zero_axes=shd.BATCH_AXES if cfg.sharding.zero1 else ())
    tx = make_onepass(t.optimizer, schedule, **kw) if t.flat_params else make_optimizer(
        t.optimizer, schedule, layer_decay=t.layer_decay, embeddings=spec.family.embeddings,
        **kw)
    if t.flat_params:
        create, shardings = onepass.state_init(tx, params, cfg.seed, mesh)
        return tx, schedule, lambda p, _: create(p), shardings
    create = lambda p, f: TrainState.create(p, tx, cfg.seed, loss_scale, f)
    abstract = jax.eval_shape(create, params, fp8)
    opt_shardings = state_shardings(abstract.opt_state, param_shardings, mesh,
                                    zero1=cfg.sharding.zero1)
    replicated = lambda tree: jax.tree_util.tree_map(lambda _: shd.replicated(mesh), tree)
    shardings = TrainState(step=shd.replicated(mesh), params=param_shardings,
                           opt_state=opt_shardings, rng=shd.replicated(mesh),
                           loss_scale=replicated(abstract.loss_scale),
                           fp8=replicated(abstract.fp8))
    return tx, schedule, create, shardings


def build_eval(cfg: Config, model, tokenizer_dir: str, devices=None) -> Run:
    """A run that only evaluates ``model`` (its parameters and fp8 state, e.g. a checkpoint's
    from ``inference.load_run``) on ``cfg``'s eval split: no optimizer state, and the training
    split is neither read nor tokenized. Per-parameter form only (``train.flat_params`` off)."""
    if cfg.train.flat_params:
        raise ValueError("build_eval: train.flat_params=true; evaluation takes the "
                         "per-parameter form, set train.flat_params=false.")
    mesh = _mesh(cfg, devices, training=False)
    graphdef, params, fp8, param_shardings = _split_model(model, mesh)
    replicated = lambda tree: jax.tree_util.tree_map(lambda _: shd.replicated(mesh), tree)
    fp8 = fp8 if _policy(cfg).fp8 else None
    shardings = TrainState(step=None, params=param_shardings, opt_state=None, rng=None,
                           fp8=replicated(fp8))
    state = jax.device_put(TrainState(step=None, params=params, opt_state=None, rng=None,
                                      fp8=fp8), shardings)
    tokenizer = load_tokenizer(tokenizer_dir, light=True) if cfg.data.name != "synthetic" \
        else None
    eval_data, label_names = splits.eval_batches(cfg, tokenizer,
                                                 model.config.max_position_embeddings)
    return Run(cfg, os.path.join(cfg.workdir, cfg.name), mesh, graphdef, state, shardings,
               eval_data, tokenizer, model.spec, label_names,
               unpad=_unpad_plan(cfg, mesh, model.spec, eval_data))


def _record(run: Run, epoch: int, step_in_epoch: int) -> dict:
    """The JSON saved beside each checkpoint: data position and what rebuilds the model (its
    spec, under "architecture")."""
    return {"epoch": epoch, "step_in_epoch": step_in_epoch,
            "step": epoch * run.train_data.steps_per_epoch + step_in_epoch,
            "config": run.cfg.to_dict(),
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
    with rundir.RunLock(run_dir) if main else contextlib.nullcontext(), \
            rundir.library_log(run_dir) if main else contextlib.nullcontext():
        changes = rundir.prepare(run_dir, cfg.to_dict()) if main else {}
        _sync("jaxaccel_run_dir_ready")
        run = build(cfg)
        with jax.set_mesh(run.mesh):      # the one mesh of every step and evaluation
            return _train(run, changes)


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


def _skips_message(cfg: Config, skips: int, scale: float, step: int) -> str:
    """Why ``skips`` fp16 steps in a row up to ``step`` had non-finite gradients with finite
    losses, the last at loss scale ``scale``, and which knob to turn: while the scale is still
    above fp16's largest value (65504) the scale itself (``precision.loss_scale_init``) is the
    suspect; below it, gradients that overflow are the run diverging."""
    p = cfg.precision
    head = (f"fp16: {skips} steps in a row up to step {step} had non-finite gradients "
            f"(finite losses; loss scale {scale:g} at the last, started at "
            f"precision.loss_scale_init={p.loss_scale_init:g})")
    fp16_max = float(np.finfo(np.float16).max)
    if scale > fp16_max:
        return (f"{head}: the scaled gradients overflow fp16 (max {fp16_max:g}) and the scale "
                f"did not halve below that within precision.max_consecutive_skips="
                f"{p.max_consecutive_skips} steps. Lower precision.loss_scale_init (default "
                "32768).")
    return (f"{head}: the gradients overflow even at a scale fp16 holds, so the run is "
            "diverging, not overflowing: lower train.learning_rate or use "
            "precision.policy=bf16.")


def _throughput(run: Run) -> flops.Throughput:
    """The tokens/s, TFLOP/s and MFU meter of the run's train steps (``jaxaccel.flops``)."""
    kind, policy = jax.devices()[0].device_kind, run.cfg.precision.policy
    meter = flops.Throughput(flops.model_shape(run.spec), policy, kind, jax.device_count(),
                             jax.process_count())
    if meter.peak is None:
        log.info("MFU: no peak FLOP/s known for device %r under policy %s (jaxaccel.flops."
                 "peak_flops, jaxaccel/devices.py); metrics carry tokens/s and model TFLOP/s only", kind, policy)
    return meter


def _train(run: Run, changes: dict) -> dict:
    cfg, t = run.cfg, run.cfg.train
    main = jax.process_index() == 0
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
    if main:            # only now: a refused resume leaves the saved config as it was
        rundir.write_files(run.run_dir, cfg.to_dict(), run.tokenizer)
    steps_per_epoch = run.train_data.steps_per_epoch

    def save(step):
        e, s = divmod(step, steps_per_epoch)
        ckpt.save(step, on_disk(state), _record(run, e, s))

    result = {"status": "completed", "run_dir": run.run_dir,
              "checkpoint_dir": ckpt.directory, "metrics_file": writer.path}
    bar = tqdm(total=run.total_steps, initial=start, disable=not (t.progress and main),
               unit="step", dynamic_ncols=True, file=sys.stderr)
    window, pending, step = [], None, start
    meter = _throughput(run)
    t_last = time.perf_counter()

    def drain(pending):
        """Fetch one step's metrics (one step late, so the device stays busy)."""
        nonlocal t_last
        step_no, metrics, batch = pending
        rows = batch["input_ids"].shape[0] * jax.process_count()
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        # A non-finite loss is divergence under every policy, fp16 included (there a step
        # whose gradients alone are non-finite is an overflow, and is skipped).
        if not math.isfinite(m["loss"]):
            raise NonFiniteLoss(step_no, m["loss"])
        skips = m.get("consecutive_skips", 0)      # fp16: this step was skipped, not applied
        if skips >= cfg.precision.max_consecutive_skips:
            raise TooManySkippedSteps(_skips_message(cfg, int(skips), m["loss_scale"], step_no))
        now = time.perf_counter()
        dt, t_last = now - t_last, now
        window.append(m)
        meter.add(batch, dt)
        bar.update(1)
        bar.set_postfix(loss=f"{m['loss']:.4f}", step_ms=f"{dt * 1e3:.0f}",
                        ex_s=f"{rows / dt:.0f}")
        if step_no % t.log_every == 0 or step_no == run.total_steps:
            mean = {k: window[-1][k] if is_state_metric(k)
                    else float(np.mean([w[k] for w in window])) for k in window[0]}
            mean["learning_rate"] = float(run.schedule(step_no - 1))
            mean["examples_per_s"] = rows / dt
            mean.update(meter.flush())
            writer.write(step_no, mean, prefix="train/")
            window.clear()

    try:
        with Preemption() as preempt:     # a signal while compiling: saved right after
            t0 = time.perf_counter()
            log.info("compiled %d programs ahead in %.1f s", compile_ahead(run, state, start),
                     time.perf_counter() - t0)
            epoch = start // steps_per_epoch
            while step < run.total_steps and not preempt.stop:
                for batch in run.train_data.batches(epoch, step - epoch * steps_per_epoch):
                    state, metrics = run.train_step(state, run.put_batch(batch))
                    step += 1
                    if pending is not None:
                        drain(pending)
                    pending = (step, metrics, batch)
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
                        ev = run.evaluate(state)
                        writer.write(step, ev, prefix="eval/")
                        if main:
                            tqdm.write(f"epoch {epoch}: eval " + " ".join(
                                f"{k} {v:.4f}" for k, v in ev.items()), file=sys.stderr)
                t_last = time.perf_counter()    # the next step's time excludes save and eval
            if preempt.stop:
                save(step)
                ckpt.wait()
                result.update(status="preempted", signal=preempt.requested, step=step)
                return result
        bar.close()
        final = run.evaluate(state)     # while the last save writes
        ckpt.wait()
        writer.write(step, final, prefix="eval/")
        result.update(step=step, task=run.task.name, summary=run.task.summary(final),
                      **{f"eval_{k}": v for k, v in final.items()})
        return result
    except (NonFiniteLoss, NonFiniteState, TooManySkippedSteps) as e:
        # The loss of step k is computed from the parameters saved as step k - 1.
        bad = e.step - 1 if isinstance(e, NonFiniteLoss) else None
        if bad in ckpt.all_steps():
            ckpt.set_aside(bad, f"its parameters give a non-finite loss ({e})")
        good = [s for s in ckpt.all_steps() if bad is None or s < bad]
        if not isinstance(e, TooManySkippedSteps):     # whose message names its own fix
            result["advice"] = ("The run diverged: lower train.learning_rate (or raise "
                                "train.warmup_ratio) and train again.")
        result.update(status="nonfinite", error=str(e), step=step,
                      last_good_checkpoint=good[-1] if good else None)
        return result
    finally:
        bar.close()
        writer.close()
        ckpt.close()
