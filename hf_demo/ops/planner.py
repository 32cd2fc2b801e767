"""``hf-demo plan``: every method on a cluster, its bytes, step time, epoch time and cost, and a recommendation.

The step time of a method is its computation plus the time its collectives keep the step waiting
(:meth:`hf_demo.ops.methods.Estimate.exchange_s`: ring collectives on the link they cross, each with the
fixed cost of a collective (``Cluster.overhead``), DDP's early
buckets under the backward pass, DeMo's overlapped payload under the next step's computation). An epoch is
``steps_per_epoch`` steps; its cost is the devices' hours at the price table's device-hour plus the bytes
that leave each node at its price per GB (nothing when everything is on one node).

The recommendation: among the methods whose parameters, gradients and optimizer state fit a device's memory
(``device_memory_gb``; a row that needs more says "does not fit" and is never recommended), those within
``tolerance`` of the fastest step, the one that trains closest to dense AdamW at equal steps (``quality``); the
reason names both figures. When none fits there is no recommendation, and the reason says what would fit.

Every plan also gives the start-up broadcast (:func:`startup_broadcast`): rank 0's parameters to every rank
before the first step (DDP's and DeMo's alike), once per launch and per restart from a checkpoint.

Failures (``--mtbf-hours``, :func:`failure_costs`): each node fails at random at ``1 / MTBF`` per hour, so an
epoch of ``T`` hours on ``N`` nodes expects ``N T / MTBF`` failures. Each costs the whole cluster, in wall time:

- restart from checkpoint: the detection, the restart of every process (``restart_s``: relaunch, process
  group, checkpoint load), and the steps since the last checkpoint, half a checkpoint interval on average;
- elastic (:mod:`hf_demo.elastic`, torchft): the step in flight (refused everywhere), the detection, the joiner's
  recovery from a live peer (the quorum's next collectives wait for it; default: the parameters over the link
  between nodes), and the lost node's share of its own restart (the survivors train on with ``(N-1)/N`` of the
  throughput meanwhile): ``restart_s / N``.

A failure while recovering is a failure too: with ``x`` = failures per hour times the hours each costs, the
time lost per epoch is ``T x / (1 - x)`` (infinite once ``x >= 1``: failures come faster than the run recovers).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass

from hf_demo.ops.links import collective_seconds, format_rate
from hf_demo.ops.methods import DEMO_OVERHEAD, DEMO_VARIANTS, METHODS, Cluster, Estimate, Workload, demo_layout
from hf_demo.ops.prices import Prices

DEVICE_MEMORY_GB = 80.0  # one device's memory when none is given: an H100's


@dataclass(frozen=True)
class Row:
    method: str
    label: str
    inter_bytes: float  # per step, on each node's link to the others (each direction)
    intra_bytes: float  # per step, on a link inside a node
    rank_bytes: float  # per step, handed by each rank to the collectives across the replicas (comm_stats.bytes_sent)
    exchange_s: float
    step_s: float
    epoch_h: float
    epoch_cost: float | None
    memory_gb: float
    quality: int
    note: str
    settings: dict | None
    loss_cost: str = ""
    fits: bool | None = None  # its memory_gb within a device's memory (None: a refused method)
    shard_rank_bytes: float = 0.0  # HSDP: per step, handed by each rank to its shard group's (comm_stats.intra_*)


def evaluate(cluster: Cluster, work: Workload, steps_per_epoch: float, prices: Prices | None = None,
             device_memory_gb: float = DEVICE_MEMORY_GB) -> list[Row]:  # fmt: skip
    """Every method's row; each says whether it fits ``device_memory_gb`` (a note "does not fit" where not)."""
    rows = []
    for method in METHODS.values():
        est = method(cluster, work)
        if est is not None:
            rows.append(_fitted(_row(est, cluster, steps_per_epoch, prices), device_memory_gb))
    return rows


def _fitted(row: Row, device_memory_gb: float) -> Row:
    if not math.isfinite(row.memory_gb):
        return row
    if row.memory_gb <= device_memory_gb:
        return dataclasses.replace(row, fits=True)
    why = f"does not fit: {row.memory_gb:.3g} GB per device > {device_memory_gb:.3g} GB"
    return dataclasses.replace(row, fits=False, note="; ".join(filter(None, (why, row.note))))


