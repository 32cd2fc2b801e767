"""Plots of the presets and the DDP baselines on 2, 4 and 8 ranks, from the result files of the "More ranks,
different data" runs (``convergence_ranks300_w{W}_{split}.json``, see docs/results.md for the commands):

- ``ranks300_ratio_vs_w.png``: each method's held-out loss as a ratio to DDP-Muon's at the same W and split,
  against W (IID solid, non-IID dashed);
- ``ranks300_loss_vs_bytes.png``: held-out loss against the bytes each rank sends per parameter and step, one
  panel per W (IID).

and from the "outer step scales with W" runs (IID; ``convergence_outerlr_*.json``,
``convergence_fewbytes_*.json``, the ``ranks300`` files and the prototype's bit-identical runs):

- ``outer_lr_ratio_vs_w.png``: the presets as they are (their outer_lr and outer_lr_scaling), the other outer lr
  and scalings measured and the mean change as it is, with the DDP baselines and the defaults, as a ratio to
  DDP-Muon's held-out loss on the same seeds against W (2 to 16), mean and sd of the per-seed ratios;
- ``outer_lr_loss_vs_bytes.png``: held-out loss against bytes per parameter and step at W = 2, 4, 8, the same
  configurations.

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

from hf_demo.settings import PRESETS  # noqa: E402

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


# ------------------------------------------------------------ the outer step scaled with W (IID, 300 steps)
_F = "sync_every=2,topk=24,decay=0.999,format=sign,chunk=32,inner_rule=orthogonal"
_FB = "sync_every=4,topk=16,chunk=64,decay=0.999,format=sign,inner_rule=orthogonal"
_SQRT2 = "outer_lr=1.4142135623730951"
OUTER_WORLDS = (2, 4, 8, 16)
OUTER_FILES = [f"ranks300_w{w}_interleaved" for w in WORLDS] + [f"outerlr_w{w}" for w in OUTER_WORLDS]
OUTER_FILES += ["outerlr_w16m", "outerlr_c2_w4", "outerlr_c2_w8", "diag_outerlr_w8", "fewbytes_c2_w2", "fewbytes_c2_w8"]
OUTER_FILES += [
    "fewbytes_sqrt2_w8",
    "fewbytes_w4",
    "fewbytes_c2_w4",
    "outerfourth_w4",
    "outerfourth_w8",
    "outerfourth_w16",
]
FOURTH = "fourth_root_world"
# (the runs' method name, the worlds it counts at or None for all) -> (preset, outer lr c on sqrt_world, or
# (FOURTH, outer lr) on fourth_root_world, or None: "as it is"); c = 1 at W = 2 is the mean change as it is
# (sqrt(2/2) = 1), the prototype's outer_lr=2 at W = 8 is c = 1 bit for bit (benchmarks/reports/2026-12-07-outer-lr.md),
# and c = sqrt(2) at W = 2 is fourth_root_world's outer_lr sqrt(2) bit for bit (the factor sqrt(2) x 1.0)
OUTER_RUNS: dict = {}


def _counts(name: str, world: int | None, preset: str, c: float | tuple | None) -> None:
    OUTER_RUNS.setdefault((name, world), []).append((preset, c))


for _preset, _cfg in (("from_scratch", _F), ("from_scratch_few_bytes", _FB)):
    _counts(f"DeMo {_cfg}", None, _preset, None)
    _counts(f"DeMo {_cfg}", 2, _preset, 1.0)
    _counts(f"DeMo {_cfg},outer_lr_scaling=sqrt_world", None, _preset, 1.0)
    _counts(f"DeMo {_cfg},outer_lr_scaling=sqrt_world", 2, _preset, None)
    _counts(f"DeMo {_cfg},outer_lr_scaling=sqrt_world,{_SQRT2}", None, _preset, 2**0.5)
    _counts(f"DeMo {_cfg},outer_lr_scaling=sqrt_world,outer_lr=2", None, _preset, 2.0)
    _counts(f"DeMo {_cfg},outer_momentum=0,outer_lr=2", 8, _preset, 1.0)
_counts("from_scratch:outer_momentum=0,outer_lr=2", 8, "from_scratch", 1.0)  # diagnose_levers.json
_counts(f"DeMo {_F},outer_lr_scaling={FOURTH},{_SQRT2}", None, "from_scratch", (FOURTH, 2**0.5))
_counts(f"DeMo {_F},outer_lr_scaling=sqrt_world,{_SQRT2}", 2, "from_scratch", (FOURTH, 2**0.5))
for _name in ("DDP-Muon", "DDP-AdamW", "DeMo"):
    _counts(_name, None, NAMES[_name], None)


def outer_series(preset: str, c: float | tuple | None) -> str:
    """The legend's name: the preset as it is now (its own outer_lr and outer_lr_scaling), another c or scaling,
    or the mean change as it is."""
    if preset not in PRESETS:
        return preset
    if c is None:
        return f"{preset}, mean change as it is"
    scaling, c = c if isinstance(c, tuple) else ("sqrt_world", c)
    root = "√(W/2)" if scaling == "sqrt_world" else "(W/2)^¼"
    factor = root if c == 1 else f"{c:.3g}·{root}"
    own = (PRESETS[preset].get("outer_lr_scaling", "none"), PRESETS[preset].get("outer_lr", 1.0))
    if own == (scaling, c):
        return f"{preset}, the preset (× {factor})"
    return f"{preset}, outer_lr={c:.3g}{'' if scaling == 'sqrt_world' else ', ' + scaling} (× {factor})"


def _outer_colors(figures: dict) -> dict:
    """One colour per configuration in both plots."""
    names = sorted({s for s, _ in figures})
    return {name: f"C{i}" if len(names) <= 10 else plt.get_cmap("tab20")(i % 20) for i, name in enumerate(names)}


def _outer_records(results: Path):
    """(run name, W, seed, held-out loss at the last step, bytes/param/step or None) of every IID run."""
    for tag in OUTER_FILES:
        path = results / f"convergence_{tag}.json"
        if path.exists():
            for r in json.loads(path.read_text()):
                if r["ok"] and r["config"]["shards"] == "interleaved" and r["config"]["steps"] == 300:
                    w = r["config"]["world"]
                    yield r["method"], w, r["seed"], r["final_loss"], r["bytes_per_param_step"]
    levers = results / "diagnose_levers.json"  # diagnose_scaling.py's runs: no bytes in them
    for r in json.loads(levers.read_text()) if levers.exists() else []:
        yield r["config"], r["world"], r["seed"], r["evals"][-1][1], None


def load_outer(results: Path) -> dict:
    """{(series, W): {seed: (held-out loss, bytes/param/step)}}; a seed found twice must agree."""
    out: dict = {}
    for name, w, seed, loss, nbytes in _outer_records(results):
        for which in OUTER_RUNS.get((name, w), []) + OUTER_RUNS.get((name, None), []):
            seeds = out.setdefault((outer_series(*which), w), {})
            if seed in seeds and abs(seeds[seed][0] - loss) > 1e-9:
                raise SystemExit(f"{name} at W={w}, seed {seed}: two different losses in the result files")
            seeds[seed] = (loss, nbytes if seed not in seeds else seeds[seed][1] or nbytes)
    return out


def outer_ratio(figures: dict, series: str, w: int):
    """(ratio, sd, n) over the seeds both have: the mean held-out loss / DDP-Muon's mean (the tables' figure),
    and the sd of the per-seed ratios."""
    mine, muon = figures.get((series, w), {}), figures.get(("DDP-Muon", w), {})
    seeds = sorted(set(mine) & set(muon))
    if not seeds:
        return None
    ratio = statistics.mean(mine[s][0] for s in seeds) / statistics.mean(muon[s][0] for s in seeds)
    per_seed = [mine[s][0] / muon[s][0] for s in seeds]
    return ratio, (statistics.stdev(per_seed) if len(seeds) > 1 else 0.0), len(seeds)


def plot_outer_ratio(figures: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(10, 4.8))
    colors = _outer_colors(figures)
    for name in (n for n in colors if n != "DDP-Muon"):
        points = [(w, outer_ratio(figures, name, w)) for w in OUTER_WORLDS]
        points = [(w, r) for w, r in points if r]
        style = "--" if "as it is" in name else ":" if name.startswith("DDP") or name == "DeMo defaults" else "-"
        ax.errorbar(
            [w for w, _ in points],
            [r[0] for _, r in points],
            yerr=[r[1] for _, r in points],
            fmt=style,
            marker="o",
            capsize=3,
            color=colors[name],
            label=name,
        )
    ax.axhline(1.0, color="black", lw=0.8, label="DDP-Muon")
    ax.set(xlabel="ranks (W)", ylabel="held-out loss / DDP-Muon's (same seeds)", xscale="log", xticks=OUTER_WORLDS)
    ax.set_xticklabels([str(w) for w in OUTER_WORLDS])
    ax.minorticks_off()
    ax.set_title("0.46M Llama, 300 steps, IID: the gap to DDP-Muon against W (± sd of the per-seed ratios)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_outer_bytes(figures: dict, path: Path) -> None:
    colors = _outer_colors(figures)
    fig, axes = plt.subplots(1, len(WORLDS), figsize=(13, 4.4), sharey=True)
    for ax, w in zip(axes, WORLDS):
        for name, color in colors.items():
            seeds = figures.get((name, w), {})
            nbytes = [b for _, b in seeds.values() if b is not None]  # the same for every seed of a configuration
            if nbytes:
                loss = statistics.mean(v[0] for v in seeds.values())
                nbytes = statistics.mean(nbytes)
                ax.scatter([nbytes], [loss], color=color, marker="x" if "as it is" in name else "o", label=name)
        ax.set(xscale="log", xlabel="bytes/param/step each rank sends", title=f"W = {w} (IID)")
    axes[0].set_ylabel("held-out loss after 300 steps (mean over seeds)")
    handles = {h.get_label(): h for ax in axes for h in ax.collections}  # every configuration once
    axes[-1].legend(handles.values(), handles.keys(), fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0))
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
    outer = load_outer(args.results_dir)
    plot_outer_ratio(outer, args.results_dir / "outer_lr_ratio_vs_w.png")
    plot_outer_bytes(outer, args.results_dir / "outer_lr_loss_vs_bytes.png")
    for name in ("ranks300_ratio_vs_w", "ranks300_loss_vs_bytes", "outer_lr_ratio_vs_w", "outer_lr_loss_vs_bytes"):
        print(f"wrote {args.results_dir / name}.png")


if __name__ == "__main__":
    main()
