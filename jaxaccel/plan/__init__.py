"""``jaxaccel compile``: the configured training and eval steps compiled for a target, and what
that says before a run is paid for.

    plan = make_plan("configs/bert_base_imdb.py", ["precision.policy=bf16"], "v5e-8")
    print(report(plan))

The run is resolved and assembled as the trainer does it (``jaxaccel.train.run``: ``resolve``
on the target's devices, ``assemble(..., abstract=True)``), so model, optimizer, layout and
train state are the trainer's, built abstractly (``jax.eval_shape``: shapes, dtypes and
shardings on the target's mesh; nothing model-sized is allocated), and the trainer's own
jitted steps (``Run.train_step``, ``Run.eval_step``) are lowered and compiled for the target's
devices (``jaxaccel.plan.topology``) with the task's batch at the config's largest shape (sequence
length ``data.max_len``; bucketed batches are shorter). Per device (one chip, or one
TensorCore of a deviceless v4) it gives:

- memory, from the compiled step's ``memory_analysis()``: parameters and optimizer state
  (their shards), the batch, temporaries (activations, gradients, workspace), the total
  (arguments + outputs - donated aliases + temporaries + code) against the device's memory
  (HBM from ``jaxaccel.devices``; on GPU the 75 % JAX preallocates by default), and the
  headroom;
- the bytes the train step's collectives write per device, by kind, and the least they send;
- for a pipelined run (``mesh.stage`` > 1, ``jaxaccel.train.pipeline``): the schedule (stages,
  repeats, micro-batches, layers per group), its bubble ``(S-1)/(R*M+S-1)`` and the
  stage-to-stage collective permutes per device (and the padding layers where the stages do
  not split the layers evenly); every device holds one stage's layers, so
  the memory per device is the memory per stage;
- FLOPs and HBM bytes per step: analytic FLOPs (``jaxaccel.flops.train_flops``); FLOPs and bytes
  counted from the optimized HLO with every loop's trips (``jaxaccel.plan.hlo_cost``: XLA's
  HloCostAnalysis per computation times its runs); XLA's ``cost_analysis()``, which counts a
  loop body once (a scanned model's layers, gradient accumulation's micro-batches, the TPU
  compiler's windowed FSDP matmuls), beside them (not given by the compile-only GPU client);
- an estimated step time, tokens/s and cost per epoch (per run where the epoch's steps are
  unknown before the data is packed: a corpus). Each estimate names its source:
  ``roofline`` = the analytic FLOPs (with a remat run's recomputed forward) at the chip's
  published peak for the policy's matmul dtype, the bytes the step moves (counted with loop
  trips, above) at the HBM bandwidth, or the bytes its collectives must send
  (``jaxaccel.plan.collectives``) at the chip's interconnect bandwidth (ICI, NVLink),
  whichever is slowest (a lower bound: real steps reach a fraction of peak, see MFU in the
  README, and overlap collectives with compute only in part); a pipeline's compute bound is
  divided by ``1 - idle`` (``Stages.idle``): every stage computes on each of the schedule's
  ``R*M+S-1`` steps, ``S-1`` of which carry no micro-batch, and padding layers compute too;
  ``xla-cost-model`` = XLA's own ``optimal_seconds`` where it gives one (TPU), which does not
  cost Pallas kernels (custom calls), so their analytic FLOPs at peak are added; used where it
  is above the roofline (no estimate goes below a lower bound);
- beside that estimate, a forecast with a range (``jaxaccel.plan.forecast``: the compute bound
  over the efficiency published runs reached on the chip, plus fitted elementwise and
  per-layer costs; the range is the spread of its errors on published runs of sources it had
  not seen), which the plan file's ``time_s``, the costs' ``forecast_*`` and ``jaxaccel
  compile``'s ranking of several targets go by; the report says which factors it used and how
  sure it is.

Caveats, also in the report: GPU compiles run without a device, so without autotuning; the
HLO is close to, not identical to, a real run's. Estimates are never measurements.

A step that does not fit raises ``DoesNotFit`` with the numbers and what would fix it.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import subprocess
import time

import jax

from jaxaccel import config as config_lib
from jaxaccel import devices as devices_lib
from jaxaccel import flops as flops_lib
from jaxaccel.compare import prices
from jaxaccel.models import attention, remat
from jaxaccel.plan import collectives as collectives_lib
from jaxaccel.plan import forecast as forecast_lib
from jaxaccel.plan import hlo_cost
from jaxaccel.plan import topology
from jaxaccel.train.run import Run, assemble, resolve

GPU_MEMORY_FRACTION = 0.75      # JAX's default GPU preallocation (XLA_PYTHON_CLIENT_MEM_FRACTION)
EXIT_DOES_NOT_FIT = 4
CAVEATS = ("estimates, not measurements: the roofline is a lower bound on step time (real "
           "steps reach a fraction of peak); XLA's cost model does not cost Pallas kernels",
           "GPU targets compile without a device, so without autotuning: the HLO is close to, "
           "not identical to, a real GPU's")


class StepRefused(ValueError):
    """The step cannot be built at the configured shapes (tracing refused it: e.g. a dropout
    mask larger than its counters); a smaller micro-batch may help. ``step``: train or eval."""

    def __init__(self, message: str, step: str):
        super().__init__(message)
        self.step = step


class DoesNotFit(RuntimeError):
    """The step needs more memory per device than the device has: the message says by how
    much and what would fix it; ``plan`` holds the numbers (None when the compiler itself
    refused the step, as the TPU compiler does: its own numbers are in the message)."""

    def __init__(self, message: str, plan: "Plan | None" = None, step: str = "train"):
        super().__init__(message)
        self.plan = plan
        self.step = step            # the step that does not fit: "train" or "eval"


@dataclasses.dataclass
class Plan:
    target: topology.Target
    cfg: config_lib.Config
    mesh: dict
    batch: int
    eval_batch: int
    seq: int
    memory: dict            # bytes per device: params, opt_state, batch, temp, total, ...
    eval_memory: dict
    capacity: float | None  # bytes per device usable by the step
    capacity_source: str
    compile_s: dict         # {"train": s, "eval": s}
    flops: dict             # per step (all devices): analytic, attention, xla (per device)
    estimate: dict          # step_s, source, tokens_per_s, ... (all labelled estimate)
    cost: dict | None       # per epoch, or per run for a corpus (``cost["unit"]``)
    collectives: dict = dataclasses.field(default_factory=dict)  # train step, bytes per device
    sent: float = 0.0       # bytes a device sends at least per train step (collectives.py)
    notes: tuple = ()       # what the plan assumed that the run may not (said in the report)
    pipeline: dict | None = None  # Stages.as_dict() + "permute_bytes" (per device, per step)
    hlo_cost: dict = dataclasses.field(default_factory=dict)  # counted_cost() + "compiler"

    @property
    def time_s(self) -> float | None:
        """The step time to go by: the forecast where the plan has one, else the estimate
        (None where the device has no peak)."""
        return self.estimate.get("forecast_s") or self.estimate["step_s"]

    @property
    def fits(self) -> bool | None:
        if self.capacity is None:
            return None
        return max(self.memory["total"], self.eval_memory["total"]) <= self.capacity


def load_config(path: str | None, sets: list[str], target: topology.Target):
    """The config as it would be on the target: config files size batches with
    ``config.device_count()``, which answers the target's device count while it loads."""
    return config_lib.load(path, sets, device_count=len(target.devices))


