"""The planner against a network with real delay: step time and wait on the link, measured and planned.

Each node count runs as one emulated cluster (:mod:`delay_netns`: a namespace per node, routed through a
namespace whose TCP relay holds every byte between nodes for the one-way delay, ``tc`` tbf limiting every
node's upload and download to the rate). One ``torchrun`` per node starts this file's worker, which runs every
case in turn: for each (delay, rate) it asks the driver to set the relay's delay and the links' rate, then
trains each method ``--repeats`` times from the same start, interleaved (repeat 1 of every method, then repeat 2,
...), each ``--warmup`` untimed steps then ``--steps`` timed ones (a multiple of every method's ``sync_every``),
between two barriers. Nothing in the worker emulates the link: its collectives are plain gloo over TCP.

Measured, per run: the step (the timed steps' wall time over their count, on the slowest rank), the forward and
backward pass, the optimizer step, and DeMo's time in its collectives (``comm_stats``, the least over the ranks:
the last rank to arrive waits only for the link). Per case and method the median over the repeats.

Planned (:mod:`hf_demo.ops.methods`, what ``hf-demo plan`` prints), given as an operator would give it: the
model's shapes, the nodes, the rate, the one-way delay between nodes, the default fixed cost per collective,
and the compute of DeMo's defaults measured in the same case (forward+backward, and its own optimizer compute:
the optimizer step less its collectives), for every method (the presets add the Newton-Schulz share measured
here, as ``benchmarks/plan_check.py`` does). DeMo's bytes per rank per step must equal the run's exactly.
The wait on the link, planned: ``Estimate.exchange_s``; measured: DeMo's time in collectives per step, and for
DDP-AdamW the step less the forward+backward of DeMo's defaults and its own optimizer step.

    python benchmarks/delay_check.py                     # as root; writes benchmarks/results/delay_check.{json,md}
    python benchmarks/delay_check.py --from-json benchmarks/results/delay_check.json   # the tables again
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

METHODS = ("demo-bf16", "demo-scratch", "demo-scratch-few", "adamw")  # DeMo's defaults, the presets, DDP-AdamW
LABELS = {
    "demo-bf16": "DeMo defaults",
    "demo-scratch": "from_scratch",
    "demo-scratch-few": "from_scratch_few_bytes",
    "adamw": "DDP-AdamW",
}
MODEL = dict(hidden=128, intermediate=344, layers=2, heads=4, seq_len=128, batch_size=4, threads=1)  # 0.46M
TOLERANCE = 0.25


# ---------------------------------------------------------------------------------------------- the worker
def _control(directory: Path, k: int, case: list) -> None:
    """Rank 0 asks the driver for case ``k`` and waits until it is set; every rank then meets at a barrier."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        (directory / f"want-{k}").write_text(json.dumps(case))
        while not (directory / f"done-{k}").exists():
            time.sleep(0.05)
    dist.barrier()


def run_one(method: str, args, batches) -> dict:
    """``args.warmup`` untimed steps then ``args.steps`` timed ones of ``method`` from the seed's start."""
    import torch
    import torch.distributed as dist

    from benchlib.baselines import ddp_baseline
    from benchlib.toy import byte_llama
    from wan_worker import build_demo

    model = byte_llama(**{k: MODEL[k] for k in ("hidden", "intermediate", "layers", "heads", "seq_len")}, seed=0)
    if method == "adamw":
        net, opt = ddp_baseline(model, "adamw"), torch.optim.AdamW(model.parameters(), lr=2e-3)
    else:
        ns = argparse.Namespace(method=method, demo_settings="", topk=32, chunk=64, comm_timeout=300.0)
        net, opt = model, build_demo(ns, model, 1e-3, dist.get_world_size(), None)
    fwd_bwd = opt_step = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            fwd_bwd = opt_step = 0.0
            sent0, comm0 = _demo_totals(opt)
            start = time.perf_counter()
        ids = batches[step % len(batches)]
        t0 = time.perf_counter()
        net(input_ids=ids, labels=ids).loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        fwd_bwd += t1 - t0
        opt_step += time.perf_counter() - t1
    wall = time.perf_counter() - start
    sent1, comm1 = _demo_totals(opt)
    dist.barrier()
    n = args.steps
    return dict(step_s=wall / n, fwd_bwd_s=fwd_bwd / n, opt_s=opt_step / n, comm_s=(comm1 - comm0) / n,
                sent=(sent1 - sent0) / n)  # fmt: skip


