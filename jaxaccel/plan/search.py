"""``jaxaccel compile --fit``: a run that does not fit a target, made to fit by the fixes the
does-not-fit message names, each tried by compiling; the fastest that fits is the answer.

MaxText's estimator searches the batch against rematerialisation by compiling; this searches,
around the config as given (every other setting kept, the optimizer batch never changed):

- the mesh: the devices the batch axes span (``data`` x ``fsdp``, after ``tensor`` and
  ``stage``) split between data parallelism and FSDP: the config's own split, then
  all-FSDP, then the splits between;
- remat: the config's policy, then where the mesh fits nothing with it, each policy that keeps
  less (``models.remat.LADDER``: none, minimal, save_dot_except_mlpwi, save_dot_except_mlp,
  save_qkv_proj, full) in turn (the recomputed forward is in the plan's estimate, so a policy
  that keeps less never makes a step faster);
- gradient accumulation: for each of those, the fewest micro-batches (``train.grad_accum``, a
  divisor of the batch that leaves each batch-axis device whole rows) that fits, found by
  bisection from the first compile's memory (temporaries scale with the micro-batch);
- the eval batch: halved while the eval step alone does not fit (training is unchanged).

A mesh whose parameters, optimizer state and batch alone exceed the device is left after one
compile (neither remat nor accumulation shrinks them). Every candidate is a full plan
(``make_plan``), so the fastest is chosen by the plan's own estimate per optimizer step; the
search stops after ``limit`` compiles and says so.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

from jaxaccel import sharding
from jaxaccel.models import remat
from jaxaccel.plan import topology
from jaxaccel.plan.compile import load_config, make_plan, plannable
from jaxaccel.plan.fit import DoesNotFit, StepRefused
from jaxaccel.plan.result import Plan

LIMIT = 12


@dataclasses.dataclass
class Candidate:
    changes: dict               # config key -> value, beyond the user's --set
    plan: Plan | None           # None: the compiler refused it, or it is not a valid run
    error: str | None = None    # why it does not fit or is not valid; None: it fits
    step: str | None = None     # the step that did not fit ("train" / "eval")
    compiled: bool = True       # False: refused before compiling (not a valid run, not built)

    @property
    def fits(self) -> bool:
        return self.error is None and self.plan is not None

    @property
    def sets(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.changes.items()]

    def describe(self) -> str:
        return " ".join(f"--set {s}" for s in self.sets) or "the config as given"

    def outcome(self) -> str:
        if self.fits:
            e = self.plan.estimate
            if self.plan.time_s is None:
                return "fits (no step-time estimate for this device)"
            return (f"fits, step {self.step_s * 1e3:.4g} ms "
                    f"({e.get('forecast_source') or e['source']})")
        if self.plan is None:           # refused before or by the compiler: its own words
            return self.error if len(self.error) < 200 else self.error[:197] + "..."
        return f"does not fit ({self.step} step)"

    @property
    def step_s(self) -> float:
        """The plan's step time (``Plan.time_s``), inf where there is none."""
        s = self.plan.time_s if self.plan else None
        return math.inf if s is None else s


@dataclasses.dataclass
class Search:
    target: str
    tried: list[Candidate]
    best: Candidate | None
    stopped: str | None         # why the search ended before trying everything, or None

    def summary(self) -> str:
        compiled = sum(c.compiled for c in self.tried)
        count = f"{compiled} configurations compiled" if compiled == len(self.tried) else \
            f"{len(self.tried)} configurations tried, {compiled} compiled"
        lines = [f"fit search on {self.target}: {count}"]
        for c in self.tried:
            lines.append(f"  {c.describe()}: {c.outcome()}")
        if self.best:
            lines.append(f"fastest that fits: {self.best.describe()} (by the plans' step "
                         "estimates; on a tie, the fewest micro-batches and changes)")
        else:
            lines.append("nothing tried fits" + (f" ({self.stopped})" if self.stopped else "")
                         + ": " + why_none(self))
        if self.stopped and self.best:
            lines.append(f"(the search stopped early: {self.stopped})")
        return "\n".join(lines)


def why_none(s: Search) -> str:
    """What the search found when nothing fits: the smallest state it saw against the device."""
    seen = [c.plan for c in s.tried if c.plan is not None]
    if not seen:
        return ("every candidate was refused (the reasons are above); a target with more "
                "memory per chip or more chips, or other settings")
    least = min(seen, key=lambda p: p.memory["params"] + p.memory["opt_state"])
    state = least.memory["params"] + least.memory["opt_state"]
    return (f"the least parameter and optimizer state per device seen was {state / 1e9:.3g} GB "
            f"of {least.capacity / 1e9:.3g} GB; a target with more memory per chip or more "
            "chips")