def _seq_len(run: Run) -> int:
    """The longest batch's sequence length (what the memory must hold): the data's longest
    row (``DataSpec.longest``; a corpus's packed rows are ``data.max_len`` long), at most the
    model's positions."""
    return min(run.resolved.data.longest(), run.spec.architecture.max_position_embeddings)


NO_TILING = "Couldn't find output tile sizes"
CUBLAS_GEMMS = {"xla_gpu_enable_triton_gemm": False}
CUBLAS_NOTE = ("XLA's GPU compiler, without a GPU to autotune on, found no Triton tiling for a "
               "GEMM whose rows are a token count that is not a multiple of 16 (a ViT's "
               "patches and CLS token); the step was compiled with cuBLAS GEMMs instead "
               "(xla_gpu_enable_triton_gemm=false), whose memory and cost may differ from "
               "what a real GPU's autotuned step uses")


def abstract_batch(run: Run, size: int) -> dict:
    """A batch of the run's task of ``size`` rows at the config's longest sequence length, as
    the trainer places its batches (``Run.abstract_batch``)."""
    return run.abstract_batch(size, _seq_len(run))


def plannable(cfg) -> tuple:
    """``(cfg, notes)``: a config whose ``model.checkpoint`` is not on this machine (a
    fine-tuning config planned from a laptop) is planned with its ``model.name`` preset's
    architecture instead of the checkpoint's config.json, and the notes say so."""
    ckpt = cfg.model.checkpoint
    if not ckpt or os.path.isfile(os.path.join(ckpt, "config.json")):
        return cfg, ()
    note = (f"model.checkpoint {ckpt!r} is not on this machine: planned with the "
            f"{cfg.model.name!r} preset's architecture (a run reads the checkpoint's "
            "config.json)")
    return config_lib.build(cfg.to_dict(), ["model.checkpoint="]), (note,)