# (collective, bytes per rank); all_reduce_pair: two all-reduces of that many bytes issued together and then
# waited for, as DDP issues its buckets; broadcast: 128 bytes from rank 0, DDP's buffers of the model here
PROBES = (
    ("all_gather", 8),
    ("all_reduce", 8),
    ("all_reduce", 1 << 20),
    ("broadcast", 128),
    ("all_reduce_pair", 1 << 20),
)


def probe(repeats: int, probes=PROBES) -> list[dict]:
    """Each of ``probes`` ``repeats`` times, each after a barrier: the median seconds on the slowest rank, and the
    TCP retransmissions and retransmission timeouts of every rank's namespace over the repeats (summed)."""
    import torch
    import torch.distributed as dist

    out = []
    for kind, nbytes in probes:
        run = _collective(kind, nbytes, dist.get_world_size())
        before, times = _tcp_counters(), []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        tcp = torch.tensor([b - a for a, b in zip(before, _tcp_counters())] + [0.0], dtype=torch.float64)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        dist.all_reduce(tcp)
        out.append(dict(kind=kind, nbytes=nbytes, seconds=statistics.median(slowest.tolist()),
                        retransmits=int(tcp[0]), timeouts=int(tcp[1])))  # fmt: skip
    return out


def _collective(kind: str, nbytes: int, world: int):
    """A function running one ``kind`` collective of ``nbytes`` per rank (:data:`PROBES`)."""
    import torch
    import torch.distributed as dist

    x, y = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)
    gathered = torch.zeros(world * x.numel())
    if kind == "all_gather":
        return lambda: dist.all_gather_into_tensor(gathered, x)
    if kind == "broadcast":
        return lambda: dist.broadcast(x, 0)
    if kind == "all_reduce_pair":
        return lambda: [w.wait() for w in (dist.all_reduce(x, async_op=True), dist.all_reduce(y, async_op=True))]
    return lambda: dist.all_reduce(x)


def _tcp_counters() -> tuple[float, float]:
    """(TCP segments retransmitted, retransmission timeouts) so far in this network namespace (/proc/net)."""

    def field(path: str, prefix: str, name: str) -> float:
        head, values = [line.split() for line in open(path) if line.startswith(prefix)][:2]
        return float(values[head.index(name)])

    return field("/proc/net/snmp", "Tcp:", "RetransSegs"), field("/proc/net/netstat", "TcpExt:", "TCPTimeouts")


def _demo_totals(opt) -> tuple[int, float]:
    stats = getattr(opt, "comm_stats", None)
    return (stats.total_bytes_sent, stats.total_seconds) if stats is not None else (0, 0.0)


def worker(args) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(MODEL["threads"])
    dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(0, 256, (MODEL["batch_size"], MODEL["seq_len"]), generator=gen) for _ in range(4)]
    control, records = Path(args.control_dir), []
    for k, (delay_ms, rate) in enumerate(json.loads(args.cases)):
        _control(control, k, [delay_ms, rate])
        if args.probes:
            probes = probe(args.probes, [("all_gather", args.probe_bytes)] if args.probe_bytes else PROBES)
            records.append(dict(delay_ms=delay_ms, rate=rate, method="probe", probes=probes,
                                load=open("/proc/loadavg").read().split()[:3]))  # fmt: skip
            if rank == 0:
                print(f"[{delay_ms} ms {rate}] probes: {probes}", flush=True)
                Path(args.out).write_text(json.dumps(records, indent=1))
        for repeat in range(args.repeats):
            for method in args.methods:
                mine = run_one(method, args, batches)
                every = [None] * dist.get_world_size()
                dist.all_gather_object(every, mine)
                records.append(dict(delay_ms=delay_ms, rate=rate, method=method, repeat=repeat, ranks=every,
                                    load=open("/proc/loadavg").read().split()[:3]))  # fmt: skip
                if rank == 0:
                    r = every[0]
                    print(f"[{delay_ms} ms {rate}] {method} #{repeat}: step {max(x['step_s'] for x in every):.3f} s "
                          f"comm {r['comm_s']:.3f} s load {records[-1]['load'][0]}", flush=True)  # fmt: skip
                    Path(args.out).write_text(json.dumps(records, indent=1))
    dist.barrier()
    from hf_demo.exchange.teardown import shutdown

    shutdown()
    return 0


