"""The step-time estimate of a compiled step (``estimate_step``: the roofline of its FLOPs, bytes
and collectives at the chip's published peaks, and XLA's cost model where it gives one), the
forecast beside it (``forecast_of``, ``jaxaccel.plan.forecast``) and the epoch's time and price
(``cost_of``)."""
from __future__ import annotations

import jax.numpy as jnp

from jaxaccel import devices as devices_lib
from jaxaccel.compare import prices
from jaxaccel.plan import forecast as forecast_lib
from jaxaccel.train.run import Run


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


def _dcn_s(target, sent: float) -> tuple[float | None, str]:
    """Least time the collectives' parts between slices take: the bytes a device must send
    over the data-center network (``sent``) at its chip's DCN share (``Chip.dcn``, one
    direction). (None, why) when unknown."""
    if not sent:
        return 0.0, ""
    if target.chip.dcn is None:
        return None, f"no DCN figure for {target.device_kind!r} in jaxaccel/devices.py"
    return sent * target.devices_per_chip / target.chip.dcn, \
        f"{target.chip.dcn:.3g} B/s DCN per chip, one direction ({devices_lib.DCN_SOURCE})"


def memory_bytes(target, cost: dict) -> tuple[float, str]:
    """``(bytes per device, which)`` the HBM bound divides by the chip's bandwidth: on a TPU the
    bytes that move to or from HBM (``cost["hbm bytes"]``, ``compile.counted_cost``), since
    XLA's cost analysis counts an access to a VMEM buffer like an HBM access (the counted
    bytes are about twice the HBM traffic); elsewhere, or where that figure is missing, the
    bytes accessed (loop trips counted where the plan could count them)."""
    if target.platform == "tpu" and cost.get("hbm bytes"):
        return cost["hbm bytes"], "hbm bytes (VMEM accesses left out)"
    return cost.get("bytes accessed", 0.0), "bytes accessed"


def estimate_step(target, policy, attention_impl: str, flops: dict, cost: dict, batch: int,
                  seq: int, sent: float, idle: float = 0.0, dcn_sent: float = 0.0) -> dict:
    """Estimated step time of a step under ``policy`` (its matmul dtype's peak; under fp8 the
    fp8 layers' FLOPs, ``flops["fp8"]``, at the fp8 peak and the rest, attention's, the
    head's and the layers left in bf16, at the compute dtype's) with ``attention_impl``: the
    roofline and, where XLA gives one, its cost model. ``idle``: the
    share of a pipeline schedule's layer computations that do no model work (its bubble and
    padding layers, ``Stages.idle``), which the compute bound is divided by ``1 - idle`` for.
    ``sent`` / ``dcn_sent``: bytes a device sends at least within its slice / between slices;
    the interconnect bound is their times' sum (a collective across slices runs its phases in
    turn: within the slices, between them, within them again)."""
    peak = devices_lib.peak_rate(target.device_kind, policy.matmul_dtype)
    if peak is None:
        return {"step_s": None, "source": f"none: no peak for {target.device_kind!r} in "
                                          "jaxaccel/devices.py"}
    peak_flops, which = peak
    work = flops["analytic"] + flops.get("recompute", 0.0)
    # fp8: its layers' FLOPs at the fp8 peak, attention's, the head's and the layers that
    # stay in the compute dtype at that dtype's
    fp8 = flops["fp8"] if policy.fp8 else 0.0
    if policy.fp8:
        other_flops, other = devices_lib.peak_rate(target.device_kind,
                                                   jnp.dtype(policy.compute_dtype).name)
        time_flops = fp8 / peak_flops + (work - fp8) / other_flops
        which = f"{which} for the fp8 layers' {fp8 / work:.0%} of the FLOPs, " \
                f"{other_flops:.4g} FLOP/s ({other}) for the rest"
    else:
        other_flops, time_flops = peak_flops, work / peak_flops
    per_chip = 1.0 / target.chips
    bandwidth = target.chip.hbm_bandwidth
    link_s, link = _interconnect_s(target, sent)
    dcn_s, dcn = _dcn_s(target, dcn_sent)
    if link_s is not None and dcn_s:
        link_s, link = link_s + dcn_s, "; ".join(filter(None, (link, dcn)))
    moved, moved_source = memory_bytes(target, cost)
    bounds = {"compute": time_flops * per_chip / (1.0 - idle),
              "memory": max(moved, 0.0) * target.devices_per_chip / bandwidth,
              "interconnect": link_s or 0.0}
    bound = max(bounds, key=bounds.get)
    out = {"roofline_s": bounds[bound], "bound": bound, "idle": idle,
           "compute_s": bounds["compute"], "memory_s": bounds["memory"],
           "memory_bytes": moved, "memory_bytes_source": moved_source,
           "work_per_chip": work * per_chip, "fp8_per_chip": fp8 * per_chip,
           "interconnect_s": link_s, "dcn_s": dcn_s, "dcn_sent": dcn_sent, "dcn": dcn,
           "interconnect": link, "peak": f"{peak_flops:.4g} FLOP/s ({which}), "
                                         f"{bandwidth:.3g} B/s HBM ({target.chip.source})"}
    # XLA's cost model: absent on the compile-only GPU client, negative when it cannot cost
    # the program (seen for whole BERT steps on TPU); kept in the plan either way.
    xla_s = out["xla_optimal_seconds"] = cost.get("optimal_seconds")
    pallas_flops = flops["attention"] if attention_impl in ("pallas", "mosaic_gpu") else 0.0
    if xla_s is not None and xla_s > 0:
        out["xla_cost_model_s"] = xla_s + pallas_flops * per_chip / other_flops
    # No estimate below the roofline, a lower bound (XLA's model may leave collectives out).
    use_xla = out.get("xla_cost_model_s", 0.0) > bounds[bound]
    step = out["xla_cost_model_s"] if use_xla else bounds[bound]
    source = "estimate:xla-cost-model" if use_xla else "estimate:roofline"
    return {**out, "step_s": step, "source": source,
            "tokens_per_s": batch * seq / step}


def forecast_of(target, run: Run, shape, seq: int, flops: dict, memory: dict,
                estimate: dict) -> dict:
    """The forecast of the train step (``jaxaccel.plan.forecast``): its FLOPs split as the
    estimate's, its tokens, passes and layers per chip, the bytes its update moves, and under
    fp8 the share of its block matmuls' FLOPs in fp8 (``flops["fp8"]`` of ``flops["block"]``:
    the published fp8 runs have every block matmul in fp8)."""
    t, stages, policy = run.cfg.train, run.resolved.stages, run.resolved.policy
    share = flops["fp8"] / flops["block"] if policy.fp8 and flops.get("block") else 1.0
    step = forecast_lib.step_of(
        shape, target.device_kind, policy.matmul_dtype,
        t.batch_size * seq / target.chips, seq, flops["recompute"] / (t.batch_size * seq),
        idle=estimate["idle"], stages=stages.stages if stages else 1,
        passes=t.grad_accum * (stages.microbatches if stages else 1),
        optimizer_bytes=(3 * memory["params"] + 2 * memory["opt_state"])
        * target.devices_per_chip, fp8_share=share)
    return forecast_lib.forecast(step, estimate["step_s"], estimate["interconnect_s"] or 0.0)


def cost_of(target, run: Run, estimate) -> dict | None:
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
