"""Pipeline parallelism: a model's layers split into stages over the mesh's ``stage`` axis and
run on micro-batches by a GPipe schedule, or the circular (interleaved) one when each stage
holds several layer groups (MaxText's ``layers/pipeline.py``: ``jax.vmap`` over the stage
dimension with ``spmd_axis_name="stage"``, activations passed on by a shift along it, which
XLA compiles to a collective permute).

Placement (``Stages``): ``L`` layers, ``S`` stages, ``R`` repeats (``model.pipeline_repeats``),
groups of ``G = ceil(L / (S R))`` consecutive layers; stage ``s`` holds groups ``r S + s`` for
``r < R``, i.e. layer ``l = (r S + s) G + j``. The parameters of the layers are stacked
[S, R, G, ...] and split over ``stage`` on the first dimension (``Stages`` is the
``forms.stacked.Stacking`` of the parameters' ``Stacked`` form); the rest of
the model (embeddings, head) is placed as without a pipeline and runs on the whole batch. Where
``S R`` does not divide ``L``, the last ``S R G - L`` places hold padding layers: zero
parameters that pass their input through (their output is not selected), never checkpointed,
whose gradient and update are zero; they cost a layer's compute each (``Stages.idle``).

Schedule: the batch's hidden states are cut into ``M`` strided micro-batches (rows ``m, m + M,
...``, as gradient accumulation cuts them: every device's block of the batch holds rows of
each), and for ``t`` in ``0 .. R M + S - 2`` every stage ``s`` runs its group of repeat
``(t - s) // M`` on micro-batch ``(t - s) % M`` at once (idle where ``t - s`` is outside
``[0, R M)``: the bubble, ``(S - 1) / (R M + S - 1)`` of the iterations), then its output moves
to stage ``s + 1``. Stage 0 reads micro-batch ``t % M`` from a buffer: the embeddings for the
first repeat, the last stage's output of the repeat before for the next (``M >= S`` makes it
ready in time). The last stage's outputs of the last repeat are the stack's output.

Every micro-batch row draws its dropout masks by its number in the whole batch and every layer
its own stream (``models.stack``), so a pipelined step is the plain step, dropout included
(tests: loss and gradients equal). Differentiating the scan gives the backward pipeline.

fp8 (``models.fp8``): the layers' delayed-scaling state is staged like their parameters and
each use of a layer reads its own copy, one per micro-batch (``_spread``); a use's "gradient"
is the state's new value (its amax history rolled, this use's amax newest) and the copies'
are combined by their maximum, not added: the amax of the whole batch, so the state comes out
as the plain step's. A bubble's use (an idle stage's, on data no micro-batch needs) reads its
copy without a gradient and leaves no trace.

With FSDP the stacked layers are split over ``fsdp`` too, and XLA gathers a group's weights at
each schedule step that uses them; ``sharding.pipeline_gather_once`` gathers them once before
the schedule instead (``_gathered``), holding the stage's weights whole, and reduce-scatters
each use's weight gradient where it arises (``_split_cotangent``).

A checkpoint holds the per-layer form (``forms.portable``): a pipelined run resumes
unpipelined, on any stage count, and the reverse.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxaccel import config as config_lib
from jaxaccel import sharding as shd
from jaxaccel.forms.stacked import Stacking
from jaxaccel.models.family import FamilyModel
from jaxaccel.models.stack import layer_fn, scan_layers
from kernels_pallas import registry

log = logging.getLogger("jaxaccel")


@dataclasses.dataclass(frozen=True)
class Stages(Stacking):
    """A pipeline's shape: ``stages`` (S, the mesh's ``stage`` size), ``repeats`` (R),
    ``microbatches`` (M) and the model's ``layers`` (L); as a ``Stacking``, the layers
    stacked [S, R, G] with S over the mesh's ``stage`` axis."""

    stages: int
    repeats: int
    microbatches: int
    layers: int
    gather_once: bool = False

    @property
    def group(self) -> int:
        """Layers per group (G = ceil(L / (S R)))."""
        return -(-self.layers // (self.stages * self.repeats))

    @property
    def shape(self) -> tuple:
        return (self.stages, self.repeats, self.group)

    @property
    def lead(self) -> tuple:
        return ("stage", None, None)

    @property
    def iterations(self) -> int:
        """Schedule steps per pass: R M + S - 1."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """The idle fraction of a stage's schedule steps: (S - 1) / (R M + S - 1)."""
        return (self.stages - 1) / self.iterations

    @property
    def idle(self) -> float:
        """The share of the layer computations the schedule runs that do no model work: the
        bubble's and the padding layers', 1 - L M / (S G (R M + S - 1)) (the bubble where
        S R divides L)."""
        return 1.0 - self.layers * self.microbatches / (
            self.stages * self.group * self.iterations)

    def layer(self, stage: int, repeat: int, j: int) -> int:
        """The model layer at position ``j`` of stage ``stage``'s group of ``repeat``."""
        return (repeat * self.stages + stage) * self.group + j

    def check(self) -> None:
        """``ValueError`` naming the numbers when some group would hold only padding or too
        few micro-batches keep the stages fed."""
        s, r, m, n = self.stages, self.repeats, self.microbatches, self.layers
        if self.padding >= self.group:
            raise ValueError(f"the model's {n} layers do not fill mesh.stage={s} stages x "
                             f"model.pipeline_repeats={r} groups of {self.group}: a group would "
                             f"hold only padding layers; use fewer stages or repeats.")
        if m < s:
            raise ValueError(f"train.microbatches={m} is fewer than mesh.stage={s}: a stage "
                             f"would wait for its own output; use at least {s} micro-batches "
                             f"(more shrink the bubble (S-1)/(R*M+S-1)).")

    def stack(self, model: FamilyModel, layers, fp8):
        layer = model.layers[0]
        fn = layer_fn(nnx.graphdef(layer), type(model).layer_call, model.spec.remat)
        return stack(self, layers, fp8, fn,
                     _layer_specs(layer, layers) if self.gather_once else None)

    def as_dict(self) -> dict:
        return {"stages": self.stages, "repeats": self.repeats,
                "microbatches": self.microbatches, "layers_per_group": self.group,
                "padding_layers": self.padding, "bubble": self.bubble, "idle": self.idle,
                "gather_once": self.gather_once}


def of(cfg, num_layers: int) -> Stages | None:
    """The pipeline of a config (``mesh.stage`` > 1), checked against the model's
    ``num_layers`` and the batch sizes its micro-batches split; None without one (pipeline
    settings given then are warned of). ``train.microbatches`` 0 is one per stage."""
    s = int(cfg.mesh.get("stage", 1))
    if s <= 1:
        _warn_ignored_keys(cfg)
        return None
    t = cfg.train
    m = t.microbatches or s
    stages = Stages(s, int(cfg.model.pipeline_repeats), int(m), int(num_layers),
                    bool(cfg.sharding.get("pipeline_gather_once", False)))
    stages.check()
    accum = f" / train.grad_accum={t.grad_accum}" if t.grad_accum > 1 else ""
    micro = f"train.microbatches={m}" if t.microbatches else \
        f"{m} (train.microbatches=0: one per stage of mesh.stage={s})"
    sizes = {(f"train.batch_size={t.batch_size}{accum}", "a train step"):
             t.batch_size // t.grad_accum,
             (f"train.eval_batch_size={t.eval_batch_size}", "an eval step"): t.eval_batch_size}
    for (keys, step), size in sizes.items():
        if size % m:
            raise ValueError(f"{keys}: {step} of {size} rows does not split into {micro} "
                             f"micro-batches; use a multiple of {m} rows, or a number of "
                             f"micro-batches that divides {size}.")
    return stages


def _warn_ignored_keys(cfg) -> None:
    """Warn of pipeline settings given to a run without a pipeline (``mesh.stage`` 1)."""
    keys = ("train.microbatches", "model.pipeline_repeats", "sharding.pipeline_gather_once")
    given = {}
    for key in keys:
        section, name = key.split(".")
        if cfg[section].get(name) != config_lib.BASE[section].get(name):
            given[key] = cfg[section][name]
    if given:
        log.warning("%s: pipeline settings, ignored with mesh.stage=%d (no pipeline); set "
                    "mesh.stage > 1 to pipeline, or drop them.",
                    ", ".join(f"{k}={v}" for k, v in given.items()), cfg.mesh.get("stage", 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _spread(tree, m: int):
    """``tree``'s [S, R, ...] leaves as [S, R, M, ...]: a copy per micro-batch, whose
    cotangents the transpose combines by their maximum (fp8's new states: one use each)."""
    return jax.tree_util.tree_map(
        lambda a: jnp.broadcast_to(a[:, :, None], (*a.shape[:2], m, *a.shape[2:])), tree)


def _spread_fwd(tree, m):
    return _spread(tree, m), None


def _spread_bwd(m, _, cotangents):
    return (jax.tree_util.tree_map(lambda c: c.max(axis=2), cotangents),)


_spread.defvjp(_spread_fwd, _spread_bwd)


def _micro(a, m: int):
    """[B, ...] -> [M, B / M, ...], micro-batch ``i`` the rows i, i + M, ..."""
    return a.reshape(a.shape[0] // m, m, *a.shape[1:]).swapaxes(0, 1)


def _unmicro(a):
    return a.swapaxes(0, 1).reshape(-1, *a.shape[2:])


def _placed(x, lead):
    """[lead, rows, ...] activations constrained to ``lead`` (a mesh axis or None) on the
    first dimension and the rows over the batch axes (unchanged without a mesh)."""
    mesh = shd.current_mesh(x)
    if mesh is None:
        return x
    spec = P(shd.drop_trivial(lead, mesh), shd.drop_trivial(shd.BATCH_AXES, mesh),
             *[P.UNCONSTRAINED] * (x.ndim - 2))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _gathered(layers, specs):
    """``(layers, split)`` for ``Stages.gather_once``: the stacked ``layers`` placed whole over
    ``fsdp`` (one all-gather per leaf before the schedule; ``specs`` one layer's mesh-axis
    specs), and the placement of one use's [G, ...] slice split over ``fsdp`` again, which
    ``_split_cotangent`` gives each use's weight gradient: reduce-scattered where it arises and
    summed split, so the gather's transpose moves nothing. Without it XLA gathers a group's
    weights at each schedule step that uses them, forward and backward; with the gather alone
    it all-reduces each use's gradient. ``(layers, None)`` without an ``fsdp`` axis."""
    mesh = shd.current_mesh(layers)
    if specs is None or mesh is None or mesh.shape.get("fsdp", 1) == 1:
        return layers, None

    def whole(e):
        if isinstance(e, tuple):
            return tuple(a for a in e if a != "fsdp") or None
        return None if e == "fsdp" else e
    gathered = jax.tree_util.tree_map(
        lambda a, spec: jax.lax.with_sharding_constraint(
            a, NamedSharding(mesh, P("stage", None, None, *map(whole, spec)))),
        layers, specs)
    split = jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, P(None, *spec)), specs,
                                   is_leaf=lambda x: isinstance(x, P))
    return gathered, split


def _split_cotangent(tree, shardings):
    """``tree`` itself, whose cotangent is placed as ``shardings`` say."""
    @jax.custom_vjp
    def place(t):
        return t

    def bwd(_, cotangent):
        return (jax.tree_util.tree_map(jax.lax.with_sharding_constraint, cotangent, shardings),)
    place.defvjp(lambda t: (t, None), bwd)
    return place(tree)


def _layer_specs(layer, layers):
    """One layer's mesh-axis specs (``Stages.gather_once``), None without a mesh."""
    mesh = shd.current_mesh(layers)
    if mesh is None:
        return None
    weights = nnx.state(layer, nnx.Param)
    placed = shd.tree_shardings(mesh, nnx.to_pure_dict(nnx.get_partition_spec(weights)),
                                nnx.to_pure_dict(weights))
    return jax.tree_util.tree_map(lambda s: s.spec, placed)


def stack(st: Stages, layers, fp8, layer_fn, specs=None):
    """The layers' ``stack(x, args, key, deterministic)`` (``models.stack``) of the stacked
    ``layers`` [S, R, G, ...]: the schedule of this module's docstring. ``fp8`` the layers'
    stacked fp8 state (None without the fp8 policy); ``layer_fn`` runs one layer
    (``models.stack.layer_fn``); ``specs`` one layer's mesh-axis specs
    (``Stages.gather_once``)."""
    s_, m_ = st.stages, st.microbatches

    def run(x, args, key, deterministic):
        if x.shape[0] % m_:
            raise ValueError(f"a batch of {x.shape[0]} rows does not split into "
                             f"train.microbatches={m_} micro-batches.")
        # XLA:CPU's runtime can run a loop's collectives and independent ones outside it in
        # different orders on different devices (a rendezvous deadlock, seen with the stage
        # permute against the loss denominator's all-reduce): on the CPU the loops are
        # unrolled, so every collective is in the program's one ordered sequence.
        unroll = registry.platform(x) == "cpu"
        args_m = jax.tree_util.tree_map(lambda a: _micro(a, m_), args)
        rows_m = _micro(jnp.arange(x.shape[0], dtype=jnp.int32), m_)
        stacked, split = _gathered(layers, specs) if st.gather_once else (layers, None)
        fp8_m = None if fp8 is None else _spread(fp8, m_)

        def stage_fn(group_params, group_fp8, h, stage, t):
            k = t - stage
            micro, repeat = k % m_, jnp.clip(k // m_, 0, st.repeats - 1)
            p = jax.tree_util.tree_map(lambda a: a[repeat], group_params)
            if split is not None:
                p = _split_cotangent(p, split)
            busy = (k >= 0) & (k < st.repeats * m_)
            f = jax.tree_util.tree_map(      # micro's copy; none of a bubble's state comes back
                lambda a: jnp.where(busy, a[repeat, micro], jax.lax.stop_gradient(
                    a[repeat, micro])), group_fp8)
            a = jax.tree_util.tree_map(lambda v: v[micro], args_m)
            return scan_layers(layer_fn, h, p, f, a, rows_m[micro], key,
                               (repeat * s_ + stage) * st.group, deterministic,
                               count=st.layers if st.padding else None, unroll=unroll)

        staged = jax.vmap(stage_fn, in_axes=(0, 0, 0, 0, None), spmd_axis_name="stage")
        return _schedule(st, functools.partial(staged, stacked, fp8_m),
                         _placed(_micro(x, m_), None), unroll)

    return run


def _schedule(st: Stages, staged, xs, unroll: bool):
    """The last stage's outputs of the last repeat, [B, ...], of the micro-batches ``xs``
    [M, B / M, ...] through ``staged(hidden [S, ...], stage ids [S], step) -> [S, ...]``.

    The buffer turns one micro-batch per step (queue[i] is micro-batch (t + i) % M at step
    t): stage 0 reads place 0 and the last stage's output of micro-batch t - (S - 1) goes to
    place (1 - S) % M, fixed places, so the loop slices the buffer statically (a slice at
    t % M made XLA gather the whole buffer over the batch axes at every step)."""
    s_, m_ = st.stages, st.microbatches
    write, stage_ids = (1 - s_) % m_, jnp.arange(s_)

    def tick(carry, t):
        state, queue = carry
        state = state.at[0].set(queue[0])
        out = staged(state, stage_ids, t)
        k = t - (s_ - 1)
        done = (k >= 0) & (k < st.repeats * m_)
        queue = queue.at[write].set(jnp.where(done, out[s_ - 1], queue[write]))
        return (_placed(jnp.roll(out, 1, axis=0), "stage"),
                _placed(jnp.roll(queue, -1, axis=0), None)), None

    state = _placed(jnp.zeros((s_, *xs.shape[1:]), xs.dtype), "stage")
    (_, queue), _ = jax.lax.scan(tick, (state, xs), jnp.arange(st.iterations), unroll=unroll)
    return _unmicro(jnp.roll(queue, st.iterations % m_, axis=0))


__all__ = ["Stages", "of", "stack"]
