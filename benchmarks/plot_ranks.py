"""Plots of the presets and the DDP baselines on 2, 4 and 8 ranks, from the result files of the "More ranks,
different data" runs (``convergence_ranks300_w{W}_{split}.json``, see docs/results.md for the commands):

- ``ranks300_ratio_vs_w.png``: each method's held-out loss as a ratio to DDP-Muon's at the same W and split,
  against W (IID solid, non-IID dashed);
- ``ranks300_loss_vs_bytes.png``: held-out loss against the bytes each rank sends per parameter and step, one
  panel per W (IID).

    python benchmarks/plot_ranks.py [--results-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

WORLDS = (2, 4, 8)
SPLITS = {"interleaved": "IID", "by_directory": "non-IID"}
# the runs' method names -> what the docs call them
NAMES = {
    "DDP-Muon": "DDP-Muon",
    "DDP-AdamW": "DDP-AdamW",
    "DeMo": "DeMo defaults",
    "DeMo sync_every=2,topk=24,decay=0.999,format=sign,chunk=32,inner_rule=orthogonal": "from_scratch",
    "DeMo sync_every=4,topk=16,chunk=64,decay=0.999,format=sign,inner_rule=orthogonal": "from_scratch_few_bytes",
    "DeMo sync_every=4,topk=4,decay=0.999,format=sign,chunk=32,inner_rule=orthogonal": "sync_every=4, top-4",
}
COLORS = {name: f"C{i}" for i, name in enumerate(NAMES.values())}  # one colour per method in both plots


def load(results: Path) -> dict:
    """{(name, W, split): (mean held-out loss, bytes/param/step)} over the seeds of each run."""
    out = {}
    for w in WORLDS:
        for split in SPLITS:
            runs = json.loads((results / f"convergence_ranks300_w{w}_{split}.json").read_text())
            for name in NAMES:
                mine = [r for r in runs if r["ok"] and r["method"] == name]
                if mine:
                    loss = statistics.mean(r["final_loss"] for r in mine)
                    out[NAMES[name], w, split] = (loss, statistics.mean(r["bytes_per_param_step"] for r in mine))
    return out


def plot_ratio(figures: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in (n for n in NAMES.values() if n != "DDP-Muon"):
        for split, style in zip(SPLITS, ("-", "--")):
            ws = [w for w in WORLDS if (name, w, split) in figures]
            ratios = [figures[name, w, split][0] / figures["DDP-Muon", w, split][0] for w in ws]
            label = f"{name} ({SPLITS[split]})"
            ax.plot(ws, ratios, style, marker="o", color=COLORS[name], label=label)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set(xlabel="ranks (W)", ylabel="held-out loss / DDP-Muon's", xticks=WORLDS)
    ax.set_title("0.46M Llama, 300 steps: the gap to DDP-Muon against W", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bytes(figures: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, len(WORLDS), figsize=(11, 3.8), sharey=True)
    for ax, w in zip(axes, WORLDS):
        for name in NAMES.values():
            if (name, w, "interleaved") in figures:
                loss, nbytes = figures[name, w, "interleaved"]
                ax.scatter([nbytes], [loss], color=COLORS[name], label=name)
        ax.set(xscale="log", xlabel="bytes/param/step each rank sends", title=f"W = {w} (IID)")
    axes[0].set_ylabel("held-out loss after 300 steps")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results-dir", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    figures = load(args.results_dir)
    plot_ratio(figures, args.results_dir / "ranks300_ratio_vs_w.png")
    plot_bytes(figures, args.results_dir / "ranks300_loss_vs_bytes.png")
    print(f"wrote {args.results_dir / 'ranks300_ratio_vs_w.png'} and {args.results_dir / 'ranks300_loss_vs_bytes.png'}")


if __name__ == "__main__":
    main()
