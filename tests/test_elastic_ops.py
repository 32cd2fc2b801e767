"""Elastic runs seen by operators (issue 40, item 8): the quorum's events (hf_demo.elastic.ElasticEvent) become
live metrics in every exporter (a real prometheus_client registry, MLflow's file store read back through its
client, the CSV and Parquet logs) and health alerts, with Prometheus rules that promtool fires."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import time

import pytest
import torch

from hf_demo.elastic import ElasticEvent
from hf_demo.ops import HealthSettings, OpsSettings
from hf_demo.ops.health import HealthRules
from hf_demo.ops.monitor import StepMonitor, StepSample, Totals
from launch_utils import ROOT
from models import Regression

GUIDE = ROOT / "docs" / "guides" / "operations.md"
RULES = ROOT / "docs" / "grafana" / "hf-demo-alerts.yml"


def event(kind, step, quorum, seconds=0.0, samples_lost=0):
    return ElasticEvent(kind, step, quorum, seconds, samples_lost, time.time())


# what one replica of a 3-replica run sees: the quorum formed, one replica lost at step 4 (its batch refused), back
# at step 7 after a 2.5 s recovery (of this replica: it is the one that lagged), lost again at step 9 and not back
EVENTS = {
    1: [event("join", 1, 3)],
    4: [event("loss", 4, 2, seconds=0.8, samples_lost=24)],
    7: [event("join", 7, 3), event("recovered", 7, 3, seconds=2.5)],
    9: [event("loss", 9, 2, seconds=0.5, samples_lost=24)],
}


def monitored(steps: int = 40, events: dict | None = None) -> tuple[list[StepSample], Totals]:
    """Each step's sample and the run's totals of a monitor that saw ``events`` (step -> events; :data:`EVENTS`)."""
    events = EVENTS if events is None else events
    monitor = StepMonitor(0, 0, 1, None, sync_cuda=False)
    samples = []
    try:
        for step in range(1, steps + 1):
            monitor.step_begin()
            for e in events.get(step, []):
                monitor.record_elastic(e)
            monitor.pre_optimizer()
            monitor.optimizer_done()
            samples.append(monitor.step_end(step))
    finally:
        monitor.close()
    return samples, monitor.totals


def test_the_quorums_events_become_each_steps_figures_and_the_runs_totals():
    samples, totals = monitored()
    by_step = {s.step: s for s in samples}
    assert [by_step[s].quorum for s in (1, 3, 4, 6, 7, 8, 9, 40)] == [3, 3, 2, 2, 3, 3, 2, 2]
    assert (by_step[4].losses, by_step[4].samples_lost, by_step[5].losses) == (1, 24, 0)
    assert (by_step[7].joins, by_step[7].recoveries, by_step[7].recovery_s) == (1, 1, 2.5)
    assert (totals.joins, totals.losses, totals.recoveries, totals.samples_lost) == (2, 2, 1, 48)
    assert totals.recovery_s == totals.last_recovery_s == 2.5 and totals.quorum == 2
    with pytest.raises(ValueError, match="'rejoin'.*join, loss, recovered"):
        StepMonitor(0, 0, 1, None, sync_cuda=False).record_elastic(event("rejoin", 1, 2))


def test_the_samples_no_replica_reads_are_each_steps_figure_a_total_and_a_prometheus_counter():
    """Trainer's elastic callback counts the shards of missing replicas in ``ElasticStats.samples_unread``; the
    monitor reads what was added since the previous step at each step's end (with the quorum the step ran with)."""
    pytest.importorskip("prometheus_client")
    from types import SimpleNamespace

    import hf_demo
    from dist_utils import free_port
    from hf_demo.elastic import ElasticStats
    from hf_demo.ops.exporters import PrometheusExporter, Snapshot

    opt = hf_demo.DeMo([torch.nn.Parameter(torch.zeros(8, 8))], lr=1e-3)
    stats = ElasticStats()
    elastic = SimpleNamespace(world=2, stats=stats, optimizer=opt, events=[], add_listener=lambda callback: None)
    monitor = StepMonitor(0, 0, 1, None, sync_cuda=False)
    seen = []
    try:
        for step, unread in enumerate([0, 8, 8, 0, 4], 1):
            monitor.step_begin(elastic)  # what the loop steps: the elastic wrapper around DeMo
            monitor.pre_optimizer()
            monitor.optimizer_done()
            stats.samples_unread += unread  # the elastic callback's on_step_end runs before the ops callback's
            sample = monitor.step_end(step, elastic)
            seen.append((sample.quorum, sample.samples_unread))
    finally:
        monitor.close()
    assert seen == [(2, 0), (2, 8), (2, 8), (2, 0), (2, 4)] and monitor.totals.samples_unread == 20
    exporter = PrometheusExporter(free_port(), "127.0.0.1", "el")
    try:
        exporter.update(0, Snapshot(monitor.totals, sample, 5, ""))
        labels = {"rank": "0", "node": "0", "run": "el"}
        assert exporter.registry.get_sample_value("hf_demo_samples_unread_total", labels) == 20.0
    finally:
        exporter.close()


