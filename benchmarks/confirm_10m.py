"""Beyond toy models, on the CPU (issue 53, item 4): an 11.2M-parameter Llama with SmolLM2's tokenizer on the Python
sources of the installed site-packages (``benchlib.code_corpus``, about 70M tokens; the last 2% of the sorted files
held out; the 136 packages of ``benchlib/confirm10m_packages.txt``, so that a package installed later does not change
it), 1000 steps at W = 4 gloo ranks: DDP-Muon, the ``from_scratch`` preset, DDP-AdamW and the
``from_scratch_few_bytes`` preset, each through ``convergence.py`` (its own tag: ``convergence_confirm10m_<name>``).

The model: hidden 192, intermediate 512, 4 layers of 3 heads, SmolLM2's vocabulary of 49,152 with the output head
tied to the embeddings (as SmolLM2's), seq 128. Rank batch 4 x 128 (2,048 tokens a step at W = 4), warm-up 50 and
cosine to 0.1 x lr; held-out loss every 50 steps on 64 windows. The learning rates are ``make gpu-quality``'s
(``scripts/gpu_quality.sh``): DDP-Muon 8e-3, the presets 2e-2, DDP-AdamW 1e-3; the presets' settings are read from
``hf_demo.settings.PRESETS``.

A run takes hours on a busy 2-core machine, so runs checkpoint every 10 steps and resume
(``convergence.py --checkpoint-every``, ``benchlib.run_checkpoint``): a session starts what it can and stops at
``--minutes``; the next one runs the same command and goes on.

    python benchmarks/confirm_10m.py run --jobs 2 --minutes 90   # in priority order, 2 runs at a time
    python benchmarks/confirm_10m.py report                      # finished and unfinished runs, ratio to DDP-Muon
    touch ~/.cache/hf-demo-bench/checkpoints/STOP                # every run stops at its next checkpoint

The corpus is the packages' sources at the versions installed: another install (``transformers`` 5.25 where the
recorded runs had 5.24, say) makes another corpus and held-out split. ``run`` refuses to add runs to the recorded
results on a corpus of another size than theirs (:data:`RECORDED_TOKENS`); a new series goes into its own
``--results-dir`` with every method run again. ``report`` refuses runs whose held-out losses at step 0 differ.

``report`` writes ``results/convergence_confirm10m.{md,png}``: each method's held-out loss at the last step it
reached, its ratio to DDP-Muon's at that step, bytes/param/step and wall time (with the machine's load).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import convergence  # noqa: E402
from benchlib.run_checkpoint import default_root, read_progress  # noqa: E402
from hf_demo.settings import PRESETS  # noqa: E402

STEPS = 1000
# the corpus the recorded runs (benchmarks/results/convergence_confirm10m_*.json) trained on: the packages of
# confirm10m_packages.txt at the versions installed then. Other versions give another corpus (and held-out split),
# whose runs are not comparable with those.
RECORDED_TOKENS = 70_844_677
PACKAGES = HERE / "benchlib" / "confirm10m_packages.txt"
COMMON = (
    "--corpus site-packages --shards interleaved --world 4 --threads 1 --tie-embeddings "
    "--hidden 192 --intermediate 512 --layers 4 --heads 3 --seq-len 128 --batch-size 4 --eval-batches 16 "
    f"--steps {STEPS} --warmup 50 --eval-every 50 --checkpoint-every 10 --seeds 0 --timeout-s 172800"
).split() + ["--corpus-packages", str(PACKAGES)]


def preset_config(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in PRESETS[name].items())


# priority order: what a session that cannot finish everything runs first
METHODS = {
    "muon": ["--methods", "muon", "--lrs", "muon=8e-3"],
    "from_scratch": ["--methods", "demo", "--lrs", "demo=2e-2", "--demo-configs", preset_config("from_scratch")],
    "adamw": ["--methods", "adamw", "--lrs", "adamw=1e-3"],
    "from_scratch_few_bytes": [
        *("--methods", "demo", "--lrs", "demo=2e-2"),
        *("--demo-configs", preset_config("from_scratch_few_bytes")),
    ],
}
LABELS = {
    "muon": "DDP-Muon",
    "from_scratch": "`from_scratch` preset",
    "adamw": "DDP-AdamW",
    "from_scratch_few_bytes": "`from_scratch_few_bytes` preset",
}


def argv(name: str, results_dir: str) -> list[str]:
    return [*COMMON, *METHODS[name], "--tag", f"confirm10m_{name}", "--results-dir", results_dir]


def run_all(args) -> None:
    """Each method's ``convergence.py --resume`` in priority order, ``--jobs`` at a time, until ``--minutes``."""
    check_corpus(args.results_dir)
    todo, running = list(args.methods), []
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + 60 * args.minutes if args.minutes else None
    while todo or running:
        while todo and len(running) < args.jobs and (deadline is None or time.time() < deadline):
            name = todo.pop(0)
            cmd = [sys.executable, str(HERE / "convergence.py"), *argv(name, args.results_dir), "--resume"]
            cmd += ["--stop-after-minutes", f"{(deadline - time.time()) / 60:.2f}"] if deadline else []
            log = open(logs / f"confirm10m_{name}.log", "a")
            print(f"[confirm_10m] {name}: {' '.join(cmd)} (log {log.name})", flush=True)
            running.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(10)
        for item in [r for r in running if r[1].poll() is not None]:
            print(f"[confirm_10m] {item[0]}: exit {item[1].returncode}", flush=True)
            item[2].close()
            running.remove(item)
        if deadline is not None and time.time() > deadline and not running:
            break
    report(args)


