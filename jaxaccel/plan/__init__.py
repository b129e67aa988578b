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
  whichever is slowest (a lower bound: real steps reach a fraction of peak, see MFU in
  docs/, and overlap collectives with compute only in part); a pipeline's compute bound is
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

The package's modules, each one job: ``compile`` (``make_plan``: build, lower and compile the
steps; memory, collectives, FLOPs), ``estimate`` (step time, forecast, epoch cost), ``fit``
(device capacity, ``DoesNotFit`` and its fixes), ``report`` (the plan as text), ``result``
(``Plan`` and its result file), ``search`` (``--fit``), ``rank`` (several targets, ranked:
``plan_targets``), ``forecast``, ``topology``, ``collectives``, ``hlo_cost``, ``loops``.
"""
from jaxaccel.plan.compile import (CUBLAS_GEMMS, CUBLAS_NOTE, NO_TILING, abstract_batch,
                                   abstract_run, counted_cost, fp8_choice, load_config,
                                   make_plan, memory_of, plannable, shard_bytes, xla_cost)
from jaxaccel.plan.estimate import cost_of, estimate_step, forecast_of
from jaxaccel.plan.fit import (EXIT_DOES_NOT_FIT, GPU_MEMORY_FRACTION, DoesNotFit, StepRefused,
                               capacity, does_not_fit)
from jaxaccel.plan.report import duration, report, usd_text
from jaxaccel.plan.result import CAVEATS, Plan, result, slug

__all__ = ["CAVEATS", "CUBLAS_GEMMS", "CUBLAS_NOTE", "EXIT_DOES_NOT_FIT", "GPU_MEMORY_FRACTION",
           "NO_TILING", "DoesNotFit", "Plan", "StepRefused", "abstract_batch", "abstract_run",
           "capacity", "cost_of", "counted_cost", "does_not_fit", "duration", "estimate_step",
           "forecast_of", "fp8_choice", "load_config", "make_plan", "memory_of", "plannable",
           "report", "result", "shard_bytes", "slug", "usd_text", "xla_cost"]