def _batch_axes(cfg, devices: int) -> tuple[int, int]:
    """(devices on the batch axes = data x fsdp, the config's fsdp) as the mesh resolves."""
    shape = dict(zip(sharding.MESH_AXES, sharding.mesh_shape(dict(cfg.mesh), devices)))
    return shape["data"] * shape["fsdp"], shape["fsdp"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(config_path: str | None, sets: list[str], topology_name: str, *,
           device_memory: float | None = None, limit: int = LIMIT,
           progress: Callable[[str], None] = lambda line: None) -> Search:
    """Search what fits ``topology_name`` (module doc). The config as given is tried first; if
    it fits, that is the answer."""
    target = topology.resolve(topology_name)
    cfg, _ = plannable(load_config(config_path, sets, target))
    rows, own_fsdp = _batch_axes(cfg, len(target.devices))
    t = cfg.train
    tried: list[Candidate] = []

    def attempt(changes: dict) -> Candidate:
        c = Candidate(dict(changes), None)
        try:
            c.plan = make_plan(config_path, [*sets, *c.sets], topology_name,
                               device_memory=device_memory)
        except DoesNotFit as e:
            c.plan, c.error, c.step = e.plan, str(e), e.step
        except StepRefused as e:                # a smaller micro-batch may build
            c.error, c.step, c.compiled = f"cannot be built: {e}", e.step, False
        except ValueError as e:                 # a combination the run refuses
            if not changes:     # the config as given: no change searched makes it valid
                raise
            c.error, c.compiled = f"not a valid run: {e}", False
        tried.append(c)
        progress(f"fit search [{len(tried)}/{limit}] {c.describe()}: {c.outcome()}")
        return c

    first = attempt({})
    if first.fits:
        return Search(target.name, tried, first, None)
    meshes, own, remats, accums = _ladders(cfg, rows, own_fsdp)
    if not accums:
        return Search(target.name, tried, None,
                      f"no gradient accumulation of train.batch_size={t.batch_size} from "
                      f"train.grad_accum={t.grad_accum} up leaves each of the {rows} batch-axis "
                      "devices whole rows")
    stopped = None
    for fsdp in meshes:
        mesh = {} if fsdp == own_fsdp else {"mesh.data": rows // fsdp, "mesh.fsdp": fsdp}
        for name in remats:
            base = {**mesh, **({"model.remat": name} if name != own else {})}
            outcome = _fewest_accum(attempt, base, accums, t, rows, first if not base else None,
                                    lambda: len(tried) >= limit)
            if outcome == "limit":
                stopped = f"the limit of {limit} compiles (--fit N raises it)"
                break
            if outcome in ("state", "fits"):   # remat shrinks no state; after a fit without
                break                           # it, it only adds compute (a slower step)
        if stopped:
            break
    fitting = [c for c in tried if c.fits]
    best = min(fitting, key=lambda c: (c.step_s, c.changes.get("train.grad_accum", 0),
                                       len(c.changes))) if fitting else None
    return Search(target.name, tried, best, stopped)


def _ladders(cfg, rows: int, own_fsdp: int) -> tuple[list, str, list, list]:
    """What the search walks: the meshes (fsdp of each), the config's remat policy and those
    after it, and the gradient accumulations that leave each batch-axis device whole rows."""
    t = cfg.train
    # The config's own split, then all-FSDP (the least state per device), then the splits
    # between, most FSDP first.
    meshes = sorted(_divisors(rows), key=lambda f: (f != own_fsdp, -f))
    own = remat.of(cfg.model.remat).name
    remats = list(remat.LADDER[remat.LADDER.index(own):]) if own in remat.LADDER \
        else [own, "full"]
    # Every split keeps data x fsdp = rows, so the same accumulations are valid on each.
    accums = [a for a in _divisors(t.batch_size)
              if a >= t.grad_accum and (t.batch_size // a) % rows == 0]
    return meshes, own, remats, accums


def _fewest_accum(attempt, base: dict, accums: list[int], t, rows: int,
                  known: Candidate | None, out_of_budget) -> str:
    """Bisect ``accums`` for the fewest micro-batches that fit with ``base``'s mesh and remat
    (``known``: base's own result, already compiled). Returns "fits", "none", "state" (the
    state alone exceeds the device) or "limit"."""
    lo, hi, i = -1, None, 0
    eval_batch = t.eval_batch_size
    while True:
        changes = {**base}
        if accums[i] != t.grad_accum:
            changes["train.grad_accum"] = accums[i]
        if eval_batch != t.eval_batch_size:
            changes["train.eval_batch_size"] = eval_batch
        if known is not None and not changes:
            c, known = known, None
        elif out_of_budget():
            return "limit"
        else:
            c = attempt(changes)
        if c.fits:
            hi = i
        elif c.error.startswith("not a valid"):
            return "none"
        elif c.step == "eval":
            if eval_batch // 2 < rows or (eval_batch // 2) % rows:
                return "none"
            eval_batch //= 2            # training fits at this accumulation: retry the same i
            continue
        else:
            lo = i
            if c.plan is not None and _state_exceeds(c.plan):
                return "state"
        if hi is not None:
            if hi - lo <= 1:
                return "fits"
            i = (lo + hi) // 2
        else:
            i = _next_index(accums, lo, c.plan, c.error)
            if i is None:
                return "none"


def _state_exceeds(p: Plan) -> bool:
    m = p.memory
    return m["total"] - m["temp"] >= p.capacity


REFUSED = re.compile(r"temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")


def _next_index(accums: list[int], failed: int, p: Plan | None,
                error: str = "") -> int | None:
    """The next accumulation to try after ``accums[failed]`` did not fit: the one its
    temporaries, scaled with the micro-batch, predict fits (from the plan's memory, or from
    the TPU compiler's refusal, which gives the temporaries and the HBM; at least twice the
    micro-batches where there are no numbers)."""
    if failed + 1 >= len(accums):
        return None
    want = 2.0 * accums[failed]
    refused = REFUSED.search(error or "")
    if p is not None:
        m = p.memory
        room = p.capacity - (m["total"] - m["temp"])
        want = accums[failed] * m["temp"] / room
    elif refused:                   # the state's share is unknown: a lower bound on the factor
        want = max(want, accums[failed] * float(refused[1]) / float(refused[2]))
    return next((j for j in range(failed + 1, len(accums)) if accums[j] >= want),
                len(accums) - 1)
