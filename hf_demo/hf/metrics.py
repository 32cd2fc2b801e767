"""The ``demo/*`` metrics of a log row: one dict, built here for ``DeMoTrainer`` and for custom loops alike.

``DeMoTrainer`` adds them to each training log row; a custom Accelerate loop logs them with
``hf_demo.log_metrics(accelerator, optimizer, step)`` (``accelerator.log``). The per-step figures are averages
over the optimizer steps since the previous row of the same :class:`CommMetrics`.
"""

from __future__ import annotations


class CommMetrics:
    """``demo/*`` figures of a DeMo optimizer, per step since the last call and in total."""

    def __init__(self) -> None:
        self.last = {"steps": 0, "sent": 0, "received": 0, "seconds": 0.0}

    def __call__(self, opt) -> dict[str, float]:
        s, last = opt.comm_stats, self.last
        steps = max(s.steps - last["steps"], 1)
        sent = (s.total_bytes_sent - last["sent"]) / steps
        metrics = {
            "demo/bytes_sent_per_step": sent,
            "demo/bytes_received_per_step": (s.total_bytes_received - last["received"]) / steps,
            "demo/comm_seconds_per_step": (s.total_seconds - last["seconds"]) / steps,
            "demo/total_bytes_sent": float(s.total_bytes_sent),
            "demo/total_bytes_received": float(s.total_bytes_received),
            "demo/total_comm_seconds": s.total_seconds,
            "demo/dense_allreduce_bytes_per_step": float(s.dense_bytes),
            "demo/ratio_to_dense": sent / s.dense_bytes if s.dense_bytes else 0.0,
            "demo/skipped_steps": float(opt.skipped_steps),
            "demo/resyncs": float(opt.resyncs),
            "demo/tier": float(opt.tier),
            "demo/tier_moves_down": float(opt.policy.moves_down),
            "demo/tier_moves_up": float(opt.policy.moves_up),
        }
        self.last = {
            "steps": s.steps,
            "sent": s.total_bytes_sent,
            "received": s.total_bytes_received,
            "seconds": s.total_seconds,
        }
        return metrics


def totals(metrics: dict[str, float]) -> dict[str, float]:
    """The run totals among ``metrics`` (the end-of-training summary)."""
    return {k: v for k, v in metrics.items() if "total" in k or "skipped" in k}
