"""One way to build a run: a config is resolved once into a ``Resolved`` description, and every
command assembles its ``Run`` from that description through ``assemble``.

    r = resolve(cfg)                      # mesh, policy, model spec, task, layout, steps
    run = assemble(r)                     # jaxaccel train: model, data, optimizer, state
    run = assemble(resolve(cfg, training=False, tokenizer=d), model=model)  # eval
    run = assemble(resolve(cfg, target.devices), abstract=True)  # jaxaccel compile

``resolve`` checks everything that can be known before a weight, a batch or a program exists
(the mesh against the batch sizes and the model, the data against the model's task, which
parameter layout the run can have) and derives it once: nothing downstream builds a policy, a
mesh or chooses a layout again. ``assemble`` builds the model (real, a checkpoint's, or only
its shapes), the data (not for an abstract run), the optimizer of the layout and the sharded
train state, and ``Run`` jits the steps of the layout over them (``jaxaccel.train.step``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

import jax
import numpy as np
from flax import nnx

from jaxaccel import config as config_lib
from jaxaccel import optim
from jaxaccel import sharding as shd, storage
from jaxaccel.config import Config
from jaxaccel.data import splits
from jaxaccel.data.batches import Batches
from jaxaccel.data.spec import DataSpec
from jaxaccel.forms.packing import Packer
from jaxaccel.forms.stacked import Stacked, Stacking, stacked_shardings
from jaxaccel.models import ModelSpec, attention, create_model, fp8_settled, model_spec, remat
from jaxaccel.models.abstract import build_abstract
from jaxaccel.models.fp8 import Fp8Meta
from jaxaccel.models.stack import Scan
from jaxaccel.models.unpad import Capacity
from jaxaccel.precision import LossScale, Policy, policy_of
from jaxaccel.train import layout as layout_lib
from jaxaccel.train import pipeline, run_data
from jaxaccel.train.checkpoint import abstract_like
from jaxaccel.train.saved import init_from
from jaxaccel.train.layout import Layout
from jaxaccel.train.state import TrainState
from jaxaccel.train.step import make_eval_step, make_train_step
from jaxaccel.train.tasks import TASKS, Task, auto_loss_chunks, with_loss_chunks

log = logging.getLogger("jaxaccel")


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A run as its config and target make it, fully derived before anything is built.

    Attributes:
      cfg: the validated config, its mesh sizes as the mesh has them (a -1 filled in).
      mesh: the device mesh (``mesh`` section) over the target's devices.
      policy: the precision policy (``precision.policy_of``), the one of the run.
      spec: the model's ``ModelSpec`` (its family, architecture, task and options).
      task: the training task (``tasks.TASKS[spec.task]``, its loss over
        ``train.loss_chunks`` chunks: ``tasks.with_loss_chunks``), which the data gives
        batches for.
      layout: the parameter layout (``layout.choose``; ``TREE`` for a run that only
        evaluates, whose checkpoint holds the per-parameter form).
      training: whether the run trains (optimizer state, training split) or only evaluates.
      data: what the data is (``data.spec.DataSpec``: its kind, tasks, splits, counts, label
        names, how batches are made), from its source's row (``data.sources``); None for a
        run fed its own batches (``bench/train_step.py``).
      steps_per_epoch: known without reading the data (``DataSpec.steps_per_epoch``: a
        dataset's size, a count the config gives, a prepared cache's index); None where
        unknown until the data is read.
      total_steps: the run's length (``train.max_steps``, else ``train.epochs`` epochs); None
        while ``steps_per_epoch`` is.
      stages: the pipeline (``pipeline.Stages``: ``mesh.stage`` > 1, training), else None.
      stacking: how the state stacks the model's layers (``forms.stacked``): the pipeline's
        stages, else the scan's (``model.scan_layers``, by default on TPUs and GPUs
        where the layers are rematerialised:
        ``models.stack.Scan``), else None (the per-layer tree, run by the model's own loop).
    """

    cfg: Config
    mesh: jax.sharding.Mesh
    policy: Policy
    spec: ModelSpec
    task: Task
    layout: Layout
    training: bool
    data: DataSpec | None
    steps_per_epoch: int | None
    total_steps: int | None
    stages: pipeline.Stages | None = None
    stacking: Stacking | None = None

    @property
    def run_dir(self) -> str:
        return storage.join(self.cfg.workdir, self.cfg.name)

    @property
    def fp8_group(self):
        """The model class's fp8 metric grouping (``FamilyModel.fp8_group``)."""
        return self.spec.family.model_class().fp8_group

    def length(self, steps_per_epoch: int) -> int:
        """The run's total steps given the epoch's (``total_steps`` once known)."""
        return _length(self.cfg.train, steps_per_epoch)