def _row(est: Estimate, cluster: Cluster, steps_per_epoch: float, prices: Prices | None) -> Row:
    if not est.collectives and math.isinf(est.compute_s):  # refused settings
        nan = math.nan
        return Row(
            est.method,
            est.label,
            nan,
            nan,
            nan,
            nan,
            nan,
            nan,
            None,
            nan,
            est.quality,
            est.note,
            None,
            "",
            shard_rank_bytes=nan,
        )
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
        shard_rank_bytes=est.rank_bytes("shard"),
    )


def recommend(rows: list[Row], tolerance: float = 0.1,
              device_memory_gb: float = DEVICE_MEMORY_GB) -> tuple[Row | None, str]:  # fmt: skip
    """The method to run, and why; (None, why) when no method fits a device's memory."""
    valid = [r for r in rows if math.isfinite(r.step_s)]
    fitting = [r for r in valid if r.fits]
    if not fitting:
        return None, _nothing_fits(valid, device_memory_gb)
    fastest = min(fitting, key=lambda r: r.step_s)
    close = [r for r in fitting if r.step_s <= fastest.step_s * (1 + tolerance)]
    pick = min(close, key=lambda r: (r.quality, r.step_s))
    dense = next((r for r in valid if r.method == "ddp-adamw"), None)
    why = [f"{pick.label}: predicted step {pick.step_s:.3g} s ({pick.exchange_s:.3g} s of it waiting on the network)"]
    if pick is not fastest:
        why.append(
            f"within {tolerance:.0%} of the fastest ({fastest.label}, {fastest.step_s:.3g} s) and closer to dense "
            "AdamW's training at equal steps (docs/results.md)"
        )
    else:
        why.append("the fastest step of the methods that fit")
    if dense is not None and dense is not pick:
        share = dense.exchange_s / dense.step_s if dense.step_s else 0.0
        fits = "" if dense.fits else f" if it fit ({dense.memory_gb:.3g} GB per device)"
        why.append(f"DDP AdamW would take {dense.step_s:.3g} s per step{fits}, {share:.0%} of it on the exchange")
    left = len(valid) - len(fitting)
    if left:
        why.append(f"{left} method(s) do not fit {device_memory_gb:.3g} GB per device")
    why.append(f"its cost in loss: {pick.loss_cost}")
    if "not measured" in pick.loss_cost:
        why.append("try it on a short run of your job against the defaults before a long one")
    return pick, "; ".join(why)


def _nothing_fits(valid: list[Row], device_memory_gb: float) -> str:
    if not valid:
        return "none: every method was refused (see the notes)"
    least = min(valid, key=lambda r: r.memory_gb)
    return (
        f"none: no method fits {device_memory_gb:.3g} GB per device (the least, {least.label}, needs "
        f"{least.memory_gb:.3g} GB for parameters, gradients and optimizer state): add devices per node (HSDP "
        "shards the state over a node's devices), or give the devices' memory with --device-memory"
    )


def startup_broadcast(cluster: Cluster, work: Workload) -> dict:
    """Rank 0's parameters to every rank before the first step (DDP's and DeMo's start alike; again after each
    restart from a checkpoint): bytes from rank 0 and seconds on the slowest link its ring crosses."""
    nbytes = work.n_params * work.param_bytes
    spans = cluster.nodes > 1
    link = cluster.inter if spans else cluster.intra
    per_node = cluster.devices_per_node if spans else 1
    inner = cluster.intra if spans else None
    seconds = collective_seconds("broadcast", nbytes, cluster.world, link, inner, per_node, cluster.overhead)
    return {"bytes": nbytes, "seconds": seconds, "link": "inter" if spans else "intra"}


def startup_line(startup: dict, cluster: Cluster) -> str:
    if cluster.world < 2:
        return f"Start-up broadcast: none (one device; {_bytes(startup['bytes'])} of parameters)"
    where = "between nodes" if startup["link"] == "inter" else "inside the node"
    return (
        f"Start-up broadcast: {_bytes(startup['bytes'])} of parameters from rank 0, {_duration(startup['seconds'])} "
        f"on the link {where}, once per launch and per restart (not in the epoch's time)"
    )


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.3g} h"
    return f"{seconds / 60:.3g} min" if seconds >= 60 else f"{seconds:.3g} s"


