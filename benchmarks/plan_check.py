"""The planner (``hf-demo plan``) against the emulated-link measurements of ``wan.py``: predicted vs measured.

For every fixed-rate configuration of every ``wan_summary.json`` under ``benchmarks/results`` (the changing-
link scenarios have no one link to plan for), every method is predicted with the planner's own model
(:mod:`hf_demo.ops.methods`) and compared with its measured median step time (slowest rank). What is given
to the planner, as an operator would give it: the model (the WAN job's byte-level Llama, shapes from its
arguments), the nodes and processes per node, the link's nominal rate (``none``: the plain veth, 8 Gbit/s
measured, see docs/BENCHMARKS.md), no latency (none was added), and the compute: **DeMo bf16's measured
forward+backward and its optimizer compute (optimizer step minus time in collectives) in the same
configuration and results folder**, used for every method there. So the DeMo bf16 row checks the exchange
model only, and every other row checks the transfer to another method (its bytes, collectives, overlap and,
for PowerSGD, the planner's default overhead). The DeMo bytes of a run are checked first: the planner's
bytes per rank per step must equal the run's recorded ``comm_stats`` bytes exactly (with the index coding
the run used); runs made with an earlier block layout are left out, named.

Latency: tc's tbf shapes the rate only (this kernel has no netem); runs made with ``wan.py --delay-ms D`` (the
latency emulated in the application, per ring hop) are planned with a one-way latency D between nodes, the others
with none, so their rows check the bandwidth terms only. The report also gives, predicted only, what a one-way
latency of ``--latency`` between nodes (5 us inside) would add. ``--measure`` checks the latency: real gloo ranks on
loopback (2 x 1, 4 x 1 and 2 x 2 nodes x ranks) train a small MLP with DDP-AdamW, DeMo's defaults, the
from_scratch preset and sync_every=4 behind an emulated link (:mod:`benchlib.ring_link`: each collective
first sleeps what its ring takes on that topology at 0/5/20/50 ms and no limit or 100 Mbit/s between nodes,
and an untimed barrier follows it), and the planner's time in collectives, bytes and collectives per step are
compared with the run's. The planner is given what this machine's collectives cost besides the link, as an
operator would measure it: the fixed cost of one collective (``hf-demo plan --collective-overhead``) and the
loopback's rate, calibrated before each case (:func:`calibrate`) and stated in the report.

    python benchmarks/plan_check.py            # writes benchmarks/results/plan_check.md, prints the summary
    python benchmarks/plan_check.py --measure  # writes benchmarks/results/plan_latency.{md,json} (~10 min)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from hf_demo.ops.links import Link, edge_bytes  # noqa: E402
from hf_demo.ops.methods import Cluster, Workload, ddp_adamw, ddp_muon, ddp_powersgd, demo_estimate  # noqa: E402
from hf_demo.settings import DeMoSettings  # noqa: E402
from wan_worker import DEMO_KW, PRESET_OF, TOPK_PER_HALF_WORLD  # noqa: E402 - the worker's settings are the ones measured

UNLIMITED = "8gbit"  # gloo between two namespaces over a plain veth (docs/BENCHMARKS.md)
TOLERANCE = 0.25
INTRA_LATENCY = "5us"


def llama_shapes(args: dict) -> list[tuple[int, ...]]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=args["hidden"],
        intermediate_size=args["intermediate"],
        num_hidden_layers=args["layers"],
        num_attention_heads=args["heads"],
        num_key_value_heads=args["heads"],
        max_position_embeddings=args["seq_len"],
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        return [tuple(p.shape) for p in LlamaForCausalLM(cfg).parameters()]


@functools.cache
def _orthogonal_overhead(hidden: int, intermediate: int, layers: int, heads: int, batch: int, seq_len: int) -> float:
    import torch

    from benchlib.toy import byte_llama
    from hf_demo.ops.compute_cost import orthogonal_overhead

    model = byte_llama(hidden=hidden, intermediate=intermediate, layers=layers, heads=heads, seq_len=seq_len, seed=0)
    ids = torch.randint(0, 256, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    return orthogonal_overhead(model, {"input_ids": ids, "labels": ids})


ORTHOGONAL_RECORD = HERE / "results" / "orthogonal_overhead.json"  # recorded shares, so a rerun plans the same
_OVERHEAD_KEYS = ("hidden", "intermediate", "layers", "heads", "batch_size", "seq_len")


def orthogonal_overhead_of(args: dict, measure: bool = False) -> float:
    """The planner's ``orthogonal_overhead`` for a run's Llama and batch: one Newton-Schulz run over its hidden
    matrices / one forward+backward, one thread as the runs train. The figure recorded in
    :data:`ORTHOGONAL_RECORD` for this model and batch when there is one (a measurement on this shared machine moves
    with its load by 10-20%, and would move the table with it); else, or with ``measure``, measured in this process
    (``measure`` records it)."""
    key = ",".join(f"{k}={int(args[k])}" for k in _OVERHEAD_KEYS)
    recorded = json.loads(ORTHOGONAL_RECORD.read_text()) if ORTHOGONAL_RECORD.is_file() else {}
    if key in recorded and not measure:
        return recorded[key]
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(int(args.get("threads") or 1))
    try:
        value = _orthogonal_overhead(*(int(args[k]) for k in _OVERHEAD_KEYS))
    finally:
        torch.set_num_threads(threads)
    if measure:
        ORTHOGONAL_RECORD.write_text(json.dumps({**recorded, key: value}, indent=1, sort_keys=True) + "\n")
    return value


def run_workload(args: dict, fwd_bwd_s: float, own_s: float) -> Workload:
    """The planner's workload for a ``wan.py`` run's Llama: its shapes, DeMo bf16's measured forward+backward and
    own compute (``own_s``), and the Newton-Schulz share measured here (:func:`orthogonal_overhead_of`)."""
    return Workload(
        llama_shapes(args),
        fwd_bwd_s,
        demo_overhead=own_s / fwd_bwd_s,
        orthogonal_overhead=orthogonal_overhead_of(args),
    )


def parse_config(key: str) -> tuple[int, int, str] | None:
    """'4 nodes, 100mbit per link' / '2 nodes × 2 processes, ...' -> (nodes, procs, rate); None for a scenario."""
    if key.startswith("scenario") or "+" in key:
        return None
    where, _, link = key.partition(", ")
    parts = where.replace("×", "x").split()
    nodes, procs = int(parts[0]), int(parts[3]) if "processes" in where else 1
    rate = link.split()[0]
    return nodes, procs, UNLIMITED if rate == "unlimited" else rate


def demo_settings(method: str, args: dict, world: int, coding: str) -> DeMoSettings:
    if method in PRESET_OF:  # built from a preset: the worker's --topk/--chunk do not apply
        return DeMoSettings.resolve(PRESET_OF[method], index_coding=coding)
    topk = args["topk"] * (max(1, world // 2) if method in TOPK_PER_HALF_WORLD else 1)
    kw = {"compression_topk": topk, "compression_chunk": args["chunk"], "index_coding": coding, **DEMO_KW[method]}
    if method.startswith("demo-policy"):
        kw.setdefault("comm_budget", args.get("comm_budget", 0.15))
    return DeMoSettings(**kw)


def predict(method: str, run: dict, cluster: Cluster, work: Workload) -> tuple[float, str] | None:
    """(predicted step s, note), or None when the run's bytes are not the current library's."""
    if method == "adamw":
        return ddp_adamw(cluster, work).step_s(cluster), ""
    if method == "powersgd":
        return ddp_powersgd(cluster, work).step_s(cluster), ""
    if method == "muon" and work.orthogonal_overhead is not None:
        return ddp_muon(cluster, work).step_s(cluster), ""
    # a method since retired (demo-hier: hierarchy="node", replaced by demo-hsdp)
    if method not in DEMO_KW and method not in PRESET_OF:
        return None
    recorded = run.get("app_sent_mean")
    layout = "hsdp" if method == "demo-hsdp" else "flat"
    for coding in ("elias_fano", "uint16"):
        settings = demo_settings(method, run["args"], cluster.world, coding)
        est = demo_estimate(method, method, 0, settings, cluster, work, layout)
        if recorded is None or round(est.rank_bytes()) == round(recorded):
            return est.step_s(cluster), f"bytes exact ({coding})"
        if abs(est.rank_bytes() - recorded) <= 1e-3 * recorded:  # the first exchange's settings, spread over a run
            return est.step_s(cluster), f"bytes within 0.1% ({coding}: the first exchange agrees the settings)"
    return None


def with_latency(cluster: Cluster, latency: str) -> Cluster:
    """The same cluster with a one-way latency between nodes (and 5 us inside a node)."""
    inter = Link(cluster.inter.bandwidth, Link.parse("1bit", latency).latency)
    intra = Link(cluster.intra.bandwidth, Link.parse("1bit", INTRA_LATENCY).latency)
    return Cluster(cluster.nodes, cluster.devices_per_node, intra, inter)


def emulated_cluster(nodes: int, procs: int, rate: str, delay_ms: float = 0.0) -> Cluster:
    """The planner's cluster for a ``wan.py`` configuration: ``rate`` between nodes, the loopback inside a node
    (its processes share one namespace), and ``delay_ms`` of one-way latency per hop between nodes when the run
    emulated one (``--delay-ms``)."""
    link = Link.parse(rate, "0")
    cluster = Cluster(nodes, procs, Link.parse(UNLIMITED, "0") if procs > 1 else link, link)
    return with_latency(cluster, f"{delay_ms}ms") if delay_ms else cluster


def _delay_ms(runs: list[dict], config: str) -> float:
    """The one-way latency per hop the runs of ``config`` emulated (``wan.py --delay-ms``; 0 for none)."""
    delays = {r.get("delay_ms", 0.0) for r in runs if r.get("config") == config and not r.get("failed")}
    if len(delays) > 1:
        raise ValueError(f"{config}: runs with different --delay-ms {sorted(delays)} in one results folder")
    return delays.pop() if delays else 0.0


def check_folder(summary_path: Path, latency: str = "20ms") -> tuple[list[dict], list[str]]:
    summary = json.loads(summary_path.read_text())
    runs_path = summary_path.parent / "wan_runs.json"
    if not runs_path.is_file():  # the per-run records (arguments, bytes) are needed to plan each run
        return [], [f"{summary_path.relative_to(HERE)}: no wan_runs.json beside it (its per-run records were removed)"]
    runs = json.loads(runs_path.read_text())
    rows, left_out = [], []
    for key, methods in summary.items():
        parsed = parse_config(key)
        if parsed is None:
            continue
        nodes, procs, rate = parsed
        # the compute of a DeMo run without Newton-Schulz (the presets' is in orthogonal_overhead, measured here)
        every_step = [m for k, m in methods.items() if k.startswith("demo") and k not in PRESET_OF]
        ref = methods.get("demo-bf16") or next(iter(every_step), None)
        if ref is None or ref.get("failed"):
            left_out.append(f"{summary_path.parent.name} / {key}: no every-step DeMo run to take the compute from")
            continue
        args = next(r["args"] for r in runs if not r.get("failed"))
        for r in runs:
            if not r.get("failed") and r["method"] in methods:
                methods[r["method"]]["args"] = r["args"]
        work = run_workload(args, ref["fwd_bwd_s"], ref["opt_s"] - ref["comm_s"])
        cluster = emulated_cluster(nodes, procs, rate, _delay_ms(runs, key))
        for method, run in methods.items():
            if run.get("failed"):
                continue
            run.setdefault("args", args)
            got = predict(method, run, cluster, work)
            if got is None and "app_sent_mean" not in run:
                left_out.append(f"{summary_path.parent.name} / {key} / {method}: the planner has no row for it")
                continue
            if got is None:
                left_out.append(
                    f"{summary_path.parent.name} / {key} / {method}: sent {run['app_sent_mean']:.0f} B per step, "
                    "not what the current library sends for it (made with an earlier version)"
                )
                continue
            predicted, note = got
            delayed = predict(method, run, with_latency(cluster, latency), work)
            rows.append(
                dict(
                    folder=str(summary_path.parent.relative_to(HERE / "results")),
                    config=key,
                    method=method,
                    predicted=predicted,
                    measured=run["step_s"],
                    error=(predicted - run["step_s"]) / run["step_s"],
                    note=note,
                    latency_s=delayed[0] - predicted,
                )
            )
    return rows, left_out


def summarize(rows: list[dict]) -> list[str]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["config"], r["method"]), []).append(r)
    lines = [
        "| configuration | method | runs | predicted s (median) | measured s (median) | mean abs. error | "
        "worst error |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for (config, method), rs in sorted(groups.items()):
        errors = [r["error"] for r in rs]
        lines.append(
            f"| {config} | {method} | {len(rs)} | {statistics.median(r['predicted'] for r in rs):.3f} | "
            f"{statistics.median(r['measured'] for r in rs):.3f} | {statistics.mean(abs(e) for e in errors):.1%} | "
            f"{max(errors, key=abs):+.1%} |"
        )
    within = sum(abs(r["error"]) <= TOLERANCE for r in rows)
    errors = [abs(r["error"]) for r in rows]
    lines += [
        "",
        f"{within} of {len(rows)} runs within {TOLERANCE:.0%}; mean absolute error "
        f"{statistics.mean(errors):.1%}, median {statistics.median(errors):.1%}.",
    ]
    return lines


def latency_table(rows: list[dict], latency: str) -> list[str]:
    """The predicted seconds per step a latency adds, per configuration and method (nothing measured)."""
    added: dict[tuple[str, str], float] = {}
    for r in rows:
        added.setdefault((r["config"], r["method"]), r["latency_s"])
    lines = [
        f"| configuration | method | measured s (no latency) | predicted s added by {latency} between nodes |",
        "|---|---|---:|---:|",
    ]
    for (config, method), extra in sorted(added.items()):
        measured = statistics.median(r["measured"] for r in rows if (r["config"], r["method"]) == (config, method))
        lines.append(f"| {config} | {method} | {measured:.3f} | {extra:+.3f} |")
    return lines


# ---------------------------------------------------------------- measured: real gloo ranks, an emulated link
MEASURED = {  # the planner's name -> DeMo's settings (None: DDP-AdamW)
    "ddp-adamw": None,
    "demo": {},
    "demo-from_scratch": {"preset": "from_scratch"},
    "demo-sync4": {"sync_every": 4},
}
LATENCIES_MS = (0.0, 5.0, 20.0, 50.0)
TOPOLOGIES = ((2, 1), (4, 1), (2, 2))  # (nodes, ranks per node) on loopback
SIDE, LAYERS = 256, 3  # the model: LAYERS square Linear layers (under 1 MB of fp32: one DDP bucket)


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(SIDE, SIDE) for _ in range(LAYERS)])


def model_shapes() -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in _model().parameters()]


def emulated_topology(nodes: int, per_node: int, latency_ms: float, rate: str):
    from benchlib.ring_link import Edge, Topology

    inf = float("inf")
    bandwidth = inf if rate == "none" else Link.parse(rate).bandwidth
    return Topology(nodes, per_node, Edge(bandwidth, latency_ms / 1000), Edge(inf, 0.0))


def emulate(seconds: float) -> float:
    """Sleep the emulated link's time; returns it. What a collective is clocked at is this time plus the real
    collective's: not the sleep's overshoot, the time this busy host takes to wake the process up again (a link
    has no such thing; on a loaded 2-core machine it is milliseconds)."""
    if seconds > 0:
        time.sleep(seconds)
    return seconds


def fence(state: dict) -> None:
    """Untimed, after each timed collective: every rank waits until every rank is out of it. Without it a rank
    that finishes a collective first goes on computing while the others are still in it, and with more ranks
    than cores (4 on this machine's 2) that computation takes the cores the collective's own threads need:
    the collective is clocked with the other ranks' computation in it (benchmarks/reports/2026-12-05-plan-
    latency.md). On a cluster each rank has its own device; ``--no-fence`` measures without it."""
    import torch.distributed as dist

    if state.get("fence", True):
        dist.barrier()


def install_link(state: dict, log: list) -> None:
    """Every DeMo collective (hf_demo's Transport) sleeps the emulated ring's time first; ``log`` gets
    (kind, bytes handed over, seconds including the sleep) of each. Only the collective is clocked: the fence
    after it is not."""
    from benchlib.ring_link import ring_seconds
    from hf_demo.exchange.transport import StepTransport, Transport

    def wrap(kind, orig):
        def timed(self, buf, *args, **kwargs):
            n = buf.numel() * buf.element_size()
            delay = emulate(ring_seconds(kind, n, state["topo"]))
            t0 = time.perf_counter()
            out = orig(self, buf, *args, **kwargs)
            log.append((kind, n, delay + time.perf_counter() - t0))
            fence(state)
            return out

        return timed

    # every all-gather runs in StepTransport.all_gather (Transport.all_gather hands over to it); the others in
    # Transport's own methods (StepTransport's hand over to them)
    for owner, kind in ((StepTransport, "all_gather"), (Transport, "all_reduce"), (Transport, "broadcast")):
        setattr(owner, kind, wrap(kind, getattr(owner, kind)))


def ddp_hook(state: dict, log: list):
    """DDP's bucket all-reduce behind the same emulated link (a comm hook, run synchronously); the mean's
    division and the fence after it are not clocked."""
    import torch
    import torch.distributed as dist

    from benchlib.ring_link import ring_seconds

    def hook(_, bucket):
        buf = bucket.buffer()
        n = buf.numel() * buf.element_size()
        delay = emulate(ring_seconds("all_reduce", n, state["topo"]))
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        log.append(("all_reduce", n, delay + time.perf_counter() - t0))
        fence(state)
        buf.div_(dist.get_world_size())
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    return hook


CALIBRATION_COMPUTE_S = 0.005  # the computation each rank does before each calibrating collective


def _least_over_ranks(times: list[float]) -> list[float]:
    """Per repetition, the least of every rank's time (every rank gets the same list)."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(times, dtype=torch.float64)
    every = torch.empty(dist.get_world_size() * len(times), dtype=torch.float64)
    dist.all_gather_into_tensor(every, mine)
    return every.view(dist.get_world_size(), -1).min(dim=0).values.tolist()


def _after_compute(op, state: dict, repeats: int, compute_s: float) -> float:
    """The median over ``repeats`` of ``op``'s time run after ``compute_s`` of computation on every rank (as a
    collective inside a training step runs), clocked as the cases are: the least over the ranks, fenced."""
    import torch

    a, times = torch.randn(64, 64), []
    for _ in range(repeats):
        deadline = time.perf_counter() + compute_s
        while time.perf_counter() < deadline:
            a @ a
        t0 = time.perf_counter()
        op()
        times.append(time.perf_counter() - t0)
        fence(state)
    return statistics.median(_least_over_ranks(times))


CALIBRATION_REDUCE = 2**18  # fp32 values of the all-reduce the loopback's rate is read from (1 MiB, DDP's size)


def calibrate(state: dict, repeats: int = 40, compute_s: float = CALIBRATION_COMPUTE_S) -> dict:
    """This machine's figures for the planner, read from collectives, not from the cases:

    - ``overhead_s``: the fixed cost of one collective (``Cluster.overhead``), an 8-byte all-gather (all
      ``W - 1`` hops of the loopback in it) run after computation (:func:`_after_compute`);
    - ``back_to_back_s``: the same all-gather back to back (nccl-tests style), what a host that never idles gives;
    - ``loopback_bps``: the loopback's rate, from a 1 MiB all-reduce after computation: its ring's bytes per edge
      over its time less the overhead (infinite where that time is not above the overhead: too fast to read)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    x, out = torch.zeros(8, dtype=torch.uint8), torch.zeros(8 * world, dtype=torch.uint8)
    gather = lambda: dist.all_gather_into_tensor(out, x)  # noqa: E731
    overhead = _after_compute(gather, state, repeats, compute_s)
    tight = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gather()
        tight.append(time.perf_counter() - t0)
    big = torch.zeros(CALIBRATION_REDUCE)
    reduce_s = _after_compute(lambda: dist.all_reduce(big), state, max(1, repeats // 4), compute_s)
    edge = edge_bytes("all_reduce", big.numel() * 4, world)
    bps = edge / (reduce_s - overhead) if reduce_s > overhead else math.inf
    return dict(overhead_s=overhead, back_to_back_s=statistics.median(_least_over_ranks(tight)), loopback_bps=bps)


def run_case(method: str, steps: int, state: dict, log: list) -> list[list[tuple]]:
    """``steps`` optimizer steps of ``method`` on this rank; per step, the (kind, bytes, seconds) of each collective."""
    import torch

    import hf_demo

    model = _model()
    if MEASURED[method] is None:
        net = torch.nn.parallel.DistributedDataParallel(model)
        net.register_comm_hook(None, ddp_hook(state, log))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        net, opt = model, hf_demo.DeMo(model.parameters(), lr=1e-3, **MEASURED[method])
    per_step, gen = [], torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    for _ in range(steps):
        log.clear()
        net(torch.randn(8, SIDE, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        per_step.append(list(log))
    return per_step


def measure_ranks(rank: int, world: int, per_node: int, cases: list, periods: int, fenced: bool = True) -> dict:
    """On every rank, each case (method, latency ms, rate) in turn: (this machine's figures calibrated just
    before it, :func:`calibrate`; its steps)."""
    state, log = {"fence": fenced}, []
    install_link(state, log)
    out = []
    for method, latency_ms, rate in cases:  # calibrated again before each: the load moves
        figures = calibrate(state)
        state["topo"] = emulated_topology(world // per_node, per_node, latency_ms, rate)
        out.append((figures, run_case(method, (periods + 1) * every_of(method), state, log)))
    return {"cases": out}


def every_of(method: str) -> int:
    settings = MEASURED[method]
    if settings is None:
        return 1
    chosen = dict(settings)
    return DeMoSettings.resolve(chosen.pop("preset", None), **chosen).sync_every


def measured_comm(per_rank: list, method: str, warmup_periods: int = 1) -> tuple[float, float, int]:
    """(median seconds in collectives per step, bytes handed over per step, collectives per period) from every
    rank's record of one case: per collective the least time over the ranks (the last rank to arrive waits only
    for the link, the others also for its computation), summed over a period of ``sync_every`` steps, the
    median over the periods after the first ``warmup_periods``, divided by the period."""
    every = every_of(method)
    steps = len(per_rank[0])
    periods = []
    for start in range(warmup_periods * every, steps - every + 1, every):
        seconds = nbytes = count = 0
        for step in range(start, start + every):
            calls = list(zip(*(r[step] for r in per_rank)))
            seconds += sum(min(c[2] for c in call) for call in calls)
            nbytes += sum(call[0][1] for call in calls)
            count += len(calls)
        periods.append((seconds, nbytes, count))
    return (
        statistics.median(p[0] for p in periods) / every,
        statistics.median(p[1] for p in periods) / every,
        int(statistics.median(p[2] for p in periods)),
    )


def predicted_comm(record: dict):
    """The planner's (seconds in collectives per step, bytes handed over per step, collectives per period) for
    a record's cluster: between nodes the emulated link (its rate, or the loopback's where none is set, and its
    latency), inside a node the loopback (its rate as calibrated), and each collective's fixed cost as
    calibrated (an 8-byte all-gather on the loopback, whose own hops it holds: the loopback's hops cost nothing
    more here)."""
    method, rate, loopback = record["method"], record["rate"], record["loopback_bps"]
    intra = Link(loopback, 0.0)
    inter = Link(loopback if rate == "none" else Link.parse(rate).bandwidth, record["latency_ms"] / 1000)
    cluster = Cluster(record["nodes"], record["per_node"], intra, inter, record["overhead_s"])
    work = Workload(model_shapes(), 1.0, ddp_buffers=False)  # linear layers: no buffers for DDP to broadcast
    if MEASURED[method] is None:
        est = ddp_adamw(cluster, work)
    else:
        chosen = dict(MEASURED[method])
        settings = DeMoSettings.resolve(chosen.pop("preset", None), **chosen)
        est = demo_estimate(method, method, 0, settings, cluster, work)
    every = every_of(method)
    return (
        est.comm_s(cluster),
        sum(c.nbytes / c.every for c in est.collectives),
        round(sum(every / c.every for c in est.collectives)),
    )


def measure(periods: int, latencies, rates, topologies, methods, fenced: bool = True) -> list[dict]:
    """Every case on real gloo ranks, one launch per topology; the raw figures of each (see :func:`compare`)."""
    from benchlib.ranks import expect_ok, run_ranks

    records = []
    for nodes, per_node in topologies:
        cases = [(m, lat, rate) for rate in rates for lat in latencies for m in methods]
        started = time.time()
        got = expect_ok(run_ranks(measure_ranks, nodes * per_node, per_node, cases, periods, fenced, timeout=3600))
        load = open("/proc/loadavg").read().split()[:3]
        given = given_figures(got[0]["cases"])
        for i, (method, lat, rate) in enumerate(cases):
            figures = dict(got[0]["cases"][i][0], **given[i])
            seconds, nbytes, count = measured_comm([g["cases"][i][1] for g in got], method)
            records.append(
                dict(
                    nodes=nodes,
                    per_node=per_node,
                    method=method,
                    latency_ms=lat,
                    rate=rate,
                    fenced=fenced,
                    **figures,
                    measured_s=seconds,
                    measured_bytes=nbytes,
                    measured_collectives=count,
                )  # fmt: skip
            )
        overheads = [r["overhead_s"] * 1e3 for r in records[-len(cases) :]]
        print(f"{nodes}x{per_node}: {len(cases)} cases in {time.time() - started:.0f} s, load {' '.join(load)}; "
              f"collective overhead {statistics.median(overheads):.2f} ms "
              f"({min(overheads):.2f} to {max(overheads):.2f})")  # fmt: skip
    return records


CALIBRATION_WINDOW = 2  # cases on each side of a case whose calibrations give its figures


def given_figures(cases: list) -> list[dict]:
    """What the planner is given for each case of a launch: the median of the calibrations (:func:`calibrate`)
    of the case and of the ``CALIBRATION_WINDOW`` cases on each side (five: about half a minute of this host).
    One calibration lasts a third of a second, and the load of a shared 2-core machine comes in bursts of
    seconds: one burst over a calibration would otherwise stand for the case."""
    out = []
    for i in range(len(cases)):
        near = [c[0] for c in cases[max(0, i - CALIBRATION_WINDOW) : i + CALIBRATION_WINDOW + 1]]
        out.append({k: statistics.median(c[k] for c in near) for k in ("overhead_s", "loopback_bps")})
        out[-1]["own_overhead_s"] = cases[i][0]["overhead_s"]
    return out


def compare(records: list[dict]) -> list[dict]:
    """Each record with the planner's prediction beside it and the relative error of the time."""
    out = []
    for r in records:
        seconds, nbytes, count = predicted_comm(r)
        error = (seconds - r["measured_s"]) / r["measured_s"] if r["measured_s"] else math.inf
        out.append(dict(r, predicted_s=seconds, predicted_bytes=nbytes, predicted_collectives=count, error=error))
    return out


