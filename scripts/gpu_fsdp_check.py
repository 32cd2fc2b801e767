"""HSDP-DeMo on real ranks, for scripts/gpu_check.sh (it also runs on CPU ranks over gloo: `--device cpu`).

    torchrun --nproc_per_node N scripts/gpu_fsdp_check.py loop --shard S      # custom loop, hf_demo.fsdp
    torchrun --nproc_per_node N scripts/gpu_fsdp_check.py loop --shard S --preset from_scratch  # local Muon steps
    accelerate launch --config_file accelerate_configs/fsdp2_hsdp.yaml --num_machines 1 --num_processes N \\
        --parallelism_config_dp_replicate_size R --parallelism_config_dp_shard_size S \\
        scripts/gpu_fsdp_check.py trainer                                     # DeMoTrainer, --optim demo

Either trains a small Llama for a few steps and checks, on every rank: the parameters are FSDP2 DTensors; DeMo
steps them with its sharded topology, exchanging over the replicate group only; every rank ends with the same
full parameters; (loop) a torch.distributed.checkpoint save at the middle step and a resume on a fresh model
ends bit for bit where the straight run ends. Prints one line per check; exit status 1 if one failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
import torch.distributed as dist

import hf_demo
from hf_demo import fsdp

STEPS = 6
HALF = 2  # the DCP resume: after a synchronisation of every sync_every up to 2 (the from_scratch preset's)


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def batch(rank: int, step: int, device):
    g = torch.Generator().manual_seed(1000 * rank + step)
    ids = torch.randint(0, 256, (4, 32), generator=g).to(device)
    return {"input_ids": ids, "labels": ids}


def full_print(model) -> torch.Tensor:
    """A sum of every full parameter in float64, the same on every rank that holds the same model."""
    return torch.stack([p.full_tensor().double().sum() for p in model.parameters()])


def loop(args) -> list[tuple[str, bool]]:
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    mesh = fsdp.hsdp_mesh(shard=args.shard, device_type=device.type)
    kw = dict(lr=1e-3, compression_chunk=16, compression_topk=8)
    kw.update({"preset": args.preset} if args.preset else {"update_rule": "adamw"})

    def build(seed):
        model = fsdp.shard_model(tiny_llama(seed).to(device), mesh)
        return model, hf_demo.create_optimizer(model, device_mesh=mesh, **kw)  # Muon-style groups for a preset

    def train(model, opt, steps, start=0):
        for step in range(start, start + steps):
            model(**batch(dist.get_rank(), step, device)).loss.backward()
            opt.step()
            opt.zero_grad()

    model, opt = build(0)
    train(model, opt, STEPS)
    straight = full_print(model)
    where = tempfile.mkdtemp() if dist.get_rank() == 0 else None
    holder = [where]
    dist.broadcast_object_list(holder, src=0)
    model, opt = build(0)
    train(model, opt, HALF)
    fsdp.save_checkpoint(holder[0], model, opt)
    model, opt = build(7)
    fsdp.load_checkpoint(holder[0], model, opt)
    train(model, opt, STEPS - HALF, HALF)
    return checks(model, opt, mesh.size(0)) + [("a DCP resume ends bit for bit as the straight run", bool(
        torch.equal(full_print(model), straight)))]  # fmt: skip


def trainer(args) -> list[tuple[str, bool]]:
    from datasets import Dataset

    rows = [{k: v[0].tolist() for k, v in batch(r, 0, "cpu").items()} for r in range(64)]
    training = hf_demo.DeMoTrainingArguments(
        output_dir=tempfile.mkdtemp(), optim="demo", max_steps=STEPS, per_device_train_batch_size=2,
        learning_rate=1e-3, report_to="none", save_strategy="no", bf16=torch.cuda.is_available(),
        demo_compression_chunk=16, demo_compression_topk=8, logging_steps=1,
    )  # fmt: skip
    t = hf_demo.DeMoTrainer(model=tiny_llama(), args=training, train_dataset=Dataset.from_list(rows))
    t.train()
    opt = hf_demo.hf.data_parallel.unwrap_optimizer(t.optimizer)
    replicas = opt.transport.world
    return checks(t.model, opt, replicas)


def checks(model, opt, replicas: int) -> list[tuple[str, bool]]:
    from torch.distributed.tensor import DTensor

    mine = full_print(model)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [
        ("parameters are FSDP2 DTensors", all(isinstance(p, DTensor) for p in model.parameters())),
        ("DeMo's topology is 'sharded'", opt.topology.name == "sharded"),
        (f"DeMo exchanges over the {replicas} replica(s)", opt.transport.world == replicas),
        ("every rank holds the same full parameters", all(torch.equal(e, every[0]) for e in every)),
        ("DeMo stepped every step", opt.steps == STEPS and opt.skipped_steps == 0),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["loop", "trainer"])
    parser.add_argument("--shard", type=int, default=None, help="ranks per shard group (default: per node)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--preset", default=None, help="loop: a DeMo preset (from_scratch: local Muon steps)")
    args = parser.parse_args()
    if args.mode == "loop":
        if args.device == "cuda":
            torch.cuda.set_device(int(__import__("os").environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    results = loop(args) if args.mode == "loop" else trainer(args)
    failed = [name for name, ok in results if not ok]
    if dist.get_rank() == 0:
        for name, ok in results:
            print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    hf_demo.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
