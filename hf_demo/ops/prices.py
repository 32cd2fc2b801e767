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


def load(path: str | Path) -> Prices:
    """Read a price table; a missing key is named with the file."""
    table = read_toml(path)
    compute, traffic = table.get("compute", {}), table.get("traffic", {})
    device, node = compute.get("device_per_hour"), compute.get("node_per_hour")
    if device is None and node is None:
        raise ValueError(f"{path}: [compute] needs device_per_hour or node_per_hour (price per hour)")
    if "per_gb" not in traffic:
        raise ValueError(f"{path}: [traffic] needs per_gb (price of one GB between sites)")
    return Prices(
        currency=str(table.get("currency", "USD")),
        per_gb=float(traffic["per_gb"]),
        device_per_hour=None if device is None else float(device),
        node_per_hour=None if node is None else float(node),
    )
