"""Where the per-step samples go besides Trainer's ``report_to``: a Prometheus endpoint and a table log.

Prometheus (``prometheus_client``, extra ``ops``): one endpoint per rank (``per_rank``: port + local rank,
updated every step) or one on rank 0 with every rank's series (``rank0``: updated at each logging step from
the ranks' gathered totals). Every series carries the labels ``rank``, ``node`` and ``run``; the names are
in :data:`METRICS` (and docs/guides/operations.md).

The table log: one row per step and rank under ``output_dir/ops/`` — ``steps-rank<r>.csv`` (appended), or
``steps/part-r<r>-<n>.parquet`` (pyarrow, extra ``ops``; one complete file per flush, so a running run's
folder reads with ``pandas.read_parquet(folder)``). Alerts go to ``alerts-rank<r>.jsonl`` beside them.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from hf_demo.ops.monitor import PARTS, StepSample, Totals
from hf_demo.ops.optional import require

# name -> (type, help); "_total" counters are exposed as <name> (prometheus_client adds nothing to custom ones)
METRICS = {
    "hf_demo_steps_total": ("counter", "optimizer steps this rank has taken"),
    "hf_demo_step_seconds_total": (
        "counter",
        "seconds by part of the step: step (all), forward_backward, "
        "demo_compute, exchange (waiting on DeMo's collectives), other (outside steps)",
    ),
    "hf_demo_last_step_seconds": ("gauge", "the last step's seconds by part (as above)"),
    "hf_demo_global_step": ("gauge", "Trainer's global step"),
    "hf_demo_bytes_sent_total": ("counter", "bytes this rank handed to DeMo's collectives"),
    "hf_demo_bytes_received_total": ("counter", "bytes this rank received from the other ranks"),
    "hf_demo_dense_bytes_total": ("counter", "bytes a dense fp32 all-reduce of the same parameters would have sent"),
    "hf_demo_bytes_saved_total": ("counter", "dense bytes minus the bytes sent"),
    "hf_demo_bytes_between_nodes_total": ("counter", "received bytes that crossed nodes (all but node_* collectives)"),
    "hf_demo_effective_bandwidth_bytes": ("gauge", "the last communicating step's bytes received per second waited"),
    "hf_demo_tier": ("gauge", "the budget policy's tier (0: the configured settings)"),
    "hf_demo_loss": ("gauge", "the last step's training loss on this rank"),
    "hf_demo_skipped_steps_total": ("counter", "steps skipped for NaN/Inf gradients"),
    "hf_demo_resyncs_total": ("counter", "times rank 0's parameters were copied to every rank"),
    "hf_demo_drift_checks_total": ("counter", "parameter fingerprint comparisons across ranks"),
    "hf_demo_alerts_total": ("counter", "DeMoHealthCallback alerts, by kind"),
    "hf_demo_cost": ("gauge", "running cost estimate of this rank (device-hours and traffic between nodes)"),
}


EXTRA_LABELS = {
    "hf_demo_step_seconds_total": ("part",),
    "hf_demo_last_step_seconds": ("part",),
    "hf_demo_alerts_total": ("kind",),
    "hf_demo_cost": ("currency",),
}


class Snapshot:
    """A rank's figures as the endpoint shows them: its totals and its last sample."""

    def __init__(self, totals: Totals, last: StepSample | None, global_step: int, currency: str):
        self.totals, self.last, self.global_step, self.currency = totals, last, global_step, currency


