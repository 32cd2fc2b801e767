"""``hf-demo report OUTPUT_DIR``: one self-contained HTML page (plots inline as PNG) of a run's logs.

It reads, from a finished or a running run: the log rows (``ops/log_history.jsonl``, written at every
logging step by :class:`~hf_demo.ops.callbacks.DeMoOpsCallback`; else ``trainer_state.json`` of the output
folder or of its newest checkpoint), the per-step table if one was kept (``ops/steps-rank*.csv`` or
``ops/steps/*.parquet``), the alerts (``ops/alerts-rank*.jsonl``) and the run's configuration (``ops/run.json``).
The page: the run's figures over the whole run (bytes sent against a dense all-reduce, tokens per second),
its configuration, loss (train and held-out), bytes per step against a dense all-reduce, the step-time split,
every rank's own time and wait (the straggler stands out), tokens per second, the tier timeline, for elastic
runs the quorum over the steps with the replicas lost and joined and the samples lost and unread, the cost,
and the alerts (a table, and labelled markers on the plots).

It opens with how the run ended (:func:`ending`): finished (Trainer's end-of-training log row, ``train_runtime``,
with no training row after it), else stopped early (or still running) after the last step seen. Logs of a killed
run read: a line cut mid-write (JSON lines, CSV rows), a Parquet part or a checkpoint's state that does not read
is left out and named on the page.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from hf_demo.ops.optional import require

PARTS = (  # (log-row key, per-step column, label)
    ("ops/forward_backward_s", "forward_backward_s", "forward+backward"),
    ("ops/demo_compute_s", "demo_compute_s", "DeMo compute"),
    ("ops/exchange_wait_s", "exchange_s", "waiting on the exchange"),
    ("ops/other_s", "other_s", "outside the step"),
    ("ops/evaluate_s", "evaluate_s", "evaluation"),
    ("ops/save_s", "save_s", "checkpoints"),
    ("ops/log_s", "log_s", "logging"),
)


END_KEY = "train_runtime"  # Trainer's end-of-training log row (train_runtime, train_loss, ...): a run that finished


@dataclass
class Log:
    """What a log file held: its rows, and the lines that were not whole JSON objects (1-based; a line cut when
    the process was killed while writing it)."""

    rows: list[dict] = field(default_factory=list)
    source: str = ""
    cut: list[int] = field(default_factory=list)
    lines: int = 0  # the number of the last line that is not empty
    unreadable: list[str] = field(default_factory=list)  # newer trainer_state.json files that did not read whole


def read_jsonl(path: Path) -> Log:
    """A JSON-lines file, every whole line read; a line cut mid-write (SIGKILL) is left out and named in ``cut``."""
    log = Log(source=str(path))
    if not path.is_file():
        return log
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        log.lines = n
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            log.rows.append(row)
        else:
            log.cut.append(n)
    return log


def read_log(folder: Path) -> Log:
    """The run's log rows and where they came from: ``ops/log_history.jsonl``, else the newest
    ``trainer_state.json`` that reads whole (newer ones cut by a kill while a checkpoint was saved: ``unreadable``)."""
    live = folder / "ops" / "log_history.jsonl"
    if live.is_file():
        return read_jsonl(live)
    states = [folder / "trainer_state.json"] + sorted(
        folder.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[-1]), reverse=True
    )
    broken: list[str] = []
    for state in states:
        if state.is_file():
            try:
                return Log(json.loads(state.read_text(errors="replace"))["log_history"], str(state), unreadable=broken)
            except (json.JSONDecodeError, KeyError, TypeError):
                broken.append(str(state))
    if broken:
        raise FileNotFoundError(f"{folder}: no trainer_state.json reads whole ({', '.join(broken)}) and there is no "
                                "ops/log_history.jsonl")  # fmt: skip
    raise FileNotFoundError(
        f"{folder}: no ops/log_history.jsonl, trainer_state.json or checkpoint-*/trainer_state.json; is this the "
        "output_dir of a Trainer run (DeMoTrainer writes ops/log_history.jsonl from the first logging step)?"
    )


def log_rows(folder: Path) -> tuple[list[dict], str]:
    """The run's log rows and where they came from."""
    log = read_log(folder)
    return log.rows, log.source


