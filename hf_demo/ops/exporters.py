"""Where the per-step samples go besides Trainer's ``report_to``: a Prometheus endpoint and a table log.

Prometheus (``prometheus_client``, extra ``ops``): one endpoint per rank (``per_rank``: port + local rank,
updated every step) or one on rank 0 with every rank's series (``rank0``: updated at each logging step from
the ranks' gathered totals). Every series carries the labels ``rank``, ``node`` and ``run``; the names are
in :data:`METRICS` (and docs/guides/operations.md). Every alert kind's counter child exists from the start, at 0
(so ``increase()`` sees the first alert). A taken port is a :class:`PortInUseError` naming the setting. After
training the endpoint serves on until a scrape has read the last step (``prometheus_linger_s`` at most).

The table log: one row per step and rank under ``output_dir/ops/`` — ``steps-rank<r>.csv`` (appended), or
``steps/part-r<r>-<n>.parquet`` (pyarrow, extra ``ops``; one complete file per flush, written under a hidden name
and renamed, so a running run's folder reads with ``pandas.read_parquet(folder)``). CSV rows are written as they
come; Parquet rows every ``flush_steps`` rows, at interpreter exit and on SIGTERM. Its column dictionary
(:data:`COLUMNS`: name, type, unit, meaning) is ``ops/columns.csv`` beside them, and each Parquet field's
metadata. Timestamps are ISO 8601 in UTC (a Parquet timestamp); a missing value (no loss recorded, no bandwidth
without traffic, no cost without a price table) is an empty CSV cell and a Parquet null, never ``nan``. Alerts go
to ``alerts-rank<r>.jsonl`` beside them.
"""

from __future__ import annotations

import atexit
import csv
import datetime
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
from hf_demo.ops.settings import ALERT_KINDS, CONDITIONS