def _families(snapshots: dict[int, Snapshot], run: str):
    core = require("prometheus_client.core", "the Prometheus endpoint")
    labels = ["rank", "node", "run"]

    def family(name, extra=()):
        kind, help = METRICS[name]
        cls = core.CounterMetricFamily if kind == "counter" else core.GaugeMetricFamily
        return cls(name.removesuffix("_total") if kind == "counter" else name, help, labels=labels + list(extra))

    fams = {name: family(name, EXTRA_LABELS.get(name, ())) for name in METRICS}
    for rank, snap in sorted(snapshots.items()):
        t, last = snap.totals, snap.last
        base = [str(rank), str(last.node if last else 0), run]
        fams["hf_demo_steps_total"].add_metric(base, t.steps)
        for part in PARTS:
            fams["hf_demo_step_seconds_total"].add_metric(base + [part], t.seconds[part])
            if last is not None:
                fams["hf_demo_last_step_seconds"].add_metric(base + [part], getattr(last, f"{part}_s"))
        fams["hf_demo_global_step"].add_metric(base, snap.global_step)
        for name, value in (
            ("hf_demo_bytes_sent_total", t.bytes_sent),
            ("hf_demo_bytes_received_total", t.bytes_received),
            ("hf_demo_dense_bytes_total", t.dense_bytes),
            ("hf_demo_bytes_saved_total", t.dense_bytes - t.bytes_sent),
            ("hf_demo_bytes_between_nodes_total", t.bytes_between_nodes),
            ("hf_demo_skipped_steps_total", t.skipped),
            ("hf_demo_resyncs_total", t.resyncs),
            ("hf_demo_drift_checks_total", t.drift_checks),
        ):
            fams[name].add_metric(base, value)
        for kind, n in sorted(t.alerts.items()):
            fams["hf_demo_alerts_total"].add_metric(base + [kind], n)
        if last is not None:
            for name, value in (
                ("hf_demo_effective_bandwidth_bytes", last.bandwidth),
                ("hf_demo_tier", last.tier),
                ("hf_demo_loss", last.loss),
            ):
                if value is not None and not math.isnan(value):
                    fams[name].add_metric(base, value)
            if not math.isnan(last.cost):
                fams["hf_demo_cost"].add_metric(base + [snap.currency], last.cost)
    return list(fams.values())


class PrometheusExporter:
    """A Prometheus endpoint over HTTP serving the snapshots it is given (its own registry, its own server)."""

    def __init__(self, port: int, addr: str, run: str):
        client = require("prometheus_client", "the Prometheus endpoint")
        self.run = run
        self.snapshots: dict[int, Snapshot] = {}
        self.registry = client.CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        served = client.start_http_server(port, addr=addr, registry=self.registry)
        self.server = served[0] if isinstance(served, tuple) else None
        self.port = port

    def collect(self):
        return _families(dict(self.snapshots), self.run)

    def update(self, rank: int, snapshot: Snapshot) -> None:
        self.snapshots[rank] = snapshot

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


class TableLog:
    """One row per step: appended to a CSV file, or written as Parquet part files, every ``flush_steps`` rows."""

    def __init__(self, folder: Path, rank: int, fmt: str, flush_steps: int):
        self.folder, self.rank, self.fmt, self.flush_steps = Path(folder), rank, fmt, max(1, flush_steps)
        if fmt == "parquet":
            self.pa, self.pq = require("pyarrow", "the Parquet log"), require("pyarrow.parquet", "the Parquet log")
            (self.folder / "steps").mkdir(parents=True, exist_ok=True)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []
        self.parts = len(list((self.folder / "steps").glob(f"part-r{rank}-*.parquet"))) if fmt == "parquet" else 0

    @property
    def csv_path(self) -> Path:
        return self.folder / f"steps-rank{self.rank}.csv"

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if len(self.rows) >= self.flush_steps:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        if self.fmt == "csv":
            new = not self.csv_path.exists()
            with open(self.csv_path, "a", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(self.rows[0]))
                if new:
                    writer.writeheader()
                writer.writerows(self.rows)
        else:
            table = self.pa.Table.from_pylist(self.rows)
            self.pq.write_table(table, self.folder / "steps" / f"part-r{self.rank}-{self.parts:05d}.parquet")
            self.parts += 1
        self.rows = []


def append_jsonl(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record, default=float) + "\n")