def abstract_run(cfg, target: topology.Target) -> Run:
    """The trainer's ``Run`` of ``cfg`` on the target's devices, its state ShapeDtypeStructs
    with the trainer's shardings, and no data: what the jitted steps need to be compiled."""
    return assemble(resolve(cfg, target.devices, absent_ok=True), abstract=True)


def shard_bytes(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.tree_util.tree_leaves(tree))


def memory_of(compiled, **known) -> dict:
    """Bytes per device of a compiled step (``memory_analysis()``) and its total: arguments +
    outputs - donated aliases + temporaries + code; ``known``: more entries (params, ...)."""
    m = compiled.memory_analysis()
    total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
             + m.temp_size_in_bytes + m.generated_code_size_in_bytes)
    return {**known, "arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
            "aliased": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes,
            "code": m.generated_code_size_in_bytes, "total": total}


def xla_cost(compiled) -> dict:
    """XLA's cost analysis of one device's program ({} where the backend gives none)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list):                  # older jax: one dict per program
        cost = cost[0] if cost else None
    return dict(cost or {})


def counted_cost(hlo: str) -> dict:
    """The train step's FLOPs and HBM bytes per device counted with loop trips
    (``jaxaccel.plan.hlo_cost``), under cost_analysis()'s keys, with their "source", the loops
    and those whose trips could not be read; {} where this jaxlib cannot count them, or
    {"error": why} where XLA refused (the plan then goes by the compiler's own figures)."""
    try:
        counted = hlo_cost.count(hlo)
    except ValueError as e:
        return {"error": str(e)}
    if counted is None:
        return {}
    return {**counted.totals, "source": counted.source, "loops": len(counted.loops),
            "uncounted": list(counted.uncounted)}


def _capacity(target: topology.Target) -> tuple[float | None, str]:
    """Bytes one device can give the step, and where that number comes from."""
    if target.name == "local":
        stats = target.devices[0].memory_stats() or {}
        if "bytes_limit" in stats:
            return float(stats["bytes_limit"]), "the device's allocator limit (memory_stats)"
        if target.platform == "cpu":
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            return ram / len(target.devices), "host RAM / CPU devices"
    if target.hbm_per_device is None:
        return None, f"unknown: {target.device_kind!r} is not in jaxaccel/devices.py"
    share = f" / {target.devices_per_chip} devices per chip" if target.devices_per_chip > 1 \
        else ""
    if target.platform == "gpu":
        return target.hbm_per_device * GPU_MEMORY_FRACTION, \
            f"{GPU_MEMORY_FRACTION:.0%} of HBM (JAX's default GPU preallocation)"
    return target.hbm_per_device, f"HBM per chip{share}"


def _interconnect_s(target, sent: float) -> tuple[float | None, str]:
    """Least time the step's collectives take: the bytes a device must send (``sent``, per
    device) at its chip's interconnect bandwidth in one direction. (None, why) when unknown."""
    if target.chips == 1 or not sent:
        return 0.0, ""
    link = target.chip.interconnect
    if link is None:
        return None, f"no interconnect figure for {target.device_kind!r} in jaxaccel/devices.py"
    between = "; NVLink within a host, the slower network between hosts not modelled" \
        if target.platform == "gpu" and target.hosts > 1 else ""
    return sent * target.devices_per_chip / (link / 2), \
        f"{link:.3g} B/s interconnect, both directions{between}"


def estimate_step(target, policy, attention_impl: str, flops: dict, cost: dict, batch: int,
                  seq: int, sent: float, idle: float = 0.0) -> dict:
    """Estimated step time of a step under ``policy`` (its matmul dtype's peak) with
    ``attention_impl``: the roofline and, where XLA gives one, its cost model. ``idle``: the
    share of a pipeline schedule's layer computations that do no model work (its bubble and
    padding layers, ``Stages.idle``), which the compute bound is divided by ``1 - idle`` for."""
    peak = devices_lib.peak_flops(target.device_kind, policy.matmul_dtype)
    if peak is None:
        return {"step_s": None, "source": f"none: no peak for {target.device_kind!r} in "
                                          "jaxaccel/devices.py"}
    peak_flops, which = peak
    per_chip = 1.0 / target.chips
    bandwidth = target.chip.hbm_bandwidth
    link_s, link = _interconnect_s(target, sent)
    work = flops["analytic"] + flops.get("recompute", 0.0)
    bounds = {"compute": work * per_chip / peak_flops / (1.0 - idle),
              "memory": cost["bytes accessed"] * target.devices_per_chip / bandwidth
              if cost.get("bytes accessed", 0) > 0 else 0.0,
              "interconnect": link_s or 0.0}
    bound = max(bounds, key=bounds.get)
    out = {"roofline_s": bounds[bound], "bound": bound, "idle": idle,
           "compute_s": bounds["compute"], "memory_s": bounds["memory"],
           "work_per_chip": work * per_chip,
           "interconnect_s": link_s,
           "interconnect": link, "peak": f"{peak_flops:.4g} FLOP/s ({which}), "
                                         f"{bandwidth:.3g} B/s HBM ({target.chip.source})"}
    # XLA's cost model: absent on the compile-only GPU client, negative when it cannot cost
    # the program (seen for whole BERT steps on TPU); kept in the plan either way.
    xla_s = out["xla_optimal_seconds"] = cost.get("optimal_seconds")
    pallas_flops = flops["attention"] if attention_impl in ("pallas", "mosaic_gpu") else 0.0
    if xla_s is not None and xla_s > 0:
        out["xla_cost_model_s"] = xla_s + pallas_flops * per_chip / peak_flops
    # No estimate below the roofline, a lower bound (XLA's model may leave collectives out).
    use_xla = out.get("xla_cost_model_s", 0.0) > bounds[bound]
    step = out["xla_cost_model_s"] if use_xla else bounds[bound]
    source = "estimate:xla-cost-model" if use_xla else "estimate:roofline"
    return {**out, "step_s": step, "source": source,
            "tokens_per_s": batch * seq / step}


def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(__file__)).stdout.strip() \
            or "unknown"
    except OSError:
        return "unknown"


