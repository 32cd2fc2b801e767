"""Draw docs/images/demo-step.png, the picture of one DeMo step in the README and docs/concepts/algorithm.md.

python docs/images/draw_demo_step.py
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

STAGES = [
    ("local gradient", "each rank's own\n(no DDP all-reduce)"),
    ("momentum", "m = decay·m\n+ lr·DCT(grad),\n64×64 blocks"),
    ("top-k", "32 of 4096 per\nblock are sent;\nthe rest stays"),
    ("exchange", "~0.025 bytes per\nparam and step,\nCRC32-checked"),
    ("mean, IDCT", "the same bits\non every rank"),
    ("sign step", "p -= lr·sign(u):\nreplicas stay\nbitwise identical"),
]


OUT = Path(__file__).with_name("demo-step.png")


def main(out: Path = OUT) -> None:
    fig, ax = plt.subplots(figsize=(11, 2.3), dpi=100)
    ax.set(xlim=(0, len(STAGES) * 1.8), ylim=(0, 2.2))
    ax.axis("off")
    for i, (title, detail) in enumerate(STAGES):
        x = 0.1 + i * 1.8
        colour = "#d9ead3" if title == "exchange" else "#dde7f3"
        ax.add_patch(FancyBboxPatch((x, 0.35), 1.45, 1.5, boxstyle="round,pad=0.04", fc=colour, ec="#4a5a6a"))
        ax.text(x + 0.725, 1.55, title, ha="center", va="center", fontsize=10, weight="bold")
        ax.text(x + 0.725, 0.85, detail, ha="center", va="center", fontsize=8.5)
        if i:
            ax.add_patch(FancyArrowPatch((x - 0.33, 1.1), (x - 0.02, 1.1), arrowstyle="-|>", mutation_scale=12))
    ax.text(0.1, 0.08, "one DeMo step on every rank; only the exchange crosses the network", fontsize=8, color="#444")
    fig.savefig(out, bbox_inches="tight")


if __name__ == "__main__":
    main()