def test_a_loss_a_quorum_that_stays_short_and_a_slow_recovery_alert():
    samples, _ = monitored()
    rules = HealthRules(HealthSettings(quorum_patience=20, recovery_alert_s=2.0, cooldown_steps=10))
    found = [(a.kind, a.step, a.value, a.baseline) for s in samples for a in rules.observe(s)]
    # each loss alerts (no cooldown between them); the quorum below the largest seen (3) for 20 steps in a row
    # alerts once, at step 28 (the first stretch, steps 4-6, was short); the 2.5 s recovery is over 2 s
    assert found == [
        ("replica_lost", 4, 2.0, 3.0),
        ("slow_recovery", 7, 2.5, 2.0),
        ("replica_lost", 9, 2.0, 3.0),
        ("quorum_below_target", 28, 2.0, 3.0),
    ], found
    # a configured size: a quorum of 3 is short of 4 from the start; a quick recovery is no alert
    rules = HealthRules(HealthSettings(expected_replicas=4, quorum_patience=3, recovery_alert_s=10.0))
    found = [(a.kind, a.step) for s in samples for a in rules.observe(s)]
    assert found == [("quorum_below_target", 3), ("replica_lost", 4), ("replica_lost", 9)], found
    # a run that is not elastic (quorum 0) never raises them
    plain = HealthRules(HealthSettings(quorum_patience=1))
    assert [a for s in samples for a in plain.observe(_not_elastic(s))] == []


def _not_elastic(s: StepSample) -> StepSample:
    import dataclasses

    return dataclasses.replace(s, quorum=0, joins=0, losses=0, recoveries=0, recovery_s=0.0, samples_lost=0)


def test_the_prometheus_registry_serves_the_quorums_series_only_for_elastic_runs():
    pytest.importorskip("prometheus_client")
    from dist_utils import free_port
    from hf_demo.ops.exporters import ELASTIC_TOTALS, METRICS, PrometheusExporter, Snapshot

    samples, totals = monitored(12)
    exporter = PrometheusExporter(free_port(), "127.0.0.1", "el")
    try:
        exporter.update(0, Snapshot(totals, samples[-1], 12, ""))
        labels = {"rank": "0", "node": "0", "run": "el"}
        read = lambda name: exporter.registry.get_sample_value(name, labels)  # noqa: E731
        assert read("hf_demo_quorum_size") == 2.0
        assert read("hf_demo_replica_joins_total") == 2.0 and read("hf_demo_replica_losses_total") == 2.0
        assert read("hf_demo_recoveries_total") == 1.0 and read("hf_demo_recovery_seconds_total") == 2.5
        assert read("hf_demo_last_recovery_seconds") == 2.5 and read("hf_demo_samples_lost_total") == 48.0
        alerts = {k: exporter.registry.get_sample_value("hf_demo_alerts_total", {**labels, "kind": k})
                  for k in ("replica_lost", "quorum_below_target", "slow_recovery")}  # fmt: skip
        assert alerts == dict.fromkeys(alerts, 0.0)  # from 0, so increase() sees the first
        plain = [_not_elastic(s) for s in samples]
        from hf_demo.ops.monitor import Totals

        t = Totals()
        for s in plain:
            t.add(s)
        exporter.update(0, Snapshot(t, plain[-1], 12, ""))
        assert read("hf_demo_quorum_size") is None and read("hf_demo_replica_losses_total") is None
    finally:
        exporter.close()
    assert {"hf_demo_quorum_size", "hf_demo_last_recovery_seconds", *ELASTIC_TOTALS} <= set(METRICS)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_the_table_log_has_the_quorums_columns(tmp_path, fmt):
    import pandas as pd

    from hf_demo.ops.exporters import TableLog

    samples, _ = monitored(10)
    table = TableLog(tmp_path, 0, fmt, flush_steps=4)
    for s in samples:
        table.add(s.row("el"))
    table.flush()
    read = pd.read_csv(tmp_path / "steps-rank0.csv") if fmt == "csv" else pd.read_parquet(tmp_path / "steps")
    read = read.sort_values("step")
    assert list(read["quorum"]) == [3, 3, 3, 2, 2, 2, 3, 3, 2, 2]
    assert list(read["losses"]) == [0, 0, 0, 1, 0, 0, 0, 0, 1, 0] and read["samples_lost"].sum() == 48
    assert read.loc[read["step"] == 7, "recovery_s"].item() == 2.5