def check_corpus(results_dir: str, tokens: int | None = None) -> None:
    """Refuse to add runs to the recorded results (the default ``--results-dir``) on another corpus than theirs."""
    if Path(results_dir).resolve() != Path(convergence.RESULTS).resolve():
        return
    if tokens is None:
        from benchlib.code_corpus import code_tokens, read_packages

        tokens = code_tokens(packages=read_packages(PACKAGES))[0].numel()
    if tokens != RECORDED_TOKENS:
        raise SystemExit(
            f"confirm_10m.py: the installed packages of confirm10m_packages.txt make a corpus of {tokens:,} tokens "
            f"here; the recorded runs in {results_dir} trained on {RECORDED_TOKENS:,}: other versions of the "
            "packages, another corpus and held-out split, so runs here are not comparable with those. Run every "
            "method on this corpus into another --results-dir, or install the versions the recorded runs used."
        )


def check_same_start(found: dict) -> None:
    """Every method starts from the same init: a different held-out loss at step 0 means another held-out split."""
    starts = {name: r["evals"][0][1] for name, r in found.items() if r["evals"] and r["evals"][0][0] == 0}
    if len(starts) > 1 and max(starts.values()) - min(starts.values()) > 1e-6:
        given = ", ".join(f"{LABELS[n]} {v:.6f}" for n, v in starts.items())
        raise SystemExit(
            f"confirm_10m.py: the runs' held-out losses at step 0 differ ({given}) though every run starts from "
            "the same init: they were evaluated on different corpora (other versions of the installed packages). "
            "Compare only runs made on one corpus: put each corpus's runs in their own --results-dir."
        )


def runs(results_dir: str) -> dict[str, dict]:
    """Each method's run: the finished one from its JSON, else the unfinished one's progress at its checkpoint."""
    out = {}
    for name in METHODS:
        path = Path(results_dir) / f"convergence_confirm10m_{name}.json"
        done = [r for r in json.loads(path.read_text())] if path.exists() else []
        done = [r for r in done if r.get("ok")]
        if done:
            out[name] = dict(done[-1], step=len(done[-1]["train_loss"]))
            continue
        parsed = convergence.parse_args(argv(name, results_dir))
        keys = [cfg.key() for cfg in convergence.build_plan(parsed)]
        progress = read_progress(Path(parsed.checkpoint_dir) if parsed.checkpoint_dir else default_root(), keys)
        if progress:
            out[name] = next(iter(progress.values()))
    return out


def loss_at(evals, step: int) -> float | None:
    return next((loss for s, loss in evals if s == step), None)


def report(args) -> str:
    found = runs(args.results_dir)
    check_same_start(found)
    muon = found.get("muon")
    lines = [
        "# Beyond toy models: an 11.2M-parameter Llama, SmolLM2's tokenizer, site-packages' sources, W = 4",
        "",
        "| method | steps trained | last held-out loss (its step) | / DDP-Muon at that step | bytes/param/step | "
        "wall, under the load noted |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in found.items():
        step = r["evals"][-1][0]
        ref = loss_at(muon["evals"], step) if muon else None
        ratio = f"{r['evals'][-1][1] / ref:.3f}" if ref else "– (DDP-Muon not there yet)"
        segs = r.get("segments", [])
        wall = sum(s["wall_s"] for s in segs)
        load = sum(s["load"] * s["wall_s"] for s in segs) / wall if wall else float("nan")
        lines.append(
            f"| {LABELS[name]} | {r['step']}/{r['config']['steps']} | {r['evals'][-1][1]:.4f} ({step}) | {ratio} | "
            f"{r['bytes_per_param_step']:.4f} | {wall / 3600:.2f} h, {wall / r['step']:.0f} s/step ({len(segs)} "
            f"stretches, mean load {load:.0f}) |"
        )
    missing = [LABELS[n] for n in METHODS if n not in found]
    lines += ["", f"Not started: {', '.join(missing)}." if missing else "Every method has started.", ""]
    lines += _common_steps(found)
    text = "\n".join(lines) + "\n"
    Path(args.results_dir).mkdir(parents=True, exist_ok=True)
    Path(args.results_dir, "convergence_confirm10m.md").write_text(text)
    _plot(found, Path(args.results_dir, "convergence_confirm10m.png"))
    print(text)
    return text


def _common_steps(found: dict) -> list[str]:
    """Held-out loss of every started method at each evaluation step they all reached."""
    if not found:
        return []
    steps = sorted(set.intersection(*({s for s, _ in r["evals"]} for r in found.values())))
    names = list(found)
    lines = ["| step | " + " | ".join(LABELS[n] for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for step in steps[1:]:
        lines.append(f"| {step} | " + " | ".join(f"{loss_at(found[n]['evals'], step):.4f}" for n in names) + " |")
    return lines


def _plot(found: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in found.items():
        steps, losses = zip(*r["evals"][1:]) if len(r["evals"]) > 1 else ((), ())
        ax.plot(steps, losses, marker="o", ms=3, label=f"{LABELS[name]} ({r['bytes_per_param_step']:.4g} B/p/s)")
    ax.set(xlabel="step", ylabel="held-out loss", title="11.2M Llama, SmolLM2 tokens, W = 4 (CPU)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv_=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("run", "report"))
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS), help="in this order")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each has 4 ranks)")
    p.add_argument("--minutes", type=float, default=None, help="stop every run at its next checkpoint after this")
    p.add_argument("--results-dir", default=str(convergence.RESULTS))
    p.add_argument("--log-dir", default=os.environ.get("CONFIRM_10M_LOGS", str(default_root().parent / "logs")))
    args = p.parse_args(argv_)
    run_all(args) if args.command == "run" else report(args)


if __name__ == "__main__":
    main()
