"""The end of a recipe run: results.json, a plot of training, and a summary a person can read."""
from __future__ import annotations

import json
import os


def communication(log_history: list[dict], parameters: int, steps: int) -> dict:
    """Bytes this rank sent (DeMo's counters) against a dense fp32 all-reduce of the same model."""
    totals = [row for row in log_history if "demo/total_bytes_sent" in row]
    dense = 4 * parameters * steps
    if not totals:
        return {"method": "dense all-reduce (DDP)", "bytes_sent": dense, "dense_bytes": dense, "saving": 1.0}
    sent = totals[-1]["demo/total_bytes_sent"]
    return {"method": "DeMo", "bytes_sent": sent, "dense_bytes": dense, "saving": dense / max(sent, 1),
            "bytes_per_param_per_step": sent / max(steps, 1) / parameters}


def summarize_and_plot(results: dict, log_history: list[dict], output_dir: str) -> None:
    os.makedirs(output_dir, exist_ok=True)
    results["communication"] = communication(log_history, results["parameters"], results["global_step"])
    results["log_history"] = log_history
    plot = os.path.join(output_dir, "training.png")
    try:
        _plot(log_history, results, plot)
        results["plot"] = plot
    except ImportError:
        results["plot"] = None
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2, default=str)
    c = results["communication"]
    b, a = results["before"], results["after"]
    print("\n" + "=" * 78)
    print(f"{results['optim']} fine-tune of {results['model']} on {results['data']} "
          f"({results['world_size']} processes, {results['global_step']} steps)")
    print(f"  perplexity          {b['perplexity']:10.3f} -> {a['perplexity']:.3f}")
    print(f"  next-token accuracy {b['next_token_accuracy']:10.4f} -> {a['next_token_accuracy']:.4f}")
    if c["method"] == "DeMo":
        print(f"  communication       rank 0 sent {c['bytes_sent'] / 1e6:.2f} MB "
              f"({c['bytes_per_param_per_step']:.4f} bytes/param/step); a dense fp32 all-reduce would have sent "
              f"{c['dense_bytes'] / 1e6:.1f} MB: {c['saving']:.0f}x less")
    else:
        print(f"  communication       dense all-reduce, about {c['dense_bytes'] / 1e6:.1f} MB per rank")
    print(f"  plot                {results['plot']}")
    print(f"  model (checkpoint)  {output_dir}")
    print(f"  results             {os.path.join(output_dir, 'results.json')}")
    print("=" * 78)


def _plot(log_history, results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    train = [(r["step"], r["loss"]) for r in log_history if "loss" in r and "step" in r]
    if train:
        ax1.plot(*zip(*train), label="training loss")
    ax1.scatter([0, results["global_step"]], [results["before"]["loss"], results["after"]["loss"]],
                color="red", zorder=3, label="eval loss (before / after)")
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("loss")
    ax1.legend()
    ax1.set_title(f"{results['optim']}: loss")
    sent = [(r["step"], r["demo/total_bytes_sent"]) for r in log_history if "demo/total_bytes_sent" in r]
    steps = [s for s, _ in sent] or [results["global_step"]]
    ax2.plot(steps, [4 * results["parameters"] * s / 1e6 for s in steps], label="dense fp32 all-reduce")
    if sent:
        ax2.plot(steps, [b / 1e6 for _, b in sent], label="DeMo (measured)")
    ax2.set_yscale("log")
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("MB sent per rank (cumulative)")
    ax2.legend()
    ax2.set_title("communication")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
