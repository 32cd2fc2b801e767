"""The price table: what a device-hour and a GB between sites cost (the TOML of ``benchmarks/prices.toml``).

    currency = "USD"
    [compute]
    device_per_hour = 2.5     # or node_per_hour = 20.0 (divided by the devices per node)
    [traffic]
    per_gb = 0.02             # one GB leaving a site towards another

The planner prices an epoch and the training monitor a running run with the same :class:`Prices`. TOML is
read with the standard library's ``tomllib`` (Python 3.11+), on Python 3.10 with ``tomli`` (a dependency there).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from pathlib import Path


def _toml():
    """``tomllib``, else (Python 3.10) ``tomli``, its backport; an ImportError saying how to get it."""
    for name in ("tomllib", "tomli"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("reading a price table on Python 3.10 needs tomli (pip install tomli; Python 3.11+ has tomllib)")


@dataclass(frozen=True)
class Prices:
    currency: str
    per_gb: float
    device_per_hour: float | None = None
    node_per_hour: float | None = None

    def per_device_hour(self, devices_per_node: int) -> float:
        """A device-hour's price: ``device_per_hour``, or ``node_per_hour`` shared by the node's devices."""
        if self.device_per_hour is not None:
            return self.device_per_hour
        return self.node_per_hour / max(1, devices_per_node)

    def cost(self, device_hours: float, gb_between_sites: float, devices_per_node: int) -> float:
        return device_hours * self.per_device_hour(devices_per_node) + gb_between_sites * self.per_gb


def read_toml(path: str | Path) -> dict:
    """A TOML file as a dict (``tomllib``, or ``tomli`` on Python 3.10)."""
    toml = _toml()
    with open(path, "rb") as f:
        return toml.load(f)


KEYS = {  # the keys of a price table, each table's own (``what``: a free-text description)
    "": ("currency", "compute", "traffic"),
    "compute": ("device_per_hour", "node_per_hour", "what"),
    "traffic": ("per_gb", "what"),
}
MAX_PRICE = 1e9  # per device-hour or per GB: anything above is a typo


def price(path, where: str, value) -> float:
    """``value`` as a price: a finite number in [0, MAX_PRICE] (not a boolean, not a string); ValueError naming
    ``where``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{path}: {where} = {value!r}: write a price as a number, e.g. {where.split('.')[-1]} = 2.5")
    if not (math.isfinite(value) and 0 <= value <= MAX_PRICE):
        raise ValueError(f"{path}: {where} = {value!r}: a price must be a finite number in [0, {MAX_PRICE:g}]")
    return float(value)


def _table(path, table: dict, name: str) -> dict:
    """``table[name]`` (the whole table for ``name=""``), checked to be a table of known keys."""
    part = table if not name else table.get(name, {})
    if not isinstance(part, dict):
        raise ValueError(f"{path}: {name} = {part!r}: [{name}] must be a table, e.g. [{name}] then its keys below")
    unknown = sorted(set(part) - set(KEYS[name]))
    if unknown:
        where = f"[{name}]" if name else "the top level"
        raise ValueError(f"{path}: unknown key {unknown[0]!r} at {where}: the keys there are {', '.join(KEYS[name])}")
    return part


def load(path: str | Path) -> Prices:
    """Read a price table; a missing, unknown or mistyped key, or a price that is not a finite number >= 0, is
    named with the file (ValueError)."""
    table = read_toml(path)
    _table(path, table, "")
    compute, traffic = _table(path, table, "compute"), _table(path, table, "traffic")
    device, node = compute.get("device_per_hour"), compute.get("node_per_hour")
    if device is None and node is None:
        raise ValueError(f"{path}: [compute] needs device_per_hour or node_per_hour (price per hour)")
    if device is not None and node is not None:
        raise ValueError(f"{path}: [compute] has device_per_hour and node_per_hour: keep one")
    if "per_gb" not in traffic:
        raise ValueError(f"{path}: [traffic] needs per_gb (price of one GB between sites)")
    currency = table.get("currency", "USD")
    if not isinstance(currency, str) or not currency.strip() or len(currency) > 16:
        raise ValueError(f'{path}: currency = {currency!r}: write a short name in quotes, e.g. currency = "USD"')
    return Prices(
        currency=currency,
        per_gb=price(path, "traffic.per_gb", traffic["per_gb"]),
        device_per_hour=None if device is None else price(path, "compute.device_per_hour", device),
        node_per_hour=None if node is None else price(path, "compute.node_per_hour", node),
    )
