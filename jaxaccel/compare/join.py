"""Result files read and joined (``join``): each row a ``Candidate`` (time, cost, energy, its
software) in a ``Group`` of the rows that ran the same work with the same software; what is left
out, with why."""
from __future__ import annotations

import collections
import dataclasses
import json
import os

from jaxaccel.compare import energy, prices

# Fields that say what work a row did, per bench: (file-level fields, row-level fields).
WORK_FIELDS = {
    "train_step": (("model", "seq"), ("batch",)),
    "attention": ((), ("shape", "mode", "B", "S", "H", "D", "causal", "dtype")),
    "optimizer": (("model", "parameters"), ()),
    "scaling": (("model", "seq", "batch"), ("strategy",)),
}
# Result files whose rows join another bench's: a compile-time plan (`jaxaccel compile`) of a
# step sits beside measured steps of the same model, sequence and global batch, its time,
# tokens/s and cost marked as estimates (the row's ``time_source``).
SAME_WORK_AS = {"plan": "train_step"}


@dataclasses.dataclass
class Candidate:
    """One row of one result file, with the metrics the score needs."""
    label: str
    device: str
    config: str
    file: str
    software: str
    time_s: float
    cost_usd: float
    price: str
    energy_j: float
    energy_source: str
    row: dict
    time_source: str = "measured"      # or "estimate:..." (a compile-time plan)
    utilisation: float | None = None
    normalised: dict = dataclasses.field(default_factory=dict)
    scores: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Group:
    bench: str
    work: dict
    candidates: list
    utilisation_source: str | None = None
    notes: list = dataclasses.field(default_factory=list)

    @property
    def title(self) -> str:
        work = ", ".join(f"{k}={v}" for k, v in self.work.items() if v is not None)
        return f"{self.bench}: {work}" if work else self.bench


def load_results(paths: list[str]) -> list[tuple[str, dict]]:
    """``(path, result)`` per file; clear errors for a missing or malformed file."""
    out = []
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"result file {path!r} does not exist; pass files written by "
                                    "`jaxaccel bench` (bench/results/<bench>-<device>.json).")
        try:
            with open(path) as f:
                result = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"result file {path!r} is not JSON ({e}).") from None
        missing = [k for k in ("bench", "device", "rows") if k not in result]
        if missing:
            raise ValueError(f"result file {path!r} lacks {missing}; expected the bench JSON "
                             '{"bench", "device", ..., "rows": [...]}.')
        if not result["rows"]:
            raise ValueError(f"result file {path!r} has no rows: nothing to compare from it "
                             "(did its bench run fail?). Run the bench again, or leave the "
                             "file out.")
        out.append((path, result))
    return out


def check_comparable(report: dict) -> None:
    """``ValueError`` saying why, when no two rows of the report could be compared."""
    if not report["groups"]:
        why = "; ".join(f"{x['row']} ({x['file']}): {x['why']}" for x in report["left_out"])
        raise ValueError(f"nothing to compare: no two rows ran the same work with the same "
                         f"software. {why or 'No rows.'} Pass result files of the same bench "
                         "and work from two devices or configurations.")


def bench_of(result: dict) -> str:
    """The bench whose work a result file's rows did (``SAME_WORK_AS``)."""
    return SAME_WORK_AS.get(result["bench"], result["bench"])


def work_of(result: dict, row: dict) -> dict:
    """What a row computed: joins rows across files and configurations."""
    bench = bench_of(result)
    if bench in WORK_FIELDS:
        top, per_row = WORK_FIELDS[bench]
        return {**{k: result.get(k) for k in top}, **{k: row.get(k) for k in per_row}}
    return {**result.get("work", {}), **row.get("work", {})}


def _time(row: dict, path: str) -> float:
    t = row.get("time_s", row.get("median_s"))
    if not isinstance(t, (int, float)) or not t > 0:
        raise ValueError(f"{path}: row {row.get('name')!r} has no positive time_s or median_s "
                         f"(got {t!r}).")
    return float(t)


def _energy(result: dict, row: dict, seconds: float) -> tuple[float, str]:
    """Measured or recorded energy; else the labelled TDP estimate (never zero)."""
    if "energy_j" in row:
        return float(row["energy_j"]), row.get("energy_source", result.get("energy_source",
                                                                           "unknown"))
    if "energy_kwh" in row:
        return float(row["energy_kwh"]) * 3.6e6, row.get("energy_source",
                                                          result.get("energy_source", "unknown"))
    devices = result.get("energy_devices", result.get("device_count", 1))
    est = energy.estimate(result["device"], devices, seconds, row.get("mfu"))
    return est["energy_j"], est["energy_source"]


def candidates(loaded: list[tuple[str, dict]], price_table: list) -> list[tuple]:
    """Every row as ``(bench, work, Candidate)``."""
    out = []
    for path, result in loaded:
        software = f"jax {result.get('jax', '?')} @ {result.get('jaxaccel', '?')}"
        devices = result.get("device_count", 1)
        for row in result["rows"]:
            seconds = _time(row, path)
            if "cost_usd" in row:
                cost, price = float(row["cost_usd"]), "recorded in the result file"
            else:
                p = prices.lookup(result["device"], price_table)
                cost = seconds / 3600 * p.usd_per_hour * devices
                price = f"{p.device}: ${p.usd_per_hour}/h x {devices} ({p.source}, {p.date})"
            joules, source = _energy(result, row, seconds)
            name = row.get("name", "?")
            label = f"{result['device']} / {name}" + (f" x{devices}" if devices > 1 else "")
            out.append((bench_of(result), work_of(result, row),
                        Candidate(label, result["device"], name, path, software, seconds, cost,
                                  price, joules, source, row,
                                  row.get("time_source", "measured"))))
    return out


def join(cands, mixed_versions: bool = False) -> tuple[list[Group], list[dict]]:
    """Groups of candidates that ran the same work with the same software; and what was left
    out, with the reason."""
    groups: dict = collections.OrderedDict()
    for bench, work, c in cands:
        key = (bench, json.dumps(work, sort_keys=True, default=str))
        groups.setdefault(key, Group(bench, work, [])).candidates.append(c)
    kept, left_out = [], []

    def leave(c, why):
        left_out.append({"row": c.label, "file": c.file, "why": why})
    for g in groups.values():
        counts = collections.Counter(c.software for c in g.candidates)
        main = max(counts, key=lambda s: (counts[s], -[c.software for c in g.candidates]
                                          .index(s)))
        seen, members = set(), []
        for c in g.candidates:
            if c.software != main and not mixed_versions:
                leave(c, f"software {c.software} differs from the group's {main} "
                         f"({g.title}); rerun on one version or pass --mixed-versions")
            elif c.label in seen:
                leave(c, f"duplicate of {c.label!r} in an earlier file ({g.title})")
            else:
                seen.add(c.label)
                members.append(c)
        if len(counts) > 1 and mixed_versions:
            g.notes.append(f"joined across software versions (--mixed-versions): "
                           f"{sorted(counts)}")
        if len(members) < 2:
            for c in members:
                leave(c, f"nothing else ran the same work ({g.title})")
            continue
        g.candidates = members
        kept.append(g)
    return kept, left_out
