"""A plan as text (``report``): per-device memory and fit, collectives, the pipeline's schedule,
compile time, FLOPs and bytes, the step-time estimates and forecast, the epoch's time and cost,
notes and caveats; and the few number formats the planner's texts share."""
from __future__ import annotations

from jaxaccel.plan import forecast as forecast_lib
from jaxaccel.plan.result import CAVEATS, Plan


def duration(seconds: float) -> str:
    """``42.1 s``, ``12.5 min``, ``3.2 h``."""
    if seconds < 120:
        return f"{seconds:.3g} s"
    return f"{seconds / 60:.3g} min" if seconds < 7200 else f"{seconds / 3600:.3g} h"


def usd_text(usd: float) -> str:
    return f"${usd:,.2f}" if usd >= 1 else f"${usd:.2g}"


def gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.2f} GB"


def report(plan: Plan) -> str:
    """The plan as text: per-device memory, fits, compile time, FLOPs, estimates."""
    e = plan.estimate
    lines = [*_header(plan), "", *_memory(plan), *_pipeline(plan), "", *_work(plan),
             *_step_time(plan), *_cost(plan)]
    if plan.notes:
        lines += ["", "notes: " + "; ".join(plan.notes) + "."]
    lines += ["", "caveats: " + "; ".join(CAVEATS) + (f"; {forecast_lib.CAVEAT}" if e.get(
        "forecast_s") is not None else "") + "."]
    return "\n".join(lines)


def _header(plan: Plan) -> list[str]:
    t = plan.target
    hosts = f", {t.hosts} hosts" if t.hosts > 1 else ""
    if t.slices > 1:
        m = plan.cfg.mesh
        hosts += (f" in {t.slices} slices (over DCN: data {m.dcn_data}, fsdp {m.dcn_fsdp} "
                  "of the mesh's ways)")
    per_chip = f" ({t.devices_per_chip} devices per chip)" if t.devices_per_chip > 1 else ""
    return [f"target {t.name}: {len(t.devices)} x {t.device_kind}, {t.chips} chips{per_chip}"
            f"{hosts}; mesh {plan.mesh}",
            f"step: global batch {plan.batch} x {plan.seq} tokens (eval batch "
            f"{plan.eval_batch}), policy {plan.cfg.precision.policy}, "
            f"optimizer {plan.cfg.train.optimizer}, attention {plan.cfg.model.attention_impl}",
            *([plan.fp8_layers] if plan.fp8_layers else [])]


def _memory(plan: Plan) -> list[str]:
    """Memory per device against the device's, and the train step's collectives."""
    m = plan.memory
    lines = ["memory per device (compiled, XLA memory_analysis):"]
    for key, label in (("params", "parameters"), ("opt_state", "optimizer state"),
                       ("batch", "batch"), ("temp", "activations/temporaries"),
                       ("total", "total (train step)")):
        lines.append(f"  {label:<26}{gb(m[key]):>12}")
    if m.get("peak"):
        lines.append(f"  {'peak (train step)':<26}{gb(m['peak']):>12}  (the compiler's "
                     "peak_memory_in_bytes)")
    lines.append(f"  {'total (eval step)':<26}{gb(plan.eval_memory['total']):>12}")
    if plan.capacity is not None:
        head = plan.capacity - max(m["total"], plan.eval_memory["total"])
        lines.append(f"  {'device memory':<26}{gb(plan.capacity):>12}  ({plan.capacity_source})")
        lines.append(f"  {'headroom':<26}{gb(head):>12}  "
                     f"({head / plan.capacity:.0%}): {'fits' if plan.fits else 'DOES NOT FIT'}")
    else:
        lines.append(f"  device memory unknown ({plan.capacity_source}): fit not checked")
    moved = {k: v for k, v in plan.collectives.items() if v}
    lines.append(f"  {'collectives per step':<26}{gb(sum(moved.values())):>12}  (" + (", ".join(
        f"{k} {gb(v)}" for k, v in moved.items()) or "none") + ")")
    return lines


def _pipeline(plan: Plan) -> list[str]:
    if not plan.pipeline:
        return []
    p = plan.pipeline
    return ["", f"pipeline: {p['stages']} stages x {p['repeats']} repeat(s) of "
                f"{p['layers_per_group']} layer(s), {p['microbatches']} micro-batches; "
                f"bubble (S-1)/(R*M+S-1) = {p['bubble']:.1%}"
                + (f"; {p['padding_layers']} padding layer(s) after the last"
                   if p.get("padding_layers") else "") + "; stage-to-stage permutes "
                f"{gb(p['permute_bytes'])} per device per step (memory above is per "
                "stage: a device holds one)"]


