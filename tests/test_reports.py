"""Reports and exports that survive: ``hf-demo report`` on a killed run's logs, one MLflow run per recipe
training, the profiler range that holds DeMo's collective, and the table log's column dictionary as a BI tool
and a spreadsheet-style import read it."""

from __future__ import annotations

import importlib

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
