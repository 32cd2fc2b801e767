"""Quickstart: a 2-process DeMo training of a tiny byte-level Llama on the Python standard library's sources.

    torchrun --nproc_per_node 2 examples/quickstart.py        (or: make quickstart)

Prints the loss as it trains and, at the end, the bytes each rank sent against what a dense fp32
all-reduce of the same model would have sent.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

import hf_demo
from hf_demo.stdlib_corpus import stdlib_bytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--value-format", default="bf16", choices=["bf16", "fp32", "sign"])
    args = ap.parse_args()

    if "RANK" in os.environ:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    try:
        train(args)
    finally:  # on every rank, also after an error: gloo can abort at exit when the group is left up
        if hasattr(hf_demo, "shutdown"):
            hf_demo.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


def train(args):
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(0)  # same initial weights on every rank
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=args.seq,
    )
    model = LlamaForCausalLM(config)
    opt = hf_demo.DeMo(model.parameters(), lr=args.lr, value_format=args.value_format)
    data = stdlib_bytes(limit=4_000_000).long()
    gen = torch.Generator().manual_seed(1 + rank)  # each rank reads its own batches
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"world size {world}, {n / 1e6:.2f}M parameters, DeMo value format {args.value_format}")
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([data[s : s + args.seq] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == 1):
            print(
                f"step {step:4d}  loss {loss.item():.3f}  sent {opt.comm_stats.bytes_sent} B "
                f"({opt.comm_stats.ratio_to_dense:.4f} of a dense all-reduce)"
            )
    opt.flush()  # every rank reads the last step's verdict (it rides in the next step's all-gather otherwise)
    s = opt.comm_stats
    if rank == 0:
        dense_total = s.dense_bytes * s.steps
        print(
            f"\nrank 0 sent {s.total_bytes_sent / 1e6:.2f} MB in {s.steps} steps; a dense fp32 all-reduce "
            f"would have sent {dense_total / 1e6:.2f} MB: {dense_total / max(s.total_bytes_sent, 1):.1f}x "
            f"less traffic ({s.total_bytes_sent / s.steps / (s.dense_bytes / 4):.4f} bytes/param/step)"
        )


if __name__ == "__main__":
    main()
