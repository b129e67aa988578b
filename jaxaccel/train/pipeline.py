"""Pipeline parallelism: a model's layers split into stages over the mesh's ``stage`` axis and
run on micro-batches by a GPipe schedule, or the circular (interleaved) one when each stage
holds several layer groups (MaxText's ``layers/pipeline.py``: ``jax.vmap`` over the stage
dimension with ``spmd_axis_name="stage"``, activations passed on by a shift along it, which
XLA compiles to a collective permute).

Placement (``Stages``): ``L`` layers, ``S`` stages, ``R`` repeats (``model.pipeline_repeats``),
groups of ``G = ceil(L / (S R))`` consecutive layers; stage ``s`` holds groups ``r S + s`` for
``r < R``, i.e. layer ``l = (r S + s) G + j``. The parameters of the layers are stacked
[S, R, G, ...] and split over ``stage`` on the first dimension (``StagedParams``); the rest of
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

A checkpoint holds the per-layer form (``StagedParams.portable``): a pipelined run resumes
unpipelined, on any stage count, and the reverse.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxaccel import sharding as shd
from jaxaccel.models.stack import layer_rngs
from jaxaccel.optim.flat import FlatNode
from kernels_pallas import registry

LAYERS = "layers"


@dataclasses.dataclass(frozen=True)
class Stages:
    """A pipeline's shape: ``stages`` (S, the mesh's ``stage`` size), ``repeats`` (R),
    ``microbatches`` (M) and the model's ``layers`` (L)."""

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
    def padding(self) -> int:
        """Padding layers after the model's last (S R G - L; 0 where S R divides L)."""
        return self.stages * self.repeats * self.group - self.layers

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

    def as_dict(self) -> dict:
        return {"stages": self.stages, "repeats": self.repeats,
                "microbatches": self.microbatches, "layers_per_group": self.group,
                "padding_layers": self.padding, "bubble": self.bubble, "idle": self.idle,
                "gather_once": self.gather_once}


def of(cfg, num_layers: int) -> Stages | None:
    """The pipeline of a config (``mesh.stage`` > 1), checked against the model's
    ``num_layers``; None without one. ``train.microbatches`` 0 is one per stage."""
    s = int(cfg.mesh.get("stage", 1))
    if s <= 1:
        return None
    m = cfg.train.microbatches or s
    stages = Stages(s, int(cfg.model.pipeline_repeats), int(m), int(num_layers),
                    bool(cfg.sharding.get("pipeline_gather_once", False)))
    stages.check()
    return stages


def _places(stages: Stages):
    """(stage, repeat, position) of every place of the [S, R, G] stack, in its order."""
    return [(i, k, j) for i in range(stages.stages) for k in range(stages.repeats)
            for j in range(stages.group)]


def _stack(stages: Stages, layers: dict, pad=None):
    """Per-layer trees ``{l: tree}`` -> one tree of [S, R, G, ...] arrays, ``pad`` (default
    zeros) where a place holds a padding layer."""
    s, r, g = stages.stages, stages.repeats, stages.group
    if stages.padding and pad is None:
        pad = jax.tree_util.tree_map(jnp.zeros_like, layers[0])
    order = [layers.get(stages.layer(*place), pad) for place in _places(stages)]
    return jax.tree_util.tree_map(
        lambda *xs: jnp.stack(xs).reshape(s, r, g, *xs[0].shape), *order)


def _unstack(stages: Stages, stacked) -> dict:
    """Inverse of ``_stack`` (the padding layers dropped)."""
    return {stages.layer(*place): jax.tree_util.tree_map(lambda a: a[place], stacked)
            for place in _places(stages) if stages.layer(*place) < stages.layers}


