"""The settings of the training-time operator tools: :class:`OpsSettings` (exporters) and :class:`HealthSettings`
(the deviation alerts of :class:`~hf_demo.ops.health.DeMoHealthCallback`).

``DeMoTrainer(..., demo_ops=OpsSettings(...))`` sets them in code (``demo_ops=False`` turns every ops callback
off); otherwise :meth:`OpsSettings.from_env` reads them from the environment, one variable per field:
``HF_DEMO_OPS_<FIELD>`` (e.g. ``HF_DEMO_OPS_PROMETHEUS_PORT=9400``) and ``HF_DEMO_HEALTH_<FIELD>`` (e.g.
``HF_DEMO_HEALTH_ENABLED=0``, ``HF_DEMO_HEALTH_PLAN=plan.json``), so launched scripts need no change.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

PROMETHEUS_MODES = ("per_rank", "rank0")
TABLE_FORMATS = ("none", "csv", "parquet")
# every kind of alert DeMoHealthCallback raises (the Prometheus counter has a child for each from the start)
ALERT_KINDS = (
    "step_time",
    "exchange_time",
    "slow_link",
    "loss_spike",
    "nonfinite_streak",
    "drift",
    "repeated_resyncs",
    "tier_change",
    "replica_lost",
    "elastic_step_refused",
    "quorum_below_target",
    "slow_recovery",
)
# the alerts on time: conditions, "ongoing" from their onset until the rank recovers (a Prometheus gauge each)
CONDITIONS = ("step_time", "exchange_time", "slow_link")


def _opt(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class HealthSettings:
    """What :class:`~hf_demo.ops.health.DeMoHealthCallback` calls a deviation. Every threshold is checked per
    rank, against that rank's own rolling baseline (the median of its last ``baseline_steps`` steps)."""

    enabled: bool = _opt(True, "watch the run and raise alerts (False: the callback does nothing)")
    baseline_steps: int = _opt(20, "steps in the rolling baseline (median) of step time, exchange time and loss")
    warmup_steps: int = _opt(3, "first steps not judged (set-up, first exchange, compilation)")
    min_baseline: int = _opt(5, "steps the baseline needs before step-time, exchange and loss alerts")
    step_time_factor: float = _opt(3.0, "alert when a step takes this many times the baseline (0 = off)")
    exchange_time_factor: float = _opt(3.0, "alert when the wait on the exchange is this many times the baseline")
    min_excess_s: float = _opt(0.1, "an alert on time needs at least this many seconds above the baseline")
    noise_factor: float = _opt(
        4.0,
        "an alert on time also needs its excess above this many robust standard deviations (1.4826 x the median "
        "absolute deviation) of the rank's own baseline: a host whose times jitter widely raises its own bar",
    )
    persist_steps: int = _opt(
        2,
        "alerts on time (step_time, exchange_time, slow_link) need this many deviating steps in a row (steps with "
        "an exchange, for the exchange's), unless a step is twice the least excess above its baseline: one stalled "
        "step on a loaded host is not a fault (1: every step alone); an ongoing one recovers after as many steps in "
        "a row back under it",
    )
    link_bandwidth: str = _opt("", "the link between nodes the plan assumed (e.g. 10gbit; empty: from plan or off)")
    link_latency: str = _opt("0", "its one-way latency (e.g. 20ms)")
    plan: str = _opt("", "a `hf-demo plan --json` file: its link between nodes (link_bandwidth wins)")
    slow_link_factor: float = _opt(2.0, "alert when the exchange takes this many times the plan's link time")
    loss_spike_factor: float = _opt(3.0, "alert when the loss is this many times its baseline (0 = off)")
    nonfinite_patience: int = _opt(3, "alert after this many consecutive skipped (NaN/Inf) steps")
    resync_limit: int = _opt(3, "alert when this many resyncs happen within resync_window steps")
    resync_window: int = _opt(100, "steps of the resync count")
    cooldown_steps: int = _opt(
        10,
        "the same alert on the same rank is not repeated within this many steps (alerts on time are not repeated "
        "while ongoing: they end with a resolved event)",
    )
    expected_replicas: int = _opt(
        0, "elastic runs: the replica groups the run should have (0: the largest quorum seen so far)"
    )
    quorum_patience: int = _opt(
        20, "elastic runs: alert when the quorum stays below expected_replicas this many steps in a row"
    )
    recovery_alert_s: float = _opt(60.0, "elastic runs: alert when a recovery from a peer takes longer (0 = off)")

    @classmethod
    def from_env(cls, environ=os.environ) -> HealthSettings:
        return cls(**_from_env(cls, "HF_DEMO_HEALTH_", environ))


@dataclass
class OpsSettings:
    """Where the training metrics go besides Trainer's ``report_to`` backends."""

    run: str = _opt("", "the run label of the exported metrics (default: the output_dir's name)")
    prometheus_port: int = _opt(0, "serve Prometheus metrics on this port (0 = off); per_rank: port + local rank")
    prometheus_addr: str = _opt("127.0.0.1", "the address the endpoint listens on (0.0.0.0: every interface)")
    prometheus_mode: str = _opt(
        "per_rank",
        "per_rank (every rank serves its own, each step) or rank0 (rank 0 serves every rank's, gathered at each "
        "logging step)",
    )
    prometheus_linger_s: float = _opt(
        10.0,
        "after training, the endpoint serves on until a scrape has read the last step, at most this many seconds",
    )
    table_log: str = _opt("none", "a per-step, per-rank table under output_dir/ops: csv, parquet or none")
    table_flush_steps: int = _opt(
        20, "parquet: rows per part file (written at exit and on SIGTERM too); csv writes every row at once"
    )
    prices: str = _opt("", "a price table (TOML, as benchmarks/prices.toml) for the running cost estimate")
    sync_cuda: bool = _opt(True, "on CUDA, synchronise at the step's boundaries so the time split is the device's")
    health: HealthSettings = field(default_factory=HealthSettings, metadata={"help": "the alerts' settings"})

    def __post_init__(self):
        if self.prometheus_mode not in PROMETHEUS_MODES:
            raise ValueError(f"prometheus_mode={self.prometheus_mode!r}: expected one of {', '.join(PROMETHEUS_MODES)}")
        if self.table_log not in TABLE_FORMATS:
            raise ValueError(f"table_log={self.table_log!r}: expected one of {', '.join(TABLE_FORMATS)}")

    @classmethod
    def from_env(cls, environ=os.environ) -> OpsSettings:
        return cls(**_from_env(cls, "HF_DEMO_OPS_", environ), health=HealthSettings.from_env(environ))


def _from_env(cls, prefix: str, environ) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        raw = environ.get(prefix + f.name.upper())
        if raw is None or f.name == "health":
            continue
        kind = type(f.default)
        try:
            out[f.name] = raw.lower() in ("1", "true", "yes", "on") if kind is bool else kind(raw)
        except ValueError:
            raise ValueError(f"{prefix}{f.name.upper()}={raw!r}: expected a {kind.__name__}") from None
    return out


def markdown_table(cls) -> str:
    """The fields of ``cls`` as a Markdown table (docs/guides/operations.md)."""
    prefix = "HF_DEMO_OPS_" if cls is OpsSettings else "HF_DEMO_HEALTH_"
    rows = ["| setting | default | environment | what it does |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.name == "health":
            continue
        rows.append(f"| `{f.name}` | `{f.default!r}` | `{prefix}{f.name.upper()}` | {f.metadata['help']} |")
    return "\n".join(rows)