def make_plan(config_path: str | None, sets: list[str], topology_name: str, *,
              device_memory: float | None = None) -> Plan:
    """Compile the configured steps for ``topology_name``; ``DoesNotFit`` when they do not.
    ``device_memory``: bytes per device to plan against instead of the target's (a device shared
    with other work, or a budget of one's own)."""
    target = topology.resolve(topology_name)
    cfg, notes = plannable(load_config(config_path, sets, target))
    attention.check_target(cfg.model.attention_impl, target.platform, target.name)
    run = abstract_run(cfg, target)
    t = cfg.train
    batch = abstract_batch(run, t.batch_size)
    eval_batch = abstract_batch(run, t.eval_batch_size)
    shape = flops_lib.model_shape(run.spec)
    seq = shape.row_tokens(_seq_len(run))
    state = run.state
    known = {"params": shard_bytes(state.params), "opt_state": shard_bytes(state.opt_state)}
    compile_s, notes = {}, list(notes)
    if run.resolved.data.absent:
        notes.append(f"the data is not on this machine ({run.resolved.data.absent.rstrip('.')})"
                     ": planned from the config alone")

    def compile_(step, jitted, *args):
        t0 = time.perf_counter()
        try:
            lowered = jitted.lower(*args)
        except ValueError as e:
            raise StepRefused(str(e), step) from e
        try:
            try:
                compiled = lowered.compile()
            except jax.errors.JaxRuntimeError as e:
                if target.platform != "gpu" or NO_TILING not in str(e):
                    raise
                compiled = lowered.compile(compiler_options=CUBLAS_GEMMS)
                if CUBLAS_NOTE not in notes:
                    notes.append(CUBLAS_NOTE)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            said = str(e).split("RESOURCE_EXHAUSTED:", 1)[1].strip().splitlines()[0]
            raise DoesNotFit(does_not_fit(
                target, cfg, dict(run.mesh.shape), step,
                f"the {target.platform.upper()} compiler refuses it: {said} (parameters "
                f"{_gb(known['params'])}, optimizer state {_gb(known['opt_state'])} per "
                "device)"), step=step) from None
        compile_s[step] = time.perf_counter() - t0
        return compiled

    with jax.set_mesh(run.mesh):
        train = compile_("train", run.train_step, state, batch)
        evaluate = compile_("eval", run.eval_step, state.params, eval_batch, state.fp8)
    memory = memory_of(train, **known, batch=shard_bytes(batch))
    eval_memory = memory_of(evaluate)
    hlo = train.as_text()
    cost, counted = xla_cost(train), counted_cost(hlo)
    if "bytes accessed" not in counted:
        notes.append("HBM bytes and FLOPs were not counted with loop trips ("
                     + counted.get("error", "this jaxlib cannot cost HLO text") + "): the "
                     "plan goes by the compiler's own figures, which count a loop body once")
    flops = {"analytic": flops_lib.train_flops(shape, t.batch_size, seq),
             "attention": flops_lib.attention_flops(shape, t.batch_size, seq),
             "recompute": flops_lib.recompute_flops(shape, t.batch_size, seq,
                                                    remat.of(cfg.model.remat).recomputes),
             "xla_per_device": cost.get("flops"), "counted_per_device": counted.get("flops")}
    capacity, capacity_source = _capacity(target) if device_memory is None else \
        (device_memory, f"{device_memory / 1e9:g} GB given (--memory)")
    found = collectives_lib.collectives(hlo, len(target.devices))
    sent = sum(c.sent for c in found)
    stages = run.resolved.stages
    pipeline = None if stages is None else {
        **stages.as_dict(), "permute_bytes": collectives_lib.by_kind(found)["collective-permute"]}
    estimate = estimate_step(target, run.resolved.policy, run.spec.attention_impl, flops,
                             {**cost, **counted}, t.batch_size, seq, sent,
                             0.0 if stages is None else stages.idle)
    if estimate["step_s"] is not None:
        estimate.update(_forecast(target, run, shape, seq, flops, memory, estimate))
    plan = Plan(target, cfg, dict(run.mesh.shape), t.batch_size, t.eval_batch_size, seq,
                memory, eval_memory, capacity, capacity_source, compile_s, flops, estimate,
                _cost_of(target, run, estimate),
                collectives_lib.by_kind(found), sent, tuple(notes), pipeline,
                {**counted, "compiler": {k: cost.get(k) for k in ("flops", "bytes accessed")}})
    if plan.fits is False:
        m, e = plan.memory, plan.eval_memory
        step = "train" if m["total"] > capacity else "eval"
        raise DoesNotFit(does_not_fit(
            target, cfg, plan.mesh, step,
            f"it needs {_gb(max(m['total'], e['total']))} per device (parameters "
            f"{_gb(m['params'])}, optimizer state {_gb(m['opt_state'])}, temporaries "
            f"{_gb(m['temp'])}; eval step {_gb(e['total'])}) but a device has "
            f"{_gb(capacity)} ({capacity_source})"), plan, step)
    return plan


