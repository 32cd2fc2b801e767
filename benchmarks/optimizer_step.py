#!/usr/bin/env python
"""Optimizer-step benchmark: hf_demo.DeMo against pytorch_optimizer.DeMo and torch.optim.AdamW.

Llama model with SmolLM2-135M's shapes (random init), fixed random gradients (no forward/backward), each optimizer
in a freshly spawned gloo world on CPU (or, with --device cuda, on GPUs: NCCL with a GPU per rank, else gloo).
What every column means: benchmarks/README.md.

    python benchmarks/optimizer_step.py                       # full size: 30 layers, 2 ranks
    python benchmarks/optimizer_step.py --layers 2            # quick run
    python benchmarks/optimizer_step.py --profile demo-bf16   # where one step spends its time (1 process)
    python benchmarks/optimizer_step.py --device cuda --world-size 1 --only demo-bf16,demo-sign,adamw
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import importlib.util
import io
import os
import pstats
import resource
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

from benchlib.ranks import expect_ok, run_ranks

OPTIMIZERS = {  # name -> label in the table
    "demo-bf16": "hf_demo.DeMo (bf16, default)",
    "demo-sign": "hf_demo.DeMo (sign)",
    "adamw": "torch.optim.AdamW (1 process; no DDP all-reduce)",
    "peer": "pytorch_optimizer.DeMo (peer)",
}
PEER_INSTALL = "pip install pytorch-optimizer einops"
TARGET_BYTES = {"demo-bf16": 0.035, "demo-sign": 0.02}  # bytes/param/step sent
TARGET_TIME_VS_PEER = 0.5
TARGET_TIME_VS_FWD_BWD = 0.15  # hf-demo's step against one forward+backward at the main job's batch
# --tune-malloc: glibc serves blocks up to 32 MiB from a heap it never trims, instead of mmap-ing each large
# temporary afresh (and page-faulting it in) on every step
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "68719476736"}


def build_model(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def rank_device(args, rank: int) -> torch.device:
    """``--device cuda``: GPU ``rank`` (modulo the GPUs there are); else the CPU."""
    if args.device == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """CUDA runs asynchronously: wait for the queued work before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def setup(name: str, args, rank: int):
    """The parameters (with their gradients in ``p.grad``), the fixed gradients and the optimizer."""
    device = rank_device(args, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    params = [p for p in build_model(args.layers).to(device).parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(1234 + rank)  # ranks differ, every optimizer sees the same
    grads = [(torch.randn(p.shape, generator=g, dtype=p.dtype) * 1e-2).to(device) for p in params]
    for p, grad in zip(params, grads):
        p.grad = grad.clone()
    if name.startswith("demo"):
        import hf_demo

        opt = hf_demo.DeMo(
            params,
            lr=args.lr,
            compression_decay=0.999,
            compression_topk=args.topk,
            compression_chunk=args.chunk,
            value_format=name.removeprefix("demo-"),
        )
    elif name == "adamw":
        opt = torch.optim.AdamW(params, lr=args.lr)
    else:
        from pytorch_optimizer import DeMo

        opt = DeMo(
            params, lr=args.lr, compression_decay=0.999, compression_top_k=args.topk, compression_chunk=args.chunk
        )
    return params, grads, opt


def peer_missing() -> str | None:
    """None when pytorch_optimizer.DeMo can run, else why not."""
    for module in ("pytorch_optimizer", "einops"):  # the peer's DeMo needs einops at construction
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    try:
        from pytorch_optimizer import DeMo  # noqa: F401
    except ImportError as exc:
        return f"pytorch_optimizer has no DeMo ({exc})"
    return None


# ---------------------------------------------------------------------------------------- counting traffic
# every collective, and where the tensor(s) this rank contributes sit: (position, keyword), a list is summed;
# None: counted with 0 bytes (objects, receives, barriers)
_COLLECTIVES = {
    "all_gather": (1, "tensor"), "all_gather_into_tensor": (1, "input_tensor"),
    "all_gather_single": (1, "input_tensor"), "_all_gather_base": (1, "input_tensor"),
    "all_gather_coalesced": (1, "input_tensor_list"), "all_reduce": (0, "tensor"),
    "all_reduce_coalesced": (0, "tensors"), "reduce": (0, "tensor"), "reduce_scatter": (1, "input_list"),
    "reduce_scatter_tensor": (1, "input"), "_reduce_scatter_base": (1, "input"), "broadcast": (0, "tensor"),
    "all_to_all": (1, "input_tensor_list"), "all_to_all_single": (1, "input"), "gather": (0, "tensor"),
    "scatter": (1, "scatter_list"), "send": (0, "tensor"), "isend": (0, "tensor"),
    **dict.fromkeys(("recv", "irecv", "batch_isend_irecv", "barrier", "monitored_barrier", "all_gather_object",
                     "broadcast_object_list", "gather_object", "scatter_object_list", "send_object_list",
                     "recv_object_list")),
}  # fmt: skip


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x) if isinstance(x, list | tuple) else 0


class CollectiveCounter:
    """While active, counts every torch.distributed collective and the bytes this rank hands to it.

    Wraps the functions wherever a module of ``torch.distributed`` or of ``packages`` holds them, under any name
    (``from torch.distributed import all_gather``, aliases such as ``_ALL_GATHER = dist.all_gather_single``).
    A collective called from inside a counted one is not counted again.
    """

    def __init__(self, packages: tuple[str, ...] = ()):
        self.packages, self._patched, self._local = packages, [], threading.local()
        self.reset()

    def reset(self) -> None:
        self.bytes_sent, self.collectives, self.by_name = 0, 0, {}

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                self.collectives += 1
                self.by_name[name] = self.by_name.get(name, 0) + 1
                if _COLLECTIVES[name] is not None:
                    pos, kw = _COLLECTIVES[name]
                    self.bytes_sent += _nbytes(kwargs[kw] if kw in kwargs else args[pos] if len(args) > pos else None)
            self._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = depth

        return wrapper

    def __enter__(self):
        originals = {id(getattr(dist, n)): (getattr(dist, n), n) for n in _COLLECTIVES if hasattr(dist, n)}
        wrappers = {key: self._wrap(n, fn) for key, (fn, n) in originals.items()}
        modules = [dist, sys.modules.get("torch.distributed.distributed_c10d")] + [
            m for n, m in list(sys.modules.items()) if any(n == p or n.startswith(p + ".") for p in self.packages)
        ]
        for mod in filter(None, modules):
            for attr, value in list(vars(mod).items()):
                if id(value) in originals and value is originals[id(value)][0]:
                    self._patched.append((mod, attr, value))
                    setattr(mod, attr, wrappers[id(value)])
        return self

    def __exit__(self, *exc):
        for mod, attr, fn in reversed(self._patched):
            setattr(mod, attr, fn)
        self._patched = []


# ---------------------------------------------------------------------------------------- memory
def _status_bytes(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM); ru_maxrss where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def state_bytes(opt: torch.optim.Optimizer) -> int:
    storages, stack = {}, list(opt.state.values())
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            storages[(v.untyped_storage().data_ptr(), v.device)] = v.untyped_storage().nbytes()
        elif isinstance(v, dict | list | tuple):
            stack.extend(v.values() if isinstance(v, dict) else v)
    return sum(storages.values())


class OtherCpu:
    """How many cores processes other than this one and its children kept busy since construction."""

    def __init__(self):
        self.t0, self.busy0, self.ours0 = time.perf_counter(), self._machine_busy(), self._ours()

    @staticmethod
    def _machine_busy() -> float | None:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]] + [0] * 8
        except (OSError, ValueError):
            return None
        return (sum(v[:3]) + sum(v[5:8])) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait

    @staticmethod
    def _ours() -> float:
        usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        return sum(r.ru_utime + r.ru_stime for r in usage)

    def others_cores(self) -> float | None:
        busy = self._machine_busy()
        if busy is None or self.busy0 is None:
            return None
        return max(0.0, (busy - self.busy0) - (self._ours() - self.ours0)) / (time.perf_counter() - self.t0)


