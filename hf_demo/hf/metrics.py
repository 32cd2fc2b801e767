"""The ``demo/*`` metrics of a log row: one dict, built here for ``DeMoTrainer`` and for custom loops alike.

``DeMoTrainer`` adds them to each training log row; a custom Accelerate loop logs them with
``hf_demo.log_metrics(accelerator, optimizer, step)`` (``accelerator.log``). The per-step figures are averages
over the optimizer steps since the previous row of the same :class:`CommMetrics`, and count the steps' own
traffic: what ``confirm()`` sent outside a step (a checkpoint's, ``flush()``'s) and the dense averaging that ends
or shows a local phase are their own series (since the previous row), and HSDP's traffic inside a replica (the
shard group) is apart (:class:`hf_demo.exchange.transport.CommStats`).
"""

from __future__ import annotations

SERIES = ("sent", "received", "settle_sent", "settle_received", "averaging_sent", "averaging_received", "intra_sent")


def _totals(s) -> dict:
    """The running totals a row is the difference of."""
    return {
        "sent": s.total_bytes_sent,
        "received": s.total_bytes_received,
        "settle_sent": s.total_settle_bytes_sent,
        "settle_received": s.total_settle_bytes_received,
        "averaging_sent": s.total_averaging_bytes_sent,
        "averaging_received": s.total_averaging_bytes_received,
        "intra_sent": s.total_intra_bytes_sent,
    }


class CommMetrics:
    """``demo/*`` figures of a DeMo optimizer, per step since the last call and in total."""

    def __init__(self) -> None:
        self.last = {"steps": 0, "seconds": 0.0, **dict.fromkeys(SERIES, 0)}

    def __call__(self, opt) -> dict[str, float]:
        s, last, now = opt.comm_stats, self.last, _totals(opt.comm_stats)
        steps = max(s.steps - last["steps"], 1)
        d = {k: now[k] - last[k] for k in SERIES}
        sent = (d["sent"] - d["settle_sent"] - d["averaging_sent"]) / steps  # the steps' own traffic
        metrics = {
            "demo/bytes_sent_per_step": sent,
            "demo/bytes_received_per_step": (d["received"] - d["settle_received"] - d["averaging_received"]) / steps,
            "demo/comm_seconds_per_step": (s.total_seconds - last["seconds"]) / steps,
            "demo/settle_bytes_sent": float(d["settle_sent"]),
            "demo/averaging_bytes_sent": float(d["averaging_sent"]),
            "demo/intra_bytes_sent_per_step": d["intra_sent"] / steps,
            "demo/total_bytes_sent": float(s.total_bytes_sent),
            "demo/total_bytes_received": float(s.total_bytes_received),
            "demo/total_settle_bytes_sent": float(s.total_settle_bytes_sent),
            "demo/total_averaging_bytes_sent": float(s.total_averaging_bytes_sent),
            "demo/total_intra_bytes_sent": float(s.total_intra_bytes_sent),
            "demo/total_comm_seconds": s.total_seconds,
            "demo/dense_allreduce_bytes_per_step": float(s.dense_bytes),
            "demo/ratio_to_dense": sent / s.dense_bytes if s.dense_bytes else 0.0,
            "demo/skipped_steps": float(opt.skipped_steps),
            "demo/resyncs": float(opt.resyncs),
            "demo/tier": float(opt.tier),
            "demo/tier_moves_down": float(opt.policy.moves_down),
            "demo/tier_moves_up": float(opt.policy.moves_up),
        }
        self.last = {"steps": s.steps, "seconds": s.total_seconds, **now}
        return metrics


def totals(metrics: dict[str, float]) -> dict[str, float]:
    """The run totals among ``metrics`` (the end-of-training summary)."""
    return {k: v for k, v in metrics.items() if "total" in k or "skipped" in k}
