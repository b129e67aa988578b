"""The kernels of a compiled GPU step by what they do, and the HBM bytes each moves: where an fp8
step's time goes beside a bf16 one's.

    found = kernels.of(compiled.as_text())
    kernels.summary(found)   # GEMMs by dtype, everything outside them, fp8's own work

Each instruction of the step's computations that launches work (``hlo_cost.by_instruction``:
the entry's and every loop body's) is one kernel, run as often as its computation runs (a
scanned layer body once per layer), with XLA's HloCostAnalysis bytes. A kernel is

- a **GEMM**: a cuBLAS or cuBLASLt custom call (``__cublas$gemm``, ``__cublas$lt$matmul``, the
  fp8 one ``__cublas$lt$matmul$f8``) or a fusion around a ``dot`` (a Triton GEMM); its dtype is
  that of the operands it reads (``f8`` where they are float8). An fp8 GEMM says whether XLA
  fused its scaling into it: the scalar operands it takes (cuBLASLt's ``a_scale``, ``b_scale``,
  ``c_scale``, ``d_scale``; the constant 1 XLA's rewriter passes where it matched no scale is
  left out) and whether it returns a scalar beside its product (the output's amax);
- or **outside the GEMMs**, where it is **fp8 work** when it computes something of the fp8
  matmul (``jaxaccel.models.fp8`` runs it under the ``fp8`` name scope, which the op_name
  metadata keeps, forward and backward) or moves float8 arrays, tagged by what its instructions
  do (``KINDS``): ``amax`` (abs and max reductions), ``scale`` (the new scale from the history's
  maximum), ``history`` (the roll that adds this step's amax, and the histories gathered and
  put back by ``models.fp8.advance``), ``quantize`` (divide, clip,
  convert to float8), ``dequantize``, ``transpose`` and ``fp8 copy`` (float8 arrays laid out
  again or stacked for the backward pass). ``alone`` says the kernel does nothing else (it was
  not fused into a producer or consumer of the model's own work).
"""
from __future__ import annotations

import dataclasses
import re

from jaxaccel.plan import hlo_cost
from jaxaccel.plan import loops as loops_lib

KINDS = ("amax", "scale", "history", "quantize", "dequantize", "transpose", "fp8 copy")
_FP8 = re.compile(r"[(/]fp8[)/]")                      # the fp8 name scope in an op_name
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_F8 = re.compile(r"\bf8e\w+\[")
_SCALAR = re.compile(r"^f32\[(1)?\]")
_MOVES = {"parameter", "constant", "bitcast", "broadcast", "get-tuple-element", "tuple",
          "reshape", "copy", "transpose", "dynamic-slice", "dynamic-update-slice", "slice",
          "concatenate", "convert"}


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    runs: float             # per step
    bytes: float            # per step (HloCostAnalysis bytes accessed x runs)
    gemm: str | None        # operand dtype of a GEMM ("f8", "bf16", ...), None outside GEMMs
    form: str               # a GEMM's "cublaslt fp8", "cublaslt", "cublas", "triton"; else opcode
    kinds: frozenset        # fp8 work outside GEMMs (KINDS)
    alone: bool             # fp8 work that fused nothing else into its kernel
    scale_operands: int = 0     # an fp8 GEMM's scalar f32 operands, constants (1) left out
    amax_output: bool = False   # an fp8 GEMM's scalar f32 second output


def _op_name(i: loops_lib.Instruction) -> str:
    return (_OP_NAME.search(i.attributes) or [None, ""])[1]


def _operands(i: loops_lib.Instruction, computation: dict) -> list[str]:
    """The shapes of ``i``'s operands that are instructions of its ``computation``."""
    return [computation[o].shape for o in i.operands if o in computation]


def _bytes(shapes) -> int:
    """The logical bytes of arrays (a cuBLAS call's operands and outputs, which XLA's cost
    analysis does not cost), its s8 workspace left out."""
    return sum(hlo_cost.array_bytes(shape, leave_out=("s8",)) for shape in shapes)


def _kind(i: loops_lib.Instruction, computation: dict) -> str | None:
    """What fp8 work instruction ``i`` (of ``computation``) does (``KINDS``), or None: model
    work, or bookkeeping (broadcasts, converts of scales, tuples)."""
    name = _op_name(i)
    f8_out = bool(_F8.match(i.shape))
    if not _FP8.search(name):
        return "fp8 copy" if f8_out and i.opcode not in ("parameter", "bitcast") else None
    primitive = name.rsplit("/", 1)[-1]
    f8_in = any(_F8.match(s) for s in _operands(i, computation))
    if "_roll_static" in name or primitive in ("scatter", "dynamic_update_slice", "slice",
                                               "concatenate"):
        return "history"
    if primitive in ("is_finite", "gt", "select_n"):      # compute_scale's guards
        return "scale"
    if primitive in ("abs", "reduce_max"):
        return "amax"
    if "clip" in name or primitive == "div" or f8_out and primitive == "convert_element_type":
        return "quantize"
    if primitive == "transpose":
        return "transpose"
    if primitive == "mul" or f8_in and primitive == "convert_element_type":
        return "dequantize"
    return None