# name -> (type, help); "_total" counters are exposed as <name> (prometheus_client adds nothing to custom ones)
METRICS = {
    "hf_demo_steps_total": ("counter", "optimizer steps this rank has taken"),
    "hf_demo_step_seconds_total": (
        "counter",
        "seconds by part: step (all), forward_backward, demo_compute, exchange (waiting on the collectives: DeMo's "
        "and DDP's buffer broadcast), other (outside steps: data), evaluate, save, log (phases between steps)",
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
    "hf_demo_alert_ongoing": ("gauge", "1 while an alert on time (step_time, exchange_time, slow_link) is ongoing"),
    "hf_demo_training_finished": ("gauge", "1 once training ended (its series going away after it is no dead run)"),
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
    "hf_demo_alert_ongoing": ("kind",),
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
        for kind in CONDITIONS:
            fams["hf_demo_alert_ongoing"].add_metric(base + [kind], t.ongoing.get(kind, 0))
        fams["hf_demo_training_finished"].add_metric(base, int(t.finished))
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


# the table log's column dictionary, name -> (type, unit, meaning): ops/columns.csv and the Parquet fields' metadata
COLUMNS = {
    "run": ("string", "", "the run's label (OpsSettings.run, else the output_dir's folder name)"),
    "step": ("int64", "step", "Trainer's global step at this step's end"),
    "rank": ("int64", "", "the process's global rank"),
    "node": ("int64", "", "the node of the rank (global rank // processes per node)"),
    "wall_s": ("float64", "s", "seconds from the start of training on this rank to this step's end"),
    "step_s": ("float64", "s", "the step: from its start to its end (forward, backward, the optimizer step)"),
    "forward_backward_s": (
        "float64",
        "s",
        "from the step's start to the optimizer step (forward, backward, clipping), less DDP's buffer broadcast",
    ),
    "demo_compute_s": (
        "float64",
        "s",
        "DeMo's own computation in the optimizer step (transform, top-k, coding, update)",
    ),
    "exchange_s": (
        "float64",
        "s",
        "the wait on the collectives wherever it happens: DeMo's in the optimizer step and DDP's buffer broadcast "
        "before the forward",
    ),
    "other_s": ("float64", "s", "time since the previous step outside any step and phase (data loading)"),
    "bytes_sent": ("float64", "B", "bytes this rank handed to DeMo's collectives this step"),
    "bytes_received": ("float64", "B", "bytes this rank received from the other ranks this step"),
    "dense_bytes": ("float64", "B", "bytes a dense fp32 all-reduce of the same parameters would send this step"),
    "bytes_between_nodes": ("float64", "B", "received bytes that crossed nodes this step"),
    "bandwidth": ("float64", "B/s", "bytes received per second of waiting on the exchange (empty: no traffic)"),
    "tier": ("int64", "", "the budget policy's tier (0: the configured settings)"),
    "skipped": ("int64", "steps", "1 when DeMo skipped this step for NaN/Inf gradients"),
    "resyncs": ("int64", "", "times rank 0's parameters were copied to every rank this step"),
    "drift_checks": ("int64", "", "parameter fingerprint comparisons across ranks this step"),
    "collectives": ("int64", "", "DeMo's collectives this step"),
    "world": ("int64", "ranks", "ranks DeMo exchanges with"),
    "optimizer_steps": ("int64", "steps", "DeMo's own step count after this step (skipped steps included)"),
    "loss": ("float64", "", "the step's training loss as the trainer sums it (empty: none recorded)"),
    "cost": ("float64", "price table currency", "running cost estimate of this rank (empty: no price table)"),
    "timestamp": ("timestamp", "ISO 8601, UTC", "wall-clock time at the step's end"),
    "tokens": ("float64", "tokens", "tokens of the step's inputs on this rank (0: inputs without input_ids)"),
    "forward_wait_s": ("float64", "s", "inside exchange_s: the wait in DDP's buffer broadcast before each forward"),
    "evaluate_s": ("float64", "s", "evaluation since the previous step (its own phase, not in other_s)"),
    "save_s": ("float64", "s", "checkpoints since the previous step (their own phase, not in other_s)"),
    "log_s": ("float64", "s", "logging since the previous step (its own phase, not in other_s)"),
    "quorum": ("int64", "replicas", "elastic runs: replicas in the quorum at the step's end (0: not elastic)"),
    "joins": ("int64", "", "elastic runs: quorum changes where replicas joined, since the previous step"),
    "losses": ("int64", "", "elastic runs: quorum changes where replicas were lost, since the previous step"),
    "recoveries": ("int64", "", "elastic runs: this replica's recoveries from a live peer, since the previous step"),
    "recovery_s": ("float64", "s", "elastic runs: the seconds of those recoveries"),
    "samples_lost": ("int64", "samples", "elastic runs: samples of the steps refused for those quorum changes"),
    "samples_unread": ("int64", "samples", "elastic runs: samples no replica reads (missing replicas' shards)"),
    "bytes_saved": ("float64", "B", "dense_bytes minus bytes_sent"),
    "own_s": (
        "float64",
        "s",
        "the rank's own time: step_s and other_s less exchange_s (never evaluation, saving, logging)",
    ),
}
DICTIONARY = "columns.csv"  # the column dictionary's file, beside the table log's files


def column(name: str, value=None) -> tuple[str, str, str]:
    """(type, unit, meaning) of a column; one :data:`COLUMNS` does not describe gets a type from its value."""
    if name in COLUMNS:
        return COLUMNS[name]
    kind = "int64" if isinstance(value, int) else "float64" if isinstance(value, float) else "string"
    return kind, "", ""


def _arrow_type(pa, kind: str):
    return {"int64": pa.int64(), "float64": pa.float64(), "string": pa.string(),
            "timestamp": pa.timestamp("us", tz="UTC")}[kind]  # fmt: skip


def table_cells(row: dict) -> dict:
    """A row as the table log writes it: timestamps as UTC datetimes, whole numbers as int, NaN as missing."""
    out = {}
    for name, value in row.items():
        kind = column(name, value)[0]
        if value is None or (isinstance(value, float) and math.isnan(value)):
            value = None
        elif kind == "timestamp":
            value = datetime.datetime.fromtimestamp(value, datetime.timezone.utc)
        elif kind == "int64":
            value = int(value)
        out[name] = value
    return out


def _csv_cell(value):
    return value.isoformat(timespec="microseconds") if isinstance(value, datetime.datetime) else value


def write_dictionary(folder: Path, row: dict) -> Path:
    """``folder/columns.csv``: name, type, unit, meaning of every column of ``row``, in its order (written under
    a name of this process's and renamed: every rank writes the same file)."""
    path = folder / DICTIONARY
    tmp = folder / f".{DICTIONARY}.{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(("name", "type", "unit", "meaning"))
        writer.writerows((name, *column(name, value)) for name, value in row.items())
    os.replace(tmp, path)
    return path


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
        self._described = False  # the column dictionary written
        self.parts = len(list((self.folder / "steps").glob(f"part-r{rank}-*.parquet"))) if fmt == "parquet" else 0
        _OPEN_TABLES.add(self)
        _flush_at_exit()

    @property
    def csv_path(self) -> Path:
        return self.folder / f"steps-rank{self.rank}.csv"

    def add(self, row: dict) -> None:
        self.rows.append(table_cells(row))
        if self.fmt == "csv" or len(self.rows) >= self.flush_steps:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        if not self._described:
            write_dictionary(self.folder, self.rows[0])
            self._described = True
        if self.fmt == "csv":
            new = not self.csv_path.exists()
            with open(self.csv_path, "a", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(self.rows[0]))
                if new:
                    writer.writeheader()
                writer.writerows({k: _csv_cell(v) for k, v in r.items()} for r in self.rows)
        else:
            self._write_part()
        self.rows = []

    def _write_part(self) -> None:
        """One Parquet part file of the buffered rows, typed by the column dictionary (each field's unit and
        meaning in its metadata), written under a hidden name and renamed: a reader never sees half a file."""
        fields = []
        for name, value in self.rows[0].items():
            kind, unit, meaning = column(name, value)
            fields.append(self.pa.field(name, _arrow_type(self.pa, kind), metadata={"unit": unit, "meaning": meaning}))
        table = self.pa.Table.from_pylist(self.rows, schema=self.pa.schema(fields))
        name = f"part-r{self.rank}-{self.parts:05d}.parquet"
        tmp = self.folder / "steps" / f".{name}.tmp"  # hidden: pandas/pyarrow skip names starting with "."
        self.pq.write_table(table, tmp)
        os.replace(tmp, self.folder / "steps" / name)
        self.parts += 1


def append_jsonl(path: Path, record: dict) -> None:
    """One JSON line at the end of ``path``, on a line of its own: after a line an earlier process was killed
    while writing (no line end), the record starts a new line instead of joining the cut one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab+") as f:
        f.seek(0, os.SEEK_END)
        cut = f.tell() > 0 and f.seek(-1, os.SEEK_END) >= 0 and f.read(1) != b"\n"
        f.write((("\n" if cut else "") + json.dumps(record, default=float) + "\n").encode())
