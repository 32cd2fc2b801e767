"""One replica group of an elastic DeMo run under Trainer (tests/test_elastic_trainer.py): launched with
``torchrun --nproc_per_node 1`` and REPLICA_GROUP_ID / NUM_REPLICA_GROUPS / TORCHFT_LIGHTHOUSE set.

``--trainer demo``: DeMoTrainer; ``with_demo``: the classes ``hf_demo.with_demo(Trainer, TrainingArguments)``
makes. Writes ``<out>/replica<id>.json``: the parameters' SHA-256, Trainer's and torchft's steps, and per step
the quorum, whether it committed and the learning rate.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

import hf_demo


class Regression(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)  # each replica starts from its own weights: the first quorum makes them one
        self.l1, self.l2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

    def forward(self, x, labels=None):
        self.last_x = x.detach()  # the batch this step read (the test finds its samples' indices)
        y = self.l2(torch.tanh(self.l1(x))).squeeze(-1)
        return {"loss": ((y - labels) ** 2).mean(), "logits": y}


class Record(TrainerCallback):
    """Each step's quorum, verdict and learning rate; ``--step-seconds`` of sleep per step, after the backward pass
    and before the optimizer step (a peer killed then dies inside the step's transaction). A test's controls:
    before the first step a wait until ``--start-file`` exists (every replica's Manager is up: none trains ahead
    alone), and the end of training at the committed step written in ``--stop-file``, once it exists."""

    def __init__(self, trainer_ref, cli, x):
        self.trainer_ref, self.cli, self.steps, self.x = trainer_ref, cli, [], x

    def on_train_begin(self, args, state, control, **kwargs):  # the optimizer (and torchft's Manager) exist now
        print(json.dumps({"replica": os.environ["REPLICA_GROUP_ID"], "train_begin": os.getpid()}), flush=True)
        _wait_for(self.cli.start_file)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        time.sleep(self.cli.step_seconds)
        first_run = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if state.global_step + 1 == self.cli.die_at and first_run:  # SIGKILL inside the step's transaction
            os.kill(os.getpid(), signal.SIGKILL)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        elastic = self.trainer_ref[0].demo_elastic
        lr = self.trainer_ref[0].optimizer.param_groups[0]["lr"]
        read = self.trainer_ref[0].model.last_x
        samples = [int((self.x == row).all(1).nonzero()[0]) for row in read]  # the dataset's indices of the batch
        self.steps.append({"step": state.global_step, "quorum": elastic.world, "committed": elastic.last_committed,
                           "lr": lr, "samples": samples, "time": time.time()})  # fmt: skip
        print(json.dumps({"replica": os.environ["REPLICA_GROUP_ID"], **self.steps[-1]}), flush=True)
        if elastic.last_committed and self.cli.stop_file and os.path.exists(self.cli.stop_file):
            text = Path(self.cli.stop_file).read_text().strip()
            control.should_training_stop = bool(text) and state.global_step >= int(text)


def _wait_for(path: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while path and not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def _ops_figures(trainer) -> dict | None:
    """The elastic figures the ops callbacks reported: the monitor's totals and the last log row's."""
    ops = getattr(trainer, "demo_ops", None)
    if ops is None or ops.monitor is None:
        return None
    t = ops.monitor.totals
    rows = [r for r in trainer.state.log_history if "ops/samples_unread_total" in r]
    return {"samples_lost": t.samples_lost, "samples_unread": t.samples_unread, "losses": t.losses,
            "logged_unread": rows[-1]["ops/samples_unread_total"] if rows else None,
            "logged_lost": rows[-1]["ops/samples_lost_total"] if rows else None}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--trainer", choices=["demo", "with_demo"], default="demo")
    ap.add_argument("--out", required=True)
    ap.add_argument("--min-replicas", type=int, default=1)
    ap.add_argument("--step-seconds", type=float, default=0.0)
    ap.add_argument("--die-at", type=int, default=-1, help="SIGKILL itself before this step's optimizer step")
    ap.add_argument("--stop-file", default="", help="a file whose number, once written, is the last step")
    ap.add_argument("--start-file", default="", help="before the first step, wait for this file")
    ap.add_argument(
        "--restart-delay",
        type=float,
        default=0.0,
        help="restarted by torchrun: wait this long first (the survivors' quorum forms without it)",
    )
    ap.add_argument("--lr", type=float, default=1e-2, help="this replica group's learning rate")
    ap.add_argument("--topk", type=int, default=4, help="this replica group's demo_compression_topk")
    args = ap.parse_args()
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        time.sleep(args.restart_delay)
    rid = int(os.environ["REPLICA_GROUP_ID"])
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"x": x.tolist(), "labels": x.sum(1).tolist()})
    trainer_cls, args_cls = (
        (hf_demo.DeMoTrainer, hf_demo.DeMoTrainingArguments)
        if args.trainer == "demo"
        else hf_demo.with_demo(Trainer, TrainingArguments)
    )
    targs = args_cls(
        output_dir=str(Path(args.out) / f"replica{rid}"), optim="demo", per_device_train_batch_size=4,
        max_steps=args.steps, logging_steps=2, report_to=[], use_cpu=True, learning_rate=args.lr, warmup_steps=2,
        save_strategy="no", disable_tqdm=True, demo_compression_topk=args.topk, demo_compression_chunk=8,
    )  # fmt: skip
    ref: list = []
    record = Record(ref, args, x)
    trainer = trainer_cls(
        model=Regression(seed=rid), args=targs, train_dataset=data, callbacks=[record],
        demo_elastic={"min_replicas": args.min_replicas, "timeout": 20.0},
    )  # fmt: skip
    ref.append(trainer)
    trainer.train()
    h = hashlib.sha256()
    for p in trainer.model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    elastic = trainer.demo_elastic
    result = {"replica": rid, "digest": h.hexdigest(), "global_step": trainer.state.global_step,
              "committed": elastic.manager.current_step(), "steps": record.steps,
              **elastic.stats.as_dict(), "ops": _ops_figures(trainer)}  # fmt: skip
    Path(args.out, f"replica{rid}.json").write_text(json.dumps(result))
    print(json.dumps({"done": rid}), flush=True)


if __name__ == "__main__":
    main()
