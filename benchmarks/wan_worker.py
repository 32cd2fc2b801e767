"""One rank of the emulated multi-node training job (started by ``wan.py`` through ``torchrun``).

The job (``benchlib.toy``): a byte-level ``LlamaForCausalLM`` (vocab 256, random init from a fixed seed) trained
on the Python standard library's own ``.py`` sources (``sysconfig.get_paths()["stdlib"]``, without
site-packages and test directories, files in sorted order). The last ``--heldout`` fraction of the bytes is the
held-out set; the rest is cut into ``world`` contiguous shards, and rank r draws its training windows only from
shard r, at offsets from a generator seeded with (seed, rank): every method sees exactly the same data in the
same order.

Methods (``--method``):

- ``demo-bf16``  ``hf_demo.DeMo`` (defaults: chunk 64, top-k 32, bf16 values); no DDP wrapper: initial
  weights are broadcast from rank 0 once, each rank back-propagates its own loss, DeMo exchanges.
- ``demo-sign``  the same with ``value_format="sign"``.
- ``demo-allreduce``  ``exchange="all_reduce"`` (the union of every rank's top-k/W positions, bf16 values all-reduced).
- ``demo-allreduce-wide``  the same with top-k ``--topk`` x W/2 (W = 4: 64), the setting that trains level
  with the all-gather.
- ``demo-overlap``  ``overlap=True`` (step t's exchange runs during step t+1's forward/backward, applied one
  step late; ``opt.flush()`` after the last step).
- ``demo-sync8``  ``sync_every=8`` (local steps, DeMo on the pseudo-gradient every 8 steps); ``demo-sync8-sign``
  the same with sign values.
- ``demo-policy``  ``comm_budget=--comm-budget`` (default 0.15): the policy moves between the tiers of
  ``hf_demo.optim.policy`` (bf16 -> sign -> sign top-k/2, /4 -> sign every 8 steps -> top-k/2, /4, /8 every 8);
  ``opt.tier`` is recorded per step.
- ``demo-hsdp``  HSDP-DeMo (``hf_demo.fsdp``): the model sharded by FSDP2 over the LOCAL_WORLD_SIZE processes
  of a node (torchrun's ``--nproc_per_node``), gradients reduce-scattered inside the node, DeMo between nodes
  (each process exchanging its own shard); every rank of a node takes part in the evaluation's forward pass.
- ``demo-scratch``  the ``from_scratch`` preset (``hf_demo.create_optimizer``: local Muon steps in Muon-style
  groups, synchronising every 2 steps); ``demo-scratch-few`` the ``from_scratch_few_bytes`` preset (every 4 steps,
  top-4). The evaluation reads rank 0's parameters: evaluate at synchronisations (``--eval-every`` a multiple of
  the interval).
- ``adamw``      ``torch.optim.AdamW`` on a ``DistributedDataParallel`` model (gloo all-reduce of fp32 grads).
- ``muon``       DDP-Muon: ``torch.optim.Muon`` on the hidden matrices, AdamW on the rest
  (``benchlib.baselines.ddp_muon``), on a ``DistributedDataParallel`` model.
- ``powersgd``   the same with DDP's ``powerSGD_hook`` (rank 4, vanilla all-reduce for the first 2 steps), in
  one DDP bucket (the hook's chained all-reduces can get out of order between ranks with several buckets).

What is measured (rank 0 writes one JSON): per training step the wall time of forward + backward + step
(ranks lined up by a barrier only before the first step and after each evaluation; evaluation time is
excluded from the clock), the training loss, and the bytes that crossed this node's interface
(``/sys/class/net/$GLOO_SOCKET_IFNAME/statistics``, read just before and after each step: wire bytes, TCP/IP
headers included) for every rank; every ``--eval-every`` steps the held-out loss (computed by rank 0 only;
the models are identical on all ranks for all four methods). For DeMo also ``opt.comm_stats``.

``--delay-ms D`` emulates latency in the application, since this kernel has no netem: before each collective
the rank sleeps ``D`` ms times the number of sequential hops of a ring algorithm, i.e. ``(W-1)·D`` before each
of DeMo's collectives (``hf_demo.exchange.transport.register_collective_hook``; ``2(W-1)·D`` before the
all-reduce of ``exchange="all_reduce"``) and ``2(W-1)·D`` before an all-reduce (DDP:
``torch.distributed.all_reduce`` wrapped, reached through DDP's Python all-reduce hook; PowerSGD does three
all-reduces per bucket). This models a one-way latency D per hop; it cannot overlap with anything, which is
pessimistic for DDP (whose all-reduces normally overlap the backward pass).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchlib.baselines import ddp_baseline, ddp_muon
from benchlib.overrides import parse_overrides
from benchlib.toy import Data, byte_llama, evaluate, stdlib_bytes

METHODS = (
    "demo-bf16",
    "demo-sign",
    "demo-allreduce",
    "demo-allreduce-wide",
    "demo-overlap",
    "demo-sync8",
    "demo-sync8-sign",
    "demo-policy",
    "demo-policy30",
    "demo-hsdp",
    "demo-scratch",
    "demo-scratch-few",
    "adamw",
    "powersgd",
    "muon",
)

# methods built by hf_demo.create_optimizer from a preset (its top-k and chunk: --topk/--chunk do not apply)
PRESET_OF = {"demo-scratch": "from_scratch", "demo-scratch-few": "from_scratch_few_bytes"}

# methods whose top-k grows with the world: --topk x max(1, W // 2), the union all-reduce's top-k that trained
# level with the all-gather's --topk at W = 4 and 8 (benchmarks/reports/2026-11-30-convergence.md)
TOPK_PER_HALF_WORLD = ("demo-allreduce-wide",)

# DeMo keywords of each demo-* method (besides lr, topk, chunk)
DEMO_KW = {
    "demo-bf16": {},
    "demo-sign": dict(value_format="sign"),
    "demo-allreduce": dict(exchange="all_reduce"),
    "demo-allreduce-wide": dict(exchange="all_reduce"),  # top-k x W/2: see TOPK_PER_HALF_WORLD
    "demo-overlap": dict(overlap=True),
    "demo-sync8": dict(sync_every=8),
    "demo-sync8-sign": dict(sync_every=8, value_format="sign"),
    "demo-policy": {},  # comm_budget from --comm-budget
    "demo-policy30": dict(comm_budget=0.3),
    "demo-hsdp": {},  # the model sharded by hf_demo.fsdp, DeMo(..., device_mesh=mesh)
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", choices=METHODS, required=True)
    p.add_argument("--out", required=True, help="JSON written by rank 0")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches of --batch-size windows")
    p.add_argument("--batch-size", type=int, default=8, help="windows per rank per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="default: 2e-3 for AdamW/PowerSGD, 1e-3 for DeMo (its sign step is absolute)",
    )
    p.add_argument("--warmup", type=int, default=5, help="linear learning-rate warmup steps")
    p.add_argument("--topk", type=int, default=32)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="DDP bucket size; default DDP's own for adamw, one bucket for everything for powersgd",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout", type=float, default=0.02)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--delay-ms", type=float, default=0.0, help="emulated one-way latency per ring hop")
    p.add_argument(
        "--delay-dist",
        default="",
        help="random latency per ring hop instead of --delay-ms, drawn per collective and rank (ms): const:D, "
        "uniform:A:B, exp:MEAN, lognormal:MEDIAN:SIGMA, pareto:SCALE:ALPHA (heavy tail)",
    )
    p.add_argument("--comm-budget", type=float, default=0.15, help="comm_budget of demo-policy")
    p.add_argument(
        "--demo-settings",
        default="",
        help="extra DeMo keywords for every demo-* method, key=value,... as in convergence.py "
        "(e.g. update_rule=adam,decay=0.99)",
    )
    p.add_argument("--comm-timeout", type=float, default=300.0, help="DeMo's comm_timeout, seconds")
    p.add_argument("--progress-file", default="", help="rank 0 writes the wall clock of the first step here")
    p.add_argument("--timeout-min", type=float, default=60.0)
    return p.parse_args(argv)


# ------------------------------------------------------------------ helpers
def wire_counters() -> tuple[int, int]:
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname:
        return 0, 0
    base = Path(f"/sys/class/net/{ifname}/statistics")
    try:
        return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())
    except OSError:
        return 0, 0


def delay_sampler(args, rank: int):
    """A function returning one latency draw in seconds (per hop), or None when no latency is emulated."""
    import random

    if not args.delay_dist:
        return (lambda: args.delay_ms / 1000) if args.delay_ms > 0 else None
    kind, *raw = args.delay_dist.split(":")
    # milliseconds, except lognormal's sigma and pareto's alpha (dimensionless, the last field)
    ps = [float(x) if (kind in ("lognormal", "pareto") and i == 1) else float(x) / 1000 for i, x in enumerate(raw)]
    rng = random.Random(args.seed * 7919 + rank)
    if kind == "const":
        return lambda: ps[0]
    if kind == "uniform":
        return lambda: rng.uniform(ps[0], ps[1])
    if kind == "exp":
        return lambda: rng.expovariate(1 / ps[0])
    if kind == "lognormal":  # median ps[0] s, sigma of the log
        import math

        return lambda: rng.lognormvariate(math.log(ps[0]), ps[1])
    if kind == "pareto":  # scale ps[0] s, shape alpha
        return lambda: ps[0] * rng.paretovariate(ps[1])
    raise SystemExit(f"wan_worker: unknown --delay-dist {args.delay_dist!r}")


def install_delay(args, world: int, rank: int, demo: bool, log: list) -> None:
    """Sleep before each collective (see the module docstring); ``log`` collects the seconds slept."""
    draw = delay_sampler(args, rank)
    if draw is None or world == 1:
        return
    if demo:
        from hf_demo.exchange.transport import register_collective_hook

        def hook(name, nbytes):
            if name.startswith("node_"):  # HSDP's agreement inside a node: the fast local link
                return
            d = draw() * (world - 1) * (2 if name == "values" else 1)  # the all-reduce exchange: 2 (W-1) hops
            log.append(d)
            time.sleep(d)

        register_collective_hook(hook)
        return
    all_reduce = dist.all_reduce

    def delayed_all_reduce(*a, **k):
        d = draw() * 2 * (world - 1)
        log.append(d)
        time.sleep(d)
        return all_reduce(*a, **k)

    dist.all_reduce = delayed_all_reduce


# ------------------------------------------------------------------ main
def params_digest(model) -> str:
    """sha256 of this rank's parameters (its local shards under HSDP), in the model's order."""
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def build_demo(args, model, lr: float, world: int, mesh):
    """The DeMo optimizer of a ``demo-*`` method: a preset through ``hf_demo.create_optimizer`` (``PRESET_OF``), or
    ``hf_demo.DeMo`` with ``--topk``/``--chunk`` and the method's keywords; ``--demo-settings`` win over both."""
    import hf_demo

    overrides = parse_overrides(args.demo_settings)  # e.g. topk=64 over --topk
    if args.method in PRESET_OF:
        return hf_demo.create_optimizer(
            model, lr=lr, preset=PRESET_OF[args.method], comm_timeout=args.comm_timeout, **overrides
        )
    kw = dict(
        compression_topk=args.topk * (max(1, world // 2) if args.method in TOPK_PER_HALF_WORLD else 1),
        compression_chunk=args.chunk,
        comm_timeout=args.comm_timeout,
        **DEMO_KW[args.method],
    )
    if args.method == "demo-policy":
        kw["comm_budget"] = args.comm_budget
    return hf_demo.DeMo(model.parameters(), lr=lr, device_mesh=mesh, **{**kw, **overrides})


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(minutes=args.timeout_min))
    rank, world = dist.get_rank(), dist.get_world_size()
    is_demo = args.method.startswith("demo")
    delays: list[float] = []
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    sharded = args.method == "demo-hsdp"
    # ring hops between nodes: HSDP's DeMo talks only to the other nodes (FSDP2's collectives stay inside)
    install_delay(args, world // local_size if sharded else world, rank, is_demo, delays)
    load_start = open("/proc/loadavg").read().split()[:3]

    data = Data(stdlib_bytes(), rank, world, args.seq_len, args.batch_size, args.seed, args.heldout, args.eval_batches)
    model = byte_llama(
        hidden=args.hidden,
        intermediate=args.intermediate,
        layers=args.layers,
        heads=args.heads,
        seq_len=args.seq_len,
        seed=args.seed,
    )
    n_params = sum(p.numel() for p in model.parameters())
    for p in model.parameters():  # identical start on every rank (same seed anyway)
        dist.broadcast(p.data, 0)

    lr = args.lr if args.lr is not None else (1e-3 if is_demo else 2e-3)
    mesh = None
    if sharded:
        from hf_demo import fsdp

        mesh = fsdp.hsdp_mesh()  # (nodes, LOCAL_WORLD_SIZE)
        fsdp.shard_model(model, mesh)
    if is_demo:
        net = model
        opt = build_demo(args, model, lr, world, mesh)
    else:
        net = ddp_baseline(model, args.method, powersgd_rank=args.powersgd_rank, bucket_cap_mb=args.bucket_cap_mb)
        if args.method in ("adamw", "muon") and (args.delay_ms > 0 or args.delay_dist):
            # DDP's all-reduce through the Python hook, so that the delay wrapper sees it
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            net.register_comm_hook(None, default_hooks.allreduce_hook)
        if args.method == "muon":
            opt = ddp_muon(model, lr)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)

    def lr_at(step):  # step counts from 0
        return lr * min(1.0, (step + 1) / max(1, args.warmup))

    steps, evals = [], []
    train_time = 0.0
    wire_tx = wire_rx = 0

    def do_eval(step):
        if sharded and rank != 0:
            evaluate(model, data.eval)  # FSDP2: every rank of the shard group takes part in the forward pass
        if rank == 0:
            wall = time.perf_counter() - wall0 if step else 0.0
            evals.append(dict(step=step, train_time=train_time, wall=wall, loss=evaluate(model, data.eval)))
            print(f"[{args.method}] step {step:4d}  t={train_time:8.2f}s  eval {evals[-1]['loss']:.4f}", flush=True)
        dist.barrier()

    do_eval(0)
    wall0 = time.perf_counter()
    if rank == 0 and args.progress_file:  # the parent times its link changes from here
        Path(args.progress_file).write_text(f"{time.time()}\n")
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        batch = data.next_batch()
        tx0, rx0 = wire_counters()
        t0 = time.perf_counter()
        loss = net(input_ids=batch, labels=batch).loss
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        if args.method == "demo-overlap" and step + 1 == args.steps:
            opt.flush()  # the last exchange still in flight: apply it (counted in this step)
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        tx1, rx1 = wire_counters()
        train_time += t2 - t0
        wire_tx += tx1 - tx0
        wire_rx += rx1 - rx0
        rec = dict(
            step=step + 1,
            time=t2 - t0,
            fwd_bwd=t1 - t0,
            opt_step=t2 - t1,
            loss=float(loss.detach()),
            tx=tx1 - tx0,
            rx=rx1 - rx0,
        )
        if is_demo:
            cs = opt.comm_stats
            rec.update(app_sent=cs.bytes_sent, app_received=cs.bytes_received, comm_s=cs.seconds, tier=opt.tier)
        rec["wall"] = t2 - wall0  # since the first step, evaluations included
        rec["delay_s"] = sum(delays)
        delays.clear()
        steps.append(rec)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            do_eval(step + 1)

    per_rank = [None] * world
    dist.all_gather_object(
        per_rank, dict(rank=rank, wire_tx=wire_tx, wire_rx=wire_rx, train_time=train_time, steps=steps)
    )
    digests = [None] * world  # every rank's final parameters, hashed: the replicas must end identical
    dist.all_gather_object(digests, params_digest(model))
    if rank == 0:
        extra = {}
        if is_demo:
            extra = dict(
                demo_dense_bytes=opt.comm_stats.dense_bytes,
                demo_ratio_to_dense=opt.comm_stats.ratio_to_dense,
                demo_total=opt.comm_stats.as_dict(),
            )
        out = dict(
            method=args.method,
            world=world,
            n_params=n_params,
            lr=lr,
            args=vars(args),
            data=data.sizes,
            evals=evals,
            ranks=per_rank,
            torch=torch.__version__,
            local_world_size=local_size,
            load_start=load_start,
            load_end=open("/proc/loadavg").read().split()[:3],
            params_digest=digests,
            **extra,
        )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
        med = sorted(r["time"] for r in steps)[len(steps) // 2]
        print(
            f"[{args.method}] done: {n_params / 1e6:.2f}M params, median step {med:.3f}s, "
            f"final eval {evals[-1]['loss']:.4f}, wire tx/rx per step {wire_tx / len(steps) / 1e6:.3f}/"
            f"{wire_rx / len(steps) / 1e6:.3f} MB",
            flush=True,
        )
    dist.barrier()
    # not a bare destroy_process_group(): DDP's reducer keeps the group, and freeing it when main() returns
    # joins gloo's worker threads with the interpreter lock held, while a worker may still need that lock
    # to free the barrier's work: one rank of an 8-node run hung there for 300 s
    # (benchmarks/reports/2026-11-30-wan-and-scaling.md)
    from hf_demo.exchange.teardown import shutdown

    shutdown()


if __name__ == "__main__":
    sys.exit(main())
