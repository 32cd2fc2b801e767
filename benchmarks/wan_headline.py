"""The slow-link headline: time to a target held-out loss on 4 emulated nodes, several runs, the planner beside it.

Runs ``wan.py`` ``--runs`` times (every method once per run, the runs taken in turn) over each ``--configs`` link
(by default 4 nodes at 100 Mbit/s and at 1 Gbit/s) with ``--delay-ms`` of one-way latency per ring hop emulated in
the application, each method at its ``--lrs`` learning rate; each run's records stay in ``OUT/runN/`` (``wan.py``'s
own ``wan_runs.json``, ``wan_summary.json`` and ``wan.md``). Then ``OUT/wan_headline.{md,json}``: per link and
method the median over the runs of the step time (slowest rank), the training time to ``--target-loss``
(evaluation excluded, interpolated between the two evaluations around it), the step it is reached at and the
final held-out loss, the bytes each rank sends per step, and the ratio of each method's time to target to
DDP-AdamW's; beside them ``hf-demo plan``'s prediction for the same scenario (the planner given the link, the
latency and DeMo defaults' measured compute, as ``plan_check.py`` does) and its error against the measured step.

    sudo .venv/bin/python benchmarks/wan_headline.py                 # 3 runs x 2 links x 6 methods (~45 min)
    .venv/bin/python benchmarks/wan_headline.py --report-only        # the tables again from OUT/run*/
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

METHODS = "adamw,muon,powersgd,demo-bf16,demo-scratch,demo-scratch-few"
LABELS = {
    "adamw": "DDP-AdamW",
    "muon": "DDP-Muon",
    "powersgd": "DDP-PowerSGD r4",
    "demo-bf16": "DeMo defaults",
    "demo-scratch": "`from_scratch` preset",
    "demo-scratch-few": "`from_scratch_few_bytes` preset",
}
# each method's best lr in this job: the lowest held-out loss at step 48 of three to four lrs around the 3.3M
# Llama's best at 300 steps, on the same 4 nodes without link limits (benchmarks/results/wan_headline_lr/)
BEST_LRS = "adamw=2e-3,muon=8e-3,powersgd=1e-3,demo-bf16=1e-3,demo-scratch=1e-2,demo-scratch-few=1e-2"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--configs", default="4:100mbit,4:1gbit", help="as wan.py's --configs")
    p.add_argument("--delay-ms", type=float, default=20.0, help="one-way latency per ring hop (wan.py --delay-ms)")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--lrs", default=BEST_LRS, help="method=lr,... (wan.py --lrs)")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--eval-every", type=int, default=4, help="a multiple of every preset's sync interval")
    p.add_argument(
        "--target-loss", type=float, default=3.0, help="reached by every method at its best lr in the lr sweep"
    )
    p.add_argument("--out-dir", default=str(HERE / "results" / "wan_headline"))
    p.add_argument("--port", type=int, default=29700)
    p.add_argument("--report-only", action="store_true")
    return p.parse_args(argv)


def run_all(a: argparse.Namespace) -> None:
    """``wan.py`` once per run (every config and method), into ``OUT/runN``; stops at the first failed run."""
    for r in range(1, a.runs + 1):
        cmd = [sys.executable, str(HERE / "wan.py"), "--out-dir", str(Path(a.out_dir) / f"run{r}")]
        cmd += ["--configs", a.configs, "--methods", a.methods, "--lrs", a.lrs, "--delay-ms", str(a.delay_ms)]
        cmd += ["--steps", str(a.steps), "--eval-every", str(a.eval_every), "--target-loss", str(a.target_loss)]
        cmd += ["--port", str(a.port + 100 * r)]
        print(f"== run {r} of {a.runs}: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, check=True)


def collect(out_dir: Path, target: float) -> dict[str, dict[str, list[dict]]]:
    """config -> method -> one ``wan.summarize`` per run folder (with ``record``: the run's own record)."""
    import wan

    got: dict[str, dict[str, list[dict]]] = {}
    for folder in sorted(out_dir.glob("run*")):
        for rec in json.loads((folder / "wan_runs.json").read_text()):
            got.setdefault(rec["config"], {}).setdefault(rec["method"], []).append(
                {**wan.summarize(rec, target), "record": rec}
            )
    return got


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def predicted_step(config: str, methods: dict[str, list[dict]]) -> dict[str, float]:
    """method -> the planner's step seconds for ``config`` (its link, the runs' latency, DeMo defaults' measured
    forward+backward and optimizer compute: medians over the runs, and the Newton-Schulz runs of the orthogonalising
    methods measured here against a forward+backward), as ``plan_check.check_folder`` plans."""
    import plan_check

    ref = [s for s in methods.get("demo-bf16", []) if not s.get("failed")]
    if not ref:
        return {}
    rec = ref[0]["record"]
    rate = plan_check.UNLIMITED if rec["rate"] in (None, "none") else rec["rate"]
    cluster = plan_check.emulated_cluster(rec["nodes"], rec.get("procs_per_node", 1), rate, rec.get("delay_ms", 0.0))
    fwd_bwd = _median([s["fwd_bwd_s"] for s in ref])
    own = _median([s["opt_s"] - s["comm_s"] for s in ref])
    work = plan_check.run_workload(ref[0]["record"]["args"], fwd_bwd, own)
    out = {}
    for method, runs in methods.items():
        ok = [s for s in runs if not s.get("failed")]
        got = plan_check.predict(method, {**ok[0], "args": ok[0]["record"]["args"]}, cluster, work) if ok else None
        if got is not None:
            out[method] = got[0]
    return out


def rows_of(config: str, methods: dict[str, list[dict]]) -> list[dict]:
    """One row per method: medians over its runs, its time to target against DDP-AdamW's, the planner's step."""
    plan = predicted_step(config, methods)
    rows = []
    for method, runs in methods.items():
        ok = [s for s in runs if not s.get("failed")]
        row = dict(config=config, method=method, runs=len(runs), failed=len(runs) - len(ok))
        row.update(
            lr=ok[0]["record"]["lr"] if ok else None,
            step_s=_median([s["step_s"] for s in ok]),
            t_target=_median([s["t_target_interp"] for s in ok]),
            step_target=_median([s["step_target_interp"] for s in ok]),
            reached=sum(s["t_target_interp"] is not None for s in ok),
            final_loss=_median([s["final_loss"] for s in ok]),
            wire_tx_per_step=_median([s["tx_mean"] for s in ok]),
            predicted_step_s=plan.get(method),
        )
        if row["predicted_step_s"] is not None and row["step_target"] is not None:
            row["predicted_t_target"] = row["predicted_step_s"] * row["step_target"]
        rows.append(row)
    ref = next((r["t_target"] for r in rows if r["method"] == "adamw"), None)
    for r in rows:
        r["vs_adamw"] = r["t_target"] / ref if ref and r["t_target"] is not None else None
    return rows


def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def table(rows: list[dict], target: float) -> list[str]:
    out = [
        "| method | lr | step s | time to target s (step) | ÷ DDP-AdamW | final loss | wire MB sent / step "
        "| planned step s (error) | planned time to target s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        reach = f"{_f(r['t_target'], '.1f')} ({_f(r['step_target'], '.1f')})"
        if r["reached"] < r["runs"] - r["failed"]:
            reach += f", {r['reached']} of {r['runs'] - r['failed']} runs reached {target}"
        err = None
        if r["predicted_step_s"] is not None and r["step_s"]:
            err = (r["predicted_step_s"] - r["step_s"]) / r["step_s"]
        planned = f"{_f(r['predicted_step_s'], '.3f')} ({_f(err, '+.0%')})" if err is not None else "no planner row"
        out.append(
            f"| {LABELS.get(r['method'], r['method'])} | {_f(r['lr'], 'g')} | {_f(r['step_s'], '.3f')} | {reach} "
            f"| {_f(r['vs_adamw'], '.2f')}× | {_f(r['final_loss'], '.4f')} "
            f"| {_f((r['wire_tx_per_step'] or 0) / 1e6, '.3f')} "
            f"| {planned} | {_f(r.get('predicted_t_target'), '.1f')} |"
        )
    return out


def report(a: argparse.Namespace) -> list[dict]:
    out_dir = Path(a.out_dir)
    got = collect(out_dir, a.target_loss)
    runs = len(list(out_dir.glob("run*")))
    lines = [
        "# Time to a target held-out loss over slow links",
        "",
        f"`benchmarks/wan_headline.py`: {runs} runs of `wan.py` (every method once per run, runs taken in turn), "
        f"{a.steps} steps, evaluation every {a.eval_every} steps, target held-out loss {a.target_loss}, "
        f"{a.delay_ms:g} ms one-way latency per ring hop emulated in the application. Medians over the runs.",
    ]
    all_rows = []
    for config, methods in got.items():
        rows = rows_of(config, methods)
        all_rows += rows
        rec = next(iter(methods.values()))[0]["record"]
        link = "unlimited" if rec["rate"] in (None, "none") else rec["rate"]
        title = f"{rec['nodes']} nodes, {link} per link, {rec.get('delay_ms', 0.0):g} ms one-way latency per hop"
        lines += ["", f"## {title}", "", *table(rows, a.target_loss)]
    (out_dir / "wan_headline.md").write_text("\n".join(lines) + "\n")
    (out_dir / "wan_headline.json").write_text(json.dumps(all_rows, indent=1))
    print("\n".join(lines))
    return all_rows


def main(argv=None) -> int:
    a = parse_args(argv)
    if not a.report_only:
        run_all(a)
    report(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
