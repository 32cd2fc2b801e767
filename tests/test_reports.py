"""Reports and exports that survive: ``hf-demo report`` on a killed run's logs, one MLflow run per recipe
training, the profiler range that holds DeMo's collective, and the table log's column dictionary as a BI tool
and a spreadsheet-style import read it."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from launch_utils import ROOT

QUICK = ["--per_device_train_batch_size", "2", "--block_size", "64", "--max_train_samples", "16",
         "--max_eval_samples", "4", "--logging_steps", "1", "--save_strategy", "no", "--use_cpu", "true",
         "--disable_tqdm", "true"]  # fmt: skip


def import_recipe(name):
    """A module of recipes/, imported as the scripts import each other (their folder on sys.path)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT / "recipes"))
        return importlib.import_module(name)


# ---------------------------------------------------------------- one MLflow run per training
def test_run_clm_makes_one_mlflow_run_with_params_and_the_final_evaluation(tiny_llama_dir, tmp_path, monkeypatch):
    """recipes/run_clm.py with ``--report_to mlflow`` into MLflow's file store, read back with MlflowClient: one
    run, holding the parameters, every training step and both evaluations (before training, after it)."""
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "one-run")
    text = tmp_path / "train.txt"  # a small corpus: the default (the stdlib's sources) takes long to tokenise
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * 7}\n" for i in range(400)))
    run_clm = import_recipe("run_clm")
    results = run_clm.main(["--model_name_or_path", str(tiny_llama_dir), "--output_dir", str(tmp_path / "out"),
                            "--train_file", str(text), "--max_steps", "3", "--report_to", "mlflow",
                            *QUICK])  # fmt: skip
    assert results["global_step"] == 3
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("one-run").experiment_id])
    assert len(runs) == 1, [(r.info.run_name, sorted(r.data.params)[:3], sorted(r.data.metrics)) for r in runs]
    [run] = runs
    assert run.info.status == "FINISHED"
    assert run.data.params["max_steps"] == "3" and run.data.params["optim"] == "demo"
    evals = client.get_metric_history(run.info.run_id, "eval_loss")
    assert [m.step for m in evals] == [0, 3]  # --eval_on_start, and the evaluation after training
    assert evals[-1].value == pytest.approx(results["after"]["loss"])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3]


