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

Latency: the emulated links of these runs have none (tc's tbf shapes the rate; this kernel has no netem, so
no delay can be added), so the measured rows check the bandwidth terms only. For each configuration the
report also gives, **predicted only**, the seconds per step that a one-way latency of ``--latency`` between
nodes (and 5 us inside a node) adds to each method under the planner's per-hop model (hops between nodes at
that latency, hops inside a node at 5 us): what a measurement with delayed links would check.

    python benchmarks/plan_check.py            # writes benchmarks/results/plan_check.md, prints the summary
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from hf_demo.ops.links import Link  # noqa: E402
from hf_demo.ops.methods import Cluster, Workload, ddp_adamw, ddp_powersgd, demo_estimate  # noqa: E402
from hf_demo.settings import DeMoSettings  # noqa: E402
from wan_worker import DEMO_KW, TOPK_PER_HALF_WORLD  # noqa: E402 - the worker's settings are the ones measured

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
    if method not in DEMO_KW:  # a method since retired (demo-hier: hierarchy="node", replaced by demo-hsdp)
        return None
    recorded = run.get("app_sent_mean")
    layout = "hsdp" if method == "demo-hsdp" else "flat"
    for coding in ("elias_fano", "uint16"):
        settings = demo_settings(method, run["args"], cluster.world, coding)
        est = demo_estimate(method, method, 0, settings, cluster, work, layout)
        if recorded is None or round(est.rank_bytes()) == round(recorded):
            return est.step_s(cluster), f"bytes exact ({coding})"
    return None


def with_latency(cluster: Cluster, latency: str) -> Cluster:
    """The same cluster with a one-way latency between nodes (and 5 us inside a node)."""
    inter = Link(cluster.inter.bandwidth, Link.parse("1bit", latency).latency)
    intra = Link(cluster.intra.bandwidth, Link.parse("1bit", INTRA_LATENCY).latency)
    return Cluster(cluster.nodes, cluster.devices_per_node, intra, inter)


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
        ref = methods.get("demo-bf16") or next((m for k, m in methods.items() if k.startswith("demo")), None)
        if ref is None or ref.get("failed"):
            left_out.append(f"{summary_path.parent.name} / {key}: no DeMo run to take the compute from")
            continue
        args = next(r["args"] for r in runs if not r.get("failed"))
        for r in runs:
            if not r.get("failed") and r["method"] in methods:
                methods[r["method"]]["args"] = r["args"]
        work = Workload(
            llama_shapes(args),
            ref["fwd_bwd_s"],
            demo_overhead=(ref["opt_s"] - ref["comm_s"]) / ref["fwd_bwd_s"],
        )
        link = Link.parse(rate, "0")
        cluster = Cluster(nodes, procs, link if procs > 1 else link, link)
        if procs > 1:  # the processes of a node share one namespace: their link is the loopback inside it
            cluster = Cluster(nodes, procs, Link.parse(UNLIMITED, "0"), link)
        for method, run in methods.items():
            if run.get("failed"):
                continue
            run.setdefault("args", args)
            got = predict(method, run, cluster, work)
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(HERE / "results"))
    p.add_argument("--out", default=str(HERE / "results" / "plan_check.md"))
    p.add_argument("--latency", default="20ms", help="the latency between nodes of the predicted-only section")
    args = p.parse_args(argv)
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