@dataclass(frozen=True)
class Failures:
    """What a failure costs (``hf-demo plan --mtbf-hours``): seconds, and steps between checkpoints."""

    mtbf_hours: float  # mean time between failures of one node
    checkpoint_every: int = 500  # steps between checkpoints (restart from checkpoint)
    restart_s: float = 300.0  # relaunching the processes, the process group, loading the checkpoint
    detect_s: float = 30.0  # until the survivors know a peer is gone (a collective's timeout; a killed process: less)
    recovery_s: float | None = None  # a joiner's recovery from a live peer (None: the parameters over the link)


@dataclass(frozen=True)
class FailureRow:
    method: str
    label: str
    failures_per_epoch: float  # expected over a fault-free epoch's hours
    restart_per_failure_s: float
    restart_lost_h: float  # per epoch
    elastic_per_failure_s: float | None  # None: not elastic (elastic_note says why)
    elastic_lost_h: float | None
    elastic_note: str = ""


def recovery_seconds(cluster: Cluster, work: Workload) -> float:
    """A joiner's recovery: the model's parameters from a live peer over the link between nodes, one round trip."""
    return work.n_params * work.param_bytes / cluster.inter.bandwidth + 2 * cluster.inter.latency


def elastic_refusal(row: Row) -> str:
    """Why :mod:`hf_demo.elastic` does not run ``row``'s method ("" when it does): its own refusals, asked of a
    DeMo with the method's settings (one source of truth)."""
    if row.settings is None:
        return "hf_demo.elastic runs DeMo"
    import torch

    from hf_demo.elastic import mode_refusals
    from hf_demo.optim.optimizer import DeMo

    opt = DeMo([torch.nn.Parameter(torch.zeros(8, 8))], **row.settings)
    sharded = row.method in DEMO_VARIANTS and demo_layout(row.method) == "hsdp"  # HSDP: a node as one replica group
    return "; ".join(mode_refusals(opt.settings, opt.tiers, sharded))


def _lost_h(epoch_h: float, per_hour: float, cost_s: float) -> float:
    x = per_hour * cost_s / 3600
    return math.inf if x >= 1 else epoch_h * x / (1 - x)


def failure_costs(rows: list[Row], cluster: Cluster, work: Workload, failures: Failures) -> list[FailureRow]:
    """Each method's expected time lost per epoch to node failures: restart from checkpoint against elastic."""
    per_hour = cluster.nodes / failures.mtbf_hours
    recovery = failures.recovery_s if failures.recovery_s is not None else recovery_seconds(cluster, work)
    out = []
    for r in rows:
        if not math.isfinite(r.step_s):
            continue
        restart = failures.detect_s + failures.restart_s + failures.checkpoint_every / 2 * r.step_s
        why = elastic_refusal(r) or ("one node: no survivor goes on" if cluster.nodes < 2 else "")
        elastic = None if why else r.step_s + failures.detect_s + recovery + failures.restart_s / cluster.nodes
        out.append(FailureRow(
            r.method, r.label, per_hour * r.epoch_h, restart, _lost_h(r.epoch_h, per_hour, restart), elastic,
            None if elastic is None else _lost_h(r.epoch_h, per_hour, elastic), why,
        ))  # fmt: skip
    return out


def _hours(h: float | None, epoch_h: float) -> str:
    if h is None:
        return "-"
    if not math.isfinite(h):
        return "never ends"
    return f"{h:.3g} h ({h / epoch_h:.2%})" if epoch_h > 0 else f"{h:.3g} h"


def failure_table(rows: list[Row], costs: list[FailureRow], cluster: Cluster, failures: Failures,
                  recovery_s: float) -> str:  # fmt: skip
    head = (
        f"Failures: MTBF {failures.mtbf_hours:.6g} h per node, {cluster.nodes} node(s). Restart from checkpoint: "
        f"{failures.detect_s:.3g} s to detect, {failures.restart_s:.3g} s to restart, a checkpoint every "
        f"{failures.checkpoint_every} steps (half of it recomputed). Elastic: the step in flight, "
        f"{failures.detect_s:.3g} s to detect, {recovery_s:.3g} s for the joiner's recovery, the restart's "
        f"{failures.restart_s / cluster.nodes:.3g} s share of one node"
    )
    epoch = {r.method: r.epoch_h for r in rows}
    lines = [head, "", "| method | failures / epoch | lost per epoch, restart from checkpoint | lost per epoch, "
             "elastic | not elastic because |", "|---|---|---|---|---|"]  # fmt: skip
    for c in costs:
        cells = [c.label, f"{c.failures_per_epoch:.3g}", _hours(c.restart_lost_h, epoch[c.method])]
        short = "; ".join(part.split(": ")[0] for part in c.elastic_note.split("; ")) if c.elastic_note else ""
        cells += [_hours(c.elastic_lost_h, epoch[c.method]), short]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _bytes(b: float) -> str:
    if not math.isfinite(b):
        return "-"
    for unit, mult in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= mult:
            return f"{b / mult:.3g} {unit}"
    return f"{b:.0f} B"


