"""The same fine-tune with DeMo, DDP-AdamW and DDP-AdamW with the PowerSGD hook, side by side.

    python recipes/compare.py --output_dir outputs/compare --steps 40 [--num_processes 2] \\
        [--recipe run_classification.py] [-- recipe args]

Each method runs a recipe (default recipes/run_clm.py) through `accelerate launch` (on a CPU-only machine
with accelerate_configs/cpu_multiprocess.yaml and ACCELERATE_USE_CPU=1) and reads its results.json (the
layout of recipes/recipelib/results.py). Writes compare.png (eval loss against steps and against bytes communicated)
and compare.md (final eval loss, the recipe's first metric, bytes per step, total bytes, wall time).
Bytes are per rank: DeMo's are measured by its counters; AdamW's are a dense fp32 all-reduce
(4 bytes/parameter/step); PowerSGD's are computed from the parameter shapes with torch's PowerSGD rule
(matrices whose rank-r factors are smaller than half the matrix are sent as P and Q, the rest dense; plain
all-reduce before start_powerSGD_iter).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from recipelib.baselines import powersgd_bytes_per_step

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def methods(args) -> dict[str, list[str]]:
    return {
        "DeMo": [
            "--optim",
            "demo",
            "--learning_rate",
            str(args.demo_lr),
            *(["--demo_preset", args.demo_preset] if args.demo_preset else []),
            *shlex.split(args.demo_args),
        ],
        "DDP-AdamW": ["--optim", "adamw_torch", "--learning_rate", str(args.adamw_lr)],
        "DDP-AdamW+PowerSGD": [
            "--optim",
            "adamw_torch",
            "--learning_rate",
            str(args.adamw_lr),
            "--ddp_comm_hook",
            "power_sgd",
            "--powersgd_rank",
            str(args.powersgd_rank),
            "--powersgd_start_iter",
            "2",
            # one DDP bucket: with several, gloo ranks can order PowerSGD's chained
            # all-reduces differently and fail ("data size doesn't match")
            "--ddp_bucket_cap_mb",
            "1024",
        ],
    }


def recipe_args(extra, args, out_dir) -> list[str]:
    """The recipe's command line for one method (``extra``: from :func:`methods`); tests launch it as it is."""
    return [
        "--output_dir",
        str(out_dir),
        "--max_steps",
        str(args.steps),
        "--eval_strategy",
        "steps",
        "--eval_steps",
        str(args.eval_steps),
        "--logging_steps",
        str(max(1, args.eval_steps // 2)),
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--seed",
        "0",
        *(["--use_cpu", "true"] if not _has_gpu() else []),
        *extra,
        *args.passthrough,
    ]


def launch(name, extra, args, out_dir) -> float:
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--num_processes", str(args.num_processes)]
    env = dict(os.environ)
    if args.config_file:
        cmd += ["--config_file", args.config_file]
    elif not _has_gpu():
        cmd += ["--config_file", str(ROOT / "accelerate_configs" / "cpu_multiprocess.yaml")]
        env["ACCELERATE_USE_CPU"] = "1"
    cmd += [str(HERE / args.recipe), *recipe_args(extra, args, out_dir)]
    print(f"[compare] {name}: {' '.join(cmd)}", flush=True)
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"[compare] {name} failed with exit code {proc.returncode}")
    return time.monotonic() - started


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def curves(name, results, args):
    """[(step, eval_loss, cumulative bytes)] from a run's results.json (its evaluations, one per step)."""
    steps_losses = sorted(
        {
            row["step"]: row["eval_loss"] for row in results["log_history"] if "eval_loss" in row and "step" in row
        }.items()
    )
    n = results["parameters"]
    if name == "DeMo":
        per_step = results["communication"]["bytes_sent"] / max(results["global_step"], 1)
        total = lambda s: per_step * s  # noqa: E731 - DeMo sends the same payload every step
    elif "PowerSGD" in name:
        compressed = powersgd_bytes_per_step(results["param_shapes"], args.powersgd_rank)
        total = lambda s: 4 * n * min(s, 1) + compressed * max(s - 1, 0)  # noqa: E731
    else:
        total = lambda s: 4 * n * s  # noqa: E731
    return [(s, loss, total(s)) for s, loss in steps_losses], total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output_dir", default="outputs/compare")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval_steps", type=int, default=10)
    ap.add_argument("--num_processes", type=int, default=2)
    ap.add_argument("--config_file", default=None, help="accelerate config (default: the CPU one without a GPU)")
    ap.add_argument("--demo_lr", type=float, default=1e-4)
    ap.add_argument("--demo_preset", default=None, help="DeMo's preset (hf_demo.settings.PRESETS), e.g. from_scratch")
    ap.add_argument(
        "--demo_args",
        default="",
        help="more recipe arguments for the DeMo run alone, e.g. '--demo_sync_every 4 --demo_compression_topk 48'",
    )
    ap.add_argument("--adamw_lr", type=float, default=1e-4)
    ap.add_argument("--powersgd_rank", type=int, default=4)
    ap.add_argument("--methods", default="DeMo,DDP-AdamW,DDP-AdamW+PowerSGD")
    ap.add_argument("--recipe", default="run_clm.py", choices=["run_clm.py", "run_classification.py"])
    ap.add_argument("passthrough", nargs="*", help="after --: arguments for the recipe")
    args = ap.parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, plotted = [], {}
    for name, extra in methods(args).items():
        if name not in args.methods.split(","):
            continue
        run_dir = out / name.replace("+", "_")
        shutil.rmtree(run_dir, ignore_errors=True)
        wall = launch(name, extra, args, run_dir)
        results = json.loads((run_dir / "results.json").read_text())
        if name != "DeMo" and results["world_size"] > 1 and not results["ddp"]:
            raise SystemExit(f"[compare] {name}: the model was not wrapped in DDP, so each rank trained alone")
        points, total = curves(name, results, args)
        plotted[name] = points
        rows.append(row(name, results, total, wall))
    write_table(rows, out / "compare.md", args)
    plot(plotted, out / "compare.png")
    (out / "compare.json").write_text(json.dumps({"rows": rows, "curves": plotted}, indent=2))
    print((out / "compare.md").read_text())
    print(f"[compare] plot: {out / 'compare.png'}")
    return rows