def measured_table(rows: list[dict]) -> list[str]:
    lines = [
        "| nodes x ranks | method | one-way latency between nodes | rate between nodes | collectives (planned / "
        "run) | bytes per step (planned / run) | overhead ms per collective | predicted ms per step | measured ms "
        "per step | error |",
        "|---|---|---:|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['nodes']}x{r['per_node']} | {r['method']} | {r['latency_ms']:g} ms | {r['rate']} | "
            f"{r['predicted_collectives']} / {r['measured_collectives']} | {r['predicted_bytes']:.0f} / "
            f"{r['measured_bytes']:.0f} | {r['overhead_s'] * 1e3:.2f} | {r['predicted_s'] * 1e3:.2f} | "
            f"{r['measured_s'] * 1e3:.2f} | {r['error']:+.1%} |"
        )
    within = sum(abs(r["error"]) <= TOLERANCE for r in rows)
    lines += ["", f"{within} of {len(rows)} rows within {TOLERANCE:.0%}."]
    return lines


def latency_summary(rows: list[dict]) -> list[str]:
    """Per emulated latency: the rows, how many within the tolerance, the median and the worst error."""
    lines = [
        "| one-way latency between nodes | rows | within 25% | median abs. error | worst error |",
        "|---:|---:|---:|---:|---:|",
    ]
    for latency in sorted({r["latency_ms"] for r in rows}):
        errors = [r["error"] for r in rows if r["latency_ms"] == latency]
        within = sum(abs(e) <= TOLERANCE for e in errors)
        lines.append(
            f"| {latency:g} ms | {len(errors)} | {within} | {statistics.median(abs(e) for e in errors):.1%} | "
            f"{max(errors, key=abs):+.1%} |"
        )
    return lines


