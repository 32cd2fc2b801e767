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
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import netns  # noqa: E402

METHODS = ("demo-bf16", "demo-sign", "adamw", "powersgd")
LABELS = {"demo-bf16": "DeMo bf16", "demo-sign": "DeMo sign", "adamw": "DDP AdamW", "powersgd": "DDP PowerSGD r4"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--configs",
        default="2:1gbit,2:100mbit,2:20mbit",
        help="comma-separated NODES:RATE (tc units: gbit, mbit, kbit; 'none' = unlimited veth)",
    )
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=10)
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


def parse_configs(s: str) -> list[tuple[int, str | None]]:
    out = []
    for item in s.split(","):
        n, rate = item.strip().split(":")
        out.append((int(n), None if rate in ("none", "inf", "") else rate))
    return out


def config_key(n: int, rate: str | None) -> str:
    return f"{n}:{rate or 'none'}"


# ------------------------------------------------------------------ running
def run_method(cluster: netns.Cluster, method: str, args, out_json: Path, logdir: Path, port: int) -> dict:
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
    ]
    extra = [a for a in args.worker_args if a != "--"]
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(args.threads),
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        PYTHONWARNINGS="ignore",
    )
    procs, logs = [], []
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
            "1",
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
        for p in procs:
            netns.kill_tree(p)
            cluster.forget(p)
        for log in logs:
            log.close()
    wall = time.time() - t0
    if failed or not out_json.exists():
        tail = (logdir / f"{method}-node0.log").read_text()[-3000:]
        raise RuntimeError(
            f"{method} on {cluster.n} nodes @ {cluster.rate}: {failed or 'no result'}\n"
            f"--- node 0 log tail ({logdir}) ---\n{tail}"
        )
    rec = json.loads(out_json.read_text())
    rec["launch_wall_s"] = wall
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
    for n, rate in parse_configs(args.configs):
        cluster = netns.Cluster(n, rate, args.shaper)
        try:
            cluster.setup()
            print(f"== {n} nodes, {rate or 'unlimited'} ({args.shaper}) ==\n{cluster.qdisc_report()}", flush=True)
            for method in methods:
                port += 1
                out_json = logdir / f"{n}-{rate}-{method}.json"
                t0 = time.time()
                try:
                    rec = run_method(cluster, method, args, out_json, logdir, port)
                except RuntimeError as e:
                    print(f"FAILED: {e}", file=sys.stderr, flush=True)
                    rec = dict(method=method, world=n, failed=str(e).split("\n")[0])
                rec.update(
                    config=config_key(n, rate),
                    nodes=n,
                    rate=rate,
                    shaper=args.shaper,
                    delay_ms=args.delay_ms,
                    target_loss=args.target_loss,
                )
                runs = [
                    r
                    for r in runs
                    if not (
                        r.get("config") == rec["config"]
                        and r["method"] == method
                        and r.get("delay_ms", 0) == args.delay_ms
                    )
                ] + [rec]
                runs_path.write_text(json.dumps(runs, indent=1))
                print(f"   {method}: {time.time() - t0:.0f}s", flush=True)
        finally:
            cluster.close()
    left = netns.list_namespaces(cluster.prefix)
    print(f"namespaces left with prefix {cluster.prefix}: {left or 'none'}", flush=True)


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
    # bytes per step: mean over ranks, median over steps (PowerSGD's first 2 steps are plain all-reduces)
    tx = median([sum(r["steps"][i]["tx"] for r in ranks) / len(ranks) for i in range(nsteps)])
    rx = median([sum(r["steps"][i]["rx"] for r in ranks) / len(ranks) for i in range(nsteps)])
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
        step_s=median(step_times),
        train_s=rec["evals"][-1]["train_time"],
        final_loss=rec["evals"][-1]["loss"],
        tx_per_step=tx,
        rx_per_step=rx,
        n_params=rec["n_params"],
        t_target=hit["train_time"] if hit else None,
        step_target=hit["step"] if hit else None,
        step_target_interp=interp[0] if interp else None,
        t_target_interp=interp[1] if interp else None,
    )
    if "demo_total" in rec:
        st = [r["steps"] for r in ranks]
        s["app_sent"] = median([x["app_sent"] for x in st[0]])
        s["app_received"] = median([x["app_received"] for x in st[0]])
        s["comm_s"] = median([x["comm_s"] for x in st[0]])
        s["opt_s"] = median([x["opt_step"] for x in st[0]])
    s["fwd_bwd_s"] = median([x["fwd_bwd"] for x in ranks[0]["steps"]])
    s["opt_step_s"] = median([x["opt_step"] for x in ranks[0]["steps"]])
    return s


def fmt_bytes(b):
    return f"{b / 1e6:.2f} MB" if b >= 1e5 else f"{b / 1e3:.1f} kB"


def ratio(a, b):
    return f"{a / b:.3g}×" if a is not None and b else "n/a"