def _forecast(target, run: Run, shape, seq: int, flops: dict, memory: dict,
              estimate: dict) -> dict:
    """The forecast of the train step (``jaxaccel.plan.forecast``): its FLOPs split as the
    estimate's, its tokens, passes and layers per chip, and the bytes its update moves."""
    t, stages = run.cfg.train, run.resolved.stages
    step = forecast_lib.step_of(
        shape, target.device_kind, run.resolved.policy.matmul_dtype,
        t.batch_size * seq / target.chips, seq, flops["recompute"] / (t.batch_size * seq),
        idle=estimate["idle"], stages=stages.stages if stages else 1,
        passes=t.grad_accum * (stages.microbatches if stages else 1),
        optimizer_bytes=(3 * memory["params"] + 2 * memory["opt_state"])
        * target.devices_per_chip)
    return forecast_lib.forecast(step, estimate["step_s"], estimate["interconnect_s"] or 0.0)


def _cost_of(target, run: Run, estimate) -> dict | None:
    """Estimated time and price of one epoch (at the longest batch's step time), or of the
    whole run (``unit: "run"``) where the epoch's steps are unknown before the data is packed
    (a corpus) and the run's length is given in steps."""
    if estimate["step_s"] is None:
        return None
    r = run.resolved
    if r.steps_per_epoch is not None:
        unit, steps, source = "epoch", r.steps_per_epoch, r.data.count_source
    elif r.total_steps is not None:
        unit, steps, source = "run", r.total_steps, f"train.max_steps={r.total_steps}"
    else:
        return None
    seconds = {"seconds": steps * estimate["step_s"]}
    for key in ("forecast", "forecast_low", "forecast_high"):
        if estimate.get(f"{key}_s") is not None:
            seconds[f"{key}_seconds"] = steps * estimate[f"{key}_s"]
    out = {"unit": unit, "steps": steps, "steps_from": source, **seconds}
    try:
        p = prices.lookup(target.device_kind, prices.PRICES)
    except KeyError:
        return {**out, "usd": None, "price": f"no price for {target.device_kind!r} in "
                                             "jaxaccel/compare/prices.py"}
    usd = {k.replace("seconds", "usd"): v / 3600 * p.usd_per_hour * target.chips
           for k, v in seconds.items()}
    return {**out, **usd, "price": f"{p.device} ${p.usd_per_hour}/h per chip x {target.chips} "
                                   f"({p.source}, {p.date})"}