def _length(t, steps_per_epoch: int | None) -> int | None:
    """``train.max_steps``, else ``train.epochs`` epochs of ``steps_per_epoch`` (None while
    that is unknown)."""
    if t.max_steps > 0:
        return t.max_steps
    return None if steps_per_epoch is None else t.epochs * steps_per_epoch


def resolve(cfg: Config, devices=None, *, training: bool = True,
            spec: ModelSpec | None = None, data: bool = True, tokenizer: str | None = None,
            label_names: tuple[str, ...] | None = None, absent_ok: bool = False) -> Resolved:
    """The run ``cfg`` describes on ``devices`` (default all; a planned target's compile-only
    devices for ``jaxaccel compile``), checked and derived once. ``training=False``: a run that
    only evaluates (no optimizer, only the eval batch must fit the mesh). ``spec``: the model's
    spec where it is known already (a checkpoint's), else read from the config. ``data=False``:
    no data is described (a benchmark feeds its own batches); ``tokenizer`` and
    ``label_names``: a trained run's, for evaluating it; ``absent_ok``: data not on this
    machine is described from the config alone (a plan). The config's choices are checked by
    their owners first (precision policy, optimizer, attention kernel)."""
    policy = policy_of(cfg.precision)
    optim.check_config(cfg.train)
    attention.check_config(cfg.model.attention_impl, policy)
    spec = model_spec(cfg.model) if spec is None else spec
    mesh = shd.make_mesh(dict(cfg.mesh), devices)
    spec = spec.for_platform(mesh.devices.flat[0].platform)
    policy = fp8_settled(policy_of(cfg.precision, mesh.devices.flat[0].device_kind), spec)
    filled = _filled_mesh(cfg, mesh)
    cfg = config_lib.build(cfg.to_dict(), [f"mesh.{a}={n}" for a, n in filled.items()]) \
        if filled else cfg
    remat.check(spec.remat, list(mesh.devices.flat))
    described = run_data.describe_data(cfg, spec, mesh.size, tokenizer, label_names,
                                       absent_ok, training) if data else None
    splits.check_batch_fits(cfg.train, {a: mesh.shape[a] for a in shd.BATCH_AXES},
                            training=training)
    shd.check_model_fits(spec.architecture, mesh)
    layout = layout_lib.choose(cfg.train) if training else layout_lib.TREE
    stages = pipeline.of(cfg, spec.architecture.num_hidden_layers) if training else None
    stacking = stages or Scan.of(cfg.model.scan_layers, spec.architecture.num_hidden_layers,
                                 mesh.devices.flat[0].platform, spec.remat)
    per_epoch = described.steps_per_epoch if training and described is not None else None
    task = with_loss_chunks(TASKS[spec.task], cfg.train.loss_chunks or auto_loss_chunks(
        spec, policy, max(1, cfg.train.batch_size // (cfg.train.grad_accum
                                                       * shd.batch_shards(mesh))),
        cfg.data.max_len, mesh.shape["tensor"], shd.width_shards(mesh, shd.residual_width(
            mesh, spec.architecture.hidden_size))), cfg.data.max_len)
    if training and filled:
        log.info("mesh %s over %d devices (%s: the devices the other axes leave)",
                 ", ".join(f"{a}={n}" for a, n in mesh.shape.items()), mesh.size,
                 ", ".join(f"mesh.{a}=-1 is {n}" for a, n in filled.items()))
    return Resolved(cfg, mesh, policy, spec, task, layout, training, described,
                    per_epoch, _length(cfg.train, per_epoch), stages, stacking)


def _filled_mesh(cfg: Config, mesh) -> dict:
    """``{axis: size}`` of the config's -1 mesh axes: the devices the other axes leave
    (``sharding.mesh_shape``), as every axis reads them from here on (a pipeline's
    ``mesh.stage=-1`` is its stage count)."""
    return {a: mesh.shape[a] for a, size in cfg.mesh.items() if size == -1}