@dataclasses.dataclass(frozen=True, eq=False)
class StagedParams(FlatNode):
    """A model's parameters with its layers stacked by stage: ``layers`` one layer's tree of
    [S, R, G, ...] arrays (split over ``stage``), ``rest`` every other parameter, as in the
    model's tree; ``layout`` the ``Stages``. Optimizer moments of these parameters are
    ``StagedParams`` too (optax maps over the pytree), and both convert to the per-layer form
    checkpoints hold (``portable``, ``jaxaccel.optim.flat``)."""

    layers: dict
    rest: dict
    layout: Stages | None = None

    @classmethod
    def create(cls, stages: Stages, params: dict, pad=None) -> "StagedParams":
        """``params`` (the model's tree) staged; ``pad`` one layer's tree for the padding
        layers' places (default zeros)."""
        rest = {k: v for k, v in params.items() if k != LAYERS}
        return cls(_stack(stages, params[LAYERS], pad), rest, stages)

    def unstaged(self) -> dict:
        """The model's parameter tree (``layers[l]`` per layer)."""
        return {**self.rest, LAYERS: _unstack(self.layout, self.layers)}

    def portable(self):
        return _unstaged(self)

    def from_portable(self, saved):
        """``saved`` staged, placed as this node's arrays are (where they are placed)."""
        placed = [getattr(a, "sharding", None) for a in jax.tree_util.tree_leaves(self)]
        if None in placed:
            return _staged(self.layout, saved)
        shardings = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(self), placed)
        return jax.jit(StagedParams.create, static_argnums=0,
                       out_shardings=shardings)(self.layout, saved)

    def portable_shardings(self, shardings):
        one = jax.tree_util.tree_map(
            lambda s: NamedSharding(s.mesh, P(*tuple(s.spec)[3:])), shardings.layers)
        return {**shardings.rest, LAYERS: {l: one for l in range(self.layout.layers)}}


jax.tree_util.register_dataclass(StagedParams, data_fields=["layers", "rest"],
                                 meta_fields=["layout"])


@jax.jit
def _unstaged(params: StagedParams) -> dict:
    return params.unstaged()


@functools.partial(jax.jit, static_argnums=0)
def _staged(stages: Stages, params: dict) -> StagedParams:
    return StagedParams.create(stages, params)


def staged_shardings(stages: Stages, shardings: dict) -> StagedParams:
    """The shardings of ``StagedParams.create(stages, params)`` given the per-layer
    ``shardings`` of ``params``: a layer's placement with [S, R, G] in front, S over
    ``stage``."""
    def stacked(s):
        return NamedSharding(s.mesh, P("stage", None, None, *tuple(s.spec)))
    layers = jax.tree_util.tree_map(stacked, shardings[LAYERS][0])
    return StagedParams(layers, {k: v for k, v in shardings.items() if k != LAYERS}, stages)


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