def duration(seconds: float) -> str:
    """``42.1 s``, ``12.5 min``, ``3.2 h``."""
    if seconds < 120:
        return f"{seconds:.3g} s"
    return f"{seconds / 60:.3g} min" if seconds < 7200 else f"{seconds / 3600:.3g} h"


def usd_text(usd: float) -> str:
    return f"${usd:,.2f}" if usd >= 1 else f"${usd:.2g}"


def _gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.2f} GB"


def does_not_fit(target, cfg, mesh: dict, step: str, numbers: str) -> str:
    """The message of a step ("train" or "eval") that does not fit: the numbers and what
    would fix it."""
    t = cfg.train
    rows = max(mesh["data"] * mesh["fsdp"], 1)
    fixes = []
    if step == "eval":
        if t.eval_batch_size // rows > 1:
            fixes.append(f"a smaller eval batch (--set train.eval_batch_size="
                         f"{t.eval_batch_size // 2})")
    else:
        if mesh["fsdp"] == 1 and len(target.devices) > 1:
            fixes.append(f"shard parameters and optimizer state with an FSDP axis (--set "
                         f"mesh.fsdp={len(target.devices)} --set mesh.data=1)")
        if not remat.of(cfg.model.remat).on:
            fixes.append("recompute activations in the backward pass (--set model.remat=true)")
        micro = t.batch_size // t.grad_accum // rows
        if micro > 1:
            fixes.append(f"a smaller micro-batch per device (now {micro}) by accumulating "
                         f"gradients over more of them, the same optimizer batch (--set "
                         f"train.grad_accum={2 * t.grad_accum})")
    fixes.append("a target with more memory per chip or more chips")
    name = "training" if step == "train" else "eval"
    return (f"the {name} step does not fit on {target.name} ({target.device_kind}): "
            f"{numbers}. Try: " + "; ".join(fixes) + "; or let --fit search these by "
            "compiling.")