def test_the_guide_lists_exactly_the_exported_metrics_and_the_tables_columns():
    import dataclasses

    from hf_demo.ops.exporters import METRICS

    guide = GUIDE.read_text()
    listed = re.findall(r"^\| `(hf_demo_\w+)` \|", guide, re.M)
    assert listed == list(METRICS), set(listed) ^ set(METRICS)
    columns = re.search(r"`hf_demo\.ops\.monitor\.StepSample` \(`([^`]*)`", guide).group(1)
    fields = [f.name for f in dataclasses.fields(StepSample)]
    assert columns.replace("`", "").replace("\n", " ").split(", ") == ["run", *fields, "bytes_saved", "own_s"]


# ---------------------------------------------------------------- a real Trainer reporting to MLflow
def test_mlflow_and_the_csv_log_get_the_quorums_figures(tmp_path, monkeypatch):
    """A DeMoTrainer fed the events of EVENTS (as an elastic optimizer's listener would) logs them in its rows:
    read back from MLflow's file store through MlflowClient, and from the per-step CSV log."""
    import pandas as pd
    from datasets import Dataset
    from mlflow.tracking import MlflowClient
    from transformers import TrainerCallback

    import hf_demo

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "elastic-ops")

    class Feed(TrainerCallback):
        def __init__(self):
            self.trainer, self.alerts = None, []

        def on_step_begin(self, args, state, control, **kwargs):
            for e in EVENTS.get(state.global_step + 1, []):
                self.trainer.demo_ops.record_elastic(e)

        def on_demo_alert(self, args, state, control, alert, **kwargs):
            self.alerts.append((alert.kind, alert.step))

    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"x": x.tolist(), "labels": x.sum(1).tolist()})
    args = hf_demo.DeMoTrainingArguments(
        output_dir=str(tmp_path / "out"), optim="demo", per_device_train_batch_size=4, max_steps=12, logging_steps=3,
        report_to="mlflow", use_cpu=True, learning_rate=1e-3, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    feed = Feed()
    ops = OpsSettings(table_log="csv", health=HealthSettings(quorum_patience=5))
    trainer = hf_demo.DeMoTrainer(model=Regression(), args=args, train_dataset=data, callbacks=[feed], demo_ops=ops)
    feed.trainer = trainer
    trainer.train()
    elastic_kinds = ("replica_lost", "quorum_below_target", "slow_recovery")  # a loaded host may add time alerts
    assert [a for a in feed.alerts if a[0] in elastic_kinds] == [("replica_lost", 4), ("replica_lost", 9)]
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("elastic-ops").experiment_id])

    def history(key):
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}

    assert history("ops/quorum") == {3: 3.0, 6: 2.0, 9: 2.0, 12: 2.0}
    assert history("ops/replica_losses") == {3: 0.0, 6: 1.0, 9: 1.0, 12: 0.0}
    assert history("ops/replica_joins") == {3: 1.0, 6: 0.0, 9: 1.0, 12: 0.0}
    assert history("ops/recovery_s") == {3: 0.0, 6: 0.0, 9: 2.5, 12: 0.0}
    assert history("ops/samples_lost_total") == {3: 0.0, 6: 24.0, 9: 48.0, 12: 48.0}
    assert history("ops/alerts_replica_lost") == {6: 1.0, 9: 1.0}
    table = pd.read_csv(tmp_path / "out" / "ops" / "steps-rank0.csv")
    assert list(table["quorum"]) == [3, 3, 3, 2, 2, 2, 3, 3, 2, 2, 2, 2] and table["samples_lost"].sum() == 48
    assert not math.isnan(table["recovery_s"].sum())
    # the run report: the quorum's figures in its summary, and the quorum over the steps
    from hf_demo.ops import report

    rows, _ = report.log_rows(tmp_path / "out")
    summary = dict(report._elastic_summary(rows))
    assert summary["quorum (smallest, last)"] == "2, 2" and summary["replicas lost, joined"] == "2, 2"
    assert summary["samples lost (refused steps)"] == "48"
    assert summary["recoveries from a live peer (seconds)"] == "1 (2.5)"
    assert summary["samples unread (missing replicas' shards)"] == "0"
    assert "Elastic: replicas in the quorum" in report.render(tmp_path / "out")