def step_rows(folder: Path, skipped: list[str] | None = None) -> list[dict]:
    """The per-step, per-rank table, if the run kept one (CSV, or Parquet read with pandas). A CSV row cut short
    and a Parquet part that does not read (a kill while it was written) are left out and named in ``skipped``."""
    skipped = [] if skipped is None else skipped
    rows: list[dict] = []
    for path in sorted((folder / "ops").glob("steps-rank*.csv")):
        text = path.read_text(errors="replace")
        table = list(csv.DictReader(io.StringIO(text, newline="")))
        for n, r in enumerate(table, 2):
            whole = None not in r and None not in r.values()  # as many cells as the header
            if not whole or (n == len(table) + 1 and not text.endswith("\n")):  # or the last line, unended
                skipped.append(f"line {n} of {path}")
                continue
            rows.append({k: _num(v) for k, v in r.items()})
    parts = sorted((folder / "ops" / "steps").glob("*.parquet"))
    if parts:
        pandas = require("pandas", "reading the Parquet log")
        tables = []
        for part in parts:
            try:
                tables.append(pandas.read_parquet(part))
            except Exception as exc:  # noqa: BLE001 - pyarrow's ArrowInvalid/OSError for a part cut short
                skipped.append(f"{part} ({type(exc).__name__})")
        rows += pandas.concat(tables).to_dict("records") if tables else []
    return rows


def _num(v):
    if v == "":
        return None  # an empty cell: a missing value
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def run_config(folder: Path) -> dict:
    """``ops/run.json`` (written by DeMoOpsCallback at the first step), or {}."""
    path = folder / "ops" / "run.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def alerts(folder: Path, skipped: list[str] | None = None) -> list[dict]:
    """Every rank's alerts; a line cut mid-write is left out and named in ``skipped``."""
    found = []
    for path in sorted((folder / "ops").glob("alerts-rank*.jsonl")):
        log = read_jsonl(path)
        found += log.rows
        if skipped is not None:
            skipped += [f"line {n} of {path}" for n in log.cut]
    return sorted(found, key=lambda a: (a["step"], a["rank"]))


def _last_step(rows) -> int | None:
    seen = [r["step"] for r in rows if isinstance(r.get("step"), (int, float)) and math.isfinite(r["step"])]
    return int(max(seen)) if seen else None


def ending(log: Log, steps: list[dict], skipped: list[str]) -> tuple[str, list[str]]:
    """How the run ended, as the page's headline (``finished at step N`` or ``stopped early after step N``) and
    its notes. It finished where Trainer's end-of-training row is there with no training row after it; else it
    stopped early (a kill, a crash) or is still running: where, from the last step in the log rows and in the
    per-step table, and what of the logs was cut mid-write."""
    ends = [i for i, r in enumerate(log.rows) if END_KEY in r]
    last, table = _last_step(log.rows), _last_step(steps)
    finished = bool(ends) and (_last_step(log.rows[ends[-1] :]) or 0) <= (log.rows[ends[-1]].get("step") or 0)
    notes = []
    if finished:
        headline = f"finished at step {log.rows[ends[-1]].get('step')}"
        notes.append(f"The run finished: Trainer's end-of-training record ({END_KEY}) is in {log.source}.")
    else:
        at = max(x for x in (last, table, 0) if x is not None)
        headline = f"stopped early after step {at}"
        seen = f"the last step in the log rows is {last}" + (f", in the per-step table {table}" if table else "")
        notes.append(f"The run stopped early (or is still running): {log.source} has no end-of-training record "
                     f"(Trainer's {END_KEY} row); {seen}.")  # fmt: skip
    if log.cut and log.cut[-1] == log.lines:
        notes.append(f"The last line of {log.source} (line {log.lines}) was cut mid-write: the process was killed "
                     "while writing it. It is left out.")  # fmt: skip
    earlier = [n for n in log.cut if n != log.lines]
    if earlier:
        notes.append(f"Line(s) {', '.join(map(str, earlier))} of {log.source} are not whole JSON (cut when an "
                     "earlier attempt was killed); left out.")  # fmt: skip
    notes += [f"{path} did not read whole (a kill while a checkpoint was saved); an older one was read."
              for path in log.unreadable]  # fmt: skip
    if skipped:
        notes.append(f"Left out, cut mid-write: {'; '.join(skipped)}.")
    return headline, notes


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


def _per_rank(steps: list[dict], column: str) -> list[tuple[str, tuple[list[float], list[float]]]]:
    ranks = sorted({r["rank"] for r in steps if isinstance(r.get("rank"), (int, float))})
    return [(f"rank {int(k)}", _per_step_mean([r for r in steps if r.get("rank") == k], column)) for k in ranks]


