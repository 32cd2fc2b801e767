"""HSDP-DeMo: a small byte-level Llama sharded by PyTorch's FSDP2 inside each shard group, DeMo across replicas.

    torchrun --nproc_per_node 4 examples/hsdp.py                   # one machine: 2 replicas x shard groups of 2
    torchrun --nnodes 2 --nproc_per_node 8 ... examples/hsdp.py --shard 8   # two nodes: shard inside each node

CPU (gloo) or one GPU per process (NCCL) where CUDA is present. The model is sharded on the ``shard`` dimension
of a (replicate, shard) mesh: each rank holds 1/shard of the parameters, gradients and DeMo's momentum; FSDP2
reduce-scatters the gradients inside the shard group (the fast link) and DeMo exchanges each shard's compressed
momentum across the replicate dimension (the slow link). Prints the loss, and at the end the bytes DeMo sent
across the replicate dimension against what HSDP's dense fp32 all-reduce of the same shard would have sent.
``--save DIR`` writes a checkpoint through torch.distributed.checkpoint at the end, ``--resume DIR`` starts from one
(the data order restarts: this is a sketch of the calls, not a resumable data loader).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os

import torch
import torch.distributed as dist

import hf_demo
from hf_demo import fsdp
from hf_demo.stdlib_corpus import stdlib_bytes


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shard", type=int, default=2, help="ranks per shard group (on several nodes: per node)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--save", default=None, help="a folder: save model and optimizer state there at the end (DCP)")
    ap.add_argument("--resume", default=None, help="a folder --save wrote: resume from it (the same mesh)")
    return ap.parse_args()


def main():
    args = parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. torchrun --nproc_per_node 4 examples/hsdp.py")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=5))
    try:
        train(args, torch.device("cuda") if cuda else torch.device("cpu"))
    finally:  # on every rank, also after an error: gloo can abort at exit when the group is left up
        hf_demo.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


def build_model(seq: int, meta: bool):
    """The model, on the meta device (shapes only, nothing allocated until each rank takes its shards) or whole."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=seq,
    )
    torch.manual_seed(0)  # the same seed on every rank: the replicas start alike (FSDP2 broadcasts nothing)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return LlamaForCausalLM(config)


def train(args, device: torch.device):
    rank = dist.get_rank()
    mesh = fsdp.hsdp_mesh(shard=args.shard)  # (world // shard, shard), dims ("replicate", "shard")
    # on CUDA the model is built on the meta device and each rank initialises its own shards; on a CPU mesh DTensor's
    # random ops would draw the same values on every shard, so there it is built whole, then sharded
    meta = device.type == "cuda"
    model = fsdp.shard_model(build_model(args.seq, meta), mesh)  # fully_shard per decoder layer, then the root
    if meta:
        model.to_empty(device=device)  # each rank allocates its own shards only: the whole model never exists
        torch.manual_seed(0)
        model.init_weights()
    opt = hf_demo.DeMo(model.parameters(), lr=args.lr, device_mesh=mesh)  # DeMo across mesh["replicate"]
    if args.resume:
        fsdp.load_checkpoint(args.resume, model, opt)  # another mesh shape stops here, naming both
    data = stdlib_bytes(limit=4_000_000).long()
    gen = torch.Generator().manual_seed(1 + rank)  # each rank reads its own batches
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"mesh {tuple(mesh.shape)} (replicate, shard), {n / 1e6:.2f}M parameters, {device.type}")
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([data[s : s + args.seq] for s in starts]).to(device)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == 1):
            print(f"step {step:4d}  loss {loss.item():.3f}")
    report(opt, rank)
    if args.save:
        fsdp.save_checkpoint(args.save, model, opt)  # every rank writes its shards; load_checkpoint resumes them
        if rank == 0:
            print(f"saved {args.save} (hf_demo.fsdp.load_checkpoint(path, model, opt) resumes it)")


def report(opt, rank: int) -> None:
    s = opt.comm_stats
    if rank == 0 and s.steps:
        dense = s.dense_bytes * s.steps
        print(
            f"\nrank 0 sent {s.total_bytes_sent / 1e6:.3f} MB across the replicate dimension in {s.steps} steps; "
            f"a dense fp32 all-reduce of its shard would have sent {dense / 1e6:.2f} MB "
            f"({dense / max(s.total_bytes_sent, 1):.0f}x more)"
        )


if __name__ == "__main__":
    main()
