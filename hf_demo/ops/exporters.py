"""Where the per-step samples go besides Trainer's ``report_to``: a Prometheus endpoint and a table log.

Prometheus (``prometheus_client``, extra ``ops``): one endpoint per rank (``per_rank``: port + local rank,
updated every step) or one on rank 0 with every rank's series (``rank0``: updated at each logging step from
the ranks' gathered totals). Every series carries the labels ``rank``, ``node`` and ``run``; the names are
in :data:`METRICS` (and docs/guides/operations.md). Every alert kind's counter child exists from the start, at 0
(so ``increase()`` sees the first alert). A taken port is a :class:`PortInUseError` naming the setting. After
training the endpoint serves on until a scrape has read the last step (``prometheus_linger_s`` at most).

The table log: one row per step and rank under ``output_dir/ops/`` — ``steps-rank<r>.csv`` (appended), or
``steps/part-r<r>-<n>.parquet`` (pyarrow, extra ``ops``; one complete file per flush, so a running run's
folder reads with ``pandas.read_parquet(folder)``). CSV rows are written as they come; Parquet rows every
``flush_steps`` rows, at interpreter exit and on SIGTERM. Alerts go to ``alerts-rank<r>.jsonl`` beside them.
"""

from __future__ import annotations

import atexit
import csv
import json
import math
import os
import signal
import threading
import time
import weakref
from pathlib import Path

from hf_demo.ops.monitor import PARTS, STEP_BUCKETS, StepSample, Totals
from hf_demo.ops.optional import require
from hf_demo.ops.settings import ALERT_KINDS

# name -> (type, help); "_total" counters are exposed as <name> (prometheus_client adds nothing to custom ones)
METRICS = {
    "hf_demo_steps_total": ("counter", "optimizer steps this rank has taken"),
    "hf_demo_step_seconds_total": (
        "counter",
        "seconds by part of the step: step (all), forward_backward, "
        "demo_compute, exchange (waiting on DeMo's collectives), other (outside steps)",
    ),
    "hf_demo_last_step_seconds": ("gauge", "the last step's seconds by part (as above)"),
    "hf_demo_step_duration_seconds": ("histogram", "step times (histogram_quantile gives the p95)"),
    "hf_demo_last_step_timestamp_seconds": (
        "gauge",
        "Unix time at the end of the last step (a heartbeat: time() minus it grows while a run hangs)",
    ),
    "hf_demo_global_step": ("gauge", "Trainer's global step"),
    "hf_demo_bytes_sent_total": ("counter", "bytes this rank handed to DeMo's collectives"),
    "hf_demo_bytes_received_total": ("counter", "bytes this rank received from the other ranks"),
    "hf_demo_dense_bytes_total": ("counter", "bytes a dense fp32 all-reduce of the same parameters would have sent"),
    "hf_demo_bytes_saved_total": ("counter", "dense bytes minus the bytes sent"),
    "hf_demo_bytes_between_nodes_total": (
        "counter",
        "received bytes that crossed nodes (all but those over the shard group)",
    ),
    "hf_demo_effective_bandwidth_bytes": ("gauge", "the last communicating step's bytes received per second waited"),
    "hf_demo_tier": ("gauge", "the budget policy's tier (0: the configured settings)"),
    "hf_demo_loss": ("gauge", "the last step's training loss on this rank"),
    "hf_demo_skipped_steps_total": ("counter", "steps skipped for NaN/Inf gradients"),
    "hf_demo_resyncs_total": ("counter", "times rank 0's parameters were copied to every rank"),
    "hf_demo_drift_checks_total": ("counter", "parameter fingerprint comparisons across ranks"),
    "hf_demo_alerts_total": ("counter", "DeMoHealthCallback alerts, by kind (every kind from 0)"),
    "hf_demo_cost": ("gauge", "running cost estimate of this rank (device-hours and traffic between nodes)"),
    "hf_demo_quorum_size": ("gauge", "elastic runs: replicas in torchft's quorum at the last step"),
    "hf_demo_replica_joins_total": ("counter", "elastic runs: quorum changes where replicas joined"),
    "hf_demo_replica_losses_total": ("counter", "elastic runs: quorum changes where replicas were lost"),
    "hf_demo_recoveries_total": ("counter", "elastic runs: times this replica received the agreed state from a peer"),
    "hf_demo_recovery_seconds_total": ("counter", "elastic runs: seconds this replica spent in those recoveries"),
    "hf_demo_last_recovery_seconds": ("gauge", "elastic runs: the last recovery's seconds"),
    "hf_demo_samples_lost_total": ("counter", "elastic runs: samples of the steps refused when replicas were lost"),
    "hf_demo_samples_unread_total": (
        "counter",
        "elastic runs: samples no replica reads (the shards of replicas missing from committed steps, Trainer)",
    ),
}