@dataclasses.dataclass
class Run:
    """A model on a mesh with its data, and the jitted steps over them.

    A training run has an optimizer, a train state and both splits' batches; a run that only
    evaluates (``resolved.training`` false) has a state holding ``params`` and ``fp8`` only and
    no training data; an abstract run (``jaxaccel compile``) has ShapeDtypeStructs for its
    state and no data at all. The steps are jitted once with the state's shardings; ``train``
    and ``evaluate_run`` enter ``jax.set_mesh(run.mesh)`` once around the whole run (the
    kernels run per shard over the ambient mesh, else over the one their operands are placed
    on: ``sharding.current_mesh``).
    """

    resolved: Resolved
    graphdef: nnx.GraphDef
    state: TrainState
    state_shardings: TrainState
    eval_data: Batches | None = None
    tokenizer: object = None
    label_names: tuple = ()
    train_data: Batches | None = None
    tx: object = None
    schedule: object = None
    total_steps: int = 0
    unpad: Capacity | None = None

    @property
    def cfg(self) -> Config:
        return self.resolved.cfg

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.resolved.mesh

    @property
    def spec(self) -> ModelSpec:
        return self.resolved.spec

    @property
    def task(self) -> Task:
        return self.resolved.task

    @property
    def run_dir(self) -> str:
        return self.resolved.run_dir

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

    def abstract_batch(self, rows: int, length: int) -> dict:
        """A global batch of the task's keys (``Task.batch_shapes``) of ``rows`` x ``length``,
        as ShapeDtypeStructs placed as ``put_batch`` places batches."""
        return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding)
                for k, (shape, dtype) in self.task.batch_shapes(self.spec, rows,
                                                                length).items()}

    @functools.cached_property
    def train_step(self):
        """``train_step(state, batch) -> (state, metrics)`` (``step.make_train_step`` on the
        run's layout), jitted: the state donated and laid out as ``state_shardings``, metrics
        replicated."""
        r = self.resolved
        step = make_train_step(self.graphdef, self.tx, r.layout, task=r.task,
                               fp8_group=r.fp8_group, grad_accum=r.cfg.train.grad_accum,
                               unpad=self.unpad)
        return jax.jit(step,
                       in_shardings=(self.state_shardings, self.batch_sharding),
                       out_shardings=(self.state_shardings, shd.replicated(self.mesh)),
                       donate_argnums=0)

    @functools.cached_property
    def eval_step(self):
        """``eval_step(params, batch, fp8) -> sums`` (``step.make_eval_step``), jitted: sums
        replicated."""
        r = self.resolved
        return jax.jit(make_eval_step(self.graphdef, r.layout, task=r.task, unpad=self.unpad),
                       in_shardings=(self.state_shardings.params, self.batch_sharding,
                                     self.state_shardings.fp8),
                       out_shardings=shd.replicated(self.mesh))

    def evaluate(self, state: TrainState | None = None) -> dict:
        """The task's report (``Task.report``: classification accuracy, mean loss, per-class
        precision/recall/F1, macro-F1 and the confusion matrix, and the ``label_names`` the
        lists follow; causal LM loss and perplexity) on the eval split of ``state``'s
        parameters and fp8 state (default ``self.state``), from the weighted sums and the
        exact integer tallies over every eval batch (each a global batch: every process's
        rows)."""
        state = self.state if state is None else state
        totals = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
        for batch in self.eval_data.batches(0):
            sums = self.eval_step(state.params, self.put_batch(batch), state.fp8)
            for k, v in jax.device_get(sums).items():
                totals[k] = totals.get(k, 0) + (np.asarray(v, np.int64) if np.ndim(v)
                                                else float(v))
        report = self.task.report(totals)
        if "confusion_matrix" in report:
            report["label_names"] = list(self.label_names) or \
                [str(i) for i in range(len(report["confusion_matrix"]))]
        return report