def _inside(i: loops_lib.Instruction, computations: dict) -> list:
    """``[(instruction, its computation)]`` a fusion (or a call) runs, nested ones too."""
    found, todo = [], [c for _, c in loops_lib.callees(i)]
    while todo:
        computation = computations.get(todo.pop(), {})
        for j in computation.values():
            found.append((j, computation))
            todo += [c for _, c in loops_lib.callees(j)]
    return found


def _gemm(i: loops_lib.Instruction, inside: list, operands: list):
    """``(dtype, form)`` of a GEMM kernel, or None."""
    target = (_TARGET.search(i.attributes) or [None, ""])[1]
    if i.opcode == "custom-call" and "cublas" in target:
        dtype = "f8" if target.endswith("$f8") else operands[0].split("[")[0]
        form = "cublaslt fp8" if target.endswith("$f8") else \
            "cublaslt" if "$lt$" in target else "cublas"
        return dtype, form
    dots = [j for j, _ in inside if j.opcode in ("dot", "convolution")]
    if i.opcode != "fusion" or not dots:
        return None
    params = [j.shape for j, _ in inside if j.opcode == "parameter"]
    dtype = "f8" if any(_F8.match(s) for s in params) else dots[0].shape.split("[")[0]
    return dtype, "triton"


def of(hlo: str) -> list[Kernel]:
    """The kernels of a compiled step's optimized HLO text (module docstring); [] where this
    jaxlib cannot cost HLO."""
    computations, _ = loops_lib.parse(hlo)
    found = []
    for i, comp, runs, cost in hlo_cost.by_instruction(hlo):
        inside = _inside(i, computations)
        step_bytes = cost["bytes accessed"] * runs
        operands = _operands(i, computations[comp])
        gemm = _gemm(i, inside, operands)
        if gemm is not None:
            dtype, form = gemm
            outputs = re.findall(r"\w+\[[\d,]*\]", i.shape)
            if i.opcode == "custom-call":
                step_bytes = _bytes([*operands, i.shape]) * runs
            scales = [o for o in i.operands if o in computations[comp]
                      and computations[comp][o].opcode != "constant"
                      and _SCALAR.match(computations[comp][o].shape)]
            found.append(Kernel(
                i.name, runs, step_bytes, dtype, form, frozenset(), False,
                scale_operands=len(scales),
                amax_output=i.shape.startswith("(") and any(_SCALAR.match(s) for s in outputs[1:])))
            continue
        work = inside or [(i, computations[comp])]
        kinds = {k for j, c in work if (k := _kind(j, c))}
        model_work = any(_kind(j, c) is None and j.opcode not in _MOVES
                         and not _FP8.search(_op_name(j))
                         for j, c in work)
        found.append(Kernel(i.name, runs, step_bytes, None, i.opcode, frozenset(kinds),
                            bool(kinds) and not model_work))
    return found


def _tally(kernels) -> dict:
    return {"kernels": round(sum(k.runs for k in kernels)), "bytes": sum(k.bytes for k in kernels)}


def summary(found: list[Kernel]) -> dict:
    """Per step: every kernel; the GEMMs by dtype and form; everything outside the GEMMs; of
    that, fp8's own work by its kinds (``"amax+quantize"``: kernels doing both), with how many
    kernels do nothing else (``alone``); and how XLA fused the fp8 GEMMs' scaling."""
    gemms = [k for k in found if k.gemm]
    outside = [k for k in found if not k.gemm]
    fp8_work = [k for k in outside if k.kinds]
    by_kind: dict = {}
    for k in fp8_work:
        by_kind.setdefault("+".join(x for x in KINDS if x in k.kinds), []).append(k)
    fp8_gemms = [k for k in gemms if k.gemm == "f8"]
    return {
        "all": _tally(found),
        "gemms": {f"{d} {f}": _tally([k for k in gemms if (k.gemm, k.form) == (d, f)])
                  for d, f in sorted({(k.gemm, k.form) for k in gemms})},
        "outside_gemms": _tally(outside),
        "fp8_work": {**_tally(fp8_work), "alone": _tally([k for k in fp8_work if k.alone]),
                     "by_kind": {name: {**_tally(ks), "alone": round(sum(
                         k.runs for k in ks if k.alone))} for name, ks in sorted(
                             by_kind.items(), key=lambda kv: -sum(k.bytes for k in kv[1]))}},
        "fp8_gemms": {**_tally(fp8_gemms),
                      "with_scale_operands": round(sum(k.runs for k in fp8_gemms
                                                       if k.scale_operands >= 2)),
                      "with_amax_output": round(sum(k.runs for k in fp8_gemms
                                                    if k.amax_output))},
    }