# ---------------------------------------------------------------- hf-demo report on a killed run
_TRAIN = r"""
import json, os, signal, sys
import torch
from datasets import Dataset
import hf_demo
from hf_demo.ops import OpsSettings, exporters
from models import Regression  # tests/models.py (tests/ is on the path)

kill_at, out, fmt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
real = exporters.append_jsonl


def dying(path, record):  # SIGKILL while the log row of step kill_at is half written
    if path.name == "log_history.jsonl" and record.get("step") == kill_at:
        line = json.dumps(record, default=float)
        with open(path, "a") as f:
            f.write(line[: len(line) // 2])
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
    real(path, record)


exporters.append_jsonl = dying


x = torch.randn(128, 8, generator=torch.Generator().manual_seed(0))
data = Dataset.from_dict({"x": x.tolist(), "labels": x.sum(1).tolist()})
args = hf_demo.DeMoTrainingArguments(output_dir=out, optim="demo", per_device_train_batch_size=4, max_steps=12,
                                     logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                                     disable_tqdm=True, learning_rate=1e-3)
trainer = hf_demo.DeMoTrainer(model=Regression(), args=args, train_dataset=data,
                              demo_ops=OpsSettings(table_log=fmt, table_flush_steps=5))
trainer.train()
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two real runs of 12 steps on one process: one killed (SIGKILL) while writing step 8's log row (a CSV table
    log), one that finished (a Parquet table log)."""
    tmp = tmp_path_factory.mktemp("killed")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(ROOT / "tests"))), "OMP_NUM_THREADS": "1"}
    done = {}
    for name, kill_at, fmt in (("killed", 8, "csv"), ("finished", 0, "parquet")):
        proc = subprocess.run([sys.executable, "-c", _TRAIN, str(kill_at), str(tmp / name), fmt], env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        done[name] = (tmp / name, proc)
    return done


def test_a_killed_runs_report_says_it_stopped_early_and_where(runs):
    from hf_demo.ops import cli

    out, proc = runs["killed"]
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    log = out / "ops" / "log_history.jsonl"
    lines = log.read_text().split("\n")
    assert len(lines) == 8 and lines[-1] and not lines[-1].endswith("}")  # 7 whole rows, step 8's cut
    with pytest.raises(json.JSONDecodeError):  # what the report choked on
        json.loads(lines[-1])
    assert cli.main(["report", str(out)]) == 0
    page = (out / "hf-demo-report.html").read_text()
    assert "stopped early after step 8" in page  # the per-step table holds step 8; the log rows end at 7
    assert "no end-of-training record" in page and "the last step in the log rows is 7, in the per-step table 8" in page
    assert f"The last line of {log} (line 8) was cut mid-write" in page
    assert "class='ended early'" in page and page.count("data:image/png;base64,") >= 4


def test_a_finished_runs_report_says_it_finished(runs):
    from hf_demo.ops import report

    out, proc = runs["finished"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = report.read_log(out).rows
    assert rows[-1]["step"] == 12 and report.END_KEY in rows[-1]  # Trainer's end-of-training row
    page = report.render(out)
    assert "finished at step 12" in page and "stopped early" not in page and "class='ended'" in page


def test_a_resumed_run_appends_on_a_new_line_after_the_cut_one(runs, tmp_path):
    from hf_demo.ops import exporters, report

    out = tmp_path / "run"
    shutil.copytree(runs["killed"][0], out)
    log = out / "ops" / "log_history.jsonl"
    exporters.append_jsonl(log, {"loss": 1.0, "step": 6})  # the resumed run's first row
    exporters.append_jsonl(log, {"train_runtime": 1.0, "step": 12})
    read = report.read_log(out)
    assert read.cut == [8] and [r["step"] for r in read.rows][-2:] == [6, 12]
    ended, notes = report.ending(read, [], [])
    assert ended == "finished at step 12"
    assert any("Line(s) 8 of" in n and "earlier attempt was killed" in n for n in notes), notes


def test_cut_table_rows_alert_lines_and_checkpoint_states_are_named_not_fatal(tmp_path):
    from hf_demo.ops import report

    ops = tmp_path / "ops"
    ops.mkdir()
    (ops / "steps-rank0.csv").write_text("step,rank,step_s\r\n1,0,0.5\r\n2,0,0.5\r\n3,0,0.")  # the last unended
    (ops / "steps-rank1.csv").write_text("step,rank,step_s\r\n1,1,0.5\r\n2,1\r\n")  # a row short of cells
    alert = {"kind": "loss_spike", "step": 2, "rank": 0, "node": 0, "message": "m"}
    (ops / "alerts-rank0.jsonl").write_text(json.dumps(alert) + "\n" + json.dumps(alert)[:20])
    for step, text in ((2, json.dumps({"log_history": [{"step": 2, "loss": 1.0}]})), (4, '{"log_history": [{"st')):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(text)
    skipped = []
    steps = report.step_rows(tmp_path, skipped)
    assert sorted((r["rank"], r["step"]) for r in steps) == [(0, 1), (0, 2), (1, 1)]
    assert len(report.alerts(tmp_path, skipped)) == 1 and len(skipped) == 3
    page = report.render(tmp_path)
    assert "stopped early after step 2" in page and "checkpoint-4/trainer_state.json did not read whole" in page
    assert "line 4 of" in page and "line 3 of" in page and "line 2 of" in page


def _chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


def test_the_killed_runs_page_renders_in_headless_chromium(runs, tmp_path):
    from PIL import Image

    from hf_demo.ops import report

    out, _ = runs["killed"]
    page = report.write(out, tmp_path / "page.html")
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium: scripts/setup.sh installs it where apt-get is available (it was not here)")
    shot = tmp_path / "shot.png"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1200,900",
             page.as_uri()]  # fmt: skip
    subprocess.run([browser, *flags], capture_output=True, timeout=120, check=False)
    assert shot.is_file(), "chromium wrote no screenshot"
    image = Image.open(shot).convert("RGB")
    banner = [image.getpixel((x, y)) for x in range(20, 400, 10) for y in range(40, 200, 4)]
    assert (0xFD, 0xEC, 0xEA) in banner  # the red "stopped early" banner was drawn near the top


# ---------------------------------------------------------------- the profiler range that holds the collectives
def _collectives_in_ranges(rank, world, settings, folder):
    """Rank ``rank``'s gloo collectives in a profiled steady step, each with the DeMo ranges around it."""
    from torch.profiler import ProfilerActivity, profile

    from hf_demo import DeMo
    from models import loss_and_backward, tiny_mlp

    model = tiny_mlp(0)
    opt = DeMo(model.parameters(), lr=1e-3, compression_chunk=8, compression_topk=4, **settings)
    for step in range(3):  # past the first exchange's checks: a steady step
        loss_and_backward(model, rank, step)
        opt.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss_and_backward(model, rank, 3)
        opt.step()
    path = f"{folder}/trace{rank}.json"
    prof.export_chrome_trace(path)  # what TensorBoard and Perfetto open
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    ranges = [e for e in events if str(e.get("name", "")).startswith("DeMo.")]
    return [
        (
            e["name"],
            sorted(r["name"] for r in ranges if r["ts"] <= e["ts"] and e["ts"] + e["dur"] <= r["ts"] + r["dur"]),
        )
        for e in events
        if str(e.get("name", "")).startswith("gloo:")
    ]


@pytest.mark.parametrize("settings", [{}, {"exchange": "all_reduce"}], ids=["defaults", "all_reduce"])
def test_the_collectives_sit_in_the_range_the_guide_names(gloo, settings, tmp_path):
    """docs/guides/operations.md: ``DeMo.exchange`` holds the exchange's collectives (with the defaults, the step's
    only one: the all-gather of the headers, the payload riding in it, inside ``DeMo.agreement``); the commit vote
    of the modes that do not settle it in the next exchange is ``DeMo.vote``'s."""
    from dist_utils import expect_ok

    guide = (ROOT / "docs" / "guides" / "operations.md").read_text()
    assert "`DeMo.exchange` (the exchange's collectives" in guide
    for found in expect_ok(gloo(_collectives_in_ranges, 2, settings, str(tmp_path))):
        payload = [ranges for name, ranges in found if name == f"gloo:{settings.get('exchange', 'all_gather')}"]
        if not settings:
            assert [name for name, _ in found] == ["gloo:all_gather"], found  # one collective a step
            assert found[0][1] == ["DeMo.agreement", "DeMo.exchange", "DeMo.step"], found
        assert payload and all("DeMo.exchange" in ranges for ranges in payload), found
        assert all("DeMo.exchange" in ranges or "DeMo.vote" in ranges for _, ranges in found), found


# ---------------------------------------------------------------- the BI export: column dictionary, types, gaps
GUIDE = ROOT / "docs" / "guides" / "operations.md"


def _bi_section() -> str:
    text = GUIDE.read_text()
    start = text.index("### The table log in a BI tool: the column dictionary")
    return text[start : text.index("\n## ", start)]


def test_the_column_dictionary_describes_every_column_written(runs):
    import dataclasses
    import re

    import pandas as pd
    import pyarrow.parquet as pq

    from hf_demo.ops.exporters import COLUMNS
    from hf_demo.ops.monitor import StepSample

    every = ["run", *(f.name for f in dataclasses.fields(StepSample)), "bytes_saved", "own_s"]
    assert list(COLUMNS) == every  # one entry per column of the table log, in its order
    assert all(kind in ("int64", "float64", "string", "timestamp") and meaning for kind, _, meaning in COLUMNS.values())
    documented = re.findall(r"^\| `(\w+)` \| (\w+) \| ([^|]*) \| ([^|]*) \|$", _bi_section(), re.M)
    assert [(n, t, u.strip(), m.strip()) for n, t, u, m in documented] == [(n, *v) for n, v in COLUMNS.items()]
    for name in ("killed", "finished"):
        ops = runs[name][0] / "ops"
        dictionary = pd.read_csv(ops / "columns.csv", keep_default_na=False)
        assert list(dictionary.columns) == ["name", "type", "unit", "meaning"]
        assert list(dictionary["name"]) == every
        assert [tuple(r) for r in dictionary[["type", "unit", "meaning"]].itertuples(index=False)] == [
            COLUMNS[n] for n in every
        ]
    part = next((runs["finished"][0] / "ops" / "steps").glob("part-*.parquet"))
    fields = {f.name: f for f in pq.read_schema(part)}
    assert fields["exchange_s"].metadata == {b"unit": b"s", b"meaning": COLUMNS["exchange_s"][2].encode()}


def test_csv_cells_are_iso_timestamps_and_empty_where_missing(runs):
    import csv
    import datetime
    import re

    path = runs["killed"][0] / "ops" / "steps-rank0.csv"
    text = path.read_text()
    rows = list(csv.DictReader(text.splitlines()))
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    assert "nan" not in text.lower()  # no text for a missing value
    iso = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00"
    assert all(re.fullmatch(iso, r["timestamp"]) for r in rows), rows[0]["timestamp"]
    when = datetime.datetime.fromisoformat(rows[0]["timestamp"])
    assert abs((datetime.datetime.now(datetime.timezone.utc) - when).total_seconds()) < 3600
    assert all(r["cost"] == "" and r["bandwidth"] == "" for r in rows)  # no price table; one rank: no traffic
    assert all(r["loss"] != "" and float(r["loss"]) > 0 for r in rows)


def test_the_guides_pandas_and_spreadsheet_imports_read_a_real_table_log(runs, tmp_path):
    """The guide's two Python blocks, run as they are on a folder with a real run's Parquet parts and a real
    run's CSV (OUTPUT_DIR replaced)."""
    import datetime
    import re

    import pyarrow as pa

    out = tmp_path / "run"
    shutil.copytree(runs["finished"][0] / "ops", out / "ops")
    shutil.copy(runs["killed"][0] / "ops" / "steps-rank0.csv", out / "ops")
    blocks = re.findall(r"```python\n(.*?)```", _bi_section(), re.S)
    assert len(blocks) == 2
    space: dict = {}
    for block in blocks:
        exec(block.replace("OUTPUT_DIR", str(out)), space)  # noqa: S102 - the guide's own code
    steps, csv_steps, columns = space["steps"], space["csv_steps"], space["columns"]
    assert sorted(steps["step"]) == list(range(1, 13)) and str(steps["timestamp"].dtype) == "datetime64[us, UTC]"
    assert steps["cost"].isna().all() and steps["loss"].notna().all() and steps["tier"].dtype == "int64"
    assert str(csv_steps["timestamp"].dt.tz) == "UTC" and csv_steps["cost"].isna().all()
    assert list(columns["name"]) == list(steps.columns) == list(csv_steps.columns)
    assert list(space["per_rank"].index) == [0]
    table = space["table"]  # pyarrow.csv with the dictionary's types
    assert table.schema.field("timestamp").type == pa.timestamp("us", "UTC")
    assert table.schema.field("step").type == pa.int64() and table.column("cost").null_count == table.num_rows
    rows = space["rows"]  # the csv module with the dictionary's types
    assert [r["step"] for r in rows] == list(range(1, 9)) and rows[0]["cost"] is None
    assert isinstance(rows[0]["timestamp"], datetime.datetime) and rows[0]["timestamp"].tzinfo is not None
    assert isinstance(rows[0]["exchange_s"], float) and isinstance(rows[0]["world"], int)


def test_a_parquet_part_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    """A part is written under a hidden name and renamed: a kill while it is written leaves no half file in the
    folder (the report and pandas.read_parquet would choke on it)."""
    import pyarrow.parquet as pq

    from hf_demo.ops.exporters import TableLog

    table = TableLog(tmp_path, 0, "parquet", flush_steps=100)
    table.add({"run": "r", "step": 1, "loss": float("nan"), "timestamp": 1.7e9})
    seen = []
    real = pq.write_table

    def watching(data, where, **kwargs):
        seen.append(sorted(p.name for p in (tmp_path / "steps").iterdir()))
        real(data, where, **kwargs)
        seen.append(sorted(p.name for p in (tmp_path / "steps").iterdir()))

    monkeypatch.setattr(table.pq, "write_table", watching)
    table.flush()
    assert seen == [[], [".part-r0-00000.parquet.tmp"]]
    assert [p.name for p in (tmp_path / "steps").iterdir()] == ["part-r0-00000.parquet"]
    read = pq.read_table(tmp_path / "steps").to_pylist()
    assert read[0]["loss"] is None and read[0]["timestamp"].isoformat() == "2023-11-14T22:13:20+00:00"