def _with_own_time(steps: list[dict]) -> list[dict]:
    """Rows with ``own_s`` (tables written before it was a column: step and outside time less the wait)."""
    out = []
    for r in steps:
        if not isinstance(r.get("own_s"), (int, float)) and all(
            isinstance(r.get(k), (int, float)) for k in ("step_s", "other_s", "exchange_s")
        ):
            r = {**r, "own_s": max(0.0, r["step_s"] + r["other_s"] - r["exchange_s"])}
        out.append(r)
    return out


def alert_marks(found: list[dict]) -> list[tuple[float, str]]:
    """(step, label) of each alert marker: the kinds raised at that step, with the ranks."""
    by_step: dict = {}
    for a in found:
        by_step.setdefault(a["step"], set()).add(f"{a['kind']} r{a['rank']}")
    return [(step, ", ".join(sorted(labels))) for step, labels in sorted(by_step.items())]


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
        for step, label in marks:
            ax.axvline(step, color="tab:red", alpha=0.35, linewidth=1)
            ax.annotate(label, (step, 1), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                        color="tab:red", ha="right", va="top")  # fmt: skip
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
        out.append((title, _png(fig)))
        plt.close(fig)

    marks = alert_marks(found)
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
    if steps:
        steps = _with_own_time(steps)
        plot("Own time per rank (step and outside it, less the wait: the straggler is highest)",
             _per_rank(steps, "own_s"), "seconds", marks=marks)  # fmt: skip
        plot("Wait on the exchange per rank", _per_rank(steps, "exchange_s"), "seconds", marks=marks)
    tokens = _series(rows, "ops/tokens_per_s")
    if tokens[0]:
        plot("Tokens per second (every rank)", [("tokens/s", tokens)], "tokens/s", marks=marks)
    tier = _per_step_mean(steps, "tier") if steps else _series(rows, "demo/tier")
    plot("Tier timeline (0: the configured settings)", [("tier", tier)], "tier", kind="step")
    quorum = _series(rows, "ops/quorum")
    if quorum[0]:
        plot("Elastic: replicas in the quorum", [("quorum", quorum)], "replicas", kind="step", marks=marks)
    cost = _series(rows, "ops/cost")
    if cost[0]:
        plot("Running cost estimate (every rank)", [("cost", cost)], "cost")
    return out


def _alert_table(found: list[dict]) -> str:
    if not found:
        return "<p>No alerts.</p>"
    head = "<tr><th>step</th><th>time (UTC)</th><th>rank</th><th>node</th><th>kind</th><th>what</th></tr>"
    body = "".join(
        f"<tr class='{html.escape(a.get('severity', 'warning'))}'><td>{a['step']}</td>"
        f"<td>{html.escape(str(a.get('time_utc', '')))}</td><td>{a['rank']}</td>"
        f"<td>{a['node']}</td><td>{html.escape(a['kind'])}</td><td>{html.escape(a['message'])}</td></tr>"
        for a in found
    )
    return f"<table>{head}{body}</table>"


def _numbers(steps: list[dict], column: str) -> list[float]:
    return [r[column] for r in steps if isinstance(r.get(column), (int, float)) and math.isfinite(r[column])]


def run_ratio(rows: list[dict], steps: list[dict]) -> float | None:
    """Bytes sent over a dense fp32 all-reduce's over the whole run: the per-step table's sums, else the last
    log row's totals (rank 0's bytes since the start over the dense bytes of as many steps)."""
    sent, dense = sum(_numbers(steps, "bytes_sent")), sum(_numbers(steps, "dense_bytes"))
    if dense > 0:
        return sent / dense
    last = next((r for r in reversed(rows) if "demo/total_bytes_sent" in r), None)
    per_step = (last or {}).get("demo/dense_allreduce_bytes_per_step", 0)
    if not last or not per_step or not last.get("step"):
        return None
    return last["demo/total_bytes_sent"] / (per_step * last["step"])


def run_tokens_per_s(rows: list[dict], steps: list[dict]) -> float | None:
    """Every rank's tokens over the run's wall time (the per-step table), else the mean of the log rows'."""
    tokens = sum(_numbers(steps, "tokens"))
    ranks = {r.get("rank") for r in steps}
    wall = max((max(_numbers([r for r in steps if r.get("rank") == k], "wall_s"), default=0) for k in ranks),
               default=0)  # fmt: skip
    if tokens > 0 and wall > 0:
        return tokens / wall
    logged = [r["ops/tokens_per_s"] for r in rows if isinstance(r.get("ops/tokens_per_s"), (int, float))]
    return sum(logged) / len(logged) if logged else None


