"""Compare benchmark results across devices and configurations: time, cost, energy, utilisation.

Rows of the result files (``bench/results/<bench>-<device>.json``) are joined into groups that
ran the same work (the same bench and the fields in ``WORK_FIELDS``, or a file's ``work``
object); within a group each row is a candidate "device / configuration". Rows run with other
software (jax version, jaxaccel commit) than the group's majority are left out, and so are
duplicate candidates and groups of one, each with the reason.

Per candidate: time T (``time_s``, else ``median_s``), cost C = ``cost_usd`` or
T / 3600 x price per device-hour x devices, energy E (``energy_j``, or ``energy_kwh``; rows
without any get the labelled TDP estimate of jaxaccel/compare/energy.py) and utilisation O (MFU, else
NVML ``gpu_util_pct``, else ``occupancy_pct``: the first source every candidate has; none: the
O term is 0 and the table says so). Each metric is max-normalised over the group
(x / max x) and the study's score, lower is better, is::

    score = w1 T + w2 C + w3 E - w4 O,   w4 = 0.1

under seven strategies: ``balance`` (0.3, 0.3, 0.3) and, for each order of time, cost and
energy, the weights 0.5 / 0.3 / 0.1 in that order.

Modules: ``join`` (result files read, rows joined into groups), ``score`` (the score, and
``compare``: load, join, score, rank), ``tables`` (Markdown, records), ``plots``, ``outputs``
(``write``: the files of a comparison), ``energy`` (meters and TDP estimates), ``prices``.
"""
from jaxaccel.compare import energy, prices
from jaxaccel.compare.join import (SAME_WORK_AS, WORK_FIELDS, Candidate, Group, bench_of,
                                   candidates, check_comparable, join, load_results, work_of)
from jaxaccel.compare.outputs import write
from jaxaccel.compare.plots import plot_group
from jaxaccel.compare.score import STRATEGIES, UTILISATION, W4, compare, parse_weights, score
from jaxaccel.compare.tables import markdown, table_rows

__all__ = ["SAME_WORK_AS", "STRATEGIES", "UTILISATION", "W4", "WORK_FIELDS", "Candidate", "Group",
           "bench_of", "candidates", "check_comparable", "compare", "energy", "join",
           "load_results", "markdown", "parse_weights", "plot_group", "prices", "score",
           "table_rows", "work_of", "write"]
