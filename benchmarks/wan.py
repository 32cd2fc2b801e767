"""Emulated multi-node training over slow links: DeMo vs DDP-AdamW vs DDP-AdamW + PowerSGD.

For each configuration ``NODES:RATE`` (default ``2:1gbit,2:100mbit,2:20mbit``) this script builds an emulated
cluster with :mod:`netns` (one network namespace per node on a bridge, every link limited to RATE in both
directions with tc tbf/htb), then runs the same training job (``wan_worker.py``: a byte-level Llama on the
Python stdlib sources, fixed seed and data order, one shard per rank) once per method, each node started with
``torchrun --nnodes NODES --node_rank i --master_addr 198.18.0.1`` inside its namespace and gloo talking over
the rate-limited veth (``GLOO_SOCKET_IFNAME=eth0``). Then it tears the cluster down.

Outputs (``--out-dir``, default ``benchmarks/results``): ``wan_runs.json`` (every run's raw record, written
after each run, so an interrupted sweep keeps what finished), ``wan.md`` (tables), ``wan_eval_loss.png``
(eval loss vs training wall time, one line per method, one panel per configuration).

Needs Linux, root, ``ip`` and ``tc``: otherwise it says what is missing and exits with status 2; it never
reports a result it did not measure. No netem in this kernel: ``--delay-ms`` adds latency in the application
(see ``wan_worker.py``). Every namespace and qdisc it creates is removed on exit, on an exception and on
SIGINT/SIGTERM/SIGHUP; after a SIGKILL run ``--cleanup-stale`` (or ``ip netns list``) to find the leftovers.

    sudo .venv/bin/python benchmarks/wan.py                                # 2 nodes x 3 speeds x 4 methods
    sudo .venv/bin/python benchmarks/wan.py --configs 4:100mbit --append   # add 4 nodes at 100 Mbit/s
    .venv/bin/python benchmarks/wan.py --report-only                       # redo tables/plot from the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import netns  # noqa: E402
from wan_worker import METHODS  # noqa: E402 - the worker's list of methods is the one list

DEFAULT_METHODS = "demo-bf16,demo-allreduce,demo-overlap,demo-sync8,demo-policy,adamw,powersgd"
LABELS = {
    "demo-bf16": "DeMo bf16",
    "demo-sign": "DeMo sign",
    "demo-allreduce": "DeMo all_reduce",
    "demo-allreduce-wide": "DeMo all_reduce, top-k x W/2",
    "demo-overlap": "DeMo overlap",
    "demo-sync8": "DeMo sync every 8",
    "demo-sync8-sign": "DeMo sign, sync every 8",
    "demo-policy": "DeMo policy (budget 0.15)",
    "demo-policy30": "DeMo policy (budget 0.3)",
    "demo-hsdp": "HSDP-DeMo (FSDP2 in a node)",
    "demo-scratch": "DeMo from_scratch preset",
    "demo-scratch-few": "DeMo from_scratch_few_bytes preset",
    "adamw": "DDP AdamW",
    "powersgd": "DDP PowerSGD r4",
    "muon": "DDP Muon",
}

COLORS = {
    "demo-bf16": "tab:blue",
    "demo-sign": "tab:cyan",
    "demo-allreduce": "tab:green",
    "demo-allreduce-wide": "darkgreen",
    "demo-overlap": "tab:purple",
    "demo-sync8": "tab:brown",
    "demo-sync8-sign": "tab:olive",
    "demo-policy": "tab:pink",
    "demo-policy30": "tab:olive",
    "demo-hsdp": "tab:gray",
    "demo-scratch": "navy",
    "demo-scratch-few": "teal",
    "adamw": "tab:red",
    "powersgd": "tab:orange",
    "muon": "maroon",
}

# Scenarios (issue 12): the link's rate over time (seconds from the first training step), links that drop,
# latency with a random distribution (in the application: this kernel has no netem).
SCENARIOS = {
    "changing": dict(
        rate="1gbit",
        events=[(10.0, "rate", "20mbit"), (30.0, "rate", "100mbit")],
        about="1 Gbit/s, at 10 s 20 Mbit/s, at 30 s 100 Mbit/s (the issue's example)",
    ),
    "harsh": dict(
        rate="1gbit",
        events=[(10.0, "rate", "500kbit"), (45.0, "rate", "2mbit")],
        about="1 Gbit/s, at 10 s 500 kbit/s, at 45 s 2 Mbit/s (meant to bind DeMo; at ~2 s steps the 256 KiB "
        "token bucket refills 125 kB per step, more than DeMo bf16's 111 kB, so it did not)",
    ),
    "choke": dict(
        rate="1gbit",
        events=[(8.0, "rate", "200kbit"), (50.0, "rate", "2mbit")],
        about="1 Gbit/s, at 8 s 200 kbit/s, at 50 s 2 Mbit/s (below DeMo bf16's payload per step time)",
    ),
    "sustained": dict(
        rate="1gbit",
        events=[(8.0, "rate", "200kbit")],
        about="1 Gbit/s, at 8 s 200 kbit/s to the end (a link that degrades and stays so: what a policy is for)",
    ),
    "drop": dict(
        rate="100mbit",
        events=[(10.0, "down", 1), (16.0, "up", 1)],
        about="100 Mbit/s; node 1's switch port down at 10 s for 6 s (every connection of node 1 stalls)",
    ),
    "jitter": dict(
        rate="100mbit",
        delay_dist="lognormal:20:1.0",
        about="100 Mbit/s plus an application-level latency per ring hop before each collective, lognormal "
        "(median 20 ms, sigma 1.0: mean 33 ms, 1% of draws above 200 ms), drawn per rank and collective",
    ),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--configs",
        default="2:1gbit,2:100mbit,2:20mbit",
        help="comma-separated NODES[xPROCS]:RATE (tc units: gbit, mbit, kbit; 'none' = unlimited veth; PROCS "
        "processes per node, LOCAL_WORLD_SIZE for demo-hsdp)",
    )
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated, of: {', '.join(METHODS)}")
    p.add_argument(
        "--lrs",
        default="",
        help="comma-separated method=lr for some methods (e.g. demo-bf16=3e-3); after any '-- --lr', so they win",
    )
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=8)
    p.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default=None,
        help="a changing-network scenario instead of fixed rates (then --configs gives only the node counts)",
    )
    p.add_argument(
        "--delay-dist",
        default="",
        help="random application-level latency per ring hop, see wan_worker.py (e.g. lognormal:20:1.0)",
    )
    p.add_argument(
        "--target-loss",
        type=float,
        default=3.2,
        help="held-out loss for 'time to target' (first evaluation at or below it)",
    )
    p.add_argument("--shaper", choices=("tbf", "htb"), default="tbf")
    p.add_argument(
        "--delay-ms",
        type=float,
        default=0.0,
        help="application-level latency per ring hop (no netem here), see wan_worker.py",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--prices", default=str(HERE / "prices.toml"), help="price table for the cost section")
    p.add_argument("--append", action="store_true", help="add to an existing wan_runs.json instead of replacing")
    p.add_argument("--report-only", action="store_true", help="only rebuild wan.md / the plot from the JSON")
    p.add_argument(
        "--cleanup-stale",
        action="store_true",
        help=f"delete namespaces named {netns.DEFAULT_PREFIX}* left by a killed run, then exit",
    )
    p.add_argument("--port", type=int, default=29555)
    p.add_argument("--run-timeout", type=float, default=1800, help="seconds per (config, method) run")
    p.add_argument(
        "worker_args",
        nargs=argparse.REMAINDER,
        help="after '--': extra wan_worker.py options (e.g. -- --hidden 128 --batch-size 4)",
    )
    return p.parse_args(argv)


def parse_configs(s: str) -> list[tuple[int, int, str | None]]:
    out = []
    for item in s.split(","):
        n, rate = item.strip().split(":")
        n, _, procs = n.partition("x")
        out.append((int(n), int(procs or 1), None if rate in ("none", "inf", "") else rate))
    return out


def config_key(n: int, rate: str | None, procs: int = 1, scenario: str | None = None) -> str:
    nodes = f"{n}x{procs}" if procs > 1 else f"{n}"
    return f"{nodes}:{scenario}" if scenario else f"{nodes}:{rate or 'none'}"


def load_avg() -> list[str]:
    try:
        return open("/proc/loadavg").read().split()[:3]
    except OSError:
        return []


class Schedule(threading.Thread):
    """Applies a scenario's events to the cluster at their times, counted from the first training step
    (the worker writes the progress file when it starts it)."""

    def __init__(self, cluster: netns.Cluster, events: list, progress: Path):
        super().__init__(daemon=True)
        self.cluster, self.events, self.progress = cluster, events, progress
        self.stop = threading.Event()
        self.log: list[dict] = []
        self.error: str | None = None

    def run(self):
        try:
            while not self.progress.exists() or not self.progress.read_text().strip():
                if self.stop.wait(0.1):
                    return
            t0 = float(self.progress.read_text().split()[0])
            for t, kind, arg in self.events:
                if self.stop.wait(max(0.0, t0 + t - time.time())):
                    return
                if kind == "rate":
                    self.cluster.set_rate(arg)
                elif kind in ("down", "up"):
                    self.cluster.set_link(arg, kind == "up")
                self.log.append(dict(t=time.time() - t0, planned=t, kind=kind, arg=arg))
                print(f"   [schedule] t={time.time() - t0:6.2f}s {kind} {arg}", flush=True)
        except Exception as e:  # reported with the run; the run itself goes on
            self.error = repr(e)


# ------------------------------------------------------------------ running
def run_method(
    cluster: netns.Cluster,
    method: str,
    args,
    out_json: Path,
    logdir: Path,
    port: int,
    procs_per_node: int = 1,
    scenario: dict | None = None,
) -> dict:
    progress = out_json.with_suffix(".started")
    progress.unlink(missing_ok=True)
    delay_dist = (scenario or {}).get("delay_dist", args.delay_dist)
    worker = [
        str(HERE / "wan_worker.py"),
        "--method",
        method,
        "--out",
        str(out_json),
        "--steps",
        str(args.steps),
        "--eval-every",
        str(args.eval_every),
        "--threads",
        str(args.threads),
        "--delay-ms",
        str(args.delay_ms),
        "--progress-file",
        str(progress),
    ]
    if delay_dist:
        worker += ["--delay-dist", delay_dist]
    extra = [a for a in args.worker_args if a != "--"]
    lrs = dict(item.split("=", 1) for item in args.lrs.split(",") if item)
    if method in lrs:
        extra += ["--lr", lrs[method]]
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(args.threads),
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        PYTHONWARNINGS="ignore",
    )
    # the workers import hf_demo from this checkout (ip netns exec keeps the environment we pass)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(HERE.parent), os.environ.get("PYTHONPATH", "")) if x)
    procs, logs = [], []
    sched = Schedule(cluster, (scenario or {}).get("events", []), progress) if scenario else None
    t0 = time.time()
    for i in range(cluster.n):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(cluster.n),
            "--node_rank",
            str(i),
            "--nproc_per_node",
            str(procs_per_node),
            "--master_addr",
            cluster.addrs[0],
            "--master_port",
            str(port),
            *worker,
            *extra,
        ]
        log = open(logdir / f"{method}-node{i}.log", "w")
        logs.append(log)
        procs.append(cluster.popen(i, cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(HERE.parent)))
    if sched:
        sched.start()
    failed = None
    try:
        deadline = time.time() + args.run_timeout
        while any(p.poll() is None for p in procs):
            bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                failed = f"node(s) {bad} exited with {[procs[i].returncode for i in bad]}"
                break
            if time.time() > deadline:
                failed = f"timed out after {args.run_timeout:.0f}s"
                break
            time.sleep(0.5)
        if failed is None:
            bad = [i for i, p in enumerate(procs) if p.returncode != 0]
            if bad:
                failed = f"node(s) {bad} exited with {[procs[i].returncode for i in bad]}"
    finally:
        if sched:
            sched.stop.set()
            sched.join(5)
        for p in procs:
            netns.kill_tree(p)
            cluster.forget(p)
        for log in logs:
            log.close()
        if scenario:  # back to the scenario's start for the next method
            for i in range(cluster.n):
                cluster.set_link(i, True)
            cluster.set_rate(scenario["rate"])
    wall = time.time() - t0
    if failed or not out_json.exists():
        tail = (logdir / f"{method}-node0.log").read_text()[-3000:]
        raise RuntimeError(
            f"{method} on {cluster.n} nodes @ {cluster.rate}: {failed or 'no result'}\n"
            f"--- node 0 log tail ({logdir}) ---\n{tail}"
        )
    rec = json.loads(out_json.read_text())
    rec["launch_wall_s"] = wall
    if sched:
        rec["schedule_log"] = sched.log
        rec["schedule_error"] = sched.error
    return rec


def sweep(args) -> None:
    try:
        netns.check_available()
    except netns.NetnsUnavailable as e:
        print(f"wan.py: cannot emulate a cluster on this machine: {e}. Nothing was measured.", file=sys.stderr)
        sys.exit(2)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs_path = out_dir / "wan_runs.json"
    runs = json.loads(runs_path.read_text()) if args.append and runs_path.exists() else []
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    logdir = Path(tempfile.mkdtemp(prefix="wan-logs-"))
    print(f"logs: {logdir}", flush=True)
    port = args.port
    netns.install_signal_handlers()
    scenario = SCENARIOS[args.scenario] if args.scenario else None
    cluster = None
    for n, procs, rate in parse_configs(args.configs):
        if scenario:
            rate = scenario["rate"]
        cluster = netns.Cluster(n, rate, args.shaper)
        key = config_key(n, rate, procs, args.scenario)
        try:
            cluster.setup()
            print(f"== {key} ({args.shaper}) ==\n{cluster.qdisc_report()}", flush=True)
            for method in methods:
                if method == "demo-hsdp" and procs < 2:
                    print("   demo-hsdp needs NODESxPROCS with PROCS >= 2: skipped", flush=True)
                    continue
                port += 1
                out_json = logdir / f"{key.replace(':', '-')}-{method}.json"
                t0 = time.time()
                load0 = load_avg()
                try:
                    rec = run_method(cluster, method, args, out_json, logdir, port, procs, scenario)
                except RuntimeError as e:
                    print(f"FAILED: {e}", file=sys.stderr, flush=True)
                    rec = dict(method=method, world=n * procs, failed=str(e).split("\n")[0])
                rec.update(
                    config=key,
                    nodes=n,
                    procs_per_node=procs,
                    rate=rate,
                    scenario=args.scenario,
                    shaper=args.shaper,
                    delay_ms=args.delay_ms,
                    delay_dist=(scenario or {}).get("delay_dist", args.delay_dist),
                    target_loss=args.target_loss,
                    load_before=load0,
                    load_after=load_avg(),
                    when=time.strftime("%Y-%m-%d %H:%M:%S"),
                )
                runs = [
                    r
                    for r in runs
                    if not (
                        r.get("config") == rec["config"]
                        and r["method"] == method
                        and r.get("delay_ms", 0) == args.delay_ms
                        and r.get("delay_dist", "") == rec["delay_dist"]
                    )
                ] + [rec]
                runs_path.write_text(json.dumps(runs, indent=1))
                print(f"   {method}: {time.time() - t0:.0f}s load {rec['load_after']}", flush=True)
        finally:
            cluster.close()
    left = netns.list_namespaces(cluster.prefix) if cluster else []
    print(f"namespaces left with prefix {cluster.prefix if cluster else '-'}: {left or 'none'}", flush=True)


# ------------------------------------------------------------------ report
def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def summarize(rec: dict, target: float) -> dict:
    if rec.get("failed"):
        return dict(failed=rec["failed"])
    ranks = rec["ranks"]
    nsteps = len(ranks[0]["steps"])
    # a step ends when the slowest rank is done; the ranks are in lockstep, so take the per-step max
    step_times = [max(r["steps"][i]["time"] for r in ranks) for i in range(nsteps)]
    # bytes per step: mean over ranks, median over steps (PowerSGD's first 2 steps are plain all-reduces);
    # sync-every-H moves bytes on one step in H: the mean over steps is the amortised figure
    tx_steps = [sum(r["steps"][i]["tx"] for r in ranks) / len(ranks) for i in range(nsteps)]
    rx_steps = [sum(r["steps"][i]["rx"] for r in ranks) / len(ranks) for i in range(nsteps)]
    ev = rec["evals"]
    hit = next((e for e in ev if e["loss"] <= target), None)
    interp = None  # step and training time at the target, linear between the two evaluations around it
    for a, b in zip(ev, ev[1:]):
        if a["loss"] > target >= b["loss"]:
            f = (a["loss"] - target) / (a["loss"] - b["loss"])
            interp = (
                a["step"] + f * (b["step"] - a["step"]),
                a["train_time"] + f * (b["train_time"] - a["train_time"]),
            )
            break
    s = dict(
        steps=nsteps,
        world=rec["world"],
        step_s=median(step_times),
        mean_step_s=sum(step_times) / nsteps,
        train_s=rec["evals"][-1]["train_time"],
        wall_s=ranks[0]["steps"][-1].get("wall"),
        final_loss=rec["evals"][-1]["loss"],
        tx_per_step=median(tx_steps),
        rx_per_step=median(rx_steps),
        tx_mean=sum(tx_steps) / nsteps,
        rx_mean=sum(rx_steps) / nsteps,
        n_params=rec["n_params"],
        t_target=hit["train_time"] if hit else None,
        step_target=hit["step"] if hit else None,
        step_target_interp=interp[0] if interp else None,
        t_target_interp=interp[1] if interp else None,
        tokens_per_step=rec["world"] * rec["args"]["batch_size"] * rec["args"]["seq_len"],
        train_tokens=rec["data"]["train_bytes"],
        delay_s=sum(x.get("delay_s", 0.0) for x in ranks[0]["steps"]),
    )
    if "demo_total" in rec:
        st = [r["steps"] for r in ranks]
        s["app_sent"] = median([x["app_sent"] for x in st[0]])
        s["app_sent_mean"] = sum(x["app_sent"] for x in st[0]) / nsteps
        s["app_received"] = median([x["app_received"] for x in st[0]])
        s["comm_s"] = median([x["comm_s"] for x in st[0]])
        # waiting: the largest over ranks of the time in DeMo's collectives (the app-level latency a rank
        # sleeps before a collective is outside that clock on the sleeper but inside on the others)
        s["wait_s"] = max(sum(x["comm_s"] for x in r) for r in st)
        s["opt_s"] = median([x["opt_step"] for x in st[0]])
        s["compute_s"] = median([x["fwd_bwd"] + x["opt_step"] - x["comm_s"] for x in st[0]])
        tiers = [x.get("tier", 0) for x in st[0]]
        s["tiers"] = tiers
        s["tier_steps"] = {t: tiers.count(t) for t in sorted(set(tiers))}
    s["fwd_bwd_s"] = median([x["fwd_bwd"] for x in ranks[0]["steps"]])
    s["opt_step_s"] = median([x["opt_step"] for x in ranks[0]["steps"]])
    s["step_times"] = step_times
    return s


def fmt_bytes(b):
    return f"{b / 1e6:.2f} MB" if b >= 1e5 else f"{b / 1e3:.1f} kB"


def ratio(a, b):
    return f"{a / b:.3g}×" if a is not None and b else "n/a"


def pct(a, b):
    return f"{100 * (a - b) / b:+.2f}%" if a is not None and b else "n/a"


def load_prices(path: Path) -> dict:
    from hf_demo.ops.prices import read_toml

    return read_toml(path)


def ddp_wait(s: dict, ref: dict | None) -> float | None:
    """DDP's time waiting on the network, estimated: the part of each step above the compute-only step time
    (DeMo bf16's fwd+bwd+opt minus its collectives, same configuration) plus AdamW's own step."""
    if ref is None or "compute_s" not in ref:
        return None
    c = ref["compute_s"]
    return sum(max(0.0, t - c) for t in s["step_times"])


def report(args) -> None:
    out_dir = Path(args.out_dir)
    runs = json.loads((out_dir / "wan_runs.json").read_text())
    prices = load_prices(Path(args.prices))
    any_rec = next(r for r in runs if not r.get("failed"))
    a = any_rec["args"]
    loads = [x for r in runs for x in (r.get("load_before"), r.get("load_after")) if x]
    lines = ["# Emulated multi-node training (generated by benchmarks/wan.py)", ""]
    lines += [
        f"Model: byte-level Llama, hidden {a['hidden']}, {a['layers']} layers, {a['heads']} heads, MLP "
        f"{a['intermediate']}, {any_rec['n_params'] / 1e6:.2f}M parameters; {a['batch_size']} windows × "
        f"{a['seq_len']} bytes per rank per step; {a['steps']} steps, eval every {a['eval_every']} "
        f"steps on {any_rec['data']['eval_windows']} held-out windows; {a['threads']} torch thread(s) per "
        f"rank; target eval loss {args.target_loss}.",
        "",
        f"Machine: {os.cpu_count()} CPU cores shared with other jobs, no GPU; every emulated node is a network "
        f"namespace on this one machine, so all nodes share these cores. Load average (1 min) when the runs "
        f"started/ended: {min(float(x[0]) for x in loads):.1f} to {max(float(x[0]) for x in loads):.1f} "
        "(per run in wan_runs.json): the step times carry that noise (a rank descheduled for a moment is a "
        "slow step for everyone), so compare within a configuration, and read differences under ~20% in step "
        "time as noise.",
        "",
        "Columns: **step s** median wall time of one training step (forward+backward+optimizer, slowest "
        "rank); **fwd+bwd s**, **opt s** its two parts on rank 0 (medians; DDP's all-reduce happens inside "
        "the backward pass, DeMo's exchange inside the optimizer step, its time in collectives in brackets); "
        "**waiting s** total over the run of the time in DeMo's collectives (largest rank; for DDP an "
        "estimate: step time above DeMo bf16's compute-only step in the same configuration, marked ≈); "
        "**to target** training wall time (evaluation excluded) until the first evaluation at or "
        "below the target loss, with that step; **interp.** the same, linearly interpolated between the two "
        "evaluations around the target; **final** held-out loss after the last step; **sent / "
        "received per step** bytes on the node's interface per rank per step (wire bytes: TCP/IP "
        "headers and gloo framing included; median over steps, or the mean for sync-every-H which sends on one "
        "step in H); DeMo's own payload count (`comm_stats.bytes_sent`, same statistic) in brackets.",
        "",
    ]
    fixed = [r for r in runs if not r.get("scenario")]
    scen = [r for r in runs if r.get("scenario")]
    configs = []
    for r in fixed:
        key = (r["nodes"], r.get("procs_per_node", 1), r["rate"], r.get("delay_ms", 0.0))
        if key not in configs:
            configs.append(key)
    configs.sort(key=lambda k: (k[3], k[1], k[0], -netns.parse_rate(k[2]) if k[2] else float("-inf")))
    plot_items, summary, cost_rows = [], {}, []
    for nodes, procs, rate, delay in configs:
        recs = {
            r["method"]: r
            for r in fixed
            if (r["nodes"], r.get("procs_per_node", 1), r["rate"], r.get("delay_ms", 0.0))
            == (nodes, procs, rate, delay)
        }
        target = args.target_loss
        sums = {m: summarize(r, target) for m, r in recs.items()}
        where = f"{nodes} nodes × {procs} processes" if procs > 1 else f"{nodes} nodes"
        title = f"{where}, {rate or 'unlimited'} per link" + (f", +{delay:g} ms/hop (app-level)" if delay else "")
        ref = sums.get("demo-bf16") if not sums.get("demo-bf16", {}).get("failed") else None
        lines += [
            f"## {title}",
            "",
            "| method | step s | fwd+bwd s | opt s | waiting s | to target s (step) | interp. s (step) | final eval "
            "loss | sent / step | received / step |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for m in METHODS:
            if m not in sums:
                continue
            s = sums[m]
            if s.get("failed"):
                lines.append(f"| {LABELS[m]} | failed: {s['failed']} | | | | | | | | |")
                continue
            tt = f"{s['t_target']:.1f} ({s['step_target']})" if s["t_target"] is not None else "not reached"
            sync = m.startswith("demo-sync")
            app = f" [{fmt_bytes(s['app_sent_mean'] if sync else s['app_sent'])}]" if "app_sent" in s else ""
            ti = (
                f"{s['t_target_interp']:.1f} ({s['step_target_interp']:.1f})"
                if s["t_target_interp"] is not None
                else "n/a"
            )
            comm = f" ({s['comm_s']:.3f})" if "comm_s" in s else ""
            if "wait_s" in s:
                wait = f"{s['wait_s']:.1f}"
            else:
                w = ddp_wait(s, ref)
                wait = f"≈{w:.1f}" if w is not None else "n/a"
            tx, rx = (s["tx_mean"], s["rx_mean"]) if sync else (s["tx_per_step"], s["rx_per_step"])
            tiers = ""
            if m.startswith("demo-policy"):
                tiers = " (tiers: " + ", ".join(f"{t}: {c} steps" for t, c in s["tier_steps"].items()) + ")"
            lines.append(
                f"| {LABELS[m]}{tiers} | {s['step_s']:.3f} | {s['fwd_bwd_s']:.3f} | {s['opt_step_s']:.3f}{comm} | "
                f"{wait} | {tt} | {ti} | {s['final_loss']:.4f} | "
                f"{fmt_bytes(tx)}{app} | {fmt_bytes(rx)} |"
            )
            cost_rows.append((title, nodes, m, s))
        lines += [
            "",
            "| ratio | step time | time to target (interp.) | final loss | bytes sent / step |",
            "|---|---:|---:|---:|---:|",
        ]
        demos = [m for m in METHODS if m.startswith("demo") and m in sums and not sums[m].get("failed")]
        for d in demos:
            bases = ["adamw", "powersgd"] + (["demo-bf16"] if d != "demo-bf16" else [])
            for base in bases:
                if base in sums and not sums[base].get("failed"):
                    sd, sb = sums[d], sums[base]
                    txd = sd["tx_mean"] if d.startswith("demo-sync") else sd["tx_per_step"]
                    txb = sb["tx_per_step"]
                    lines.append(
                        f"| {LABELS[d]} / {LABELS[base]} | {ratio(sd['step_s'], sb['step_s'])} | "
                        f"{ratio(sd['t_target_interp'], sb['t_target_interp'])} | "
                        f"{pct(sd['final_loss'], sb['final_loss'])} | {ratio(txd, txb)} |"
                    )
        # the 15-minute figure shows a machine still busy from an earlier job, which the 1-minute one hides
        before = [
            f"{LABELS[m]} {'/'.join(recs[m]['load_before'])}" for m in METHODS if m in recs and "load_before" in recs[m]
        ]
        if before:
            lines += ["", "Load average (1/5/15 min) before each method, its predecessors' ranks included: "]
            lines[-1] += "; ".join(before) + "."
        lines.append("")
        plot_items.append((title, recs, target))
        summary[title] = {m: {k: v for k, v in s.items() if k not in ("step_times", "tiers")} for m, s in sums.items()}
    lines += scenario_report(scen, args, summary)
    lines += cost_report(cost_rows, prices, args)
    (out_dir / "wan.md").write_text("\n".join(lines))
    (out_dir / "wan_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print("\n".join(lines))
    if plot_items:
        plot(plot_items, out_dir / "wan_eval_loss.png")
    if scen:
        plot_scenarios(scen, out_dir / "wan_scenarios.png", args.target_loss)


def scenario_report(scen: list, args, summary: dict) -> list[str]:
    if not scen:
        return []
    lines = [
        "# Changing networks (issue 12)",
        "",
        "Each scenario starts the cluster at its first rate; the parent process changes every link's tc qdisc "
        "(`tc qdisc change`) or takes a node's switch port down (`ip link set p1 down`, then up) at the given "
        "times, counted from the first training step of each run (the worker writes a file when it starts "
        "it); every method sees the same timeline. This kernel has no netem: latency and jitter are added in "
        "the application, by sleeping before each collective (DeMo: "
        "`hf_demo.exchange.transport.register_collective_hook`; "
        "DDP: `torch.distributed.all_reduce` wrapped) for a random draw per rank and collective times the "
        "ring hops ((W-1) per DeMo collective, 2(W-1) per all-reduce). **wall s**: from the first step to the "
        "end of the last one (evaluations included, the same 4 batches for every method); **train s** the "
        "same without evaluations; **waiting s** DeMo's time in its collectives (largest rank; DDP: ≈ estimate "
        "as above, from DeMo bf16's compute time in the same scenario); **slept s** the application-level "
        "latency rank 0 slept; **tiers** steps spent in each tier of the policy (0 bf16 top-32, 1 sign, "
        "2 sign top-16, 3 sign top-8, 4/5/6/7 sign top-32/16/8/4 synchronising every 8 steps; "
        "hf_demo.optim.policy).",
        "",
    ]
    names = list(dict.fromkeys(r["scenario"] for r in scen))
    for name in names:
        recs = {r["method"]: r for r in scen if r["scenario"] == name}
        sums = {m: summarize(r, args.target_loss) for m, r in recs.items()}
        nodes = next(iter(recs.values()))["nodes"]
        about = SCENARIOS.get(name, {}).get("about", name)
        lines += [
            f"## Scenario `{name}`, {nodes} nodes: {about}",
            "",
            "| method | wall s | train s | median step s | waiting s | slept s | final eval loss | tiers | link "
            "events applied (s) |",
            "|---|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        ref = sums.get("demo-bf16") if not sums.get("demo-bf16", {}).get("failed") else None
        for m in METHODS:
            if m not in sums:
                continue
            s = sums[m]
            if s.get("failed"):
                lines.append(f"| {LABELS[m]} | failed: {s['failed']} | | | | | | | |")
                continue
            w = s.get("wait_s")
            wait = f"{w:.1f}" if w is not None else (f"≈{ddp_wait(s, ref):.1f}" if ref else "n/a")
            tiers = ", ".join(f"{t}: {c}" for t, c in s.get("tier_steps", {}).items()) or "-"
            ev = ", ".join(f"{e['kind']} {e['arg']} @{e['t']:.1f}" for e in recs[m].get("schedule_log", []))
            lines.append(
                f"| {LABELS[m]} | {s['wall_s']:.1f} | {s['train_s']:.1f} | {s['step_s']:.3f} | {wait} | "
                f"{s['delay_s']:.1f} | {s['final_loss']:.4f} | {tiers} | {ev or '-'} |"
            )
        for policy in [m for m in sums if m.startswith("demo-policy") and not sums[m].get("failed") and ref]:
            sp, sf = sums[policy], ref
            lines += [
                "",
                f"{LABELS[policy]} / fixed default (DeMo bf16): wall time {ratio(sp['wall_s'], sf['wall_s'])}, "
                f"training time {ratio(sp['train_s'], sf['train_s'])}, "
                f"final loss {pct(sp['final_loss'], sf['final_loss'])} "
                "(issue 12 target: <= 0.6× wall time with final loss within 2%).",
            ]
        if "adamw" in sums and not sums["adamw"].get("failed") and ref:
            lines.append(
                f"DeMo bf16 / DDP AdamW: wall time {ratio(ref['wall_s'], sums['adamw']['wall_s'])}, final loss "
                f"{pct(ref['final_loss'], sums['adamw']['final_loss'])}."
            )
        lines.append("")
        summary[f"scenario {name}"] = {
            m: {k: v for k, v in s.items() if k not in ("step_times", "tiers")} for m, s in sums.items()
        }
    return lines


def cost_report(rows, prices: dict, args) -> list[str]:
    node_h = float(prices["compute"]["node_per_hour"])
    per_gb = float(prices["traffic"]["per_gb"])
    cur = prices.get("currency", "USD")
    lines = [
        "# Iteration time and cost",
        "",
        f"Prices from `{Path(args.prices).name}` (edit it and run `wan.py --report-only`): compute "
        f"{node_h:g} {cur} per node-hour ({prices['compute'].get('what', '')}), inter-site traffic {per_gb:g} "
        f"{cur} per GB ({prices['traffic'].get('what', '')}). One **epoch** = one pass over the training "
        "bytes (byte-level model: 1 byte = 1 token), i.e. train bytes / (W × batch × seq) steps. Time = steps × "
        "the median step time measured above (this 2-core CPU machine, shared: the compute part is this "
        "machine's, not a GPU's). Traffic = bytes leaving every node (wire tx per step summed over nodes; the "
        "HSDP mode's intra-node traffic does not cross sites). Cost = nodes × hours × node price + "
        "GB × traffic price.",
        "",
        "| configuration | method | step s | tokens / step | epoch h | traffic / epoch GB | cost / epoch "
        f"({cur}) | of which traffic | cost / 1B tokens ({cur}) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for title, nodes, m, s in rows:
        steps_epoch = s["train_tokens"] / s["tokens_per_step"]
        hours = steps_epoch * s["step_s"] / 3600
        tx = s["tx_mean"] if m.startswith(("demo-sync", "demo-policy")) else s["tx_per_step"]
        gb = steps_epoch * tx * nodes / 1e9
        cost = nodes * hours * node_h + gb * per_gb
        per_b = cost * 1e9 / s["train_tokens"]
        lines.append(
            f"| {title} | {LABELS[m]} | {s['step_s']:.3f} | {s['tokens_per_step']} | {hours:.3f} | {gb:.3f} | "
            f"{cost:.4f} | {100 * gb * per_gb / cost if cost else 0:.1f}% | {per_b:.2f} |"
        )
    lines.append("")
    return lines


def plot(items, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(items))
    rows = (len(items) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, (title, recs, target) in zip(axes.flat, items):
        for m in METHODS:
            r = recs.get(m)
            if not r or r.get("failed"):
                continue
            ax.plot(
                [e["train_time"] for e in r["evals"]],
                [e["loss"] for e in r["evals"]],
                "o-",
                ms=3,
                color=COLORS.get(m),
                label=LABELS[m],
            )
        ax.axhline(target, color="grey", ls=":", lw=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training wall time, s (eval excluded)")
        ax.set_ylabel("held-out loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(items) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def plot_scenarios(scen: list, path: Path, target: float) -> None:
    """Per scenario: training loss (rank 0, per step, light) and held-out loss (dots) against wall time, and
    the policy's tier against wall time; the link events as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["scenario"] for r in scen))
    fig, axes = plt.subplots(
        2,
        len(names),
        figsize=(5.2 * len(names), 6.2),
        squeeze=False,
        gridspec_kw=dict(height_ratios=[3, 1.2]),
        sharex="col",
    )
    for j, name in enumerate(names):
        ax, axt = axes[0, j], axes[1, j]
        for r in (r for r in scen if r["scenario"] == name):
            if r.get("failed"):
                continue
            m = r["method"]
            st = r["ranks"][0]["steps"]
            ax.plot([x["wall"] for x in st], [x["loss"] for x in st], "-", lw=0.8, alpha=0.45, color=COLORS.get(m))
            ax.plot(
                [e.get("wall", e["train_time"]) for e in r["evals"]],
                [e["loss"] for e in r["evals"]],
                "o-",
                ms=4,
                color=COLORS.get(m),
                label=LABELS[m],
            )
            if "tier" in st[0]:
                axt.step(
                    [0] + [x["wall"] for x in st],
                    [st[0]["tier"]] + [x["tier"] for x in st],
                    where="post",
                    color=COLORS.get(m),
                    label=LABELS[m],
                )
            for e in r.get("schedule_log", []):
                for a_ in (ax, axt):
                    a_.axvline(e["t"], color="k", ls=":", lw=0.7)
                ax.text(
                    e["t"],
                    ax.get_ylim()[1] if False else 5.3,
                    f" {e['kind']} {e['arg']}",
                    fontsize=6,
                    rotation=90,
                    va="top",
                )
        ax.set_title(f"{name}: {SCENARIOS.get(name, {}).get('about', '')[:60]}", fontsize=8)
        ax.set_ylabel("loss (line: train, dots: held-out)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        axt.set_ylabel("tier")
        axt.set_yticks(range(8))  # hf_demo.optim.policy.tiers: at most 8 tiers
        axt.set_xlabel("wall time since first step, s")
        axt.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None):
    args = parse_args(argv)
    if args.cleanup_stale:
        print("removed:", netns.remove_stale() or "nothing")
        return
    if not args.report_only:
        try:
            sweep(args)
        except netns.Interrupted as e:
            print(f"wan.py: {e}; namespaces and qdiscs removed, finished runs kept in wan_runs.json", file=sys.stderr)
            sys.exit(130)
    report(args)


if __name__ == "__main__":
    main()