# ---------------------------------------------------------------------------------------------- the driver
def drive(args) -> list[dict]:
    import delay_netns
    import netns

    try:
        delay_netns.check_available()
    except netns.NetnsUnavailable as e:
        print(f"delay_check.py: cannot emulate a cluster here: {e}. Nothing was measured.", file=sys.stderr)
        sys.exit(2)
    netns.install_signal_handlers()
    cases = [[d, r] for r in args.rates for d in args.delays_ms]
    records = []
    for nodes in args.nodes:
        records += drive_nodes(nodes, cases, args)
        Path(args.json_out).write_text(json.dumps(records, indent=1))
    return records


def drive_nodes(nodes: int, cases: list, args) -> list[dict]:
    import delay_netns

    control = Path(tempfile.mkdtemp(prefix="delay-control-"))
    out = control / "records.json"
    worker_args = [str(HERE / "delay_check.py"), "--worker", "--control-dir", str(control), "--out", str(out),
                   "--cases", json.dumps(cases), "--methods", *args.methods, "--repeats", str(args.repeats),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--probes", str(args.probes),
                   "--probe-bytes", str(args.probe_bytes)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore",
               TRANSFORMERS_VERBOSITY="error")  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(HERE.parent), os.environ.get("PYTHONPATH", "")) if x)
    started = time.time()
    if args.no_relay:  # netns's bridge: the links' rate only, no relay in the path
        import netns

        made = netns.Cluster(nodes, cases[0][1], prefix=f"dly{os.getpid()}")
    else:
        made = delay_netns.DelayedCluster(nodes, cases[0][1], cases[0][0], prefix=f"dly{os.getpid()}")
    with made as cluster:
        procs = []
        for i in range(nodes):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(i),
                   "--nproc_per_node", "1", "--master_addr", cluster.addrs[0], "--master_port", "29700",
                   *worker_args]  # fmt: skip
            log = open(control / f"node{i}.log", "w")
            procs.append(cluster.popen(i, cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(HERE.parent)))
        k = 0
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"a node failed; logs in {control}:\n" + (control / "node0.log").read_text()[-3000:])
            if time.time() - started > args.timeout:
                raise RuntimeError(f"{nodes} nodes: timed out after {args.timeout:.0f} s; logs in {control}")
            want = control / f"want-{k}"
            if want.exists():
                delay_ms, rate = json.loads(want.read_text())
                cluster.set_rate(rate)
                if not args.no_relay:
                    cluster.set_delay(delay_ms)
                print(f"== {nodes} nodes: {delay_ms} ms one way, {rate} ==\n{cluster.qdisc_report()}", flush=True)
                (control / f"done-{k}").write_text("")
                k += 1
            time.sleep(0.1)
    bad = [p.returncode for p in procs if p.returncode != 0]
    if bad or not out.exists():
        raise RuntimeError(f"{nodes} nodes: exit codes {bad}; logs in {control}")
    records = json.loads(out.read_text())
    for r in records:
        r["nodes"] = nodes
    print(f"{nodes} nodes: {len(records)} runs in {time.time() - started:.0f} s", flush=True)
    return records


