"""Device mesh from config and the logical-axis rules that place parameters and batches on it.

Models name the axes of every parameter logically (``vocab``, ``embed``, ``heads``,
``kv_heads``, ``kv``, ``mlp``, and ``stage`` for a pipeline's stacked layers); this module
alone knows the mesh axes (``stage``, ``data``, ``fsdp``, ``tensor``). One rules table maps the
first to the second, MaxText-style:

* data parallel: batch split over ``data``; params replicated.
* FSDP / ZeRO-3: ``embed`` dimension of every weight split over ``fsdp``; batch split over
  ``data`` x ``fsdp``.
* Megatron tensor parallel: ``heads``, ``kv_heads`` and ``mlp`` (attention QKV/out, MLP in/out)
  and ``vocab`` split over ``tensor``: column-parallel in, row-parallel out.
* pipeline: the layers split into groups over ``stage`` (outermost: the slowest links carry
  only the stage-to-stage activations); ``jaxaccel.train.pipeline``.

Across TPU slices (MaxText's ``dcn_*_parallelism``): ``mesh.dcn_data`` / ``mesh.dcn_fsdp`` of
the ``data`` / ``fsdp`` axis's ways run between slices, over the data-center network (DCN), the
rest within a slice over ICI (``jax.experimental.mesh_utils.create_hybrid_device_mesh``).

``residual`` places a model's residual stream: its batch over the batch axes and, under tensor
parallelism, its width over ``tensor`` (the ``activation_embed`` rule).

``constrain`` puts an array in its logical spec's layout on its mesh (a weight made whole
before a loop, so it is gathered once).

``per_shard`` runs a function on each device's shards (``shard_map``): the one way both Pallas
kernels (flash attention, the fused Adan on its flat layout) run on sharded operands. It finds
the mesh itself (the ambient ``jax.set_mesh``, else the mesh the arguments are placed on), so a
caller that forgets ``set_mesh`` does not make XLA gather whole operands onto every device.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("stage", "data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
DCN_AXES = ("data", "fsdp")         # the axes that may span slices: mesh.dcn_data, mesh.dcn_fsdp

# logical axis -> mesh axis (or tuple of mesh axes, or None for replicated)
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),         # a decoder's key/value heads (grouped-query attention)
    ("kv", None),
    ("mlp", "tensor"),
    ("activation_embed", "tensor"),  # the residual stream's width between layers (``residual``)
    ("stage", "stage"),             # a pipeline's stacked layers [stage, repeat, group, ...]
)


def mesh_shape(sizes: dict[str, int], num_devices: int) -> tuple[int, ...]:
    """Resolve -1 in ``{"data": -1, "fsdp": 1, "tensor": 1, "stage": 1}`` (absent axes: 1)
    and check the product."""
    unknown = [a for a in sizes if a not in MESH_AXES and a.removeprefix("dcn_") not in DCN_AXES]
    if unknown:
        raise ValueError(f"mesh axes {unknown} are unknown; the mesh axes are {MESH_AXES} "
                         f"(and {tuple('dcn_' + a for a in DCN_AXES)}: their ways over DCN).")
    shape = [int(sizes.get(a, 1)) for a in MESH_AXES]
    fixed = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % fixed:
            raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))}: the fixed axes multiply to "
                             f"{fixed}, which does not divide the {num_devices} devices.")
        shape[shape.index(-1)] = num_devices // fixed
    if math.prod(shape) != num_devices:
        raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))} has {math.prod(shape)} devices "
                         f"but {num_devices} are available; make the sizes multiply to "
                         f"{num_devices} (or use -1 for one axis).")
    return tuple(shape)


def default_devices() -> list[jax.Device]:
    """All devices of all processes on the platform arrays go to by default: the default
    backend's, unless ``jax.default_device`` names a device or platform (e.g. the CPU on a
    GPU machine)."""
    default = jax.config.jax_default_device
    if default is None:
        return jax.devices()
    return jax.devices(default if isinstance(default, str) else default.platform)


def make_mesh(sizes: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ('stage', 'data', 'fsdp', 'tensor') mesh over ``devices`` (default: all devices of
    all processes, of the default device's platform: the default backend's, or the one
    ``jax.default_device`` names). Over devices of several TPU slices (``slice_index``), a
    hybrid mesh: ``sizes["dcn_data"]`` / ``["dcn_fsdp"]`` of those axes' ways between slices
    (``dcn_shape``), each slice's devices adjacent along the rest."""
    devices = list(default_devices() if devices is None else devices)
    shape = mesh_shape(sizes, len(devices))
    dcn = dcn_shape(sizes, shape, devices)
    from jax.experimental import mesh_utils
    if math.prod(dcn) > 1:
        ici = tuple(s // d for s, d in zip(shape, dcn))
        granule = {"process_is_granule": not hasattr(devices[0], "slice_index")}
        try:
            grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, **granule)
        except (ValueError, NotImplementedError, AssertionError):
            grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, **granule,
                                                        allow_split_physical_axes=True)
    else:
        try:
            grid = mesh_utils.create_device_mesh(shape, devices)
        except (ValueError, NotImplementedError, AssertionError):
            grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def slices_of(devices: Sequence[jax.Device]) -> int:
    """How many TPU slices ``devices`` span (their distinct ``slice_index``; 1 without)."""
    return len({getattr(d, "slice_index", 0) for d in devices})


