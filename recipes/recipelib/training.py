"""How a recipe trains, evaluates and ends: metric scripts offline, the evaluation before training, one short
line per log row, train -> save -> evaluate -> report, and the exit on every rank."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

import hf_demo
from recipelib.plots import plot
from recipelib.results import collect_results, summary

METRICS = Path(__file__).resolve().parent.parent / "metrics"


def load_metric(name: str):
    """A metric script of recipes/metrics/, offline. keep_in_memory: no cache files that processes could share."""
    import evaluate

    return evaluate.load(str(METRICS / name), keep_in_memory=True, experiment_id=f"{name}-{os.getpid()}")


class EvalBeforeTraining(TrainerCallback):
    """Keeps the metrics of the evaluation Trainer runs at the start of train() (``--eval_on_start``)."""

    def __init__(self):
        self.start_step, self.metrics = None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_step, self.metrics = state.global_step, None

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.metrics is None and state.global_step == self.start_step:
            self.metrics = dict(metrics or {})


class TrackingRun(TrainerCallback):
    """The MLflow run that ``train()`` logs to (rank 0, where Trainer's ``MLflowCallback`` started one)."""

    def __init__(self):
        self.run_id = None

    def on_train_begin(self, args, state, control, **kwargs):  # after MLflowCallback's: reporting callbacks go first
        mlflow = sys.modules.get("mlflow")
        active = mlflow.active_run() if mlflow is not None and state.is_world_process_zero else None
        self.run_id = active.info.run_id if active is not None else None


@contextlib.contextmanager
def same_tracking_run(tracking: TrackingRun):
    """Whatever is logged inside goes to the MLflow run of ``train()``: Trainer's ``MLflowCallback`` ends its run
    when training ends, and MLflow would start a second run, without the parameters, for the metrics of an
    ``evaluate()`` after it. The run is reopened for the block and ended after it (a run already active: kept)."""
    mlflow = sys.modules.get("mlflow")
    if tracking.run_id is None or mlflow is None or mlflow.active_run() is not None:
        yield
        return
    mlflow.start_run(run_id=tracking.run_id)
    try:
        yield
    except BaseException:
        mlflow.end_run("FAILED")
        raise
    mlflow.end_run()


def log_line(step: int, max_steps: int, logs: dict) -> str:
    """One log row as a short line: ``step 3/20  loss 2.311  grad_norm 1.2  learning_rate 9.5e-05  sent ...``.

    DeMo's ``demo/*`` figures are summed up as the megabytes sent that step and the saving against a dense
    all-reduce; epoch, FLOPs and the evaluation's timings are left out (every figure still reaches report_to).
    """
    parts = [f"step {step}/{max_steps}"]
    for key, value in logs.items():
        if key.startswith("demo/") or key in ("epoch", "total_flos"):
            continue
        if key.startswith("eval_") and key.endswith(("_runtime", "_per_second", "_preparation_time")):
            continue
        parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    if "demo/bytes_sent_per_step" in logs:
        line = f"sent {logs['demo/bytes_sent_per_step'] / 1e6:.2f} MB/step"
        if logs.get("demo/ratio_to_dense"):
            line += f" ({1 / logs['demo/ratio_to_dense']:.0f}x less than dense)"
        parts.append(line)
    return "  ".join(parts)


class ConciseProgress(ProgressCallback):
    """Trainer's progress bar, with each log row written as one :func:`log_line` instead of a dict: the
    recipes log every step (``logging_steps=1``, for the plot), and a dict of ~15 figures a step is unreadable."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs:
            self.training_bar.write(log_line(state.global_step, state.max_steps, logs))


def concise_progress(trainer) -> None:
    """Swap Trainer's progress bar for :class:`ConciseProgress` (nothing to do with ``--disable_tqdm``)."""
    if any(type(cb) is ProgressCallback for cb in trainer.callback_handler.callbacks):
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(ConciseProgress)


def train_and_report(recipe: str, trainer, *, model: str, data: str, **extra) -> dict:
    """train(), save the model, evaluate(); the results (layout above, with ``extra``) on every rank, and
    results.json, training.png and the summary from rank 0. "before" is None without ``--eval_on_start``."""
    before, tracking = EvalBeforeTraining(), TrackingRun()
    trainer.add_callback(before)
    trainer.add_callback(tracking)
    concise_progress(trainer)
    train_result = trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    trainer.save_model()
    with same_tracking_run(tracking):  # one MLflow run per training: the final evaluation in it too
        after = trainer.evaluate()
    results = collect_results(
        recipe,
        trainer,
        train_result,
        eval_metrics(before.metrics),
        eval_metrics(after),
        model=model,
        data=data,
        **extra,
    )
    if trainer.is_world_process_zero():
        report(results, trainer.args.output_dir)
    return results


def eval_metrics(metrics: dict | None, prefix: str = "eval_") -> dict | None:
    """Evaluation metrics without the prefix and without Trainer's bookkeeping (runtime, speed, epoch, and TRL's
    count of training tokens)."""
    if metrics is None:
        return None
    bookkeeping = ("runtime", "samples_per_second", "steps_per_second", "epoch", "model_preparation_time", "num_tokens")
    stripped = {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in metrics.items()}
    return {k: v for k, v in stripped.items() if k not in bookkeeping}


def end(trainer=None) -> None:
    """Close the run on every rank: trackers, then the process group (gloo aborts at exit without it)."""
    if trainer is not None and hasattr(trainer, "end"):  # transformers >= 5.24: trackers and the process group
        trainer.end()
    elif trainer is not None:
        for tracker in trainer.accelerator.trackers:
            tracker.finish()
    if hasattr(hf_demo, "shutdown"):
        hf_demo.shutdown()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def report(results: dict, output_dir: str) -> None:
    """Write results.json and training.png into ``output_dir`` and print the summary (call on rank 0)."""
    os.makedirs(output_dir, exist_ok=True)
    picture = os.path.join(output_dir, "training.png")
    try:
        plot(results, picture)
        results["plot"] = picture
    except ImportError:
        results["plot"] = None
    path = os.path.join(output_dir, "results.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(summary(results, output_dir, path), flush=True)