# ---------------------------------------------------------------------------------------- measuring
def set_threads(n: int) -> None:
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:
        pass


@torch.no_grad()
def load_grads(params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad.copy_(g)


def timed_step(opt, params, grads, counter=None) -> tuple[float, float, int]:
    """Gradients copied in and ranks lined up (untimed), then ``opt.step()`` (in ``counter`` if given):
    wall seconds, CPU seconds, minor page faults."""
    load_grads(params, grads)
    device = params[0].device
    synchronize(device)
    if dist.is_initialized():
        dist.barrier()
    with counter or contextlib.nullcontext():
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        c0, t0 = time.process_time(), time.perf_counter()
        opt.step()
        synchronize(device)
        t1, c1 = time.perf_counter(), time.process_time()
        return t1 - t0, c1 - c0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


def measure_rank(rank: int, world: int, name: str, args) -> dict:
    """One rank of one optimizer's world (run by ``run_ranks``): per-step figures of this rank."""
    set_threads(args.threads)
    params, grads, opt = setup(name, args, rank)
    counter = CollectiveCounter(packages=("hf_demo", "pytorch_optimizer"))
    gc.collect()
    dist.barrier()
    device = params[0].device
    if device.type == "cuda":  # the peak is the CUDA allocator's
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        exact_peak, rss0 = True, torch.cuda.memory_allocated(device)
    else:
        exact_peak = reset_peak_rss()
        rss0 = _status_bytes("VmRSS")
    rec = {k: [] for k in ("times", "cpu", "faults", "sent", "collectives", "comm_seconds", "reported")}
    for step in range(args.warmup + args.steps):
        counter.reset()
        wall, cpu, faults = timed_step(opt, params, grads, counter)
        if step < args.warmup:
            continue
        for key, value in zip(
            ("times", "cpu", "faults", "sent", "collectives"),
            (wall, cpu, faults, counter.bytes_sent, counter.collectives),
        ):
            rec[key].append(value)
        if hasattr(opt, "comm_stats"):  # hf_demo's own counters, cross-checked against ours
            rec["comm_seconds"].append(opt.comm_stats.seconds)
            rec["reported"].append((opt.comm_stats.bytes_sent, opt.comm_stats.collectives))
        elif hasattr(opt, "data_transmit"):  # the peer's own byte count
            rec["reported"].append((opt.data_transmit, None))
    if hasattr(opt, "flush"):  # hf_demo: read the last step's verdict on every rank (untimed)
        opt.flush()
    n_params = sum(p.numel() for p in params)
    return dict(
        rec,
        name=name,
        n_params=n_params,
        dense_bytes=4 * n_params,
        state_bytes=state_bytes(opt),
        peak_delta=(torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _status_bytes("VmHWM"))
        - rss0,
        exact_peak=exact_peak,
        by_name=counter.by_name,
    )


def measure_fwd_bwd(rank: int, world: int, args) -> dict:
    """One rank's forward+backward of the model at ``--batch`` x ``--seq`` random tokens (the main job's batch),
    each rank at once as in training (no DDP: DeMo replaces its all-reduce): wall seconds per pass."""
    set_threads(args.threads)
    device = rank_device(args, rank)
    model = build_model(args.layers).to(device)
    g = torch.Generator().manual_seed(99 + rank)
    tokens = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g).to(device)
    times = []
    for step in range(args.warmup + args.steps):
        model.zero_grad(set_to_none=True)
        synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    return {"times": times}


