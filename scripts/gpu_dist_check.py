#!/usr/bin/env python
"""DeMo with its parameters on CUDA over real ranks: after every mode's steps the replicas must be bitwise identical.

Run by ``scripts/gpu_check.sh``; by hand: ``torchrun --nproc_per_node 2 scripts/gpu_dist_check.py --backend nccl``
(a GPU per rank), ``--backend gloo`` (ranks may share a GPU: buffers go through the host), or with one process.
Every mode runs with ``check_every=1, drift="raise"`` (a fingerprint in every header: the first step whose replicas
differ raises), then the parameters' bytes are all-gathered and compared. The HSDP mode shards the model with FSDP2
(``hf_demo.fsdp``) on a (2, world/2) replicate x shard mesh (one dimension of every rank for an odd world) and
compares the whole parameters (``full_tensor()``); it needs NCCL on CUDA (gloo: CPU only). Prints one line per mode
on rank 0; exits 1 if any mode failed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hf_demo  # noqa: E402
from hf_demo import fsdp  # noqa: E402

MODES = {
    "default (bf16, sign rule)": dict(),
    "fp32 values, raw rule": dict(value_format="fp32", update_rule="raw"),
    "sign values, adam rule": dict(value_format="sign", update_rule="adam"),
    "all_reduce exchange": dict(exchange="all_reduce"),
    "overlap": dict(overlap=True),
    "sync_every=3": dict(sync_every=3),
    "bf16 weights, stochastic rounding": dict(param_rounding="stochastic"),
    "HSDP (hf_demo.fsdp, FSDP2)": dict(hsdp=True),
    "HMAC (HF_DEMO_SECRET)": dict(),
}


def build(device: torch.device, bf16: bool) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(96, 130), torch.nn.Tanh(), torch.nn.Linear(130, 50))  # 130: padded
    return model.to(device, torch.bfloat16 if bf16 else torch.float32)


def whole(p: torch.Tensor) -> torch.Tensor:
    """The whole parameter: an FSDP2 DTensor's shards gathered, a plain tensor as it is."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def hsdp(model: torch.nn.Module, device: torch.device, world: int):
    """The model sharded by FSDP2 on a (2, world/2) mesh (replicate, shard), the mesh for DeMo."""
    mesh = fsdp.hsdp_mesh(shard=world // 2 if world % 2 == 0 else world, device_type=device.type)
    fsdp.shard_model(model, mesh, layers=[model[0], model[2]])
    return mesh


def run_mode(name: str, settings: dict, device: torch.device, rank: int, world: int, steps: int) -> str:
    settings = dict(settings)
    sharded = settings.pop("hsdp", False)
    if sharded and device.type == "cuda" and dist.get_backend() != "nccl":
        return "skip FSDP2 on CUDA runs on NCCL (--backend nccl)"
    if name.startswith("HMAC"):
        os.environ["HF_DEMO_SECRET"] = "gpu-check"
    bf16 = settings.get("param_rounding") == "stochastic"
    model = build(device, bf16)
    mesh = hsdp(model, device, world) if sharded else None
    start = torch.cat([whole(p).detach().reshape(-1).float() for p in model.parameters()])
    opt = hf_demo.DeMo(
        model.parameters(), lr=1e-3, compression_topk=8, compression_chunk=32, check_every=1, drift="raise",
        device_mesh=mesh if sharded and world % 2 == 0 else None, **settings,
    )  # fmt: skip
    every = settings.get("sync_every", 1)
    steps = -(-steps // every) * every  # end on a synchronising step: local steps differ between ranks
    t0 = time.perf_counter()
    for step in range(steps):
        g = torch.Generator(device=device).manual_seed(1000 * rank + step)  # every rank its own data
        x = torch.randn(64, 96, device=device, generator=g, dtype=torch.bfloat16 if bf16 else torch.float32)
        model.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        opt.step()
    opt.flush()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - t0) / steps
    os.environ.pop("HF_DEMO_SECRET", None)
    mine = torch.cat([whole(p).detach().reshape(-1).contiguous().view(torch.uint8) for p in model.parameters()])
    rows = [torch.empty_like(mine) for _ in range(world)]
    if world > 1:
        dist.all_gather(rows, mine)
    else:
        rows = [mine]
    identical = all(torch.equal(rows[0], r) for r in rows)
    moved = not torch.equal(torch.cat([whole(p).detach().reshape(-1).float() for p in model.parameters()]), start)
    problems = [] if identical else ["replicas differ"]
    problems += [] if moved else ["parameters did not move"]
    problems += ["momentum not on the parameters' device"] * any(
        t.device != device for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0
        and t.is_floating_point()
    )  # fmt: skip
    stats = opt.comm_stats
    if opt.transport.world > 1 and stats.total_bytes_sent == 0:
        problems.append("nothing was sent")
    detail = (
        f"{seconds * 1000:.1f} ms/step, sent {stats.total_bytes_sent:,} B in {stats.total_collectives} collectives, "
        f"{stats.total_seconds * 1000:.1f} ms in collectives"
    )
    return ("FAIL " + "; ".join(problems) + " -- " if problems else "ok   ") + detail


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run of this script (gloo)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_dist_check: torch sees no CUDA device", file=sys.stderr)
        return 77
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if "MASTER_ADDR" not in os.environ:  # one process without torchrun
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1")
    kwargs = {"device_id": device} if args.backend == "nccl" else {}
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=120), **kwargs)
    failed = 0
    if rank == 0:
        what = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"gpu_dist_check: {world} rank(s), {args.backend}, {what}, {args.steps} steps")
    for name, settings in MODES.items():
        try:
            line = run_mode(name, settings, device, rank, world, args.steps)
        except Exception as exc:  # noqa: BLE001 - reported, the other modes still run
            line = f"FAIL {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            traceback.print_exc()
        failed += line.startswith("FAIL")
        if rank == 0 or line.startswith("FAIL"):
            print(f"  [rank {rank}] {name:36} {line}", flush=True)
    hf_demo.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
