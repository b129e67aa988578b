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


def _price(path: str, where: str, device, usd, source, date) -> Price:
    """One price file entry, or ``ValueError`` naming ``where`` it is and what it holds."""
    try:
        price = Price(str(device), float(usd), source or path, date or "")
    except (TypeError, ValueError):
        price = None
    if price is None or not device or not price.usd_per_hour > 0:
        raise ValueError(f"--prices {path!r} {where}: expected a device name and a price in "
                         "USD per device-hour > 0 (CSV: device,usd_per_hour[,source,date]; "
                         'JSON: {"device kind": usd_per_hour}). Fix or delete that entry.')
    return price


def _csv_entries(path: str, text: str) -> list[tuple[str, Price]]:
    lines = text.splitlines()
    reader = csv.reader(lines)
    header = [h.strip() for h in next(reader, [])]
    if header[:2] != ["device", "usd_per_hour"]:
        raise ValueError(f"--prices {path!r} line 1: {lines[0] if lines else ''!r} is not the "
                         "header device,usd_per_hour[,source,date].")
    out = []
    for row in reader:
        if not any(cell.strip() for cell in row):
            continue
        where = f"line {reader.line_num}: {lines[reader.line_num - 1]!r}"
        cells = [c.strip() for c in row] + [""] * (4 - len(row))
        if len(row) > len(header) or len(row) < 2:
            raise ValueError(f"--prices {path!r} {where}: {len(row)} fields where the header "
                             f"has {len(header)} ({','.join(header)}). Fix that line.")
        out.append((where, _price(path, where, *cells[:4])))
    return out


class _Pairs(list):
    """A JSON object's (key, value) pairs in file order, duplicates kept."""


def _json_entries(path: str, text: str) -> list[tuple[str, Price]]:
    try:
        pairs = json.loads(text, object_pairs_hook=_Pairs)
    except json.JSONDecodeError as e:
        raise ValueError(f"--prices {path!r} is not valid JSON: {e.msg} at line {e.lineno}. "
                         "Fix the file.") from None
    if not isinstance(pairs, _Pairs):
        raise ValueError(f"--prices {path!r}: expected a JSON object "
                         '{"device kind": usd_per_hour, ...}.')
    out = []
    for device, usd in pairs:
        where = f"entry {device!r}: {usd!r}"
        out.append((where, _price(path, where, device, usd, path, "")))
    return out


def load(path: str) -> list[Price]:
    """Prices from a user file (CSV or JSON, see the module docstring); a bad entry or a
    device listed twice is refused, naming its line(s)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--prices {path!r} does not exist; pass a CSV with columns "
                                "device,usd_per_hour[,source,date] or a JSON object.")
    with open(path) as f:
        text = f.read()
    entries = (_json_entries if path.endswith(".json") else _csv_entries)(path, text)
    first = {}
    for where, price in entries:
        key = price.device.lower()
        if key in first:
            raise ValueError(f"--prices {path!r} lists device {price.device!r} twice: "
                             f"{first[key]} and {where}. Keep one of them.")
        first[key] = where
    return [price for _, price in entries]


def lookup(device_kind: str, table: list[Price]) -> Price:
    """The price of one device of this kind; an error naming ``--prices`` when unknown."""
    for p in table:
        if p.device.lower() in device_kind.lower():
            return p
    raise KeyError(f"no price for device {device_kind!r} (known: "
                   f"{sorted({p.device for p in table})}). Pass --prices FILE with a line "
                   f"'{device_kind},USD_PER_HOUR,source,date' (CSV header "
                   "device,usd_per_hour,source,date).")
