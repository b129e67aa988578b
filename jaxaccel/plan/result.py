"""What a plan is (``Plan``: the numbers ``make_plan`` found for one target) and its result file
(bench/results format), which ``jaxaccel compare`` joins with measured steps."""
from __future__ import annotations

import dataclasses
import datetime
import os
import subprocess

import jax

from jaxaccel import config as config_lib
from jaxaccel.plan import topology

CAVEATS = ("estimates, not measurements: the roofline is a lower bound on step time (real "
           "steps reach a fraction of peak); XLA's cost model does not cost Pallas kernels",
           "GPU targets compile without a device, so without autotuning: the HLO is close to, "
           "not identical to, a real GPU's")


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
    train_hlo: str = dataclasses.field(default="", repr=False)  # the compiled train step's HLO
    fp8_layers: str = ""    # fp8: which block Dense layers run it and why (compile.fp8_choice)

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
           "dcn_sent_bytes_per_device": e.get("dcn_sent"), "dcn_s": e.get("dcn_s"),
           "compile_s": plan.compile_s, "model_flops": plan.flops["analytic"],
           "fp8_layers": plan.fp8_layers or None,
           "xla_flops_per_device": plan.flops["xla_per_device"],
           "counted_flops_per_device": plan.flops.get("counted_per_device"),
           "hbm_bytes_per_device": plan.hlo_cost.get("bytes accessed"),
           "hbm_only_bytes_per_device": plan.hlo_cost.get("hbm bytes"),
           "memory_bound_s": e.get("memory_s"),
           "memory_bound_bytes": e.get("memory_bytes_source"),
           "hlo_cost": plan.hlo_cost,
           "roofline_s": e.get("roofline_s"), "xla_cost_model_s": e.get("xla_cost_model_s"),
           "xla_optimal_seconds": e.get("xla_optimal_seconds"),
           "peak": e.get("peak"),
           **{f"{c['unit']}_{k}": c[k] for k in ("steps", "seconds", "usd", "forecast_seconds",
                                                   "forecast_usd") if k in c},
           "price": c.get("price")}
    return {"bench": "plan", "device": t.device_kind, "backend": t.platform,
            "topology": t.name, "device_count": t.chips, "devices": len(t.devices),
            "slices": t.slices,
            "jax": jax.__version__, "jaxaccel": _git_sha(),
            "date": datetime.date.today().isoformat(), "model": plan.cfg.model.name,
            "seq": plan.seq, "mesh": plan.mesh, "config": plan.cfg.to_dict(),
            "caveats": list(CAVEATS), "notes": list(plan.notes), "rows": [row]}


def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(__file__)).stdout.strip() \
            or "unknown"
    except OSError:
        return "unknown"


def slug(name: str) -> str:
    """``v5e:2x4`` -> ``v5e_2x4`` (file names)."""
    return "".join(ch if ch.isalnum() else "_" for ch in name).strip("_")