def split_model(model, mesh):
    """``(graphdef, params, fp8, param_shardings)``: the model's parameters and fp8 state as
    pure dicts, and the parameters' shardings on ``mesh`` by the logical-axis rules."""
    graphdef, params_state, fp8_state = nnx.split(model, nnx.Param, Fp8Meta)
    params = nnx.to_pure_dict(params_state)
    logical = nnx.to_pure_dict(nnx.get_partition_spec(params_state))
    return graphdef, params, nnx.to_pure_dict(fp8_state), shd.tree_shardings(mesh, logical,
                                                                              params)


def optimizer_state(r: Resolved, params, fp8, param_shardings, total_steps: int):
    """``(tx, schedule, create, shardings)``: the layout's optimizer and the schedule over
    ``total_steps``, the train state's initialiser ``create(params, fp8) -> TrainState`` (the
    parameters put in the layout's form, the optimizer state zeroed, the fp16 loss scale
    where the policy scales) and the state's shardings on the run's mesh. ``params`` and
    ``fp8`` (None unless the policy is fp8) may be abstract: nothing is computed here."""
    cfg, t = r.cfg, r.cfg.train
    schedule = optim.make_schedule(t.schedule, t.learning_rate, total_steps,
                             int(t.warmup_ratio * total_steps))
    if r.stacking is not None:
        param_shardings = stacked_shardings(r.stacking, param_shardings)
    tx = r.layout.make_optimizer(t, schedule, r.spec, Packer(
        param_shardings, shd.BATCH_AXES if cfg.sharding.zero1 else ()))
    loss_scale = LossScale.create(cfg.precision.loss_scale_init,
                                  cfg.precision.loss_scale_growth_interval) \
        if r.policy.loss_scaling else None

    def create(params, fp8):
        if r.stacking is not None:
            params = Stacked.create(r.stacking, params)
        return TrainState.create(r.layout.flatten(tx, params), tx, cfg.seed, loss_scale, fp8)
    shardings = r.layout.state_shardings(jax.eval_shape(create, params, fp8), param_shardings,
                                         r.mesh, cfg.sharding.zero1)
    return tx, schedule, create, shardings


def _unpad_plan(r: Resolved, eval_data, train_data=None,
                train_steps: int = 0) -> Capacity | None:
    """The run's unpadding plan (``models.unpad``) over one pass of ``eval_data`` and the
    first ``train_steps`` batches of ``train_data`` (if any), or None: ``train.unpad`` off, a
    task without padded rows, gradient accumulation or a pipeline (micro-batches), or batches
    without padded rows to plan (``Batches.token_capacity`` None: packed LM rows)."""
    cfg = r.cfg
    if not (cfg.train.unpad and r.task.unpads and cfg.train.grad_accum == 1
            and r.stages is None):
        return None
    sources = [eval_data] + ([] if train_data is None else [train_data])
    groups = shd.batch_shards(r.mesh)
    capacities = [data.token_capacity(0, stop, groups)
                  for data, stop in zip(sources, (eval_data.steps_per_epoch, train_steps))]
    if any(c is None for c in capacities):
        return None
    largest = {}
    for capacity in capacities:
        for shape, most in capacity.items():
            largest[shape] = max(largest.get(shape, 0), most)
    return Capacity.of(groups, largest)


def assemble(r: Resolved, *, model=None, abstract: bool = False, data: bool = True) -> Run:
    """The ``Run`` of ``r``:

    * training (``r.training``): the model (``create_model``: a checkpoint's weights or random
      from the seed, then a run's weights where ``model.init_from`` names one; or ``model``),
      its tokenizer (``DataSpec.tokenizer``), both splits' batches, the layout's optimizer and
      the sharded train state; ``data=False``: no tokenizer and no batches (a benchmark feeding
      its own, ``bench/train_step.py``), the schedule over ``r.total_steps``;
    * evaluation only: ``model`` (e.g. a checkpoint's, ``inference.load_run``) and the eval
      split tokenized by the run's tokenizer (``resolve``'s ``tokenizer``: a trained run's;
      ``data=False``: no split; predict brings its texts); no optimizer state, and the
      training split is neither read nor tokenized;
    * ``abstract`` (``jaxaccel compile``): the training run's state as ShapeDtypeStructs with
      the trainer's shardings, and no data: what the jitted steps need to be compiled.
    """
    if abstract:
        # Outside the mesh: under one, nnx.eval_shape reads the logical axis names as mesh axes.
        shapes = build_abstract(lambda: create_model(r.cfg.model, r.policy, r.cfg.seed, r.spec))
        with jax.set_mesh(r.mesh):
            return _abstract(r, shapes)
    if r.training and model is None:
        model = _new_model(r)
    with jax.set_mesh(r.mesh):
        if not r.training:
            return _eval_only(r, model, data)
        return _training(r, model, data)


