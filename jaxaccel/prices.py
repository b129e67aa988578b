"""On-demand cloud list prices per accelerator-hour, and user price files that override them.

``cost_usd = time_s / 3600 x usd_per_hour x devices``. A device kind (jax's ``device_kind``)
matches the first entry whose key it contains, case-insensitively; user entries come first.

The shipped figures are public on-demand list prices (no discounts, no committed use, no spot)
for one chip or one GPU, as listed on the pages named per line, as of the date given. Prices
change and differ by region: pass ``--prices FILE`` to use your own.

A price file is CSV with a header ``device,usd_per_hour[,source,date]`` or JSON
``{"device kind": usd_per_hour, ...}``.
"""
from __future__ import annotations

import csv
import json
import os
from typing import NamedTuple


class Price(NamedTuple):
    device: str
    usd_per_hour: float
    source: str
    date: str


_TPU = "https://cloud.google.com/tpu/pricing, on-demand per chip-hour, us-central"
_GCE = "https://cloud.google.com/compute/vm-instance-pricing, on-demand, us-central1"
PRICES = [
    # jax reports v5e as "TPU v5 lite", v6e as "TPU v6 lite", v5p as "TPU v5".
    Price("TPU v5 lite", 1.20, f"{_TPU} (v5e)", "2025"),
    Price("TPU v5e", 1.20, f"{_TPU} (v5e)", "2025"),
    Price("TPU v6 lite", 2.70, f"{_TPU} (v6e Trillium)", "2025"),
    Price("TPU v6e", 2.70, f"{_TPU} (v6e Trillium)", "2025"),
    Price("TPU v5p", 4.20, f"{_TPU} (v5p)", "2025"),
    Price("TPU v5", 4.20, f"{_TPU} (v5p)", "2025"),
    Price("TPU v4", 3.22, f"{_TPU} (v4, us-central2)", "2025"),
    Price("H100", 11.06, f"{_GCE}: a3-highgpu-8g $88.49/h / 8 H100 80GB (VM incl.)", "2025"),
    Price("A100-SXM4-80GB", 5.07, f"{_GCE}: a2-ultragpu-1g, 1 A100 80GB (VM incl.)", "2025"),
    Price("A100", 3.67, f"{_GCE}: a2-highgpu-1g, 1 A100 40GB (VM incl.)", "2025"),
]


def load(path: str) -> list[Price]:
    """Prices from a user file (CSV or JSON, see the module docstring)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--prices {path!r} does not exist; pass a CSV with columns "
                                "device,usd_per_hour[,source,date] or a JSON object.")
    with open(path) as f:
        text = f.read()
    try:
        if path.endswith(".json"):
            items = [(k, v, path, "") for k, v in json.loads(text).items()]
        else:
            items = [(r["device"], r["usd_per_hour"], r.get("source") or path, r.get("date") or "")
                     for r in csv.DictReader(text.splitlines())]
        prices = [Price(d, float(p), s, t) for d, p, s, t in items]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"--prices {path!r}: cannot read a price table ({e!r}); expected CSV "
                         "with header device,usd_per_hour[,source,date] or JSON "
                         '{"device kind": usd_per_hour}.') from None
    bad = [p for p in prices if not p.usd_per_hour > 0]
    if bad:
        raise ValueError(f"--prices {path!r}: usd_per_hour must be > 0, got {bad}.")
    return prices


def lookup(device_kind: str, table: list[Price]) -> Price:
    """The price of one device of this kind; an error naming ``--prices`` when unknown."""
    for p in table:
        if p.device.lower() in device_kind.lower():
            return p
    raise KeyError(f"no price for device {device_kind!r} (known: "
                   f"{sorted({p.device for p in table})}). Pass --prices FILE with a line "
                   f"'{device_kind},USD_PER_HOUR,source,date' (CSV header "
                   "device,usd_per_hour,source,date).")