def report(plan: Plan) -> str:
    """The plan as text: per-device memory, fits, compile time, FLOPs, estimates."""
    t, m, e = plan.target, plan.memory, plan.estimate
    hosts = f", {t.hosts} hosts" if t.hosts > 1 else ""
    per_chip = f" ({t.devices_per_chip} devices per chip)" if t.devices_per_chip > 1 else ""
    lines = [f"target {t.name}: {len(t.devices)} x {t.device_kind}, {t.chips} chips{per_chip}"
             f"{hosts}; mesh {plan.mesh}",
             f"step: global batch {plan.batch} x {plan.seq} tokens (eval batch "
             f"{plan.eval_batch}), policy {plan.cfg.precision.policy}, "
             f"optimizer {plan.cfg.train.optimizer}, attention {plan.cfg.model.attention_impl}",
             "", "memory per device (compiled, XLA memory_analysis):"]
    for key, label in (("params", "parameters"), ("opt_state", "optimizer state"),
                       ("batch", "batch"), ("temp", "activations/temporaries"),
                       ("total", "total (train step)")):
        lines.append(f"  {label:<26}{_gb(m[key]):>12}")
    lines.append(f"  {'total (eval step)':<26}{_gb(plan.eval_memory['total']):>12}")
    if plan.capacity is not None:
        head = plan.capacity - max(m["total"], plan.eval_memory["total"])
        lines.append(f"  {'device memory':<26}{_gb(plan.capacity):>12}  ({plan.capacity_source})")
        lines.append(f"  {'headroom':<26}{_gb(head):>12}  "
                     f"({head / plan.capacity:.0%}): {'fits' if plan.fits else 'DOES NOT FIT'}")
    else:
        lines.append(f"  device memory unknown ({plan.capacity_source}): fit not checked")
    f, h = plan.flops, plan.hlo_cost
    xla = f"{f['xla_per_device']:.4g} per device" if f["xla_per_device"] else \
        "not given by this compiler"
    counted = f"; counted with loop trips {f['counted_per_device']:.4g} per device" \
        if f.get("counted_per_device") else ""
    moved = {k: v for k, v in plan.collectives.items() if v}
    lines.append(f"  {'collectives per step':<26}{_gb(sum(moved.values())):>12}  (" + (", ".join(
        f"{k} {_gb(v)}" for k, v in moved.items()) or "none") + ")")
    if plan.pipeline:
        p = plan.pipeline
        lines += ["", f"pipeline: {p['stages']} stages x {p['repeats']} repeat(s) of "
                      f"{p['layers_per_group']} layer(s), {p['microbatches']} micro-batches; "
                      f"bubble (S-1)/(R*M+S-1) = {p['bubble']:.1%}"
                      + (f"; {p['padding_layers']} padding layer(s) after the last"
                         if p.get("padding_layers") else "") + "; stage-to-stage permutes "
                      f"{_gb(p['permute_bytes'])} per device per step (memory above is per "
                      "stage: a device holds one)"]
    lines += ["", f"compile time: train {plan.compile_s['train']:.1f} s, eval "
                  f"{plan.compile_s['eval']:.1f} s",
              f"FLOPs per step: analytic {f['analytic']:.4g} (6N x tokens + attention "
              f"{f['attention']:.4g})" + (f" + the remat forward {f['recompute']:.4g}"
                                          if f.get("recompute") else "")
              + f"{counted}; XLA cost analysis {xla} (loop bodies once)"]
    if h.get("bytes accessed"):
        own = h["compiler"].get("bytes accessed")
        lines.append(f"HBM bytes per step: {_gb(h['bytes accessed'])} per device, counted with "
                     f"loop trips ({h['source']}; {h['loops']} loops"
                     + (f", {len(h['uncounted'])} of unreadable trips counted once"
                        if h["uncounted"] else "") + f"); the compiler's own count "
                     + (f"{_gb(own)} (loop bodies once)" if own else "not given"))
    if e["step_s"] is None:
        lines.append(f"step time: no estimate ({e['source']})")
    else:
        lines.append(f"step time ({e['source']}): {e['step_s'] * 1e3:.4g} ms; "
                     f"{e['tokens_per_s']:.4g} tokens/s (estimate)")
        if e.get("forecast_s") is not None:
            lines.append(f"  forecast {e['forecast_s'] * 1e3:.4g} ms (range "
                         f"{e['forecast_low_s'] * 1e3:.4g}-{e['forecast_high_s'] * 1e3:.4g} ms),"
                         f" {plan.batch * plan.seq / e['forecast_s']:.4g} tokens/s: "
                         f"{e['forecast_source']}")
            lines.append(f"    how sure: {e['forecast_confidence']} (jaxaccel/plan/"
                         "calibration.json, docs/calibration.md)")
        else:
            lines.append(f"  forecast: {e.get('forecast_source', 'none')}")
        lines.append(f"  roofline {e['roofline_s'] * 1e3:.2f} ms ({e['bound']}-bound at "
                     f"{e['peak']})")
        if e.get("idle"):
            lines.append(f"  (the compute bound includes the pipeline's idle share, bubble and "
                         f"padding layers: / (1 - {e['idle']:.3f}))")
        if e["interconnect"]:
            link = "no estimate" if e["interconnect_s"] is None else \
                f"{e['interconnect_s'] * 1e3:.2f} ms"
            lines.append(f"  collectives {link}: {_gb(plan.sent)} sent per device at least "
                         f"({e['interconnect']})")
        if "xla_cost_model_s" in e:
            lines.append(f"  XLA cost model {e['xla_cost_model_s'] * 1e3:.2f} ms (+ Pallas "
                         "attention's analytic FLOPs at peak where used)")
        else:
            lines.append(f"  XLA cost model: no usable figure (optimal_seconds = "
                         f"{e['xla_optimal_seconds']})")
    c = plan.cost
    if c:
        usd = usd_text(c["usd"]) if c["usd"] is not None else "no price"
        lines.append(f"{c['unit']} (estimate): {c['steps']} steps x step time = "
                     f"{c['seconds']:.1f} s, {usd} ({c['price']})")
        lines.append(f"  the {c['unit']}'s steps: from {c['steps_from']}")
        if "forecast_seconds" in c:
            usd = "" if c["usd"] is None else (
                f", {usd_text(c['forecast_usd'])} ({usd_text(c['forecast_low_usd'])}-"
                f"{usd_text(c['forecast_high_usd'])})")
            lines.append(f"  forecast: {duration(c['forecast_seconds'])} ("
                         f"{duration(c['forecast_low_seconds'])}-"
                         f"{duration(c['forecast_high_seconds'])}){usd}")
    elif e["step_s"] is not None:
        lines.append("epoch: no estimate (the data's size is unknown until it is read: "
                     "jaxaccel data prepare builds its cache, whose index then gives it; or "
                     "set train.max_steps, data.train_examples or data.train_tokens)")
    if plan.notes:
        lines += ["", "notes: " + "; ".join(plan.notes) + "."]
    lines += ["", "caveats: " + "; ".join(CAVEATS) + (f"; {forecast_lib.CAVEAT}" if e.get(
        "forecast_s") is not None else "") + "."]
    return "\n".join(lines)


