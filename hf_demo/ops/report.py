"""``hf-demo report OUTPUT_DIR``: one self-contained HTML page (plots inline as PNG) of a run's logs.

It reads, from a finished or a running run: the log rows (``ops/log_history.jsonl``, written at every
logging step by :class:`~hf_demo.ops.callbacks.DeMoOpsCallback`; else ``trainer_state.json`` of the output
folder or of its newest checkpoint), the per-step table if one was kept (``ops/steps-rank*.csv`` or
``ops/steps/*.parquet``) and the alerts (``ops/alerts-rank*.jsonl``). The page: loss (train and held-out),
bytes per step against a dense all-reduce, the step-time split, the tier timeline, the alerts, the cost.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
from pathlib import Path

from hf_demo.ops.optional import require

PARTS = (  # (log-row key, per-step column, label)
    ("ops/forward_backward_s", "forward_backward_s", "forward+backward"),
    ("ops/demo_compute_s", "demo_compute_s", "DeMo compute"),
    ("ops/exchange_wait_s", "exchange_s", "waiting on the exchange"),
    ("ops/other_s", "other_s", "outside the step"),
)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def log_rows(folder: Path) -> tuple[list[dict], str]:
    """The run's log rows and where they came from."""
    live = folder / "ops" / "log_history.jsonl"
    if live.is_file():
        return _jsonl(live), str(live)
    states = [folder / "trainer_state.json"] + sorted(
        folder.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[-1]), reverse=True
    )
    for state in states:
        if state.is_file():
            return json.loads(state.read_text())["log_history"], str(state)
    raise FileNotFoundError(
        f"{folder}: no ops/log_history.jsonl, trainer_state.json or checkpoint-*/trainer_state.json; is this the "
        "output_dir of a Trainer run (DeMoTrainer writes ops/log_history.jsonl from the first logging step)?"
    )


def step_rows(folder: Path) -> list[dict]:
    """The per-step, per-rank table, if the run kept one (CSV, or Parquet read with pandas)."""
    rows: list[dict] = []
    for path in sorted((folder / "ops").glob("steps-rank*.csv")):
        with open(path) as f:
            rows += [{k: _num(v) for k, v in r.items()} for r in csv.DictReader(f)]
    parts = sorted((folder / "ops" / "steps").glob("*.parquet"))
    if parts:
        pandas = require("pandas", "reading the Parquet log")
        rows += pandas.concat([pandas.read_parquet(p) for p in parts]).to_dict("records")
    return rows


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def alerts(folder: Path) -> list[dict]:
    found = [a for p in sorted((folder / "ops").glob("alerts-rank*.jsonl")) for a in _jsonl(p)]
    return sorted(found, key=lambda a: (a["step"], a["rank"]))


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _per_step_mean(steps: list[dict], column: str) -> tuple[list[float], list[float]]:
    by_step: dict[float, list[float]] = {}
    for r in steps:
        v = r.get(column)
        if isinstance(v, (int, float)) and math.isfinite(v):
            by_step.setdefault(r["step"], []).append(v)
    xs = sorted(by_step)
    return xs, [sum(by_step[x]) / len(by_step[x]) for x in xs]


