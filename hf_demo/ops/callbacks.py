"""The ops callbacks of a Trainer: :class:`DeMoOpsCallback` (measures every step, exports, adds the ``ops/*``
figures to Trainer's log rows) and :class:`~hf_demo.ops.health.DeMoHealthCallback` (alerts), wired by
:func:`attach`. ``DeMoTrainer`` attaches them when it trains with DeMo (``demo_ops=False`` turns them off).

The log rows (every ``report_to`` backend, ``trainer_state.json``) get, over the steps since the last row and
gathered from every rank at that row (one small all-gather of Python objects on the default group, on every
rank, where Trainer logs):

=============================  ==========================================================================
``ops/step_s``                 mean step time over ranks; ``ops/step_s_max`` the longest rank's
``ops/slowest_rank``           the rank the others waited for: the most own time (step and time outside it,
                               less the wait on the collectives), which is ``ops/own_s_max``
``ops/forward_backward_s``     forward+backward per step, less DDP's buffer broadcast (mean over ranks)
``ops/demo_compute_s``         DeMo's own computation per step (mean over ranks)
``ops/exchange_wait_s``        the wait on the collectives per step: DeMo's exchange and DDP's buffer broadcast
                               before the forward (mean over ranks; max: ``_max``)
``ops/other_s``                time outside the steps and the phases below (data loading) per step
``ops/evaluate_s``             evaluation per step (mean over ranks); ``ops/save_s`` checkpoints,
                               ``ops/log_s`` logging: phases of their own, never in a rank's own time
``ops/effective_bandwidth``    bytes received per second of waiting (mean over ranks)
``ops/bytes_saved_per_step``   dense fp32 all-reduce bytes minus DeMo's, per step and rank
``ops/bytes_saved_total``      the same since the start, summed over ranks
``ops/drift_checks``           fingerprint comparisons so far
``ops/cost``                   running cost estimate of every rank together (with a price table)
``ops/tokens_per_s``           every rank's input tokens over the window's wall time (inputs with input_ids)
``ops/alerts``                 alerts since the last row, every rank; ``ops/alerts_<kind>`` by kind (no key is
                               both a value and a prefix of another: MLflow's file store keeps both)
``ops/quorum``                 elastic runs (:mod:`hf_demo.elastic`): replicas in the quorum at the last step
``ops/replica_joins``          elastic runs, since the last row: quorum changes where replicas joined;
                               ``ops/replica_losses`` where they were lost; ``ops/recoveries`` this replica's
                               recoveries from a peer and ``ops/recovery_s`` their seconds; ``ops/samples_lost``
                               the samples of the refused steps (``ops/samples_lost_total`` since the start);
                               ``ops/samples_unread`` the samples no replica reads: the shards of replicas
                               missing from committed steps, Trainer (``ops/samples_unread_total``)
=============================  ==========================================================================
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from hf_demo.hf.data_parallel import unwrap_optimizer, unwrap_stepped
from hf_demo.ops import exporters
from hf_demo.ops.health import Alert, DeMoHealthCallback
from hf_demo.ops.monitor import PHASES, StepMonitor, StepSample, phase_of_log, rank_and_node
from hf_demo.ops.prices import load as load_prices
from hf_demo.ops.settings import OpsSettings

TRAINER_KEYS = (  # the Trainer arguments ops/run.json keeps
    "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type",
    "warmup_steps", "weight_decay", "max_grad_norm", "max_steps", "num_train_epochs", "seed", "bf16", "fp16",
    "optim", "logging_steps", "output_dir",
)  # fmt: skip


class DeMoOpsCallback(TrainerCallback):
    def __init__(self, settings: OpsSettings | None = None, health: DeMoHealthCallback | None = None):
        self.settings = settings or OpsSettings()
        self.health = health
        if health is not None:
            health.fed = True
            health.sinks.append(self._count_alert)
        self.monitor: StepMonitor | None = None
        self.prometheus: exporters.PrometheusExporter | None = None
        self.table: exporters.TableLog | None = None
        self.window: list[StepSample] = []
        self.window_alerts: dict[str, int] = {}
        self.last: StepSample | None = None
        self.run, self.folder, self.rank, self.currency = "", Path("."), 0, ""
        self._config_written = False
        self._hooks: list = []
        self._watched = None

    # ---------------------------------------------------------------- lifecycle
    def on_train_begin(self, args, state, control, **kwargs):
        s = self.settings
        self.rank, node, local = rank_and_node(args)
        self.folder = Path(args.output_dir) / "ops"
        self.run = s.run or Path(args.output_dir).resolve().name
        prices = load_prices(s.prices) if s.prices else None
        self.currency = prices.currency if prices else ""
        self.monitor = StepMonitor(self.rank, node, local, prices, s.sync_cuda)
        if s.prometheus_port and (s.prometheus_mode == "per_rank" or self.rank == 0):
            port = s.prometheus_port + (self.rank % local if s.prometheus_mode == "per_rank" else 0)
            self.prometheus = exporters.PrometheusExporter(port, s.prometheus_addr, self.run)
        if s.table_log != "none":
            self.table = exporters.TableLog(self.folder, self.rank, s.table_log, s.table_flush_steps)

    def on_train_end(self, args, state, control, **kwargs):
        if self.table is not None:
            self.table.flush()
        if self.monitor is not None:  # finished: its series going away is no dead run (HfDemoRunGone)
            self.monitor.totals.finished = True
        if self.prometheus is not None:  # serves on until the last step is scraped (or the linger is over)
            for snapshot in self.prometheus.snapshots.values():  # rank0: every rank's, as last gathered
                snapshot.totals.finished = True
            if self.last is not None:
                self.prometheus.update(self.rank, self._snapshot(state.global_step))
            self.prometheus.close_later(self.settings.prometheus_linger_s)
            self.prometheus = None
        self._unwatch()
        if self.monitor is not None:
            self.monitor.close()

    # ---------------------------------------------------------------- the step
    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if self.monitor is not None:
            self.monitor.step_begin(unwrap_stepped(optimizer))  # DeMo, or the elastic wrapper around it

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.pre_optimizer()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.optimizer_done()

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if self.monitor is None:
            return
        opt = unwrap_optimizer(optimizer)
        sample = self.monitor.step_end(state.global_step, unwrap_stepped(optimizer))
        if not self._config_written:
            self._write_run_config(args, opt)
        self.last = sample
        self.window.append(sample)
        if self.health is not None:
            self.health.observe(sample, opt, args, state, control)
        if self.table is not None:
            self.table.add(sample.row(self.run))
        if self.prometheus is not None and self.settings.prometheus_mode == "per_rank":
            self.prometheus.update(self.rank, self._snapshot(state.global_step))

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Rank 0 appends every log row to ``ops/log_history.jsonl`` (what ``hf-demo report`` reads while the run
        is still going: trainer_state.json is written with checkpoints only)."""
        if logs and state.is_world_process_zero and self.monitor is not None:
            exporters.append_jsonl(self.folder / "log_history.jsonl", {**logs, "step": state.global_step})
        if self.monitor is not None:  # the logging (or the evaluation, for its row) is a phase of its own
            self.monitor.phase_done(phase_of_log(logs))

    def on_evaluate(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.phase_done("evaluate")

    def on_save(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.phase_done("save")

    def record_loss(self, loss) -> None:
        if self.monitor is not None:
            self.monitor.record_loss(loss)

    def watch_forward(self, wrapped) -> None:
        """Time DDP's work before the model's forward at every micro-batch (its broadcast of the buffers: a
        collective in which the ranks wait for the slowest), so a rank's own time leaves it out."""
        inner = getattr(wrapped, "module", None)
        if self.monitor is None or not isinstance(wrapped, DistributedDataParallel) or self._watched is wrapped:
            return
        self._unwatch()
        self._watched, started = wrapped, []

        def enter(*_):
            started.append(time.perf_counter())

        def inside(*_):
            if started and self.monitor is not None:
                self.monitor.record_forward_wait(time.perf_counter() - started.pop())

        self._hooks = [wrapped.register_forward_pre_hook(enter), inner.register_forward_pre_hook(inside)]

    def _unwatch(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._watched = [], None

    def record_elastic(self, event) -> None:
        """An :class:`~hf_demo.elastic.ElasticEvent`, counted in the next step's sample (the monitor listens to an
        elastic optimizer's events by itself; this is for events from elsewhere)."""
        if self.monitor is not None:
            self.monitor.record_elastic(event)

    def record_inputs(self, inputs) -> None:
        """A micro-batch's inputs (their tokens: ``ops/tokens_per_s``)."""
        if self.monitor is not None:
            self.monitor.record_tokens(inputs)

    def _write_run_config(self, args, opt) -> None:
        """Rank 0 writes ``ops/run.json``: the run's DeMo settings, world and Trainer arguments (the report's)."""
        self._config_written = True
        if self.rank != 0 or opt is None:
            return
        chosen = {k: getattr(args, k, None) for k in TRAINER_KEYS}
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        config = {"run": self.run, "world_size": world, "demo": opt.settings.as_dict(), "trainer": chosen}
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "run.json").write_text(json.dumps(config, indent=1, default=str))

    def _snapshot(self, global_step: int) -> exporters.Snapshot:
        return exporters.Snapshot(self.monitor.totals, self.last, global_step, self.currency)

    def _count_alert(self, alert: Alert) -> None:
        """Onsets and events are counted; an alert on time's state sets its gauge (1 ongoing, 0 resolved)."""
        totals = self.monitor.totals if self.monitor is not None else None
        if totals is not None and alert.state != "event":
            totals.ongoing[alert.kind] = int(alert.state == "ongoing")
        if alert.state != "resolved":
            if totals is not None:
                totals.alerts[alert.kind] = totals.alerts.get(alert.kind, 0) + 1
            self.window_alerts[alert.kind] = self.window_alerts.get(alert.kind, 0) + 1
        exporters.append_jsonl(self.folder / f"alerts-rank{alert.rank}.jsonl", alert.as_dict())

    # ---------------------------------------------------------------- log rows
    def log_metrics(self, global_step: int) -> dict:
        """The ``ops/*`` figures of a training log row; called on every rank (it gathers from every rank)."""
        if self.monitor is None:
            return {}
        mine = (self.rank, _window_summary(self.window), self._snapshot(global_step), dict(self.window_alerts))
        self.window, self.window_alerts = [], {}
        everyone = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        if self.prometheus is not None and self.settings.prometheus_mode == "rank0":
            for rank, _, snapshot, _ in everyone:
                self.prometheus.update(rank, snapshot)
        return _log_row(everyone)


def _window_summary(samples: list[StepSample]) -> dict:
    def mean(key):
        values = [getattr(s, key) for s in samples if not math.isnan(getattr(s, key))]
        return statistics.fmean(values) if values else math.nan

    keys = ("step_s", "forward_backward_s", "demo_compute_s", "exchange_s", "other_s", "own_s", *PHASE_KEYS)
    out = {k: mean(k) for k in keys}
    out["bandwidth"] = mean("bandwidth")
    out["saved"] = mean("bytes_saved") if samples else math.nan
    out["tokens"] = float(sum(s.tokens for s in samples))
    out["span_s"] = float(sum(s.step_s + s.other_s + s.phases_s for s in samples))  # the window's wall time
    out["quorum"] = samples[-1].quorum if samples else 0
    for key in ELASTIC_WINDOW:
        out[key] = float(sum(getattr(s, key) for s in samples))
    return out


PHASE_KEYS = tuple(f"{phase}_s" for phase in PHASES)  # per-step means of the phases, as ops/<phase>_s
ELASTIC_WINDOW = ("joins", "losses", "recoveries", "recovery_s", "samples_lost", "samples_unread")  # per log row
ELASTIC_KEYS = {"joins": "ops/replica_joins", "losses": "ops/replica_losses", "recoveries": "ops/recoveries",
                "recovery_s": "ops/recovery_s", "samples_lost": "ops/samples_lost",
                "samples_unread": "ops/samples_unread"}  # fmt: skip


def _elastic_row(summaries: list, everyone: list) -> dict:
    """The quorum's figures of a log row (elastic runs only): the smallest quorum any rank saw at its last step;
    the events since the last row, as the rank that saw most (every rank of a replica group sees the same)."""
    quorums = [w.get("quorum", 0) for _, w in summaries if w.get("quorum", 0)]
    if not quorums:
        return {}
    row = {"ops/quorum": float(min(quorums))}
    row.update({name: max(w.get(key, 0.0) for _, w in summaries) for key, name in ELASTIC_KEYS.items()})
    row["ops/samples_lost_total"] = float(max(s.totals.samples_lost for _, _, s, _ in everyone))
    row["ops/samples_unread_total"] = float(max(s.totals.samples_unread for _, _, s, _ in everyone))
    return row


def _log_row(everyone: list) -> dict:
    summaries = [(rank, w) for rank, w, _, _ in everyone if not math.isnan(w["step_s"])]
    if not summaries:
        return {}

    def mean(key):
        values = [w[key] for _, w in summaries if not math.isnan(w[key])]
        return statistics.fmean(values) if values else math.nan

    slowest = max(summaries, key=lambda rw: rw[1]["own_s"])  # the rank the others waited for
    row = {
        "ops/step_s": mean("step_s"),
        "ops/step_s_max": max(w["step_s"] for _, w in summaries),
        "ops/slowest_rank": float(slowest[0]),
        "ops/own_s_max": slowest[1]["own_s"],
        "ops/forward_backward_s": mean("forward_backward_s"),
        "ops/demo_compute_s": mean("demo_compute_s"),
        "ops/exchange_wait_s": mean("exchange_s"),
        "ops/exchange_wait_s_max": max(w["exchange_s"] for _, w in summaries),
        "ops/other_s": mean("other_s"),
        **{f"ops/{key}": mean(key) for key in PHASE_KEYS},
        "ops/effective_bandwidth": mean("bandwidth"),
        "ops/bytes_saved_per_step": mean("saved"),
        "ops/bytes_saved_total": float(sum(s.totals.dense_bytes - s.totals.bytes_sent for _, _, s, _ in everyone)),
        "ops/drift_checks": float(max(s.totals.drift_checks for _, _, s, _ in everyone)),
    }
    tokens, span = sum(w.get("tokens", 0.0) for _, w in summaries), mean("span_s")
    if tokens > 0 and span > 0:
        row["ops/tokens_per_s"] = tokens / span  # every rank's tokens over the window's wall time
    costs = [s.last.cost for _, _, s, _ in everyone if s.last is not None and not math.isnan(s.last.cost)]
    if costs:
        row["ops/cost"] = float(sum(costs))
    alerts: dict[str, int] = {}
    for _, _, _, counts in everyone:
        for kind, n in counts.items():
            alerts[kind] = alerts.get(kind, 0) + n
    row["ops/alerts"] = float(sum(alerts.values()))
    row.update({f"ops/alerts_{kind}": float(n) for kind, n in sorted(alerts.items())})
    row.update(_elastic_row(summaries, everyone))
    return {k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))}


def attach(trainer, settings: OpsSettings | None = None) -> DeMoOpsCallback:
    """Add the ops callbacks to any Trainer: :class:`DeMoOpsCallback` and (``settings.health.enabled``) a
    :class:`~hf_demo.ops.health.DeMoHealthCallback` whose alerts reach the trainer's other callbacks."""
    settings = settings or OpsSettings.from_env()
    health = DeMoHealthCallback(settings.health) if settings.health.enabled else None
    ops = DeMoOpsCallback(settings, health)
    trainer.add_callback(ops)
    if health is not None:
        health.handler = trainer.callback_handler
        trainer.add_callback(health)
    return ops


def for_trainer(trainer, demo_ops) -> DeMoOpsCallback | None:
    """What ``DeMoTrainer`` attaches: nothing with ``demo_ops=False`` or without DeMo; the given
    :class:`OpsSettings`; else the settings of the environment (:meth:`OpsSettings.from_env`)."""
    if demo_ops is False or not trainer.uses_demo:
        return None
    if demo_ops is not None and not isinstance(demo_ops, OpsSettings):
        raise TypeError(f"demo_ops must be an hf_demo.ops.OpsSettings or False, not {type(demo_ops).__name__}")
    return attach(trainer, demo_ops)
