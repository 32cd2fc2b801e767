"""The Prometheus endpoint of every rank, scraped over loopback HTTP during a real 2-process DeMoTrainer run."""

import csv
import json
import socket

import pytest

from dist_utils import free_port
from launch_utils import ROOT, accelerate_launch

SCRIPT = ROOT / "tests" / "scripts" / "train_ops.py"


def _two_free_ports() -> int:
    """A port p with p + 1 free too (rank 1 serves on p + 1)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise AssertionError("no two consecutive free ports")


@pytest.mark.launch
def test_every_ranks_prometheus_endpoint_is_scraped_during_training(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    port = _two_free_ports()
    out, rec = tmp_path / "out", tmp_path / "rec"
    accelerate_launch(
        SCRIPT, "--output_dir", out, "--record_dir", rec, "--prometheus_port", port, "--scrape_step", 4,
        "--optim", "demo", "--per_device_train_batch_size", 4, "--max_steps", 12, "--logging_steps", 3,
        "--slow_step", 8,
        "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "true",
    )  # fmt: skip
    for rank in (0, 1):
        samples = [
            s
            for fam in text_string_to_metric_families((rec / f"scrape-rank{rank}.txt").read_text())
            for s in fam.samples
        ]
        mine = {s.name: s for s in samples if not {"part", "kind", "currency"} & set(s.labels)}
        assert {s.labels["rank"] for s in samples} == {str(rank)}
        assert mine["hf_demo_steps_total"].labels == {"rank": str(rank), "node": "0", "run": "launch-test"}
        assert mine["hf_demo_steps_total"].value >= 3  # scraped in the middle of the run, not after it
        assert mine["hf_demo_bytes_received_total"].value > 0 and mine["hf_demo_dense_bytes_total"].value > 0
        waited = [s for s in samples if s.name == "hf_demo_step_seconds_total" and s.labels["part"] == "exchange"]
        assert waited and waited[0].value > 0
        assert {s.labels["kind"] for s in samples if s.name == "hf_demo_alerts_total"} >= {"step_time", "drift"}
        assert mine["hf_demo_step_duration_seconds_count"].value == mine["hf_demo_steps_total"].value
    rows = [list(csv.DictReader(open(out / "ops" / f"steps-rank{r}.csv"))) for r in (0, 1)]
    assert [len(r) for r in rows] == [12, 12] and rows[0][0]["bytes_sent"] == rows[1][0]["bytes_sent"]
    logged = [r for r in (out / "ops" / "log_history.jsonl").read_text().splitlines() if "ops/step_s_max" in r]
    assert len(logged) == 4  # rank 0's log rows, with every rank's figures gathered
    # rank 1 was late for step 8 (a stall before it): the row of steps 7-9 names it, and so do the alerts
    slow_row = json.loads(logged[2])
    assert slow_row["step"] == 9 and slow_row["ops/slowest_rank"] == 1.0, slow_row
    alerts = {r: [json.loads(x) for x in (out / "ops" / f"alerts-rank{r}.jsonl").read_text().splitlines()]
              if (out / "ops" / f"alerts-rank{r}.jsonl").exists() else [] for r in (0, 1)}  # fmt: skip
    assert ("step_time", 8) in [(a["kind"], a["step"]) for a in alerts[1]], alerts
    assert "step_time" not in [a["kind"] for a in alerts[0]], alerts
    assert all(json.loads(r)["ops/tokens_per_s"] > 0 for r in logged)  # the batches' tokens, every rank
    config = json.loads((out / "ops" / "run.json").read_text())
    assert config["world_size"] == 2 and config["demo"]["compression_topk"] > 0