def dcn_shape(sizes: dict[str, int], shape: Sequence[int],
              devices: Sequence[jax.Device]) -> tuple[int, ...]:
    """Each mesh axis's ways between slices (``sizes["dcn_data"]``, ``["dcn_fsdp"]``; 1 for the
    others), checked against the axes' sizes (``shape``) and the slices ``devices`` span: their
    product is the slice count. Devices without slices (CPU, GPU) take DCN axes between their
    processes (hosts)."""
    dcn = tuple(int(sizes.get(f"dcn_{a}", 1)) if a in DCN_AXES else 1 for a in MESH_AXES)
    for axis, size, ways in zip(MESH_AXES, shape, dcn):
        if ways < 1 or size % ways:
            raise ValueError(f"mesh.dcn_{axis}={ways} must be >= 1 and divide mesh.{axis}="
                             f"{size} (its ways between slices, of the axis's {size}).")
    wanted, sliced = math.prod(dcn), hasattr(devices[0], "slice_index")
    granules = slices_of(devices) if sliced or wanted == 1 else \
        len({d.process_index for d in devices})
    if wanted != granules:
        what = "TPU slices" if sliced else "processes (devices without TPU slices)"
        raise ValueError(
            f"the {len(devices)} devices span {granules} {what}, but mesh.dcn_data x "
            f"mesh.dcn_fsdp = {wanted}: make the ways over DCN multiply to {granules}, e.g. "
            f"mesh.dcn_data={granules} (data parallel between slices).")
    return dcn


def check_model_fits(config, mesh: Mesh) -> None:
    """Tensor parallelism splits whole (query and key/value) heads and the MLP hidden size:
    they must divide."""
    t = mesh.shape["tensor"]
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name, None)
        if value is not None and value % t:
            raise ValueError(f"mesh.tensor={t} does not divide the model's {name}={value}; "
                             f"use a tensor size that divides {value}.")


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes one PartitionSpec entry names (None, an axis or a tuple of axes)."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def logical_to_mesh(spec: Sequence[str | None] | None, rules=DEFAULT_RULES) -> P:
    """Map a logical PartitionSpec (tuple of logical names) to a mesh PartitionSpec."""
    table = dict(rules)
    if spec is None:
        return P()
    used, out = set(), []
    for name in spec:
        # one mesh axis at most once per array
        axes = tuple(a for a in entry_axes(table.get(name)) if a not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def _fits(shape, spec: P, mesh: Mesh) -> P:
    """Drop mesh axes from dimensions they do not divide (e.g. a 2-label classifier)."""
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = entry_axes(axes)
        size = math.prod(mesh.shape[a] for a in names)
        out.append(axes if size == 1 or dim % size == 0 else None)
    return P(*out)


def mesh_spec(shape, logical_spec: Sequence[str | None] | None, mesh: Mesh,
              rules=DEFAULT_RULES) -> P:
    """The mesh PartitionSpec of an array of ``shape`` with ``logical_spec`` on ``mesh``: the
    rules' axes, those that do not divide a dimension dropped (``tree_shardings``' and
    ``constrain``'s layout)."""
    return _fits(shape, logical_to_mesh(logical_spec, rules), mesh)


def tree_shardings(mesh: Mesh, logical_specs, shapes, rules=DEFAULT_RULES):
    """NamedShardings for a pytree given its logical specs (tuples of names) and shapes."""
    def one(spec, x):
        return NamedSharding(mesh, mesh_spec(x.shape, spec, mesh, rules))
    return jax.tree_util.tree_map(one, logical_specs, shapes,
                                  is_leaf=lambda s: s is None or isinstance(s, (tuple, P)))


def constrain(x, logical_spec: Sequence[str | None], rules=DEFAULT_RULES):
    """``x`` constrained to the mesh layout of its logical spec (``tree_shardings``' mapping:
    mesh axes that do not divide a dimension dropped) on its mesh (``current_mesh``);
    unchanged without one. A dimension the spec leaves None is whole on every device: a
    weight FSDP splits, constrained so before a loop that uses it, is gathered once."""
    mesh = current_mesh(x)
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, mesh_spec(x.shape, logical_spec, mesh, rules)))