def _new_model(r: Resolved):
    """The model of a training run (``create_model``, then the weights of
    ``model.init_from``'s run where it names one), built by one process outside the run's mesh:
    under it every eager operation of the initialisation runs on each of the mesh's devices
    (replicated), 8 times the work on 8 devices of one CPU (1.5 s instead of 0.2 s for the tiny
    BERT). The processes of a multi-process run build it under the mesh, whose replicas they
    share: placing one process's arrays on the mesh would compare every parameter across the
    processes."""
    cfg = r.cfg
    with jax.set_mesh(r.mesh) if jax.process_count() > 1 else contextlib.nullcontext():
        model = create_model(cfg.model, r.policy, cfg.seed, r.spec)
        if cfg.model.init_from:
            init_from(model, cfg.model.init_from)
    return model


def build(cfg: Config, devices=None) -> Run:
    """The training run of ``cfg`` over ``devices`` (default all): ``assemble(resolve(...))``."""
    return assemble(resolve(cfg, devices))


def _abstract(r: Resolved, model) -> Run:
    graphdef, params, fp8, param_shardings = split_model(model, r.mesh)
    params = abstract_like(params, param_shardings)
    fp8 = abstract_like(fp8, jax.tree_util.tree_map(lambda _: shd.replicated(r.mesh), fp8)) \
        if r.policy.fp8 else None
    # A corpus's length in epochs is unknown before it is packed: one step's schedule.
    total = r.total_steps or 1
    tx, schedule, create, shardings = optimizer_state(r, params, fp8, param_shardings, total)
    state = abstract_like(jax.eval_shape(create, params, fp8), shardings)
    return Run(r, graphdef, state, shardings, tx=tx, schedule=schedule, total_steps=total)


def _training(r: Resolved, model, data: bool) -> Run:
    graphdef, params, fp8, param_shardings = split_model(model, r.mesh)
    fp8 = fp8 if r.policy.fp8 else None
    sources = run_data.batches(r) if data else {}
    total = r.total_steps if r.total_steps is not None else \
        r.length(sources["train_data"].steps_per_epoch)
    tx, schedule, create, shardings = optimizer_state(r, params, fp8, param_shardings, total)
    params = jax.device_put(params, param_shardings)
    state = jax.jit(create, out_shardings=shardings)(params, fp8)
    unpad = _unpad_plan(r, sources["eval_data"], sources["train_data"], total) if data \
        else None
    return Run(r, graphdef, state, shardings, **sources, tx=tx, schedule=schedule,
               total_steps=total, unpad=unpad)


def _eval_only(r: Resolved, model, data: bool) -> Run:
    graphdef, params, fp8, param_shardings = split_model(model, r.mesh)
    replicated = lambda tree: jax.tree_util.tree_map(lambda _: shd.replicated(r.mesh), tree)
    fp8 = fp8 if r.policy.fp8 else None
    if r.stacking is not None:
        params = jax.device_put(params, param_shardings)
        param_shardings = stacked_shardings(r.stacking, param_shardings)
        params = jax.jit(Stacked.create, static_argnums=0,
                         out_shardings=param_shardings)(r.stacking, params)
    shardings = TrainState(step=None, params=param_shardings, opt_state=None, rng=None,
                           fp8=replicated(fp8))
    state = jax.device_put(TrainState(step=None, params=params, opt_state=None, rng=None,
                                      fp8=fp8), shardings)
    if not data:
        return Run(r, graphdef, state, shardings)
    tokenizer = run_data.tokenizer_of(r.data, r.spec.architecture, light=True) \
        if r.data.tokenized else None
    eval_data, label_names = splits.eval_batches(r.data, tokenizer, shd.batch_share(r.mesh),
                                                 r.data.label_names)
    return Run(r, graphdef, state, shardings, eval_data, tokenizer, label_names,
               unpad=_unpad_plan(r, eval_data))


__all__ = ["Resolved", "Run", "assemble", "build", "optimizer_state", "resolve", "split_model"]