def row(name, results, total, wall) -> dict:
    """One line of the table from a run's results.json: the final eval loss and the recipe's first metric."""
    after, steps = results["after"], results["global_step"]
    metric = next((k for k in after if k != "loss"), None)
    return {
        "method": name,
        "final_eval_loss": after["loss"],
        "metric": metric,
        "metric_value": after.get(metric),
        "bytes_per_step": total(steps) / max(steps, 1),
        "total_bytes": total(steps),
        "wall_time_s": wall,
        "train_runtime_s": results.get("train_runtime_s"),
        "ddp": results["ddp"],
    }


def write_table(rows, path, args):
    metric = rows[0]["metric"] if rows else "metric"
    lines = [
        f"Same fine-tune ({args.recipe}), {args.num_processes} processes, {args.steps} steps. Bytes are per rank. "
        f"DeMo: lr {args.demo_lr}, preset {args.demo_preset or 'none (defaults)'}; AdamW: lr {args.adamw_lr}.",
        "",
        f"| method | final eval loss | {metric} | bytes/step | total bytes | wall time (s) | train time (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['final_eval_loss']:.4f} | {r['metric_value']:.4f} | "
            f"{r['bytes_per_step'] / 1e6:.3f} MB | {r['total_bytes'] / 1e6:.2f} MB | "
            f"{r['wall_time_s']:.1f} | {r['train_runtime_s'] or float('nan'):.1f} |"
        )
    path.write_text("\n".join(lines) + "\n")


def plot(curves_by_method, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, points in curves_by_method.items():
        steps, losses, sent = zip(*points)
        ax1.plot(steps, losses, marker="o", label=name)
        ax2.plot([max(b, 1) / 1e6 for b in sent], losses, marker="o", label=name)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("eval loss")
    ax1.set_title("eval loss against steps")
    ax2.set_xscale("log")
    ax2.set_xlabel("MB communicated per rank (log)")
    ax2.set_ylabel("eval loss")
    ax2.set_title("eval loss against bytes communicated")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
