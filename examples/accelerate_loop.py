"""A custom Accelerate loop with DeMo: checkpoints with ``accelerator.save_state``/``load_state`` and the ``demo/*``
metrics through ``accelerator.log``, on a tiny byte-level Llama over the Python standard library's sources.

    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/cpu_multiprocess.yaml \\
        examples/accelerate_loop.py --output_dir outputs/loop                       # trains, saves every 10 steps
    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/cpu_multiprocess.yaml \\
        examples/accelerate_loop.py --output_dir outputs/loop --resume_from_checkpoint outputs/loop/step_20

(on GPUs: ``accelerate launch examples/accelerate_loop.py ...``). The metrics go to TensorBoard under
``OUTPUT_DIR/hf_demo_loop``; rank 0 prints a line every 10 steps.
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import hf_demo
from hf_demo.stdlib_corpus import stdlib_bytes


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same weights on every rank (DDP broadcasts rank 0's anyway)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=args.seq)  # fmt: skip
    model = LlamaForCausalLM(config)
    data = stdlib_bytes(limit=2_000_000).long()
    rows = data[: data.numel() // args.seq * args.seq].view(-1, args.seq)
    loader = DataLoader(TensorDataset(rows), batch_size=args.batch, shuffle=True)
    optimizer = hf_demo.create_optimizer(model, lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    return model, optimizer, loader, scheduler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--resume_from_checkpoint", default=None)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--checkpointing_steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    return ap.parse_args()


def report(accelerator, step: int, loss: float, metrics: dict) -> None:
    sent, ratio = metrics["demo/bytes_sent_per_step"], metrics["demo/ratio_to_dense"]
    accelerator.print(f"step {step:3d}  loss {loss:.3f}  sent {sent:.0f} B/step ({ratio:.4f} of a dense all-reduce)")


def train(args, accelerator, model, optimizer, loader, scheduler) -> None:
    step, batches = 0, loader
    if args.resume_from_checkpoint:  # every rank's DeMo state, checked against the checkpoint's manifest
        accelerator.load_state(args.resume_from_checkpoint)
        step = int(os.path.basename(os.path.normpath(args.resume_from_checkpoint)).split("_")[-1])
        batches = accelerator.skip_first_batches(loader, step % len(loader))
    while step < args.steps:
        for (batch,) in batches:
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            metrics = hf_demo.log_metrics(accelerator, optimizer, step)  # demo/* through accelerator.log
            accelerator.log({"train_loss": loss.item()}, step=step)
            if step % 10 == 0:
                report(accelerator, step, loss.item(), metrics)
            if step % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{step}"))
            if step >= args.steps:
                break
        batches = loader
    optimizer.flush()  # the last step's verdict; an exchange in flight (overlap); ends a local phase (sync_every > 1)
    accelerator.print(f"skipped steps {optimizer.skipped_steps}, resyncs {optimizer.resyncs}, tier {optimizer.tier}")


def main():
    args = parse_args()
    accelerator = Accelerator(log_with="tensorboard", project_dir=args.output_dir)
    accelerator.init_trackers("hf_demo_loop")
    try:
        train(args, accelerator, *hf_demo.prepare(accelerator, *build(args)))
        accelerator.end_training()
    finally:
        hf_demo.shutdown()  # on every rank, also after an error


if __name__ == "__main__":
    main()