def summarise(per_rank: list[dict]) -> dict:
    """A distributed step is as slow as its slowest rank: per step the max over ranks, then the median."""
    r0 = per_rank[0]

    def slowest(key):
        return [max(r[key][i] for r in per_rank) for i in range(len(r0[key]))]

    times = slowest("times")
    s = dict(
        name=r0["name"],
        n_params=r0["n_params"],
        dense_bytes=r0["dense_bytes"],
        median=statistics.median(times),
        min=min(times),
        max=max(times),
        cpu=statistics.median(slowest("cpu")),
        faults=statistics.median(slowest("faults")),
        comm=statistics.median(r0["comm_seconds"]) if r0["comm_seconds"] else None,
        state=max(r["state_bytes"] for r in per_rank),
        peak=max(r["peak_delta"] for r in per_rank),
        exact_peak=all(r["exact_peak"] for r in per_rank),
        sent=statistics.median(r0["sent"]),
        collectives=statistics.median(r0["collectives"]),
        by_name=r0["by_name"],
        reported=r0["reported"],
    )
    s["bpp"] = s["sent"] / s["n_params"]
    return s


# ---------------------------------------------------------------------------------------- report
def print_report(summaries: dict[str, dict], skipped: dict[str, str], args, load: dict) -> None:
    def mib(b):
        return f"{b / 2**20:,.0f}"

    known = [x for x in load.values() if x is not None]
    if known:
        print(
            "\nCPU used by other processes while each world ran (cores): "
            + ", ".join(f"{n} {x:.2f}" for n, x in load.items() if x is not None)
            + (
                "  -- WARNING: the machine was not idle, the times are noisy (compare the fastest steps)"
                if max(known) > 0.2
                else ""
            )
        )
    if summaries:
        n = next(iter(summaries.values()))["n_params"]
        malloc = " ".join(f"{k}={v}" for k, v in TUNED_MALLOC.items()) if args.tune_malloc else "default malloc"
        print(
            f"\n## Optimizer step, Llama/SmolLM2-135M shapes, {args.layers} layers ({n / 1e6:.1f}M parameters), "
            f"{args.world_size} {args.backend} rank(s) on {args.device}, {args.threads} thread(s)/rank, "
            f"median of {args.steps} steps "
            f"after {args.warmup} warm-up, chunk {args.chunk}, top-k {args.topk}, torch {torch.__version__}, "
            f"{malloc}\n"
        )
    print(
        "| optimizer | step s (median) | step s (min / max) | CPU s/step | in collectives s | state MiB "
        f"| {'peak CUDA memory' if args.device == 'cuda' else 'peak RSS'} Δ MiB | page faults/step (GiB) "
        "| bytes sent/step | bytes/param/step | collectives/step "
        "| sent / dense fp32 |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for name, label in OPTIMIZERS.items():
        if name == "fwd-bwd":
            continue
        if name in skipped:
            print(f"| {label} | not run: {skipped[name]} |" + " |" * 11)
        if name not in summaries:
            continue
        s = summaries[name]
        comm = f"{s['comm']:.3f}" if s["comm"] is not None else "—"
        if name == "adamw":
            sent = f"0 (DDP would all-reduce {s['dense_bytes'] / 1e6:,.1f} MB)"
            bpp, ratio = "0 (DDP: 4.000)", "— (DDP: 1.0)"
        else:
            sent, bpp, ratio = f"{s['sent']:,.0f}", f"{s['bpp']:.4f}", f"{s['sent'] / s['dense_bytes']:.4f}"
        faults = f"{s['faults']:,.0f} ({s['faults'] * resource.getpagesize() / 2**30:.2f})"
        print(
            f"| {label} | {s['median']:.3f} | {s['min']:.3f} / {s['max']:.3f} | {s['cpu']:.3f} | {comm} "
            f"| {mib(s['state'])} | {mib(s['peak'])}{'' if s['exact_peak'] else ' (≥)'} | {faults} | {sent} "
            f"| {bpp} | {s['collectives']:g} | {ratio} |"
        )

    peer, adamw = summaries.get("peer"), summaries.get("adamw")
    print("\nRatios (step time: median of the per-step slowest rank; fastest steps; CPU time):")
    for name in TARGET_BYTES:
        s = summaries.get(name)
        for other, what in ((peer, "peer"), (adamw, "AdamW")):
            if s and other:
                print(
                    f"- {OPTIMIZERS[name]} / {what}: step time {s['median'] / other['median']:.3f}x, "
                    f"{s['min'] / other['min']:.3f}x, {s['cpu'] / other['cpu']:.3f}x; bytes sent "
                    + (
                        f"{s['sent'] / peer['sent']:.3f}x"
                        if other is peer
                        else f"vs a DDP fp32 all-reduce {s['sent'] / s['dense_bytes']:.4f}x"
                    )
                )

    fwd_bwd = summaries.get("fwd-bwd")
    if fwd_bwd:
        print(
            f"\nForward+backward at batch {args.batch} x {args.seq} tokens per rank: {fwd_bwd['median']:.3f}s "
            "(median of the per-step slowest rank)"
        )
        for name in TARGET_BYTES:
            if s := summaries.get(name):
                print(f"- {OPTIMIZERS[name]} step / forward+backward: {s['median'] / fwd_bwd['median']:.3f}")

    print("\nTargets:")
    for name, limit in TARGET_BYTES.items():
        s, label = summaries.get(name), OPTIMIZERS[name]
        if s is None:
            print(f"SKIP  {label}: bytes/param/step <= {limit} (not run)")
        else:
            print(f"{'PASS' if s['bpp'] <= limit else 'FAIL'}  {label}: bytes/param/step {s['bpp']:.4f} <= {limit}")
        if s is None or peer is None:
            print(f"SKIP  {label}: step time <= {TARGET_TIME_VS_PEER}x peer ({'not run' if s is None else 'no peer'})")
        else:
            r = s["median"] / peer["median"]
            print(
                f"{'PASS' if r <= TARGET_TIME_VS_PEER else 'FAIL'}  {label}: step time {s['median']:.3f}s = "
                f"{r:.3f}x peer's {peer['median']:.3f}s <= {TARGET_TIME_VS_PEER}x"
            )

        if s is not None and fwd_bwd:
            r = s["median"] / fwd_bwd["median"]
            print(
                f"{'PASS' if r <= TARGET_TIME_VS_FWD_BWD else 'FAIL'}  {label}: step time {s['median']:.3f}s = "
                f"{r:.3f}x forward+backward's {fwd_bwd['median']:.3f}s <= {TARGET_TIME_VS_FWD_BWD}x"
            )

    print("\nCross-checks of the byte counts:")
    for name, s in summaries.items():
        if name == "fwd-bwd":
            continue
        own = s["reported"][-1] if s["reported"] else (0, None)
        if name != "adamw":
            whose = "opt.comm_stats" if name.startswith("demo") else "its own data_transmit"
            print(
                f"- {name}: counted at torch.distributed {s['sent']:,.0f} B in {s['by_name']}; {whose} says "
                f"{own[0]:,} B" + (f" in {own[1]} collectives" if own[1] is not None else "")
            )


# ---------------------------------------------------------------------------------------- profile
def profile(name: str, args) -> None:
    """Steps of one optimizer in this process (world size 1), then one under cProfile and one torch.profiler."""
    set_threads(args.threads)
    params, grads, opt = setup(name, args, 0)
    warmup = max(1, args.warmup)
    runs = [timed_step(opt, params, grads) for _ in range(warmup + args.steps)][warmup:]
    wall, cpu, faults = (statistics.median(x) for x in zip(*runs))
    print(
        f"## Profile of {OPTIMIZERS[name]}: {args.layers} layers, {sum(p.numel() for p in params) / 1e6:.1f}M "
        f"parameters, world size 1, {args.threads} thread(s), {'tuned' if args.tune_malloc else 'default'} "
        f"malloc; step time median {wall:.3f}s (CPU {cpu:.3f}s), {faults:,.0f} minor page faults/step "
        f"({faults * resource.getpagesize() / 2**30:.2f} GiB first-touched), over {len(runs)} steps"
    )

    load_grads(params, grads)
    prof = cProfile.Profile()
    prof.runcall(opt.step)
    for sort, title in (("tottime", "self time"), ("cumulative", "cumulative time")):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(args.profile_rows)
        print(f"\n### cProfile, one step, top {args.profile_rows} by {title}\n")
        print(out.getvalue().split("\n", 4)[-1].rstrip())

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    load_grads(params, grads)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with torch_profile(activities=activities, record_shapes=True) as tp:
        opt.step()
        synchronize(params[0].device)
    for by_shape in (False, True):
        print(
            f"\n### torch.profiler, one step, top {args.profile_rows} aten ops by self CPU time"
            + (", grouped by input shape" if by_shape else "")
            + "\n"
        )
        table = tp.key_averages(group_by_input_shape=by_shape)
        print(table.table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))


