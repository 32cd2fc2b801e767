"""``hf-demo plan``: every method on a cluster, its bytes, step time, epoch time and cost, and a recommendation.

The step time of a method is its computation plus the time its collectives keep the step waiting
(:meth:`hf_demo.ops.methods.Estimate.exchange_s`: ring collectives on the link they cross, each with the
fixed cost of a collective (``Cluster.overhead``), DDP's early
buckets under the backward pass, DeMo's overlapped payload under the next step's computation). An epoch is
``steps_per_epoch`` steps; its cost is the devices' hours at the price table's device-hour plus the bytes
that leave each node at its price per GB (nothing when everything is on one node).

The recommendation: among the methods within ``tolerance`` of the fastest step, the one that trains
closest to dense AdamW at equal steps (``quality``); the reason names both figures.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from hf_demo.ops.links import format_rate
from hf_demo.ops.methods import METHODS, Cluster, Estimate, Workload
from hf_demo.ops.prices import Prices


@dataclass(frozen=True)
class Row:
    method: str
    label: str
    inter_bytes: float  # per step, on each node's link to the others (each direction)
    intra_bytes: float  # per step, on a link inside a node
    rank_bytes: float  # per step, handed to the collectives by each rank
    exchange_s: float
    step_s: float
    epoch_h: float
    epoch_cost: float | None
    memory_gb: float
    quality: int
    note: str
    settings: dict | None
    loss_cost: str = ""


def evaluate(cluster: Cluster, work: Workload, steps_per_epoch: float, prices: Prices | None = None) -> list[Row]:
    rows = []
    for method in METHODS.values():
        est = method(cluster, work)
        if est is not None:
            rows.append(_row(est, cluster, steps_per_epoch, prices))
    return rows


def _row(est: Estimate, cluster: Cluster, steps_per_epoch: float, prices: Prices | None) -> Row:
    if not est.collectives and math.isinf(est.compute_s):  # refused settings
        nan = math.nan
        return Row(est.method, est.label, nan, nan, nan, nan, nan, nan, None, nan, est.quality, est.note, None, "")
    step = est.step_s(cluster)
    inter = est.link_bytes("inter", cluster) if cluster.nodes > 1 else 0.0
    hours = steps_per_epoch * step / 3600
    cost = None
    if prices is not None:
        gb_between_sites = steps_per_epoch * inter * cluster.nodes / 1e9
        cost = prices.cost(hours * cluster.world, gb_between_sites, cluster.devices_per_node)
    return Row(
        est.method,
        est.label,
        inter,
        est.link_bytes("intra", cluster),
        est.rank_bytes(),
        est.exchange_s(cluster),
        step,
        hours,
        cost,
        est.memory_bytes / 1e9,
        est.quality,
        est.note,
        est.settings,
        est.loss_cost,
    )


def recommend(rows: list[Row], tolerance: float = 0.1) -> tuple[Row, str]:
    """The method to run, and why."""
    valid = [r for r in rows if math.isfinite(r.step_s)]
    fastest = min(valid, key=lambda r: r.step_s)
    close = [r for r in valid if r.step_s <= fastest.step_s * (1 + tolerance)]
    pick = min(close, key=lambda r: (r.quality, r.step_s))
    dense = next((r for r in valid if r.method == "ddp-adamw"), None)
    why = [f"{pick.label}: predicted step {pick.step_s:.3g} s ({pick.exchange_s:.3g} s of it waiting on the network)"]
    if pick is not fastest:
        why.append(
            f"within {tolerance:.0%} of the fastest ({fastest.label}, {fastest.step_s:.3g} s) and closer to dense "
            "AdamW's training at equal steps (docs/results.md)"
        )
    else:
        why.append("the fastest step of all methods")
    if dense is not None and dense is not pick:
        share = dense.exchange_s / dense.step_s if dense.step_s else 0.0
        why.append(f"DDP AdamW would take {dense.step_s:.3g} s per step, {share:.0%} of it on the exchange")
    why.append(f"its cost in loss: {pick.loss_cost}")
    if "not measured" in pick.loss_cost:
        why.append("try it on a short run of your job against the defaults before a long one")
    return pick, "; ".join(why)


def _bytes(b: float) -> str:
    if not math.isfinite(b):
        return "-"
    for unit, mult in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= mult:
            return f"{b / mult:.3g} {unit}"
    return f"{b:.0f} B"


def table(rows: list[Row], prices: Prices | None) -> str:
    cur = prices.currency if prices else ""
    head = ["method", "between nodes / step", "inside a node / step", "exchange s", "step s", "epoch h"]
    head += [f"epoch cost {cur}".strip(), "memory GB", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cost = "-" if r.epoch_cost is None or not math.isfinite(r.epoch_cost) else f"{r.epoch_cost:.4g}"
        cells = [r.label, _bytes(r.inter_bytes), _bytes(r.intra_bytes), f"{r.exchange_s:.3g}", f"{r.step_s:.3g}"]
        cells += [f"{r.epoch_h:.3g}", cost, f"{r.memory_gb:.3g}", r.note]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(cluster: Cluster, work: Workload, steps_per_epoch: float) -> str:
    return (
        f"{work.n_params / 1e6:.4g}M parameters in {len(work.shapes)} tensors; {cluster.nodes} node(s) x "
        f"{cluster.devices_per_node} device(s); between nodes {format_rate(cluster.inter.bandwidth)}, "
        f"{cluster.inter.latency * 1e3:.3g} ms; inside a node {format_rate(cluster.intra.bandwidth)}, "
        f"{cluster.intra.latency * 1e6:.3g} us; {cluster.overhead * 1e6:.3g} us per collective; "
        f"compute {work.compute_s:.3g} s per step; "
        f"{steps_per_epoch:.6g} steps per epoch"
    )


def to_json(cluster: Cluster, work: Workload, steps_per_epoch: float, rows: list[Row], pick: Row, why: str) -> str:
    return json.dumps(
        {
            "cluster": {
                "nodes": cluster.nodes,
                "devices_per_node": cluster.devices_per_node,
                "inter": asdict(cluster.inter),
                "intra": asdict(cluster.intra),
                "collective_overhead": cluster.overhead,
            },
            "n_params": work.n_params,
            "compute_s": work.compute_s,
            "steps_per_epoch": steps_per_epoch,
            "methods": [asdict(r) for r in rows],
            "recommended": pick.method,
            "reason": why,
        },
        indent=1,
        default=lambda x: None if isinstance(x, float) and not math.isfinite(x) else str(x),
    )