# ---------------------------------------------------------------- the shipped Prometheus rules
_RULE_TEST = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'hf_demo_alerts_total{{kind="replica_lost", rank="0", node="0", run="r"}}'
        values: '0 0 1 1 1 1'
      - series: 'hf_demo_quorum_size{{rank="0", node="0", run="r"}}'
        values: '3x10 2x30'
      - series: 'hf_demo_replica_losses_total{{rank="0", node="0", run="r"}}'
        values: '0 1 2 3 4 4 4'
    alert_rule_test:
      - eval_time: 3m
        alertname: HfDemoReplicaLost
        exp_alerts:
          - exp_labels: {{severity: warning, kind: replica_lost, rank: "0", node: "0", run: r}}
            exp_annotations:
              summary: "run r: a replica left torchft's quorum (seen by rank 0)"
              description: "the step in flight was refused, the survivors go on; its launcher restarts it"
      - eval_time: 20m
        alertname: HfDemoQuorumShrunk
      - eval_time: 30m
        alertname: HfDemoQuorumShrunk
        exp_alerts:
          - exp_labels: {{severity: warning, rank: "0", node: "0", run: r}}
            exp_annotations:
              summary: "run r: the quorum is 2 replicas, fewer than in the last 6 hours, for 15 minutes"
              description: "an elastic run trains on with fewer replicas: restart the lost ones"
      - eval_time: 5m
        alertname: HfDemoFrequentLosses
        exp_alerts:
          - exp_labels: {{severity: warning, rank: "0", node: "0", run: r}}
            exp_annotations:
              summary: "run r: more than 3 replicas lost in an hour"
              description: "each costs a step, the detection and a recovery: a failing host or a pre-empting scheduler"