def overhead_summary(rows: list[dict]) -> list[str]:
    """Per topology, the collective's fixed cost as calibrated before its cases (what the planner was given)."""
    lines = [
        "| nodes x ranks | collective overhead given to the planner, ms: median (least to most) | the same "
        "all-gather back to back, ms (median) | loopback rate given to the planner, Gbit/s: median (least to most) |",
        "|---|---:|---:|---:|",
    ]
    for topo in sorted({(r["nodes"], r["per_node"]) for r in rows}, key=lambda t: (t[0] * t[1], t)):
        mine = [r for r in rows if (r["nodes"], r["per_node"]) == topo]
        given = [r["overhead_s"] * 1e3 for r in mine]
        tight = statistics.median(r["back_to_back_s"] * 1e3 for r in mine)
        rates = [r["loopback_bps"] * 8e-9 for r in mine]
        lines.append(
            f"| {topo[0]}x{topo[1]} | {statistics.median(given):.2f} ({min(given):.2f} to {max(given):.2f}) | "
            f"{tight:.2f} | {statistics.median(rates):.3g} ({min(rates):.3g} to {max(rates):.3g}) |"
        )
    return lines


def main_measure(args) -> int:
    if args.from_json:
        records = json.loads(Path(args.from_json).read_text())
    else:
        records = measure(args.periods, args.latencies_ms, args.rates, [tuple(t) for t in args.topologies],
                          args.methods, not args.no_fence)  # fmt: skip
        Path(args.json_out).write_text(json.dumps(records, indent=1))
    rows = compare(records)
    fenced = "fenced" if all(r.get("fenced", True) for r in rows) else "NOT fenced (--no-fence)"
    text = latency_summary(rows) + ["", f"Collectives {fenced}. The collective's fixed cost, calibrated:", ""]
    text += overhead_summary(rows) + [""] + measured_table(rows)
    Path(args.out).write_text(MEASURE_HEAD + "\n".join(text) + "\n")
    print("\n".join(text))
    return 0


