#!/usr/bin/env python
"""Optimizer-step benchmark: hf_demo.DeMo against pytorch_optimizer.DeMo and torch.optim.AdamW.

The model is Llama-shaped with SmolLM2-135M's shapes (random init, nothing downloaded). No forward or
backward runs: every parameter gets a fixed random gradient (seeded by rank, the same for every optimizer),
copied into ``p.grad`` before each step, outside the timed region. Each optimizer runs in its own freshly
spawned gloo world on CPU (one thread per rank), so its memory figures are its own.

    python benchmarks/optimizer_step.py                 # full size: 30 layers, 2 ranks
    python benchmarks/optimizer_step.py --layers 2      # quick run
    python benchmarks/optimizer_step.py --profile demo-bf16   # where one hf_demo step spends its time (1 process)

See benchmarks/README.md for what every column means.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import importlib.util
import io
import os
import pstats
import resource
import socket
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPTIMIZERS = {  # name -> label in the table
    "demo-bf16": "hf_demo.DeMo (bf16, default)",
    "demo-sign": "hf_demo.DeMo (sign)",
    "adamw": "torch.optim.AdamW (1 process; no DDP all-reduce)",
    "peer": "pytorch_optimizer.DeMo (peer)",
}
PEER_INSTALL = "pip install pytorch-optimizer einops"
TARGET_BYTES = {"demo-bf16": 0.035, "demo-sign": 0.02}  # bytes/param/step sent
TARGET_TIME_VS_PEER = 0.5
# --tune-malloc: glibc keeps freed memory (up to 32 MiB blocks from the heap, which is never trimmed) instead
# of handing every large temporary back to the OS and page-faulting a fresh one in on the next step
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "68719476736"}


# ---------------------------------------------------------------------------------------- model & gradients
def build_model(layers: int, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def fixed_grads(params: list[torch.Tensor], rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + rank)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) * 1e-2 for p in params]


def make_optimizer(name: str, params: list[torch.Tensor], args):
    if name in ("demo-bf16", "demo-sign"):
        import hf_demo

        return hf_demo.DeMo(params, lr=args.lr, compression_decay=0.999, compression_topk=args.topk,
                            compression_chunk=args.chunk, value_format="bf16" if name == "demo-bf16" else "sign")
    if name == "adamw":
        return torch.optim.AdamW(params, lr=args.lr)
    if name == "peer":
        from pytorch_optimizer import DeMo

        return DeMo(params, lr=args.lr, compression_decay=0.999, compression_top_k=args.topk,
                    compression_chunk=args.chunk)
    raise ValueError(name)


def peer_missing() -> str | None:
    """None when pytorch_optimizer.DeMo can run, else why not."""
    if importlib.util.find_spec("pytorch_optimizer") is None:
        return "pytorch-optimizer is not installed"
    try:
        from pytorch_optimizer import DeMo  # noqa: F401
    except ImportError as exc:
        return f"pytorch_optimizer has no DeMo ({exc})"
    if importlib.util.find_spec("einops") is None:  # pytorch_optimizer.DeMo needs it at construction
        return "einops is not installed (pytorch_optimizer.DeMo needs it)"
    return None


# ---------------------------------------------------------------------------------------- counting traffic
_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base",
                "all_gather_coalesced", "all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter",
                "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "broadcast",
                "all_to_all", "all_to_all_single", "gather", "scatter", "send", "isend", "recv", "irecv",
                "batch_isend_irecv", "barrier", "monitored_barrier", "all_gather_object",
                "broadcast_object_list", "gather_object", "scatter_object_list", "send_object_list",
                "recv_object_list")
# where the tensor(s) this rank contributes sit: (positional index, keyword); a list is summed
_INPUT_ARG = {"all_gather": (1, "tensor"), "all_gather_into_tensor": (1, "input_tensor"),
              "all_gather_single": (1, "input_tensor"), "_all_gather_base": (1, "input_tensor"),
              "all_gather_coalesced": (1, "input_tensor_list"), "all_reduce": (0, "tensor"),
              "all_reduce_coalesced": (0, "tensors"), "reduce": (0, "tensor"),
              "reduce_scatter": (1, "input_list"), "reduce_scatter_tensor": (1, "input"),
              "reduce_scatter_single": (1, "input"), "_reduce_scatter_base": (1, "input"),
              "broadcast": (0, "tensor"), "all_to_all": (1, "input_tensor_list"),
              "all_to_all_single": (1, "input"), "gather": (0, "tensor"), "scatter": (1, "scatter_list"),
              "send": (0, "tensor"), "isend": (0, "tensor")}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CollectiveCounter:
    """While active, counts every torch.distributed collective and the bytes this rank hands to it.

    Patches the functions in ``torch.distributed`` and ``torch.distributed.distributed_c10d``, and every
    global of a loaded module of the given packages that holds one of them under any name (``from
    torch.distributed import all_gather`` as pytorch_optimizer does, or an alias such as ``_ALL_GATHER =
    dist.all_gather_single``). Calls nested inside a counted call are not counted again. Objects
    (``*_object*``) and point-to-point batches are counted as collectives with 0 bytes.
    """

    def __init__(self, packages: tuple[str, ...] = ()):
        self.packages = packages
        self.bytes_sent = 0
        self.collectives = 0
        self.by_name: dict[str, int] = {}
        self._patched: list[tuple[object, str, object]] = []
        self._local = threading.local()

    def reset(self) -> None:
        self.bytes_sent = self.collectives = 0
        self.by_name = {}

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                self.collectives += 1
                self.by_name[name] = self.by_name.get(name, 0) + 1
                if name in _INPUT_ARG:
                    pos, kw = _INPUT_ARG[name]
                    self.bytes_sent += _nbytes(kwargs[kw] if kw in kwargs else
                                               (args[pos] if len(args) > pos else None))
            self._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = depth

        wrapper.__wrapped__ = fn
        return wrapper

    def __enter__(self):
        originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
        wrappers = {name: self._wrap(name, fn) for name, fn in originals.items()}
        modules = [dist, sys.modules.get("torch.distributed.distributed_c10d")]
        modules += [m for n, m in list(sys.modules.items())
                    if m is not None and any(n == p or n.startswith(p + ".") for p in self.packages)]
        by_id = {id(fn): name for name, fn in originals.items()}
        for mod in modules:
            if mod is None:
                continue
            for attr, value in list(vars(mod).items()):
                name = by_id.get(id(value))
                if name is not None and value is originals[name]:
                    self._patched.append((mod, attr, value))
                    setattr(mod, attr, wrappers[name])
        return self

    def __exit__(self, *exc):
        for mod, name, fn in reversed(self._patched):
            setattr(mod, name, fn)
        self._patched = []
        return False


# ---------------------------------------------------------------------------------------- memory
def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> int:
    try:
        return _proc_status_kib("VmRSS") * 1024
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_bytes() -> int:
    try:
        return _proc_status_kib("VmHWM") * 1024
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def state_bytes(opt: torch.optim.Optimizer) -> int:
    seen, total = set(), 0
    stack = list(opt.state.values())
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            key = (v.untyped_storage().data_ptr(), v.device)
            if key not in seen:
                seen.add(key)
                total += v.untyped_storage().nbytes()
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total


# ---------------------------------------------------------------------------------------- one rank
def _set_threads(n: int) -> None:
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:
        pass


def _rank_main(rank: int, world: int, port: int, name: str, args, results) -> None:
    _set_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        model = build_model(args.layers)
        params = [p for p in model.parameters() if p.requires_grad]
        n_params = sum(p.numel() for p in params)
        grads = fixed_grads(params, rank)
        for p, g in zip(params, grads):
            p.grad = g.clone()  # resident before the baseline is taken
        opt = make_optimizer(name, params, args)
        counter = CollectiveCounter(packages=("hf_demo", "pytorch_optimizer"))
        gc.collect()
        dist.barrier()

        exact_peak = reset_peak_rss()
        rss0 = rss_bytes()
        times, cpu, faults, sent, colls, comm_s, reported = [], [], [], [], [], [], []
        for step in range(args.warmup + args.steps):
            with torch.no_grad():
                for p, g in zip(params, grads):
                    p.grad.copy_(g)
            dist.barrier()
            counter.reset()
            with counter:
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                c0, t0 = time.process_time(), time.perf_counter()
                opt.step()
                t1, c1 = time.perf_counter(), time.process_time()
                f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if step < args.warmup:
                continue
            times.append(t1 - t0)
            cpu.append(c1 - c0)
            faults.append(f1 - f0)
            sent.append(counter.bytes_sent)
            colls.append(counter.collectives)
            stats = getattr(opt, "comm_stats", None)
            if stats is not None:  # hf_demo: its own counters, cross-checked against ours below
                comm_s.append(stats.seconds)
                reported.append((stats.bytes_sent, stats.collectives))
            elif hasattr(opt, "data_transmit"):  # the peer keeps a byte count of its own
                reported.append((opt.data_transmit, None))
        peak = peak_rss_bytes()
        result = dict(
            name=name, rank=rank, n_params=n_params, times=times, cpu=cpu, faults=faults, sent=sent,
            collectives=colls, comm_seconds=comm_s, reported=reported, state_bytes=state_bytes(opt), rss_before=rss0,
            peak_delta=peak - rss0, exact_peak=exact_peak, by_name=dict(counter.by_name),
            dense_bytes=4 * n_params,
        )
        everyone = [None] * world
        dist.all_gather_object(everyone, result)
        if rank == 0:
            results.put(everyone)
    finally:
        dist.destroy_process_group()


class OtherCpu:
    """How many cores processes other than this one and its children kept busy since construction."""

    def __init__(self):
        self.t0, self.busy0, self.ours0 = time.perf_counter(), self._machine_busy(), self._ours()

    @staticmethod
    def _machine_busy() -> float | None:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = (v + [0] * 8)[:8]
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _ours() -> float:
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                     resource.getrusage(resource.RUSAGE_CHILDREN)))

    def others_cores(self) -> float | None:
        busy = self._machine_busy()
        if busy is None or self.busy0 is None:
            return None
        return max(0.0, (busy - self.busy0) - (self._ours() - self.ours0)) / (time.perf_counter() - self.t0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(name: str, args) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_rank_main, args=(args.world_size, free_port(), name, args, results),
                       nprocs=args.world_size, join=True, start_method="spawn")
    return results.get()


# ---------------------------------------------------------------------------------------- report
def summarise(per_rank: list[dict]) -> dict:
    r0 = per_rank[0]
    # a distributed step is as slow as its slowest rank: per step, the max over ranks
    step_max = [max(r["times"][i] for r in per_rank) for i in range(len(r0["times"]))]
    s = dict(
        name=r0["name"], n_params=r0["n_params"], dense_bytes=r0["dense_bytes"],
        median=statistics.median(step_max), min=min(step_max), max=max(step_max),
        median_rank0=statistics.median(r0["times"]),
        cpu=statistics.median([max(r["cpu"][i] for r in per_rank) for i in range(len(r0["cpu"]))]),
        faults=statistics.median([max(r["faults"][i] for r in per_rank) for i in range(len(r0["faults"]))]),
        comm=statistics.median(r0["comm_seconds"]) if r0["comm_seconds"] else None,
        state=max(r["state_bytes"] for r in per_rank), peak=max(r["peak_delta"] for r in per_rank),
        exact_peak=all(r["exact_peak"] for r in per_rank),
        sent=statistics.median(r0["sent"]), collectives=statistics.median(r0["collectives"]),
        by_name=r0["by_name"], reported=r0["reported"],
    )
    s["bpp"] = s["sent"] / s["n_params"]
    return s


def _mib(b: float) -> str:
    return f"{b / 2**20:,.0f}"


def print_report(summaries: dict[str, dict], skipped: dict[str, str], args, load: dict) -> None:
    any_s = next(iter(summaries.values()), None)
    print()
    known = [x for x in load.values() if x is not None]
    if known:
        print("CPU used by other processes while each world ran (cores, average): "
              + ", ".join(f"{n} {x:.2f}" for n, x in load.items() if x is not None)
              + (f"  -- WARNING: the machine ({os.cpu_count()} CPUs) was not idle; other processes competed "
                 "with the ranks and the times are noisy. Compare the 'fastest steps' ratios too, or rerun "
                 "on an idle machine." if max(known) > 0.2 else "") + "\n")
    if any_s:
        print(f"## Optimizer step, Llama/SmolLM2-135M shapes, {args.layers} layers "
              f"({any_s['n_params'] / 1e6:.1f}M parameters), {args.world_size} gloo rank(s) on CPU, "
              f"{args.threads} thread(s)/rank, median of {args.steps} steps after {args.warmup} warm-up, "
              f"chunk {args.chunk}, top-k {args.topk}, torch {torch.__version__}, "
              + ("glibc malloc tuned (--tune-malloc: "
                 + " ".join(f"{k}={v}" for k, v in TUNED_MALLOC.items()) + ")"
                 if args.tune_malloc else "default glibc malloc settings"))
    print()
    print("| optimizer | step s (median) | step s (min / max) | CPU s/step | in collectives s | state MiB "
          "| peak RSS Δ MiB | page faults/step (GiB) | bytes sent/step | bytes/param/step | collectives/step "
          "| sent / dense fp32 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, label in OPTIMIZERS.items():
        if name in skipped:
            print(f"| {label} | not run: {skipped[name]} | | | | | | | | | | |")
            continue
        if name not in summaries:
            continue
        s = summaries[name]
        comm = f"{s['comm']:.3f}" if s["comm"] is not None else "—"
        if name == "adamw":
            sent = f"0 (DDP would all-reduce {s['dense_bytes'] / 1e6:,.1f} MB)"
            bpp, ratio = "0 (DDP: 4.000)", "— (DDP: 1.0)"
        else:
            sent, bpp, ratio = f"{s['sent']:,.0f}", f"{s['bpp']:.4f}", f"{s['sent'] / s['dense_bytes']:.4f}"
        peak = _mib(s["peak"]) + ("" if s["exact_peak"] else " (≥)")
        faults = f"{s['faults']:,.0f} ({s['faults'] * resource.getpagesize() / 2**30:.2f})"
        print(f"| {label} | {s['median']:.3f} | {s['min']:.3f} / {s['max']:.3f} | {s['cpu']:.3f} | {comm} "
              f"| {_mib(s['state'])} | {peak} | {faults} | {sent} | {bpp} | {s['collectives']:g} | {ratio} |")

    print()
    peer = summaries.get("peer")
    lines = []
    for name in ("demo-bf16", "demo-sign"):
        s = summaries.get(name)
        if s is None:
            continue
        if peer:
            lines.append(f"- {OPTIMIZERS[name]} / peer: step time {s['median'] / peer['median']:.3f}x "
                         f"(fastest steps: {s['min'] / peer['min']:.3f}x, "
                         f"CPU time: {s['cpu'] / peer['cpu']:.3f}x), bytes sent {s['sent'] / peer['sent']:.3f}x")
        if "adamw" in summaries:
            adamw = summaries["adamw"]
            lines.append(f"- {OPTIMIZERS[name]} / AdamW: step time {s['median'] / adamw['median']:.3f}x "
                         f"(fastest steps: {s['min'] / adamw['min']:.3f}x, "
                         f"CPU time: {s['cpu'] / adamw['cpu']:.3f}x), "
                         f"bytes sent vs a DDP fp32 all-reduce {s['sent'] / s['dense_bytes']:.4f}x")
    if lines:
        print("Ratios (step time: median of the per-step slowest rank):")
        print("\n".join(lines))
        print()

    print("Targets:")
    for name, limit in TARGET_BYTES.items():
        s = summaries.get(name)
        if s is None:
            print(f"SKIP  {OPTIMIZERS[name]}: bytes/param/step <= {limit} (not run)")
        else:
            verdict = "PASS" if s["bpp"] <= limit else "FAIL"
            print(f"{verdict}  {OPTIMIZERS[name]}: bytes/param/step {s['bpp']:.4f} <= {limit}")
    for name in TARGET_BYTES:
        s = summaries.get(name)
        if s is None or peer is None:
            why = "peer not run" if peer is None else "not run"
            print(f"SKIP  {OPTIMIZERS[name]}: step time <= {TARGET_TIME_VS_PEER}x peer ({why})")
        else:
            r = s["median"] / peer["median"]
            verdict = "PASS" if r <= TARGET_TIME_VS_PEER else "FAIL"
            print(f"{verdict}  {OPTIMIZERS[name]}: step time {s['median']:.3f}s = {r:.3f}x peer's "
                  f"{peer['median']:.3f}s <= {TARGET_TIME_VS_PEER}x   (CPU time: {s['cpu'] / peer['cpu']:.3f}x, "
                  f"fastest steps: {s['min'] / peer['min']:.3f}x)")
    print()

    print("Cross-checks of the byte counts:")
    for name, s in summaries.items():
        if name.startswith("demo"):
            own = s["reported"][-1] if s["reported"] else (0, 0)
            print(f"- {name}: counted at torch.distributed {s['sent']:,.0f} B in {s['by_name']}; "
                  f"opt.comm_stats says {own[0]:,} B in {own[1]} collectives")
        elif name == "peer":
            own = s["reported"][-1][0] if s["reported"] else 0
            print(f"- peer: counted at torch.distributed {s['sent']:,.0f} B in {s['by_name']}; "
                  f"its own data_transmit says {own:,} B")
    print()
    print("Measured: step time = wall time of opt.step() alone (grads are copied in before, outside the "
          "timer; a barrier lines the ranks up before each step), per step the slowest rank, median over "
          "steps. CPU s/step = process CPU time (all threads, gloo's included) spent in opt.step(), per step "
          "the busiest rank, median: much less sensitive than wall time to other processes on the machine. "
          "page faults/step = minor page faults of the busiest rank during opt.step() (and the memory they "
          "first-touched, at 4 KiB a page): fresh pages for temporaries the allocator got from the OS; "
          "contention-independent, and each costs CPU time (zeroing, kernel entry). "
          "'in collectives' = hf_demo's comm_stats.seconds on rank 0 (waiting for the other rank "
          "included). state = bytes of the tensors in opt.state (max over ranks). peak RSS Δ = the process's "
          "peak resident set (VmHWM, reset just before the first step via /proc/self/clear_refs) minus its "
          "resident set then, max over ranks: optimizer state plus the step's transient buffers ('≥' where "
          "the peak could not be reset and it is a lower bound). bytes sent = bytes of the tensors this rank "
          "hands to torch.distributed collectives during one step (counted by wrapping them), the same "
          "convention as hf_demo's comm_stats.bytes_sent; an all-gather receives (world-1)x that. "
          "AdamW runs alone on each rank: DDP's gradient all-reduce (4 B/param fp32 handed in; a ring "
          "moves ~2(N-1)/N of that per rank) is not included in its time or bytes.")


# ---------------------------------------------------------------------------------------- profile
def profile(name: str, args) -> None:
    """One step of one optimizer in this process (world size 1), under cProfile and torch.profiler."""
    _set_threads(args.threads)
    model = build_model(args.layers)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = fixed_grads(params, 0)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt = make_optimizer(name, params, args)

    def refill():
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.grad.copy_(g)

    times, cpu, faults = [], [], []
    for _ in range(max(1, args.warmup) + args.steps):
        refill()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        c0, t0 = time.process_time(), time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    skip = max(1, args.warmup)
    times, cpu, faults = times[skip:], cpu[skip:], faults[skip:]
    n = sum(p.numel() for p in params)
    f = statistics.median(faults)
    print(f"## Profile of {OPTIMIZERS[name]}: {args.layers} layers, {n / 1e6:.1f}M parameters, world size 1, "
          f"{args.threads} thread(s), {'tuned' if args.tune_malloc else 'default'} glibc malloc; step time median "
          f"{statistics.median(times):.3f}s (CPU {statistics.median(cpu):.3f}s), {f:,.0f} minor page faults/step "
          f"({f * resource.getpagesize() / 2**30:.2f} GiB first-touched), over {len(times)} steps")

    refill()
    prof = cProfile.Profile()
    prof.enable()
    opt.step()
    prof.disable()
    for sort, title in (("tottime", "self time"), ("cumulative", "cumulative time")):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(args.profile_rows)
        print(f"\n### cProfile, one step, top {args.profile_rows} by {title}\n")
        print(out.getvalue().split("\n", 4)[-1].rstrip())

    refill()
    from torch.profiler import ProfilerActivity, profile as tprofile
    with tprofile(activities=[ProfilerActivity.CPU], record_shapes=True) as tp:
        opt.step()
    print(f"\n### torch.profiler, one step, top {args.profile_rows} aten ops by self CPU time\n")
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))
    print(f"\n### torch.profiler, same step, grouped by input shape (top {args.profile_rows})\n")
    print(tp.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total",
                                                           row_limit=args.profile_rows))


# ---------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M has 30)")
    ap.add_argument("--world-size", type=int, default=2, help="gloo ranks to spawn (default 2)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (state allocation)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--only", default=",".join(OPTIMIZERS),
                    help=f"comma-separated subset of {','.join(OPTIMIZERS)}")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--chunk", type=int, default=64, help="compression chunk, both DeMos")
    ap.add_argument("--topk", type=int, default=32, help="compression top-k, both DeMos")
    ap.add_argument("--profile", choices=list(OPTIMIZERS), default=None,
                    help="instead of the table: profile one step of this optimizer in one process")
    ap.add_argument("--profile-rows", type=int, default=25)
    ap.add_argument("--tune-malloc", action="store_true",
                    help="run with glibc malloc tuned to reuse freed memory (" +
                         " ".join(f"{k}={v}" for k, v in TUNED_MALLOC.items()) + ") instead of the defaults")
    args = ap.parse_args(argv)
    if args.tune_malloc and any(os.environ.get(k) != v for k, v in TUNED_MALLOC.items()):
        # glibc reads these at process start: the spawned ranks inherit them; --profile re-executes itself
        os.environ.update(TUNED_MALLOC)
        if args.profile:
            os.execv(sys.executable, [sys.executable] + sys.argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(args.threads))

    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown:
        ap.error(f"unknown optimizer(s) {unknown}; choose from {list(OPTIMIZERS)}")
    skipped = {}
    why = peer_missing()
    if why and ("peer" in names or args.profile == "peer"):
        print(f"pytorch_optimizer.DeMo (the peer) will not run: {why}. Install it with: {PEER_INSTALL}",
              file=sys.stderr)
        skipped["peer"] = f"{why}; `{PEER_INSTALL}`"
        if args.profile == "peer":
            return 1
    if args.profile:
        profile(args.profile, args)
        return 0

    summaries, load = {}, {}
    t_all = time.perf_counter()
    for name in names:
        if name in skipped:
            continue
        t0 = time.perf_counter()
        print(f"[{name}] {args.world_size} rank(s), {args.layers} layers ...", file=sys.stderr, flush=True)
        cpu0 = OtherCpu()
        summaries[name] = summarise(run_world(name, args))
        load[name] = cpu0.others_cores()
        print(f"[{name}] done in {time.perf_counter() - t0:.0f}s: step {summaries[name]['median']:.3f}s",
              file=sys.stderr, flush=True)
    print_report(summaries, skipped, args, load)
    print(f"\n(total wall time {time.perf_counter() - t_all:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