def _figure(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else "-"


def table(rows: list[Row], prices: Prices | None) -> str:
    cur = prices.currency if prices else ""
    head = ["method", "between nodes / step", "inside a node / step", "exchange s", "step s", "epoch h"]
    head += [f"epoch cost {cur}".strip(), "memory GB", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cost = "-" if r.epoch_cost is None or not math.isfinite(r.epoch_cost) else f"{r.epoch_cost:.4g}"
        cells = [r.label, _bytes(r.inter_bytes), _bytes(r.intra_bytes), _figure(r.exchange_s), _figure(r.step_s)]
        cells += [_figure(r.epoch_h), cost, _figure(r.memory_gb), r.note]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(cluster: Cluster, work: Workload, steps_per_epoch: float,
             device_memory_gb: float = DEVICE_MEMORY_GB) -> str:  # fmt: skip
    measured = " (the measured default)" if work.demo_overhead == DEMO_OVERHEAD else ""
    return (
        f"{work.n_params / 1e6:.4g}M parameters in {len(work.shapes)} tensors; {cluster.nodes} node(s) x "
        f"{cluster.devices_per_node} device(s) of {device_memory_gb:.3g} GB; between nodes "
        f"{format_rate(cluster.inter.bandwidth)}, "
        f"{cluster.inter.latency * 1e3:.3g} ms; inside a node {format_rate(cluster.intra.bandwidth)}, "
        f"{cluster.intra.latency * 1e6:.3g} us; {cluster.overhead * 1e6:.3g} us per collective; "
        f"compute {work.compute_s:.3g} s per step, DeMo's own {work.demo_overhead:.3g} of it{measured}; "
        f"{steps_per_epoch:.6g} steps per epoch"
    )


def to_json(cluster: Cluster, work: Workload, steps_per_epoch: float, rows: list[Row], pick: Row | None, why: str,
            failures: dict | None = None, startup: dict | None = None,
            device_memory_gb: float = DEVICE_MEMORY_GB) -> str:  # fmt: skip
    """The plan as JSON (strict: a figure that is not finite is null); ``failures``: :func:`failures_json`'s
    (``--mtbf-hours``); ``recommended`` null when no method fits."""
    plan = {
        "cluster": {
            "nodes": cluster.nodes,
            "devices_per_node": cluster.devices_per_node,
            "inter": asdict(cluster.inter),
            "intra": asdict(cluster.intra),
            "collective_overhead": cluster.overhead,
            "device_memory_gb": device_memory_gb,
        },
        "n_params": work.n_params,
        "compute_s": work.compute_s,
        "demo_overhead": work.demo_overhead,
        "steps_per_epoch": steps_per_epoch,
        "startup_broadcast": startup if startup is not None else startup_broadcast(cluster, work),
        "methods": [asdict(r) for r in rows],  # a refused method's figures: null
        "recommended": None if pick is None else pick.method,
        "reason": why,
        **({"failures": failures} if failures is not None else {}),
    }
    return json.dumps(_strict(plan), indent=1, allow_nan=False)


def _strict(value):
    """``value`` with every float that is not finite as None, inside dicts and lists (JSON has no NaN, no Infinity),
    and anything that is not JSON as its text."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def _finite(row: dict) -> dict:
    """``row`` with every float that is not finite as None (JSON's null: NaN and Infinity are not JSON)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}


def failures_json(failures: Failures, recovery_s: float, costs: list[FailureRow]) -> dict:
    """The failures' inputs and each method's figures (a time lost that never ends: null)."""
    return {**asdict(failures), "recovery_s": recovery_s, "methods": [_finite(asdict(c)) for c in costs]}