MEASURE_HEAD = """# The planner against real gloo collectives on an emulated link with latency

Generated by `python benchmarks/plan_check.py --measure`.

Time in collectives per step (the communication part: each collective timed on every rank, the least over the
ranks, a median over the steps; an untimed barrier after each, so no rank computes while another is still in
it), predicted by the planner (`Estimate.comm_s`) and measured. The link is emulated in the application
(benchmarks/benchlib/ring_link.py); inside a node and at 0 ms the link is gloo on loopback. The planner is given
the collective's fixed cost (`Cluster.overhead`, `hf-demo plan --collective-overhead`) and the loopback's rate,
both calibrated before each case on the same ranks, clocked as the cases are (the median of 40 8-byte
all-gathers, and of 10 1 MiB all-reduces, each run after 5 ms of computation on every rank), and smoothed: each
case gets the median of its own calibration and of the two cases' on each side.

"""


def topology(text: str) -> tuple[int, int]:
    nodes, _, per_node = text.partition("x")
    return int(nodes), int(per_node or 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(HERE / "results"))
    p.add_argument("--out", default=None, help="the Markdown report (default: results/plan_check.md or "
                   "results/plan_latency.md with --measure)")  # fmt: skip
    p.add_argument("--latency", default="20ms", help="the latency between nodes of the predicted-only section")
    p.add_argument("--measure", action="store_true", help="measure real gloo ranks on an emulated link instead")
    p.add_argument("--periods", type=int, default=16, help="--measure: sync periods measured per case (one more first)")
    p.add_argument("--latencies-ms", type=float, nargs="+", default=list(LATENCIES_MS))
    p.add_argument("--rates", nargs="+", default=["none", "100mbit"], help="between nodes; none: loopback")
    p.add_argument("--topologies", type=topology, nargs="+", default=list(TOPOLOGIES), help="NODESxRANKS, e.g. 2x2")
    p.add_argument("--methods", nargs="+", default=list(MEASURED), choices=list(MEASURED))
    p.add_argument("--json-out", default=str(HERE / "results" / "plan_latency.json"))
    p.add_argument("--from-json", default=None, help="--measure: redo the table from recorded figures")
    p.add_argument("--no-fence", action="store_true", help="--measure: no barrier after each timed collective")
    args = p.parse_args(argv)
    if args.measure:
        args.out = args.out or str(HERE / "results" / "plan_latency.md")
        return main_measure(args)
    args.out = args.out or str(HERE / "results" / "plan_check.md")
    rows, left_out = [], []
    for path in sorted(Path(args.results).rglob("wan_summary.json")):
        got, skipped = check_folder(path, args.latency)
        rows += got
        left_out += skipped
    text = ["# The planner against the emulated-link runs (generated by benchmarks/plan_check.py)", ""]
    text += summarize(rows)
    text += ["", f"## Latency: predicted only ({args.latency} between nodes, {INTRA_LATENCY} inside)", ""]
    text += [
        "The runs above had no latency (this machine's kernel has no netem to add one), so nothing here is "
        "measured: these are the planner's per-hop latency terms for the same runs.",
        "",
    ]
    text += latency_table(rows, args.latency) + ["", "## Every run", ""]
    text += [
        "| folder | configuration | method | predicted s | measured s | error | note |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    text += [
        f"| {r['folder']} | {r['config']} | {r['method']} | {r['predicted']:.3f} | {r['measured']:.3f} | "
        f"{r['error']:+.1%} | {r['note']} |"
        for r in rows
    ]
    text += ["", "## Left out", ""] + [f"- {x}" for x in left_out]
    Path(args.out).write_text("\n".join(text) + "\n")
    print("\n".join(summarize(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
