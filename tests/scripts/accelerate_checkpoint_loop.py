"""A custom Accelerate loop in the shape of accelerate's ``by_feature/checkpointing.py`` with DeMo: a model initialised
apart on each rank (DDP broadcasts rank 0's), a prepared data loader and scheduler, ``accelerator.save_state``
mid-run, ``accelerator.load_state`` + ``skip_first_batches`` to resume, ``demo/*`` metrics through
``accelerator.log``, and the optimizer's DeMo calls after ``hf_demo.prepare``.

    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/cpu_multiprocess.yaml \
        tests/scripts/accelerate_checkpoint_loop.py --out OUT [--resume CKPT [--broken CKPT ...]]

Without ``--resume`` it trains 10 steps and saves ``OUT/step_5`` after step 5; with it, it first tries to load
each ``--broken`` checkpoint (recording the error), then resumes from ``--resume`` and trains to step 10. Each rank
records its figures in ``OUT/rank<r>.pt``, rank 0 the logged rows in ``OUT/logged.json``.
"""

import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker
from torch.utils.data import DataLoader, TensorDataset

import hf_demo

STEPS, SAVE_AT, BATCH = 10, 5, 8


class Recorder(GeneralTracker):
    """A tracker that writes every logged row to a JSON file (as TensorBoard or W&B would keep them)."""

    name = "recorder"
    requires_logging_directory = False

    def __init__(self, path):
        super().__init__()
        self.path, self.rows = path, []

    @property
    def tracker(self):
        return self.rows

    def store_init_configuration(self, values):
        pass

    def log(self, values, step=None, **kwargs):
        self.rows.append({"step": step, **values})
        with open(self.path, "w") as f:
            json.dump(self.rows, f)


def digest(tensors):
    return hashlib.sha256(b"".join(t.detach().contiguous().numpy().tobytes() for t in tensors)).hexdigest()


def data(accelerator):
    x = torch.randn(STEPS * BATCH * accelerator.num_processes, 16, generator=torch.Generator().manual_seed(1))
    return x, x[:, :4].argmax(1)


def build(accelerator):
    torch.manual_seed(accelerator.process_index)  # different initial weights: DDP must broadcast rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    torch.manual_seed(0)
    optimizer = hf_demo.create_optimizer(model, lr=1e-2, weight_decay=0.01, compression_topk=8, compression_chunk=16)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.1 * s))
    loader = DataLoader(TensorDataset(*data(accelerator)), batch_size=BATCH, shuffle=True)
    return hf_demo.prepare(accelerator, model, optimizer, loader, scheduler)


def data_loss(accelerator, model) -> float:
    """The loss of this rank's model on the whole data set (no step, no collective)."""
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(
            accelerator.unwrap_model(model)(data(accelerator)[0]), data(accelerator)[1]
        ).item()


def try_broken(accelerator, folders):
    errors = []
    for folder in folders:
        try:
            accelerator.load_state(folder)
            errors.append(None)
        except hf_demo.DeMoStateError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors


def main(args):
    os.makedirs(args.out, exist_ok=True)
    accelerator = Accelerator(log_with=[Recorder(os.path.join(args.out, "logged.json"))])
    accelerator.init_trackers("hf_demo_loop")
    model, optimizer, loader, scheduler = build(accelerator)
    loss_before = data_loss(accelerator, model)
    errors, start, batches = [], 0, loader
    if args.resume:
        errors = try_broken(accelerator, args.broken)
        accelerator.load_state(args.resume)
        start = SAVE_AT
        batches = accelerator.skip_first_batches(loader, SAVE_AT)
    losses, grad0 = [], None
    for step, (x, y) in enumerate(batches, start=start):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        grad0 = grad0 or digest(p.grad for p in model.parameters())  # this run's first step, as the optimizer sees it
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        hf_demo.log_metrics(accelerator, optimizer, step=step)
        if not args.resume and step + 1 == SAVE_AT:
            accelerator.save_state(os.path.join(args.out, f"step_{SAVE_AT}"))
    optimizer.flush()  # the README's call, on what hf_demo.prepare returned
    with optimizer.averaged_parameters():
        averaged = digest(model.parameters())
    record = {
        "world_size": dist.get_world_size(),
        "params": digest(model.parameters()),
        "averaged": averaged,
        "momentum": digest(s["momentum"] for s in optimizer.demo.state.values()),
        "losses": losses,
        "grad0": grad0,
        "data_loss": (loss_before, data_loss(accelerator, model)),  # before this run's steps, after them
        "lr": scheduler.get_last_lr(),
        "counters": (optimizer.skipped_steps, optimizer.resyncs, optimizer.tier),
        "bytes_sent": optimizer.comm_stats.total_bytes_sent,
        "errors": errors,
    }
    torch.save(record, os.path.join(args.out, f"rank{accelerator.process_index}.pt"))
    accelerator.end_training()
    hf_demo.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume")
    parser.add_argument("--broken", nargs="*", default=[])
    main(parser.parse_args())