def batch_sharding(mesh: Mesh, rules=DEFAULT_RULES) -> NamedSharding:
    """Sharding of [batch, ...] arrays: the batch dimension over the batch axes."""
    return NamedSharding(mesh, logical_to_mesh(("batch",), rules))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def opt_state_shardings(opt_state_shapes, param_shardings, mesh: Mesh):
    """Shardings for an optimizer state: a leaf whose key path ends with a parameter's path and
    has its shape takes that parameter's sharding (optax's per-parameter moments); anything
    else (counters, flat multi-tensor buffers) is replicated."""
    by_path = {}
    for path, s in jax.tree_util.tree_flatten_with_path(param_shardings)[0]:
        by_path[tuple(map(str, path))] = s

    def one(path, leaf):
        keys = tuple(map(str, path))
        for n in range(len(keys), 0, -1):
            s = by_path.get(keys[-n:])
            if s is not None and len(s.spec) <= len(leaf.shape):
                return s
        return replicated(mesh)
    return jax.tree_util.tree_map_with_path(one, opt_state_shapes)


def drop_trivial(axes, mesh):
    """A PartitionSpec entry without the mesh axes of size 1 (or absent from ``mesh``)."""
    names = tuple(a for a in entry_axes(axes) if mesh.shape.get(a, 1) > 1)
    return None if not names else names[0] if len(names) == 1 else names


def zero1_shardings(opt_state_shapes, base_shardings, mesh: Mesh):
    """ZeRO-1: split each optimizer-state array over the batch axes along its first dimension
    that they divide (on top of ``base_shardings``); arrays no dimension of which fits keep
    their base sharding. XLA then reduce-scatters into the update and all-gathers out of it."""
    n = batch_shards(mesh)

    def one(leaf, base):
        spec = [drop_trivial(s, mesh) for s in base.spec]
        spec += [None] * (len(leaf.shape) - len(spec))
        used = {a for s in spec for a in entry_axes(s)}
        if n == 1 or used & set(BATCH_AXES):
            return base
        for i, dim in enumerate(leaf.shape):
            if spec[i] is None and dim % n == 0:
                spec[i] = BATCH_AXES
                return NamedSharding(mesh, P(*spec))
        return base
    return jax.tree_util.tree_map(one, opt_state_shapes, base_shardings)


def current_mesh(*args):
    """The mesh to run per shard over: the ambient one (``jax.set_mesh``), else the one the
    arrays in ``args`` are placed on (their types carry it inside ``jit`` too), else None.

    Not found: arrays that are not yet placed (numpy, or uncommitted arrays given to a ``jit``
    with ``in_shardings``) carry no mesh in their types; place them first (``jax.device_put``
    with a ``NamedSharding``) or call under ``jax.set_mesh(mesh)``."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh
    for x in jax.tree_util.tree_leaves(args):
        sharding = getattr(jax.typeof(x), "sharding", None)
        if sharding is not None and not sharding.mesh.empty:
            return sharding.mesh
    return None


def batch_shards(mesh) -> int:
    """How many ways the mesh's batch axes split a batch (their sizes' product)."""
    return math.prod(mesh.shape.get(a, 1) for a in BATCH_AXES)


def batch_share(mesh: Mesh) -> tuple[int, int]:
    """``(i, n)``: this process's devices hold part ``i`` of ``n`` equal contiguous parts of
    every batch (split over the batch axes); what its data loader reads. Processes whose
    devices differ only along other axes (pipeline stages, a tensor axis spanning processes)
    hold, and load, the same part."""
    shards = batch_shards(mesh)
    held = batch_sharding(mesh).addressable_devices_indices_map((shards,))
    rows = sorted({index[0].start or 0 for index in held.values()})
    part = len(rows)
    if rows != list(range(rows[0], rows[0] + part)) or shards % part:
        raise ValueError(f"this process's devices hold batch shards {rows} of {shards}, not one "
                         "contiguous part; order the mesh so that each process's devices are "
                         "adjacent along the batch axes.")
    return rows[0] // part, shards // part


def batch_split(x) -> tuple:
    """``(mesh, axes)``: the mesh ``x`` is laid out on (``current_mesh``) and its batch axes of
    size > 1 (a PartitionSpec entry), or ``(mesh, None)`` where there are none or they do not
    divide ``x``'s first dimension; ``(None, None)`` without a mesh."""
    mesh = current_mesh(x)
    if mesh is None:
        return None, None
    axes = drop_trivial(BATCH_AXES, mesh)
    return mesh, axes if axes is not None and x.shape[0] % batch_shards(mesh) == 0 else None