def report(args) -> None:
    out_dir = Path(args.out_dir)
    runs = json.loads((out_dir / "wan_runs.json").read_text())
    configs = []
    for r in runs:
        key = (r["nodes"], r["rate"], r.get("delay_ms", 0.0))
        if key not in configs:
            configs.append(key)
    configs.sort(key=lambda k: (k[2], k[0], -netns.parse_rate(k[1]) if k[1] else float("-inf")))
    lines = ["# Emulated multi-node training (generated by benchmarks/wan.py)", ""]
    any_rec = next(r for r in runs if not r.get("failed"))
    a = any_rec["args"]
    lines += [
        f"Model: byte-level Llama, hidden {a['hidden']}, {a['layers']} layers, {a['heads']} heads, MLP "
        f"{a['intermediate']}, {any_rec['n_params'] / 1e6:.2f}M parameters; {a['batch_size']} windows × "
        f"{a['seq_len']} bytes per rank per step; {a['steps']} steps, eval every {a['eval_every']} "
        f"steps on {any_rec['data']['eval_windows']} held-out windows; {a['threads']} torch thread(s) per "
        f"rank; target eval loss {args.target_loss}.",
        "",
        "Columns: **step s** median wall time of one training step (forward+backward+optimizer, slowest "
        "rank); **fwd+bwd s**, **opt s** its two parts on rank 0 (medians; DDP's all-reduce happens inside "
        "the backward pass, DeMo's exchange inside the optimizer step, its time in collectives in brackets); "
        "**to target** training wall time (evaluation excluded) until the first evaluation at or "
        "below the target loss, with that step; **interp.** the same, linearly interpolated between the two "
        "evaluations around the target; **final** held-out loss after the last step; **sent / "
        "received per step** bytes on the node's interface per rank per step (wire bytes: TCP/IP "
        "headers and gloo framing included); DeMo's own payload count (`comm_stats.bytes_sent`) in "
        "brackets.",
        "",
    ]
    plot_items, summary = [], {}
    for nodes, rate, delay in configs:
        recs = {r["method"]: r for r in runs if (r["nodes"], r["rate"], r.get("delay_ms", 0.0)) == (nodes, rate, delay)}
        target = args.target_loss
        sums = {m: summarize(r, target) for m, r in recs.items()}
        title = f"{nodes} nodes, {rate or 'unlimited'} per link" + (f", +{delay:g} ms/hop (app-level)" if delay else "")
        lines += [
            f"## {title}",
            "",
            "| method | step s | fwd+bwd s | opt s | to target s (step) | interp. s (step) | final eval loss "
            "| sent / step | received / step |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for m in METHODS:
            if m not in sums:
                continue
            s = sums[m]
            if s.get("failed"):
                lines.append(f"| {LABELS[m]} | failed: {s['failed']} | | | | | | | |")
                continue
            tt = f"{s['t_target']:.1f} ({s['step_target']})" if s["t_target"] is not None else "not reached"
            app = f" [{fmt_bytes(s['app_sent'])}]" if "app_sent" in s else ""
            ti = (
                f"{s['t_target_interp']:.1f} ({s['step_target_interp']:.1f})"
                if s["t_target_interp"] is not None
                else "n/a"
            )
            comm = f" ({s['comm_s']:.3f})" if "comm_s" in s else ""
            lines.append(
                f"| {LABELS[m]} | {s['step_s']:.3f} | {s['fwd_bwd_s']:.3f} | {s['opt_step_s']:.3f}{comm} | "
                f"{tt} | {ti} | {s['final_loss']:.4f} | "
                f"{fmt_bytes(s['tx_per_step'])}{app} | {fmt_bytes(s['rx_per_step'])} |"
            )
        lines += ["", "| ratio | step time | time to target (interp.) | bytes sent / step |", "|---|---:|---:|---:|"]
        for d in ("demo-bf16", "demo-sign"):
            for base in ("adamw", "powersgd"):
                if d in sums and base in sums and not sums[d].get("failed") and not sums[base].get("failed"):
                    sd, sb = sums[d], sums[base]
                    lines.append(
                        f"| {LABELS[d]} / {LABELS[base]} | {ratio(sd['step_s'], sb['step_s'])} | "
                        f"{ratio(sd['t_target_interp'], sb['t_target_interp'])} | "
                        f"{ratio(sd['tx_per_step'], sb['tx_per_step'])} |"
                    )
        lines.append("")
        plot_items.append((title, recs, target))
        summary[title] = sums
    (out_dir / "wan.md").write_text("\n".join(lines))
    (out_dir / "wan_summary.json").write_text(json.dumps(summary, indent=1))
    print("\n".join(lines))
    plot(plot_items, out_dir / "wan_eval_loss.png")


def plot(items, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(items))
    rows = (len(items) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    colors = {"demo-bf16": "tab:blue", "demo-sign": "tab:cyan", "adamw": "tab:red", "powersgd": "tab:orange"}
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
                color=colors[m],
                label=LABELS[m],
            )
        ax.axhline(target, color="grey", ls=":", lw=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training wall time, s (eval excluded)")
        ax.set_ylabel("held-out loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(items) :]:
        ax.axis("off")
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