def _summary(rows: list[dict], found: list[dict], steps: list[dict] = (), ended: str = "") -> list[tuple[str, str]]:
    train = [r for r in rows if "loss" in r]
    last = train[-1] if train else {}
    evals = [r for r in rows if "eval_loss" in r]
    out = [("run", ended)] if ended else []
    out.append(("steps logged", str(max((r.get("step", 0) for r in rows), default=0))))
    if "loss" in last:
        out.append(("last training loss", f"{last['loss']:.4g}"))
    if evals:
        out.append(("last held-out loss", f"{evals[-1]['eval_loss']:.4g}"))
    ratio = run_ratio(rows, list(steps))
    if ratio is not None:
        out.append(("bytes sent / dense all-reduce, whole run", f"{ratio:.4g}"))
    if "demo/ratio_to_dense" in last:
        out.append(("bytes sent / dense all-reduce, last logging window", f"{last['demo/ratio_to_dense']:.4g}"))
    speed = run_tokens_per_s(rows, list(steps))
    if speed is not None:
        out.append(("tokens per second, whole run (every rank)", f"{speed:.4g}"))
    if "ops/cost" in last:
        out.append(("cost so far", f"{last['ops/cost']:.4g}"))
    out.extend(_elastic_summary(rows))
    out.append(("alerts", str(len(found))))
    return out


def _elastic_summary(rows: list[dict]) -> list[tuple[str, str]]:
    """Elastic runs (log rows with ``ops/quorum``): the quorum's range, the replicas lost and joined, the
    recoveries, and the samples lost (refused steps) and unread (missing replicas' shards) since the start."""
    quorums = [r["ops/quorum"] for r in rows if r.get("ops/quorum")]
    if not quorums:
        return []

    def total(key):
        return sum(r.get(key, 0) for r in rows)

    def last(key):
        return max((r[key] for r in rows if key in r), default=0)

    return [
        ("quorum (smallest, last)", f"{min(quorums):g}, {quorums[-1]:g}"),
        ("replicas lost, joined", f"{total('ops/replica_losses'):g}, {total('ops/replica_joins'):g}"),
        ("recoveries from a live peer (seconds)", f"{total('ops/recoveries'):g} ({total('ops/recovery_s'):.3g})"),
        ("samples lost (refused steps)", f"{last('ops/samples_lost_total'):g}"),
        ("samples unread (missing replicas' shards)", f"{last('ops/samples_unread_total'):g}"),
    ]


STYLE = """body{font-family:system-ui,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px}h2{font-size:17px;margin-top:28px}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}tr.warning td{background:#fff3e0}
tr.info td{background:#e8f4fd}img{max-width:100%;border:1px solid #eee}.k{color:#555}
.ended{padding:8px 12px;border:1px solid #9c9;background:#eef8ee}
.ended.early{border-color:#e57373;background:#fdecea}"""


def _config_table(config: dict) -> str:
    if not config:
        return "<p>No ops/run.json (written by DeMoOpsCallback at the first step).</p>"
    flat = {"run": config.get("run"), "world size": config.get("world_size")}
    flat.update({f"trainer {k}": v for k, v in (config.get("trainer") or {}).items()})
    flat.update({f"DeMo {k}": v for k, v in (config.get("demo") or {}).items()})
    cells = "".join(
        f"<tr><td class='k'>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>" for k, v in flat.items()
    )
    return f"<table>{cells}</table>"


def render(folder: str | Path) -> str:
    folder, skipped = Path(folder), []
    log = read_log(folder)
    rows, source = log.rows, log.source
    steps, found = step_rows(folder, skipped), alerts(folder, skipped)
    ended, notes = ending(log, steps, skipped)
    summary = "".join(
        f"<tr><td class='k'>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>"
        for k, v in _summary(rows, found, steps, ended)
    )
    plots = "".join(
        f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' src='data:image/png;base64,{png}'>"
        for title, png in figures(rows, steps, found)
    )
    early = "" if ended.startswith("finished") else " early"
    banner = f"<div class='ended{early}'>" + "".join(f"<p>{html.escape(n)}</p>" for n in notes) + "</div>"
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>hf-demo run report: {html.escape(folder.name)}"
        f"</title><style>{STYLE}</style></head><body><h1>hf-demo run report: {html.escape(folder.name)}</h1>"
        f"{banner}<p class='k'>From {html.escape(source)}{' and the per-step table' if steps else ''}.</p>"
        f"<table>{summary}</table><h2>Configuration</h2>{_config_table(run_config(folder))}{plots}"
        f"<h2>Alerts</h2>{_alert_table(found)}</body></html>"
    )


def write(folder: str | Path, out: str | Path | None = None) -> Path:
    path = Path(out) if out else Path(folder) / "hf-demo-report.html"
    path.write_text(render(folder))
    return path