def figures(rows: list[dict], steps: list[dict], found: list[dict]) -> list[tuple[str, str]]:
    """(title, base64 PNG) of every plot there is data for."""
    require("matplotlib", "hf-demo report's plots")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []

    def plot(title, series, ylabel, logy=False, kind="line", marks=()):
        fig, ax = plt.subplots(figsize=(9, 3.2))
        for label, (xs, ys) in series:
            if xs:
                (ax.step if kind == "step" else ax.plot)(
                    xs, ys, label=label, **({"where": "post"} if kind == "step" else {})
                )
        for step in marks:
            ax.axvline(step, color="tab:red", alpha=0.35, linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        out.append((title, _png(fig)))
        plt.close(fig)

    marks = sorted({a["step"] for a in found})
    losses = [("train", _series(rows, "loss")), ("held-out", _series(rows, "eval_loss"))]
    values = [v for _, (_, ys) in losses for v in ys if v > 0]
    spread = bool(values) and max(values) > 100 * min(values)  # a spike: on a log scale the rest stays readable
    plot("Loss", losses, "loss", logy=spread, marks=marks)
    dense = _series(rows, "demo/dense_allreduce_bytes_per_step")
    traffic = [
        ("DeMo sent", _series(rows, "demo/bytes_sent_per_step")),
        ("DeMo received", _series(rows, "demo/bytes_received_per_step")),
        ("dense fp32 all-reduce", dense),
    ]
    plot("Bytes per step and rank", traffic, "bytes", logy=True)
    if steps:
        split = [(label, _per_step_mean(steps, column)) for _, column, label in PARTS]
    else:
        split = [(label, _series(rows, key)) for key, _, label in PARTS]
    plot("Step-time split (mean over ranks)", split, "seconds", marks=marks)
    tier = _per_step_mean(steps, "tier") if steps else _series(rows, "demo/tier")
    plot("Tier timeline (0: the configured settings)", [("tier", tier)], "tier", kind="step")
    cost = _series(rows, "ops/cost")
    if cost[0]:
        plot("Running cost estimate (every rank)", [("cost", cost)], "cost")
    return out


def _alert_table(found: list[dict]) -> str:
    if not found:
        return "<p>No alerts.</p>"
    head = "<tr><th>step</th><th>rank</th><th>node</th><th>kind</th><th>what</th></tr>"
    body = "".join(
        f"<tr class='{html.escape(a.get('severity', 'warning'))}'><td>{a['step']}</td><td>{a['rank']}</td>"
        f"<td>{a['node']}</td><td>{html.escape(a['kind'])}</td><td>{html.escape(a['message'])}</td></tr>"
        for a in found
    )
    return f"<table>{head}{body}</table>"


def _summary(rows: list[dict], found: list[dict]) -> list[tuple[str, str]]:
    train = [r for r in rows if "loss" in r]
    last = train[-1] if train else {}
    evals = [r for r in rows if "eval_loss" in r]
    out = [("steps logged", str(max((r.get("step", 0) for r in rows), default=0)))]
    if "loss" in last:
        out.append(("last training loss", f"{last['loss']:.4g}"))
    if evals:
        out.append(("last held-out loss", f"{evals[-1]['eval_loss']:.4g}"))
    if "demo/ratio_to_dense" in last:
        out.append(("bytes sent / dense all-reduce", f"{last['demo/ratio_to_dense']:.4g}"))
    if "ops/cost" in last:
        out.append(("cost so far", f"{last['ops/cost']:.4g}"))
    out.append(("alerts", str(len(found))))
    return out


STYLE = """body{font-family:system-ui,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px}h2{font-size:17px;margin-top:28px}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}tr.warning td{background:#fff3e0}
tr.info td{background:#e8f4fd}img{max-width:100%;border:1px solid #eee}.k{color:#555}"""


def render(folder: str | Path) -> str:
    folder = Path(folder)
    rows, source = log_rows(folder)
    steps, found = step_rows(folder), alerts(folder)
    summary = "".join(
        f"<tr><td class='k'>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in _summary(rows, found)
    )
    plots = "".join(
        f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' src='data:image/png;base64,{png}'>"
        for title, png in figures(rows, steps, found)
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>hf-demo run report: {html.escape(folder.name)}"
        f"</title><style>{STYLE}</style></head><body><h1>hf-demo run report: {html.escape(folder.name)}</h1>"
        f"<p class='k'>From {html.escape(source)}{' and the per-step table' if steps else ''}.</p>"
        f"<table>{summary}</table>{plots}<h2>Alerts</h2>{_alert_table(found)}</body></html>"
    )


def write(folder: str | Path, out: str | Path | None = None) -> Path:
    path = Path(out) if out else Path(folder) / "hf-demo-report.html"
    path.write_text(render(folder))
    return path
