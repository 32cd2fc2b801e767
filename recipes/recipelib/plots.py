"""training.png: the training and held-out loss, and the bytes sent against a dense all-reduce."""

from __future__ import annotations

from recipelib.results import loss_curve


def display_name(optim: str) -> str:
    return "DeMo" if optim == "demo" else optim


SMOOTHING = 0.8  # of the training-loss curve: a bias-corrected EMA, as TensorBoard's smoothing slider


def ema(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Bias-corrected exponential moving average (TensorBoard's smoothing): no pull towards 0 at the start."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight**i))
    return out


def plot_data(results: dict) -> dict:
    """What training.png draws, from the results (layout above); the plot itself only draws this.

    train_steps/train_loss: every logged training loss (the mean over the ranks of that step's batch loss);
    train_smoothed: their EMA (``SMOOTHING``); eval_steps/eval_loss: every evaluation (before, in between,
    after); comm_steps with demo_mb/dense_mb: megabytes rank 0 sent up to each step, DeMo's measured
    counters (None without DeMo) against a dense fp32 all-reduce (4 bytes/parameter/step); saving: dense/DeMo.
    """
    log_history = results["log_history"]
    train = loss_curve(log_history)
    evals = sorted({r["step"]: r["eval_loss"] for r in log_history if "eval_loss" in r and "step" in r}.items())
    sent = sorted({r["step"]: r["demo/total_bytes_sent"] for r in log_history if "demo/total_bytes_sent" in r}.items())
    steps = [s for s, _ in sent if s > 0] or list(range(1, results["global_step"] + 1))
    comm = results.get("communication") or {}
    demo = comm.get("method") == "DeMo"
    return {
        "title": f"{display_name(results['optim'])} fine-tune of {results['model']} on {results['data']}\n"
        f"{results['world_size']} processes, {results['global_step']} steps",
        "loss_title": "it learns: held-out loss " + " -> ".join(f"{v:.3f}" for _, v in evals[:: max(len(evals) - 1, 1)])
        if len(evals) > 1
        else "loss",
        "eval_label": "held-out loss"
        + (f" (the same {results['eval_samples']} examples each time)" if results.get("eval_samples") else ""),
        "train_steps": [s for s, _ in train],
        "train_loss": [v for _, v in train],
        "train_smoothed": ema([v for _, v in train]),
        "eval_steps": [s for s, _ in evals],
        "eval_loss": [v for _, v in evals],
        "comm_steps": steps,
        "dense_mb": [4 * results["parameters"] * s / 1e6 for s in steps],
        "demo_mb": [b / 1e6 for s, b in sent if s > 0] if demo and sent else None,
        "saving": comm.get("saving") if demo else None,
    }


def plot(results: dict, path: str) -> None:
    """Draw training.png (:func:`plot_data`): the losses on the left, the bytes sent on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    d = plot_data(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    fig.suptitle(d["title"], fontsize=11)
    _draw_losses(ax1, d)
    _draw_communication(ax2, d, display_name(results["optim"]))
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(-0.5, max(results["global_step"], 1) + 0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_losses(ax, d: dict) -> None:
    if d["train_steps"]:
        label = "training loss of each step (its own batch)"
        ax.plot(d["train_steps"], d["train_loss"], color="tab:blue", alpha=0.3, lw=1, marker=".", ms=4, label=label)
        label = f"training loss, smoothed (EMA {SMOOTHING})"
        ax.plot(d["train_steps"], d["train_smoothed"], color="tab:blue", lw=2.2, label=label)
    if d["eval_steps"]:
        ax.plot(
            d["eval_steps"], d["eval_loss"], color="tab:red", marker="o", ms=7, lw=2.5, zorder=3, label=d["eval_label"]
        )
        for s, v in zip(d["eval_steps"], d["eval_loss"]):
            ax.annotate(
                f"{v:.3f}", (s, v), textcoords="offset points", xytext=(0, 9), ha="center", color="tab:red", fontsize=9
            )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss (lower is better)")
    ax.set_title(d["loss_title"])
    low, high = ax.get_ylim()
    ax.set_ylim(low - 0.07 * (high - low), high)  # room for the note
    note = "each step trains on other files, so its loss moves with them; the held-out loss measures learning"
    ax.text(0.01, 0.015, note, transform=ax.transAxes, fontsize=7.5, color="dimgray")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)


def _draw_communication(ax, d: dict, name: str) -> None:
    steps, dense, last = d["comm_steps"], d["dense_mb"], d["comm_steps"][-1]
    ax.plot(steps, dense, color="tab:gray", lw=2, label="dense fp32 all-reduce (DDP)")
    ax.annotate(
        f"{dense[-1]:,.0f} MB", (last, dense[-1]), textcoords="offset points", xytext=(-4, 6), ha="right",
        color="tab:gray", fontsize=9,
    )  # fmt: skip
    if d["demo_mb"]:
        sent = d["demo_mb"]
        ax.plot(steps, sent, color="tab:green", lw=2, label=f"{name} (measured)")
        ax.annotate(
            f"{sent[-1]:,.1f} MB", (last, sent[-1]), textcoords="offset points", xytext=(-4, -14), ha="right",
            color="tab:green", fontsize=9,
        )  # fmt: skip
        arrow = {"arrowstyle": "<->", "color": "black", "lw": 1.2}
        ax.annotate("", xy=(last, sent[-1]), xytext=(last, dense[-1]), arrowprops=arrow)
        middle = (sent[-1] * dense[-1]) ** 0.5  # halfway on the log scale
        ax.text(last, middle, f"  {d['saving']:.0f}x less ", ha="right", va="center", fontsize=13, fontweight="bold")
    ax.set_yscale("log")
    ax.set_ylim(top=dense[-1] * 4)  # room for the labels
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("MB sent per rank, cumulative (log scale)")
    ax.set_title("what it saved: communication")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=9, loc="upper left")