# ---------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M has 30)")
    ap.add_argument("--world-size", type=int, default=2, help="ranks to spawn")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the parameters live")
    ap.add_argument(
        "--backend",
        choices=["gloo", "nccl"],
        help="default: nccl with --device cuda and a GPU per rank, else gloo (CUDA buffers staged through the host)",
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (state allocation)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--only", default=",".join(OPTIMIZERS), help=f"comma-separated subset of {','.join(OPTIMIZERS)}")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--chunk", type=int, default=64, help="compression chunk, both DeMos")
    ap.add_argument("--topk", type=int, default=32, help="compression top-k, both DeMos")
    ap.add_argument("--profile", choices=list(OPTIMIZERS), help="profile one step of this optimizer in one process")
    ap.add_argument("--profile-rows", type=int, default=25)
    ap.add_argument("--batch", type=int, default=2, help="forward+backward: sequences per rank (the main job's)")
    ap.add_argument("--seq", type=int, default=128, help="forward+backward: tokens per sequence")
    ap.add_argument("--no-fwd-bwd", action="store_true", help="skip timing forward+backward")
    ap.add_argument("--tune-malloc", action="store_true", help="glibc malloc tuned to reuse freed memory")
    args = ap.parse_args(argv)
    if args.tune_malloc and any(os.environ.get(k) != v for k, v in TUNED_MALLOC.items()):
        os.environ.update(TUNED_MALLOC)  # glibc reads them at start: the spawned ranks inherit them
        if args.profile:
            os.execv(sys.executable, [sys.executable] + sys.argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    if args.backend is None:
        gpus = torch.cuda.device_count() if args.device == "cuda" else 0
        args.backend = "nccl" if args.device == "cuda" and args.world_size <= gpus else "gloo"
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(args.threads))

    names = [n.strip() for n in args.only.split(",") if n.strip()]
    if unknown := [n for n in names if n not in OPTIMIZERS]:
        ap.error(f"unknown optimizer(s) {unknown}; choose from {list(OPTIMIZERS)}")
    skipped = {}
    if "peer" in names + [args.profile] and (why := peer_missing()):
        print(
            f"pytorch_optimizer.DeMo (the peer) will not run: {why}. Install it with: {PEER_INSTALL}", file=sys.stderr
        )
        skipped["peer"] = f"{why}; `{PEER_INSTALL}`"
        if args.profile == "peer":
            return 1
    if args.profile:
        profile(args.profile, args)
        return 0

    summaries, load, t_all = {}, {}, time.perf_counter()
    for name in (n for n in names if n not in skipped):
        print(f"[{name}] {args.world_size} rank(s), {args.layers} layers ...", file=sys.stderr, flush=True)
        t0, others = time.perf_counter(), OtherCpu()
        per_rank = run_ranks(
            measure_rank,
            args.world_size,
            name,
            args,
            timeout=3600,
            collective_timeout=600,
            start_method="spawn",
            backend=args.backend,
        )
        summaries[name] = summarise(expect_ok(per_rank))
        load[name] = others.others_cores()
        print(
            f"[{name}] done in {time.perf_counter() - t0:.0f}s: step {summaries[name]['median']:.3f}s",
            file=sys.stderr,
            flush=True,
        )
    if not args.no_fwd_bwd:
        print(f"[fwd-bwd] {args.world_size} rank(s), batch {args.batch} x {args.seq} ...", file=sys.stderr, flush=True)
        per_rank = run_ranks(
            measure_fwd_bwd, args.world_size, args, timeout=3600, collective_timeout=600, start_method="spawn",
            backend=args.backend,
        )  # fmt: skip
        times = [max(r["times"][i] for r in expect_ok(per_rank)) for i in range(args.steps)]
        summaries["fwd-bwd"] = {"median": statistics.median(times), "min": min(times)}
    print_report(summaries, skipped, args, load)
    print(f"\n(total wall time {time.perf_counter() - t_all:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