ELASTIC_TOTALS = {  # the elastic counters (exported once the run is elastic: a quorum seen) -> their Totals field
    "hf_demo_replica_joins_total": "joins",
    "hf_demo_replica_losses_total": "losses",
    "hf_demo_recoveries_total": "recoveries",
    "hf_demo_recovery_seconds_total": "recovery_s",
    "hf_demo_samples_lost_total": "samples_lost",
    "hf_demo_samples_unread_total": "samples_unread",
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

    classes = {"counter": core.CounterMetricFamily, "gauge": core.GaugeMetricFamily,
               "histogram": core.HistogramMetricFamily}  # fmt: skip

    def family(name, extra=()):
        kind, help = METRICS[name]
        return classes[kind](name.removesuffix("_total"), help, labels=labels + list(extra))

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
        for kind in sorted(set(ALERT_KINDS) | set(t.alerts)):
            fams["hf_demo_alerts_total"].add_metric(base + [kind], t.alerts.get(kind, 0))
        buckets = [(str(bound), n) for bound, n in zip(STEP_BUCKETS, t.step_buckets)] + [("+Inf", t.steps)]
        fams["hf_demo_step_duration_seconds"].add_metric(base, buckets, t.seconds["step"])
        if not math.isnan(t.last_timestamp):
            fams["hf_demo_last_step_timestamp_seconds"].add_metric(base, t.last_timestamp)
        if t.quorum:  # an elastic run
            _elastic_series(fams, base, t)
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


def _elastic_series(fams: dict, base: list, t: Totals) -> None:
    """The quorum's figures of an elastic run (:mod:`hf_demo.elastic`): every counter from 0 once a quorum is seen."""
    fams["hf_demo_quorum_size"].add_metric(base, t.quorum)
    for name, key in ELASTIC_TOTALS.items():
        fams[name].add_metric(base, getattr(t, key))
    if not math.isnan(t.last_recovery_s):
        fams["hf_demo_last_recovery_seconds"].add_metric(base, t.last_recovery_s)


class PortInUseError(OSError):
    """The Prometheus endpoint's port is taken (by another process, or another run's rank)."""


class PrometheusExporter:
    """A Prometheus endpoint over HTTP serving the snapshots it is given (its own registry, its own server)."""

    def __init__(self, port: int, addr: str, run: str):
        client = require("prometheus_client", "the Prometheus endpoint")
        self.run = run
        self.snapshots: dict[int, Snapshot] = {}
        self.updates = self.scraped = 0  # updates made; updates a scrape has read
        self.registry = client.CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        try:
            served = client.start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            raise PortInUseError(
                exc.errno,
                f"the Prometheus endpoint cannot listen on {addr}:{port} ({exc.strerror}): another process (or "
                "another run on this host) holds it. Give a free port: OpsSettings(prometheus_port=...) or "
                "HF_DEMO_OPS_PROMETHEUS_PORT (per_rank serves on port + local rank), or 0 to turn the endpoint off",
            ) from exc
        self.server = served[0] if isinstance(served, tuple) else None
        self.port = port
        self._closer: threading.Thread | None = None

    def collect(self):
        seen = self.updates
        families = _families(dict(self.snapshots), self.run)
        self.scraped = max(self.scraped, seen)
        return families

    def update(self, rank: int, snapshot: Snapshot) -> None:
        self.snapshots[rank] = snapshot
        self.updates += 1

    def close(self, linger_s: float = 0.0) -> None:
        """Stop serving, once a scrape has read the last update or after ``linger_s`` seconds."""
        deadline = time.monotonic() + linger_s
        while self.scraped < self.updates and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def close_later(self, linger_s: float) -> None:
        """:meth:`close` in the background (the training script goes on); the interpreter's exit waits for it."""
        if self._closer is None:
            self._closer = threading.Thread(target=self.close, args=(linger_s,), daemon=True, name="hf-demo-prom")
            self._closer.start()
            atexit.register(self._closer.join)


_OPEN_TABLES: weakref.WeakSet = weakref.WeakSet()
_SIGTERM_HOOKED = False


def _flush_open_tables() -> None:
    for table in list(_OPEN_TABLES):
        table.flush()


def _on_sigterm(previous):
    def handler(signum, frame):
        _flush_open_tables()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default: end as SIGTERM ends a process
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    return handler


def _flush_at_exit() -> None:
    """Flush every open table at interpreter exit and on SIGTERM (chained to the handler already there)."""
    global _SIGTERM_HOOKED
    if _SIGTERM_HOOKED:
        return
    _SIGTERM_HOOKED = True
    atexit.register(_flush_open_tables)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm(signal.getsignal(signal.SIGTERM)))


class TableLog:
    """One row per step: appended to a CSV file as it comes, or written as Parquet part files every
    ``flush_steps`` rows (and at exit, and on SIGTERM)."""

    def __init__(self, folder: Path, rank: int, fmt: str, flush_steps: int):
        self.folder, self.rank, self.fmt, self.flush_steps = Path(folder), rank, fmt, max(1, flush_steps)
        if fmt == "parquet":
            self.pa, self.pq = require("pyarrow", "the Parquet log"), require("pyarrow.parquet", "the Parquet log")
            (self.folder / "steps").mkdir(parents=True, exist_ok=True)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []
        self.parts = len(list((self.folder / "steps").glob(f"part-r{rank}-*.parquet"))) if fmt == "parquet" else 0
        _OPEN_TABLES.add(self)
        _flush_at_exit()

    @property
    def csv_path(self) -> Path:
        return self.folder / f"steps-rank{self.rank}.csv"

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if self.fmt == "csv" or len(self.rows) >= self.flush_steps:
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
    """One JSON line at the end of ``path``, on a line of its own: after a line an earlier process was killed
    while writing (no line end), the record starts a new line instead of joining the cut one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab+") as f:
        f.seek(0, os.SEEK_END)
        cut = f.tell() > 0 and f.seek(-1, os.SEEK_END) >= 0 and f.read(1) != b"\n"
        f.write((("\n" if cut else "") + json.dumps(record, default=float) + "\n").encode())