"""


def test_promtool_fires_the_elastic_rules(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no promtool (Debian: apt-get install prometheus)")
    (tmp_path / "t.yml").write_text(_RULE_TEST.format(rules=RULES))
    tested = subprocess.run([promtool, "test", "rules", str(tmp_path / "t.yml")], capture_output=True, text=True,
                            timeout=60, env={**os.environ})  # fmt: skip
    assert tested.returncode == 0, tested.stdout + tested.stderr


# ---------------------------------------------------------------- hf-demo plan --mtbf-hours
FAILING = ["plan", "--shapes", "1000x1000", "--nodes", "2", "--inter-node", "1gbit", "--compute-s", "1",
           "--steps-per-epoch", "3600", "--mtbf-hours", "100", "--checkpoint-every", "100", "--restart-s", "60",
           "--detect-s", "10"]  # fmt: skip


def test_the_plan_prices_failures_restart_from_checkpoint_against_elastic(tmp_path, capsys):
    import json

    from hf_demo.ops import cli

    assert cli.main([*FAILING, "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "Failures: MTBF 100 h per node, 2 node(s)" in out and "lost per epoch, elastic" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    failures = plan["failures"]
    assert failures["recovery_s"] == pytest.approx(4e6 / 1.25e8)  # 1M fp32 parameters over 1 Gbit/s
    rows = {r["method"]: r for r in plan["methods"]}
    costs = {c["method"]: c for c in failures["methods"]}
    per_hour = 2 / 100  # two nodes, 100 h each between failures

    def lost(epoch_h, seconds):
        x = per_hour * seconds / 3600
        return epoch_h * x / (1 - x)

    demo, cost = rows["demo"], costs["demo"]
    assert cost["failures_per_epoch"] == pytest.approx(per_hour * demo["epoch_h"])
    restart = 10 + 60 + 50 * demo["step_s"]  # detection, restart, half of 100 steps recomputed
    elastic = demo["step_s"] + 10 + failures["recovery_s"] + 60 / 2  # the step, detection, recovery, restart / N
    assert cost["restart_per_failure_s"] == pytest.approx(restart)
    assert cost["elastic_per_failure_s"] == pytest.approx(elastic)
    assert cost["restart_lost_h"] == pytest.approx(lost(demo["epoch_h"], restart))
    assert cost["elastic_lost_h"] == pytest.approx(lost(demo["epoch_h"], elastic))
    assert cost["elastic_lost_h"] < cost["restart_lost_h"]
    # what hf_demo.elastic does not run has no elastic figure, and says why
    assert costs["ddp-adamw"]["elastic_lost_h"] is None and "runs DeMo" in costs["ddp-adamw"]["elastic_note"]
    assert costs["demo-budget"]["elastic_lost_h"] is not None  # the budget's local-step tiers run elastically
    assert costs["demo-overlap"]["elastic_lost_h"] is not None  # overlap runs elastically


def test_the_plan_prices_hsdp_nodes_as_elastic_replica_groups_and_says_what_it_refuses_there(tmp_path):
    """HSDP (a node as one replica group) runs every-step DeMo elastically; its local steps (the from_scratch
    preset) are refused there, and the plan says why."""
    import json

    from hf_demo.ops import cli

    assert cli.main([*FAILING, "--devices-per-node", "2", "--json", str(tmp_path / "plan.json")]) == 0
    costs = {c["method"]: c for c in json.loads((tmp_path / "plan.json").read_text())["failures"]["methods"]}
    assert costs["demo-hsdp"]["elastic_lost_h"] is not None and costs["demo-hsdp"]["elastic_note"] == ""
    refused = costs["demo-hsdp-from_scratch"]
    assert refused["elastic_lost_h"] is None and "local steps" in refused["elastic_note"], refused


def test_failures_faster_than_the_recovery_never_end(tmp_path, capsys):
    import json

    from hf_demo.ops import cli

    # 2 nodes failing every 0.2 h: 10 failures an hour, one each 360 s; with the defaults a restart from checkpoint
    # costs 30 s + 300 s + 250 steps (over 360 s: never ends), an elastic one 1 step + 30 s + 300 s / 2 (about 180 s)
    argv = [*FAILING[:-8], "--mtbf-hours", "0.2", "--json", str(tmp_path / "plan.json")]
    assert cli.main(argv) == 0
    assert "never ends" in capsys.readouterr().out
    costs = {c["method"]: c for c in json.loads((tmp_path / "plan.json").read_text())["failures"]["methods"]}
    assert costs["demo"]["restart_lost_h"] is None and costs["demo"]["restart_per_failure_s"] > 360
    assert 0 < costs["demo"]["elastic_lost_h"] < math.inf


def test_the_monitor_listens_to_an_elastic_optimizers_events_by_itself():
    """A custom loop (or DeMoOpsCallback) hands the monitor the optimizer: the monitor takes the events the
    Elastic already had, listens for the next ones, and reads the quorum's size from it at every step."""
    from models import small_demo, tiny_mlp

    class FakeElastic:  # what the monitor reads of hf_demo.elastic.Elastic
        def __init__(self, optimizer):
            self.events, self.listeners, self.world = [event("join", 1, 3)], [], 3
            self.optimizer = optimizer  # the DeMo it wraps

        def add_listener(self, callback):
            self.listeners.append(callback)

    opt = small_demo(tiny_mlp())
    elastic = FakeElastic(opt)  # what the loop steps
    monitor = StepMonitor(0, 0, 1, None, sync_cuda=False)
    try:
        samples = []
        for step in (1, 2, 3):
            monitor.step_begin(elastic)
            if step == 2:
                elastic.world = 2
                for listener in elastic.listeners:
                    listener(event("loss", 2, 2, samples_lost=8))
            samples.append(monitor.step_end(step, elastic))
    finally:
        monitor.close()
    assert len(elastic.listeners) == 1  # attached once
    seen = [(s.quorum, s.joins, s.losses, s.samples_lost) for s in samples]
    assert seen == [(3, 1, 0, 0), (2, 0, 1, 8), (2, 0, 0, 0)]