# ---------------------------------------------------------------------------------------------- the planner
def summarize(records: list[dict]) -> list[dict]:
    """Per (nodes, delay, rate, method): the medians over the repeats of the run's figures (``load``: the
    load averages over its runs)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["method"] != "probe":
            groups.setdefault((r["nodes"], r["delay_ms"], r["rate"], r["method"]), []).append(r)
    out = []
    for (nodes, delay_ms, rate, method), runs in groups.items():
        step = [max(x["step_s"] for x in r["ranks"]) for r in runs]
        first = [r["ranks"][0] for r in runs]
        out.append(dict(nodes=nodes, delay_ms=delay_ms, rate=rate, method=method, runs=len(runs),
                        step_s=statistics.median(step), step_runs=step,
                        fwd_bwd_s=statistics.median(x["fwd_bwd_s"] for x in first),
                        opt_s=statistics.median(x["opt_s"] for x in first),
                        comm_s=statistics.median(min(x["comm_s"] for x in r["ranks"]) for r in runs),
                        sent=statistics.median(x["sent"] for x in first),
                        load=[float(r["load"][0]) for r in runs]))  # fmt: skip
    return out


def delayed_cluster(nodes: int, rate: str, delay_ms: float, round_trip: bool, overhead: float | None = None):
    """The planner's cluster for a case: one rank per node, ``rate`` and ``delay_ms`` between nodes; as
    ``hf-demo plan --backend gloo`` plans it (``round_trip``: a round trip per ring hop, a binomial-tree broadcast,
    two collectives at once, :class:`hf_demo.ops.links.Link`, :class:`hf_demo.ops.methods.Cluster`), or as
    ``--backend nccl`` (a latency per hop, one collective at a time)."""
    from hf_demo.ops.links import COLLECTIVE_OVERHEAD, Link, parse_rate
    from hf_demo.ops.methods import Cluster

    link = Link(parse_rate(rate), delay_ms / 1000, round_trip)
    fixed = COLLECTIVE_OVERHEAD if overhead is None else overhead
    return Cluster(nodes, 1, link, link, fixed, concurrent=2 if round_trip else 1)


def estimate(method: str, cluster, work):
    from hf_demo.ops.methods import ddp_adamw, demo_estimate
    from plan_check import demo_settings

    if method == "adamw":
        return ddp_adamw(cluster, work)
    settings = demo_settings(method, dict(topk=32, chunk=64), cluster.world, "elias_fano")
    return demo_estimate(method, method, 0, settings, cluster, work)


def plan(rows: list[dict], orthogonal: float) -> list[dict]:
    """Each summary row with the planner's step and wait beside it: ``--backend nccl``'s model (``*_one``: a
    latency per hop, one collective at a time) and ``--backend gloo``'s (the planner for these runs: a round trip
    per ring hop, a binomial-tree broadcast, DDP's buckets side by side). ``orthogonal``: the planner's
    ``orthogonal_overhead`` (one Newton-Schulz run over the hidden matrices / one forward+backward)."""
    from hf_demo.ops.methods import Workload
    from plan_check import llama_shapes

    by_case = {(r["nodes"], r["delay_ms"], r["rate"], r["method"]): r for r in rows}
    out = []
    for r in rows:
        ref = by_case[(r["nodes"], r["delay_ms"], r["rate"], "demo-bf16")]
        own = ref["opt_s"] - ref["comm_s"]  # DeMo's own optimizer compute, its collectives taken out
        work = Workload(llama_shapes(MODEL), ref["fwd_bwd_s"], own / ref["fwd_bwd_s"], orthogonal)
        got = {}
        for trips in (False, True):
            cluster = delayed_cluster(r["nodes"], r["rate"], r["delay_ms"], trips)
            est = estimate(r["method"], cluster, work)
            got[trips] = (est.step_s(cluster), est.exchange_s(cluster), est)
        est = got[True][2]
        if r["method"] == "adamw":
            note, wait = "", r["step_s"] - ref["fwd_bwd_s"] - r["opt_s"]
        else:
            exact = round(est.rank_bytes()) == round(r["sent"])
            note = "bytes exact" if exact else f"bytes: planned {est.rank_bytes():.0f}, sent {r['sent']:.0f}"
            wait = r["comm_s"]
        step, planned_wait = got[True][0], got[True][1]
        out.append(dict(r, planned_step_s=step, planned_wait_s=planned_wait, wait_s=wait, note=note,
                        planned_step_one_s=got[False][0], planned_wait_one_s=got[False][1],
                        step_error=(step - r["step_s"]) / r["step_s"],
                        step_error_one=(got[False][0] - r["step_s"]) / r["step_s"],
                        wait_error=(planned_wait - wait) / wait if wait > 0 else float("nan"),
                        wait_error_one=(got[False][1] - wait) / wait if wait > 0 else float("nan")))  # fmt: skip
    return out


def _order(r: dict) -> tuple:
    return r["nodes"], r["delay_ms"], -_bits(r["rate"]), METHODS.index(r["method"])


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| nodes | one-way delay | rate | method | step s measured (median of 3) | planned, gloo "
        "| error | planned, nccl's model | error | wait on the link s measured | planned, gloo "
        "| error | planned, nccl's model | load average (1 min) over the 3 runs | note |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in sorted(rows, key=_order):
        lines.append(
            f"| {r['nodes']} | {r['delay_ms']:g} ms | {r['rate']} | {LABELS[r['method']]} | {r['step_s']:.3f} | "
            f"{r['planned_step_s']:.3f} | {r['step_error']:+.0%} | {r['planned_step_one_s']:.3f} | "
            f"{r['step_error_one']:+.0%} | {r['wait_s']:.3f} | {r['planned_wait_s']:.3f} | {r['wait_error']:+.0%} | "
            f"{r['planned_wait_one_s']:.3f} | {' '.join(f'{x:.1f}' for x in r['load'])} | {r['note']} |"
        )
    return lines + [""] + totals(rows)


def totals(rows: list[dict]) -> list[str]:
    out = []
    for suffix, what in (("", "gloo's model (--backend gloo)"), ("_one", "nccl's model (--backend nccl)")):
        steps = [abs(r["step_error" + suffix]) for r in rows]
        waits = [abs(r["wait_error" + suffix]) for r in rows if r["wait_error" + suffix] == r["wait_error" + suffix]]
        out.append(
            f"- planned with {what}: step {sum(e <= TOLERANCE for e in steps)} of {len(steps)} within "
            f"{TOLERANCE:.0%} (median error {statistics.median(steps):.1%}); wait on the link "
            f"{sum(e <= TOLERANCE for e in waits)} of {len(waits)} (median error {statistics.median(waits):.1%})"
        )
    return out


def probe_rows(records: list[dict]) -> list[dict]:
    """The bare collectives (``--probes``): measured, and the planner's ``collective_seconds`` both ways."""
    out = []
    for r in records:
        if r["method"] != "probe":
            continue
        for p in r["probes"]:
            planned = {}
            for trips in (False, True):
                cluster = delayed_cluster(r["nodes"], r["rate"], r["delay_ms"], trips)
                planned[trips] = planned_probe(p["kind"], p["nbytes"], cluster)
            out.append(dict(nodes=r["nodes"], delay_ms=r["delay_ms"], rate=r["rate"], kind=p["kind"],
                            nbytes=p["nbytes"], measured=p["seconds"], round_trip=planned[True],
                            one=planned[False], load=r["load"][0], retransmits=p.get("retransmits"),
                            timeouts=p.get("timeouts")))  # fmt: skip
    return out