def _work(plan: Plan) -> list[str]:
    """Compile time, FLOPs and HBM bytes per step, with where each count comes from."""
    f, h = plan.flops, plan.hlo_cost
    xla = f"{f['xla_per_device']:.4g} per device" if f["xla_per_device"] else \
        "not given by this compiler"
    counted = f"; counted with loop trips {f['counted_per_device']:.4g} per device" \
        if f.get("counted_per_device") else ""
    lines = [f"compile time: train {plan.compile_s['train']:.1f} s, eval "
             f"{plan.compile_s['eval']:.1f} s",
             f"FLOPs per step: analytic {f['analytic']:.4g} (6N x tokens + attention "
             f"{f['attention']:.4g})" + (f" + the remat forward {f['recompute']:.4g}"
                                         if f.get("recompute") else "")
             + f"{counted}; XLA cost analysis {xla} (loop bodies once)"]
    if h.get("bytes accessed"):
        own = h["compiler"].get("bytes accessed")
        lines.append(f"HBM bytes per step: {gb(h['bytes accessed'])} per device, counted with "
                     f"loop trips ({h['source']}; {h['loops']} loops"
                     + (f", {len(h['uncounted'])} of unreadable trips counted once"
                        if h["uncounted"] else "") + "); the compiler's own count "
                     + (f"{gb(own)} (loop bodies once)" if own else "not given"))
    if h.get("hbm bytes"):
        lines.append(f"  of them to or from HBM: {gb(h['hbm bytes'])} (accesses to buffers the "
                     "TPU compiler placed in VMEM left out; the HBM bound's bytes)")
    return lines


def _step_time(plan: Plan) -> list[str]:
    """The step-time estimate, the forecast and its range, and the bounds behind them."""
    e = plan.estimate
    if e["step_s"] is None:
        return [f"step time: no estimate ({e['source']})"]
    lines = [f"step time ({e['source']}): {e['step_s'] * 1e3:.4g} ms; "
             f"{e['tokens_per_s']:.4g} tokens/s (estimate)"]
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
                 f"{e['peak']}); HBM bound {e['memory_s'] * 1e3:.2f} ms from the "
                 f"{e['memory_bytes_source']}")
    if e.get("idle"):
        lines.append(f"  (the compute bound includes the pipeline's idle share, bubble and "
                     f"padding layers: / (1 - {e['idle']:.3f}))")
    if e["interconnect"]:
        link = "no estimate" if e["interconnect_s"] is None else \
            f"{e['interconnect_s'] * 1e3:.2f} ms"
        lines.append(f"  collectives {link}: {gb(plan.sent)} sent per device at least "
                     f"({e['interconnect']})")
    if e.get("dcn_sent"):
        share = "no estimate" if e["dcn_s"] is None else \
            f"{e['dcn_s'] * 1e3:.2f} ms, {e['dcn_s'] / plan.time_s:.1%} of the step"
        lines.append(f"    of them between the {plan.target.slices} slices (DCN): "
                     f"{gb(e['dcn_sent'])} per device at least, {share} ({e['dcn']})")
    if "xla_cost_model_s" in e:
        lines.append(f"  XLA cost model {e['xla_cost_model_s'] * 1e3:.2f} ms (+ Pallas "
                     "attention's analytic FLOPs at peak where used)")
    else:
        lines.append(f"  XLA cost model: no usable figure (optimal_seconds = "
                     f"{e['xla_optimal_seconds']})")
    return lines


def _cost(plan: Plan) -> list[str]:
    """The epoch's (or run's) time and price, or why there is none."""
    c = plan.cost
    if not c:
        return [] if plan.estimate["step_s"] is None else [
            "epoch: no estimate (the data's size is unknown until it is read: jaxaccel data "
            "prepare builds its cache, whose index then gives it; or set train.max_steps, "
            "data.train_examples or data.train_tokens)"]
    usd = usd_text(c["usd"]) if c["usd"] is not None else "no price"
    lines = [f"{c['unit']} (estimate): {c['steps']} steps x step time "
             f"{plan.estimate['step_s'] * 1e3:.4g} ms = {duration(c['seconds'])}, {usd} "
             f"({c['price']})",
             f"  the {c['unit']}'s steps: from {c['steps_from']}"]
    if "forecast_seconds" in c:
        usd = "" if c["usd"] is None else (
            f", {usd_text(c['forecast_usd'])} ({usd_text(c['forecast_low_usd'])}-"
            f"{usd_text(c['forecast_high_usd'])})")
        lines.append(f"  forecast: {duration(c['forecast_seconds'])} ("
                     f"{duration(c['forecast_low_seconds'])}-"
                     f"{duration(c['forecast_high_seconds'])}){usd}")
    return lines
