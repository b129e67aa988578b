"""The configured training and eval steps compiled for a target (``make_plan``): the trainer's run
built abstractly on the target's devices, its jitted steps lowered and compiled, and what the
compiled train step says: memory per device, collectives, FLOPs and bytes with loop trips."""
from __future__ import annotations

import math
import os
import time

import jax

from jaxaccel import config as config_lib
from jaxaccel import flops as flops_lib
from jaxaccel.models import attention, fp8_layers, remat
from jaxaccel.plan import collectives as collectives_lib
from jaxaccel.plan import hlo_cost
from jaxaccel.plan import topology
from jaxaccel.plan.estimate import cost_of, estimate_step, forecast_of
from jaxaccel.plan.fit import DoesNotFit, StepRefused, capacity, check, does_not_fit
from jaxaccel.plan.report import gb
from jaxaccel.plan.result import Plan
from jaxaccel.precision import fp8_break_even
from jaxaccel.train.run import Run, assemble, resolve


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
    outputs - donated aliases + temporaries + code; ``known``: more entries (params, ...).
    Beside them the compiler's own ``peak`` (``peak_memory_in_bytes``; on a TPU below
    arguments + temporaries where not all temporaries are live at once: llama-350m's step in
    docs/reports/maxtext.md)."""
    m = compiled.memory_analysis()
    total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
             + m.temp_size_in_bytes + m.generated_code_size_in_bytes)
    return {**known, "arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
            "aliased": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes,
            "code": m.generated_code_size_in_bytes, "total": total,
            "peak": getattr(m, "peak_memory_in_bytes", None)}


def xla_cost(compiled) -> dict:
    """XLA's cost analysis of one device's program ({} where the backend gives none)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list):                  # older jax: one dict per program
        cost = cost[0] if cost else None
    return dict(cost or {})


def counted_cost(hlo: str, platform: str) -> dict:
    """The train step's FLOPs and HBM bytes per device counted with loop trips
    (``jaxaccel.plan.hlo_cost``), under cost_analysis()'s keys, with their "source", the loops
    and those whose trips could not be read; on a TPU also ``"hbm bytes"``, those of them that
    move to or from HBM (``hlo_cost.hbm_bytes``: accesses to VMEM buffers left out); {} where
    this jaxlib cannot count them, or {"error": why} where XLA refused (the plan then goes by
    the compiler's own figures)."""
    try:
        counted = hlo_cost.count(hlo)
    except ValueError as e:
        return {"error": str(e)}
    if counted is None:
        return {}
    out = {**counted.totals, "source": counted.source, "loops": len(counted.loops),
           "uncounted": list(counted.uncounted)}
    if platform == "tpu":
        out["hbm bytes"] = hlo_cost.hbm_bytes(hlo_cost.by_instruction(hlo))
    return out