def stack(params: StagedParams, layer_graphdef, layer_call, *, remat: bool = False,
          fp8: StagedParams | None = None, specs=None):
    """The layers' ``stack(x, args, key, deterministic)`` (``models.stack``) of the staged
    ``params``: the schedule of this module's docstring. ``layer_graphdef`` is one layer's,
    ``layer_call`` the family's; ``remat`` rematerialises each layer in the backward pass;
    ``fp8`` the layers' staged fp8 state (None without the fp8 policy); ``specs`` one layer's
    mesh-axis specs (``Stages.gather_once``)."""
    st = params.layout
    s_, m_, g_ = st.stages, st.microbatches, st.group

    def one_layer(p, f, x, args, rows, key, index, deterministic):
        layer = nnx.merge(layer_graphdef, p, *(() if f is None else (f,)))
        return layer_call(layer, x, args, deterministic, layer_rngs(key, index), rows)

    def run(x, args, key, deterministic):
        if x.shape[0] % m_:
            raise ValueError(f"a batch of {x.shape[0]} rows does not split into "
                             f"train.microbatches={m_} micro-batches.")
        layer_fn = jax.checkpoint(one_layer, static_argnums=(7,)) if remat else one_layer
        # XLA:CPU's runtime can run a loop's collectives and independent ones outside it in
        # different orders on different devices (a rendezvous deadlock, seen with the stage
        # permute against the loss denominator's all-reduce): on the CPU the loops are
        # unrolled, so every collective is in the program's one ordered sequence.
        unroll = registry.platform(x) == "cpu"
        xs = _placed(_micro(x, m_), None)
        args_m = jax.tree_util.tree_map(lambda a: _micro(a, m_), args)
        rows_m = _micro(jnp.arange(x.shape[0], dtype=jnp.int32), m_)
        stage_ids = jnp.arange(s_)
        layers, split = (_gathered(params.layers, specs) if st.gather_once
                         else (params.layers, None))
        fp8_m = None if fp8 is None else _spread(fp8.layers, m_)

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
            rows = rows_m[micro]
            first = (repeat * s_ + stage) * g_

            def body(h, pj):
                p_j, f_j, j = pj
                out = layer_fn(p_j, f_j, h, a, rows, key, first + j, deterministic)
                if st.padding:      # a padding layer passes its input through
                    out = jnp.where(first + j < st.layers, out, h)
                return out, None
            h, _ = jax.lax.scan(body, h, (p, f, jnp.arange(g_)), unroll=unroll)
            return h

        staged = jax.vmap(stage_fn, in_axes=(0, 0, 0, 0, None), spmd_axis_name="stage")

        # The buffer turns one micro-batch per step (queue[i] is micro-batch (t + i) % M at
        # step t): stage 0 reads place 0 and the last stage's output of micro-batch
        # t - (S - 1) goes to place (1 - S) % M, fixed places, so the loop slices the buffer
        # statically (a slice at t % M made XLA gather the whole buffer over the batch axes
        # at every step).
        write = (1 - s_) % m_

        def tick(carry, t):
            state, queue = carry
            state = state.at[0].set(queue[0])
            out = staged(layers, fp8_m, state, stage_ids, t)
            k = t - (s_ - 1)
            done = (k >= 0) & (k < st.repeats * m_)
            queue = queue.at[write].set(jnp.where(done, out[s_ - 1], queue[write]))
            return (_placed(jnp.roll(out, 1, axis=0), "stage"),
                    _placed(jnp.roll(queue, -1, axis=0), None)), None

        state = _placed(jnp.zeros((s_, *xs.shape[1:]), xs.dtype), "stage")
        (_, queue), _ = jax.lax.scan(tick, (state, xs), jnp.arange(st.iterations),
                                     unroll=unroll)
        return _unmicro(jnp.roll(queue, st.iterations % m_, axis=0))

    return run


def forward_model(graphdef, params: StagedParams, fp8: dict | None = None):
    """``(model, stack)``: the model of ``graphdef`` with ``params.rest`` (its layers hold
    placeholders the stack never reads) and the pipelined stack over ``params.layers`` to
    call it with (``model(..., stack=stack)``); ``fp8`` the model's fp8 state (per layer, as
    the train state holds it), staged here."""
    stages = params.layout
    if fp8 is not None:
        # A padding layer's scales are a real layer's (zero scales would quantize to NaN,
        # which its zero cotangent does not cancel), and give that layer no gradient.
        fp8 = StagedParams.create(stages, fp8, jax.lax.stop_gradient(fp8[LAYERS][0]))

    def placeholders(staged):
        first = jax.tree_util.tree_map(lambda a: a[0, 0, 0], staged.layers)
        return {**staged.rest, LAYERS: {l: first for l in range(stages.layers)}}
    model = nnx.merge(graphdef, *(placeholders(t) for t in (params, fp8) if t is not None))
    layer = model.layers[0]
    specs, mesh = None, shd.current_mesh(params.layers)
    if stages.gather_once and mesh is not None:
        weights = nnx.state(layer, nnx.Param)
        placed = shd.tree_shardings(mesh, nnx.to_pure_dict(nnx.get_partition_spec(weights)),
                                    nnx.to_pure_dict(weights))
        specs = jax.tree_util.tree_map(lambda s: s.spec, placed)
    return model, stack(params, nnx.graphdef(layer), type(model).layer_call,
                        remat=model.spec.remat, fp8=fp8, specs=specs)


__all__ = ["StagedParams", "Stages", "forward_model", "of", "stack", "staged_shardings"]