def residual_width(mesh, hidden: int, rules=DEFAULT_RULES):
    """The mesh axes ``residual`` splits a residual stream of width ``hidden`` over (a
    ``PartitionSpec`` entry), or None: where the ``activation_embed`` rule's axes of size > 1
    divide it and the batch does not span both ``data`` and ``fsdp`` (``residual``)."""
    width = drop_trivial(logical_to_mesh(("activation_embed",), rules)[0], mesh)
    if width is None or hidden % width_shards(mesh, width) \
            or len(entry_axes(drop_trivial(BATCH_AXES, mesh))) > 1:
        return None
    return width


def width_shards(mesh, entry) -> int:
    """How many ways a ``PartitionSpec`` entry (None, an axis or a tuple of axes) splits a
    dimension."""
    return math.prod(mesh.shape[a] for a in entry_axes(entry))


def residual(x, rules=DEFAULT_RULES):
    """``x`` [batch, ..., hidden], a model's residual stream (the embeddings' output and the
    hidden states between layers), constrained to be split over the mesh's batch axes on its
    first dimension and over the mesh axes of the ``activation_embed`` rule (``tensor``) on
    its last, the dimensions between left to XLA (MaxText's ``activation_embed``).

    The batch split keeps XLA's partitioner from gathering activations where FSDP gathers
    weights. The width split keeps each device's share of every layer's input (what remat
    saves, for all layers) 1/tensor of it: Llama-2 70B on v5p-256 over FSDP 32 x tensor 4
    needs 18.06 GB of temporaries a chip with it, 33.92 without, and compiles to MaxText's
    program within 0.3% (docs/reports/maxtext.md). A dimension its axes do not divide (or
    axes of size 1: no tensor parallelism) is left to XLA, so without tensor parallelism only
    the batch is constrained, as before; unchanged without a mesh or with neither.

    Nor is the width split where the batch spans both ``data`` and ``fsdp``: there XLA's SPMD
    partitioner (jax 0.10.2 and 0.12.0.1, CPU) miscompiles the decoder's and the MAE's steps
    (tests/test_llama_sharding.py's 2 x 2 x 2 step drifted 1.5% in its loss); a lone ``h @
    w`` with ``h`` on ("data", "fsdp"), ..., "tensor" and ``w`` on "tensor", "fsdp" computes
    correctly, so the smallest failing program is not known."""
    mesh, batch = batch_split(x)
    if mesh is None:
        return x
    width = residual_width(mesh, x.shape[-1], rules)
    if batch is None and width is None:
        return x
    free = P.UNCONSTRAINED
    spec = P(free if batch is None else batch, *[free] * (x.ndim - 2),
             free if width is None else width)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def per_shard(fn, in_specs, out_specs, *, mesh=None):
    """``fn`` run on each device's shards of its arguments (``jax.shard_map``), for what XLA
    cannot partition (Pallas calls) or should not gather for (the flat multi-tensor layout).

    ``in_specs`` / ``out_specs``: mesh-axis ``PartitionSpec``s, pytrees like the arguments and
    the result; axes the mesh lacks or has with size 1 are dropped. The mesh: ``mesh`` if
    given, else ``current_mesh(*args)`` at call time. Without one (unplaced arguments), or on a
    one-device mesh, ``fn`` runs on the whole arrays."""
    def call(*args):
        m = mesh if mesh is not None else current_mesh(*args)
        if m is None or m.size == 1:
            return fn(*args)
        fit = lambda specs: jax.tree_util.tree_map(
            lambda s: P(*(drop_trivial(e, m) for e in s)), specs,
            is_leaf=lambda s: isinstance(s, P))
        return jax.shard_map(fn, mesh=m, in_specs=fit(tuple(in_specs)),
                             out_specs=fit(out_specs), check_vma=False)(*args)
    return call