def planned_probe(kind: str, nbytes: int, cluster) -> float:
    """The planner's seconds for a probe: one collective, or (``all_reduce_pair``) two issued together, planned as
    DDP's buckets are (:class:`hf_demo.ops.methods.Estimate`, side by side where ``cluster.concurrent`` allows)."""
    from hf_demo.ops.methods import Estimate
    from hf_demo.ops.traffic import Collective

    if kind == "all_reduce_pair":
        pair = [Collective(f"b{i}", "all_reduce", nbytes, cluster.nodes, "inter", overlaps=True) for i in (0, 1)]
    else:
        pair = [Collective("probe", kind, nbytes, cluster.nodes, "inter")]
    return Estimate("probe", "probe", pair, 0.0, 0.0, 0.0, 0).exchange_s(cluster)


def probe_table(rows: list[dict]) -> list[str]:
    lines = [
        "| nodes | one-way delay | rate | collective | bytes per rank | measured s (median) | planned, gloo "
        "| planned, nccl's hops | measured / one-way delay | TCP retransmits, timeouts | load average |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["nodes"], r["delay_ms"], -_bits(r["rate"]), r["kind"], r["nbytes"])):
        per = f"{r['measured'] / (r['delay_ms'] / 1000):.1f}" if r["delay_ms"] else "-"
        tcp = "-" if r.get("retransmits") is None else f"{r['retransmits']}, {r['timeouts']}"
        lines.append(
            f"| {r['nodes']} | {r['delay_ms']:g} ms | {r['rate']} | {r['kind']} | {r['nbytes']} | "
            f"{r['measured']:.4f} | {r['round_trip']:.4f} | {r['one']:.4f} | {per} | {tcp} | {r['load']} |"
        )
    return lines


def _bits(rate: str) -> float:
    from hf_demo.ops.links import parse_rate

    return parse_rate(rate)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--delays-ms", type=float, nargs="+", default=[20.0, 50.0])
    p.add_argument("--rates", nargs="+", default=["20mbit", "1gbit"])
    p.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    p.add_argument("--probes", type=int, default=0, help="time each bare collective (PROBES) this many times per case")
    p.add_argument("--no-relay", action="store_true", help="netns.py's bridge instead (rate only: --delays-ms 0)")
    p.add_argument("--probe-bytes", type=int, default=0, help="probe only an all-gather of this many bytes per rank")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="timed steps per run (a multiple of 4: the presets' period)")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per node count")
    p.add_argument("--json-out", default=str(HERE / "results" / "delay_check.json"))
    p.add_argument("--out", default=str(HERE / "results" / "delay_check.md"))
    p.add_argument("--from-json", default=None, help="redo the tables from recorded runs")
    p.add_argument(
        "--orthogonal-overhead",
        type=float,
        default=None,
        help="the planner's Newton-Schulz share for the presets (default: plan_check's, recorded or measured here)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--control-dir", help=argparse.SUPPRESS)
    p.add_argument("--cases", help=argparse.SUPPRESS)
    args, _ = p.parse_known_args(argv)
    if args.worker:
        return worker(args)
    if args.no_relay and any(args.delays_ms):
        p.error("--no-relay has no delay to set: give --delays-ms 0")
    if args.steps % 4:
        p.error(f"--steps must be a multiple of 4 (the from_scratch_few_bytes period), not {args.steps}")
    records = json.loads(Path(args.from_json).read_text()) if args.from_json else drive(args)
    probes = probe_rows(records)
    text = ["## Bare collectives", ""] + probe_table(probes) + [""] if probes else []
    if args.orthogonal_overhead is None:
        from plan_check import orthogonal_overhead_of

        args.orthogonal_overhead = orthogonal_overhead_of(MODEL)
    print(f"orthogonal_overhead given to the planner: {args.orthogonal_overhead:.3f}", flush=True)
    rows = plan(summarize(records), args.orthogonal_overhead)
    text += (["## Training steps", ""] + table(rows)) if rows else []
    text += ["", f"The planner's orthogonal_overhead (presets): {args.orthogonal_overhead:.3f}."] if rows else []
    Path(args.out).write_text(HEAD + "\n".join(text) + "\n")
    print("\n".join(text))
    return 0


HEAD = """# The planner against a network with real delay (generated by benchmarks/delay_check.py)

Every byte between nodes held for the one-way delay by a TCP relay between network namespaces
(benchmarks/delay_relay.py, benchmarks/delay_netns.py), every link rate-limited by tc tbf; gloo untouched. The
planner is given DeMo defaults' compute measured in the same case, the default fixed cost per collective, the
nominal rate and the delay, and plans gloo (`--backend gloo`: a round trip per ring hop, a binomial-tree broadcast,
DDP's buckets two at a time) beside NCCL's model (`--backend nccl`: a latency per hop, one collective at a time).
Wait on the link: DeMo's time in its collectives; DDP-AdamW's step less its compute.

"""


if __name__ == "__main__":
    sys.exit(main())