def result(plan: Plan) -> dict:
    """The plan as a result file (bench/results format) whose one row ``jaxaccel compare``
    joins with measured ``train_step`` rows of the same model, sequence and batch; its time
    and cost are marked estimates (``time_source``)."""
    e, c, t = plan.estimate, plan.cost or {}, plan.target
    forecast = e.get("forecast_s")
    row = {"name": f"plan.{plan.cfg.precision.policy}.{plan.cfg.train.optimizer}."
                   f"{plan.cfg.model.attention_impl}",
           "batch": plan.batch, "time_s": plan.time_s,
           "time_source": "estimate:forecast" if forecast else e["source"],
           "tokens_per_s": plan.batch * plan.seq / plan.time_s if plan.time_s else None,
           "fits": plan.fits,
           "bound_s": e["step_s"], "bound_source": e["source"],
           "forecast_low_s": e.get("forecast_low_s"), "forecast_high_s": e.get("forecast_high_s"),
           "forecast_method": e.get("forecast_source"),
           "forecast_confidence": e.get("forecast_confidence"),
           "forecast_terms_s": e.get("forecast_terms"), "calibration": e.get("calibration"),
           "memory_per_device": plan.memory, "eval_memory_per_device": plan.eval_memory,
           "device_memory": plan.capacity, "device_memory_source": plan.capacity_source,
           "collective_bytes_per_device": plan.collectives,
           "collective_sent_bytes_per_device": plan.sent, "pipeline": plan.pipeline,
           "interconnect_s": e.get("interconnect_s"),
           "compile_s": plan.compile_s, "model_flops": plan.flops["analytic"],
           "xla_flops_per_device": plan.flops["xla_per_device"],
           "counted_flops_per_device": plan.flops.get("counted_per_device"),
           "hbm_bytes_per_device": plan.hlo_cost.get("bytes accessed"),
           "hlo_cost": plan.hlo_cost,
           "roofline_s": e.get("roofline_s"), "xla_cost_model_s": e.get("xla_cost_model_s"),
           "xla_optimal_seconds": e.get("xla_optimal_seconds"),
           "peak": e.get("peak"),
           **{f"{c['unit']}_{k}": c[k] for k in ("steps", "seconds", "usd", "forecast_seconds",
                                                   "forecast_usd") if k in c},
           "price": c.get("price")}
    return {"bench": "plan", "device": t.device_kind, "backend": t.platform,
            "topology": t.name, "device_count": t.chips, "devices": len(t.devices),
            "jax": jax.__version__, "jaxaccel": _git_sha(),
            "date": datetime.date.today().isoformat(), "model": plan.cfg.model.name,
            "seq": plan.seq, "mesh": plan.mesh, "config": plan.cfg.to_dict(),
            "caveats": list(CAVEATS), "notes": list(plan.notes), "rows": [row]}


def slug(name: str) -> str:
    """``v5e:2x4`` -> ``v5e_2x4`` (file names)."""
    return "".join(ch if ch.isalnum() else "_" for ch in name).strip("_")