def make_plan(config_path: str | None, sets: list[str], topology_name: str, *,
              device_memory: float | None = None, compiler_options: dict | None = None) -> Plan:
    """Compile the configured steps for ``topology_name``; ``DoesNotFit`` when they do not.
    ``device_memory``: bytes per device to plan against instead of the target's (a device shared
    with other work, or a budget of one's own). ``compiler_options``: XLA options to compile
    the steps with (``CUBLAS_GEMMS``: the GEMMs as cuBLAS calls, which a GPU's autotuner may
    choose where the compile-only target, without one, makes Triton GEMMs)."""
    target = topology.resolve(topology_name)
    cfg, notes = plannable(load_config(config_path, sets, target))
    attention.check_target(cfg.model.attention_impl, target.platform, target.name)
    run = abstract_run(cfg, target)
    t, state, notes = cfg.train, run.state, list(notes)
    batch = abstract_batch(run, t.batch_size)
    shape = flops_lib.model_shape(run.spec)
    seq = shape.row_tokens(_seq_len(run))
    known = {"params": shard_bytes(state.params), "opt_state": shard_bytes(state.opt_state)}
    if not cfg.train.loss_chunks and run.task.loss_chunks > 1:
        notes.append(f"the loss is taken over {run.task.loss_chunks} sequence chunks "
                     "(train.loss_chunks=0: the whole float32 logits would be the step's peak; "
                     "train.loss_chunks=1 keeps them whole)")
    if run.resolved.data.absent:
        notes.append(f"the data is not on this machine ({run.resolved.data.absent.rstrip('.')})"
                     ": planned from the config alone")
    if compiler_options:
        notes.append(f"compiled with the XLA options {compiler_options}")
    compiled, compile_s = _compile_steps(run, target, batch, known, notes, compiler_options)
    memory = memory_of(compiled["train"], **known, batch=shard_bytes(batch))
    hlo = compiled["train"].as_text()
    cost, counted = xla_cost(compiled["train"]), counted_cost(hlo, target.platform)
    if "bytes accessed" not in counted:
        notes.append("HBM bytes and FLOPs were not counted with loop trips ("
                     + counted.get("error", "this jaxlib cannot cost HLO text") + "): the "
                     "plan goes by the compiler's own figures, which count a loop body once")
    flops = _flops(shape, cfg, run.resolved.policy, seq, cost, counted)
    room, room_source = capacity(target) if device_memory is None else \
        (device_memory, f"{device_memory / 1e9:g} GB given (--memory)")
    # across slices the compiled program is one slice's (collectives.py)
    found = collectives_lib.collectives(hlo, len(target.devices) // target.slices)
    sent, stages = collectives_lib.ici_sent(found), run.resolved.stages
    pipeline = None if stages is None else {
        **stages.as_dict(), "permute_bytes": collectives_lib.by_kind(found)["collective-permute"]}
    estimate = estimate_step(target, run.resolved.policy, run.spec.attention_impl, flops,
                             {**cost, **counted}, t.batch_size, seq, sent,
                             0.0 if stages is None else stages.idle,
                             collectives_lib.dcn_sent(found))
    if estimate["step_s"] is not None:
        estimate.update(forecast_of(target, run, shape, seq, flops, memory, estimate))
    return check(Plan(
        target, cfg, dict(run.mesh.shape), t.batch_size, t.eval_batch_size, seq, memory,
        memory_of(compiled["eval"]), room, room_source, compile_s, flops, estimate,
        cost_of(target, run, estimate), collectives_lib.by_kind(found), sent, tuple(notes),
        pipeline, {**counted, "compiler": {k: cost.get(k) for k in ("flops", "bytes accessed")}},
        hlo, fp8_choice(run, target.device_kind)))


def fp8_choice(run: Run, device_kind: str) -> str:
    """Under the fp8 policy, which of the model's block Dense layers run fp8 and why (each
    layer 3 GEMMs: forward, two backward; ``precision.fp8_layers``, ``Policy.fp8_dense``):
    "" under another policy."""
    if run.cfg.precision.policy != "fp8":
        return ""
    policy = run.resolved.policy
    shapes = fp8_layers(run.spec, policy)
    width = policy.fp8_min_width
    why = (f"N*K/(N+K) at least {width:,.0f} on {device_kind} (precision.fp8_layers=paying)"
           if width else f"every one (precision.fp8_layers={run.cfg.precision.fp8_layers}; "
           f"{device_kind} has {'an' if fp8_break_even(device_kind) else 'no'} fp8 peak)")
    each = ", ".join(f"{n} x [{k}, {m}] ({k * m / (k + m):,.0f}) in {'fp8' if on else 'bf16'}"
                     for (k, m, on), n in sorted(shapes.items()))
    fp8 = sum(n for (*_, on), n in shapes.items() if on)
    return f"fp8 on {fp8} of {sum(shapes.values())} block Dense layers: {why}: {each}"


def _flops(shape, cfg, policy, seq: int, cost: dict, counted: dict) -> dict:
    """FLOPs per step: analytic (all devices: the model's, attention's, a remat run's recomputed
    forward, and of those under ``policy`` the fp8 layers' and every block matmul's, the
    layers an fp8 run with every layer in fp8 would run in fp8) beside XLA's and the
    loop-trip count (per device)."""
    b, recomputes = cfg.train.batch_size, remat.of(cfg.model.remat).recomputes
    return {"analytic": flops_lib.train_flops(shape, b, seq),
            "attention": flops_lib.attention_flops(shape, b, seq),
            "recompute": flops_lib.recompute_flops(shape, b, seq, recomputes),
            "fp8": flops_lib.fp8_flops(shape, b, seq, policy.fp8_dense, recomputes)
            if policy.fp8 else 0.0,
            "block": flops_lib.fp8_flops(shape, b, seq, lambda k, n: True, recomputes)
            if policy.fp8 else 0.0,
            "xla_per_device": cost.get("flops"), "counted_per_device": counted.get("flops")}


def _compile_steps(run: Run, target, batch, known: dict, notes: list,
                   options: dict | None) -> tuple[dict, dict]:
    """The train and eval steps compiled (``{"train", "eval"}``) and the seconds each took;
    ``DoesNotFit`` where the compiler refuses a step for its memory."""
    state = run.state
    eval_batch = abstract_batch(run, run.cfg.train.eval_batch_size)
    steps = {"train": (run.train_step, state, batch),
             "eval": (run.eval_step, state.params, eval_batch, state.fp8)}
    compiled, seconds = {}, {}
    with jax.set_mesh(run.mesh):
        for step, (jitted, *args) in steps.items():
            t0 = time.perf_counter()
            try:
                compiled[step] = _compile(jitted, args, step, target.platform, notes, options)
            except jax.errors.JaxRuntimeError as e:
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                said = str(e).split("RESOURCE_EXHAUSTED:", 1)[1].strip().splitlines()[0]
                raise DoesNotFit(does_not_fit(
                    target, run.cfg, dict(run.mesh.shape), step,
                    f"the {target.platform.upper()} compiler refuses it: {said} (parameters "
                    f"{gb(known['params'])}, optimizer state {gb(known['opt_state'])} per "
                    "device)"), step=step) from None
            seconds[step] = time.perf_counter() - t0
    return compiled, seconds


def _compile(jitted, args, step: str, platform: str, notes: list, options: dict | None):
    """``jitted`` lowered for ``args`` and compiled with XLA ``options``; ``StepRefused`` where
    tracing refuses the step. A GPU GEMM without a Triton tiling is compiled with cuBLAS GEMMs
    (and ``notes`` say so)."""
    try:
        lowered = jitted.lower(*args)
    except ValueError as e:
        raise StepRefused(str(e), step) from e
    try:
        return lowered.compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as e:
        if platform != "gpu" or NO_TILING not in str(e):
            raise
    compiled = lowered.compile(compiler_options={**(options or {}), **CUBLAS_GEMMS})
    if CUBLAS_NOTE not in notes:
        notes.append(CUBLAS_NOTE)
    return compiled
