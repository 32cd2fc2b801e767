"""The operator's view of a DeMo run (docs/guides/operations.md).

- before: ``hf-demo plan`` (:mod:`hf_demo.ops.planner`): bytes, step time, epoch time and cost of every
  method on a cluster, and a recommendation;
- during: :class:`DeMoOpsCallback` (every rank's step split, traffic, cost; a Prometheus endpoint, a CSV or
  Parquet log) and :class:`DeMoHealthCallback` (deviation alerts), both on by default in ``DeMoTrainer``;
- after: ``hf-demo report OUTPUT_DIR`` (:mod:`hf_demo.ops.report`): one HTML page with the run's plots.

The Trainer parts import transformers when first used; the planner needs only torch.
"""

from hf_demo.ops.settings import HealthSettings, OpsSettings

_LAZY = {
    "DeMoOpsCallback": "hf_demo.ops.callbacks",
    "attach": "hf_demo.ops.callbacks",
    "DeMoHealthCallback": "hf_demo.ops.health",
    "HealthRules": "hf_demo.ops.health",
    "Alert": "hf_demo.ops.health",
    "StepMonitor": "hf_demo.ops.monitor",
    "StepSample": "hf_demo.ops.monitor",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = ["HealthSettings", "OpsSettings", *_LAZY]
