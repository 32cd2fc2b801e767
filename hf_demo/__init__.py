"""hf-demo: DeMo (Decoupled Momentum Optimization) for the Hugging Face stack."""

import importlib

from hf_demo.errors import (
    DeMoError,
    DeMoNonFiniteError,
    DeMoPayloadError,
    DeMoSettingsError,
    DeMoSetupError,
    DeMoStateError,
    DeMoSyncError,
)
from hf_demo.exchange.teardown import shutdown
from hf_demo.exchange.transport import CommStats
from hf_demo.hf.checkpoint import last_complete_checkpoint
from hf_demo.hf.data_parallel import (
    disable_gradient_allreduce,
    install_step_guard,
    log_metrics,
    prepare,
)
from hf_demo.optim.factory import create_optimizer, optimizer_cls_and_kwargs, parse_optim_args
from hf_demo.optim.optimizer import DeMo
from hf_demo.optim.param_groups import muon_style_groups

# the Hugging Face integration, imported on first use (it needs transformers and accelerate: pip install
# 'hf-demo[hf]'): the optimizer, the planner and a custom loop import hf_demo without importing them
_HF = {
    "DeMoTrainer": "hf_demo.hf.trainer",
    "DeMoTrainerMixin": "hf_demo.hf.trainer",
    "with_demo": "hf_demo.hf.trainer",
    "DeMoArguments": "hf_demo.hf.training_args",
    "DeMoTrainingArguments": "hf_demo.hf.training_args",
}


def __getattr__(name: str):
    if name not in _HF:
        raise AttributeError(f"module 'hf_demo' has no attribute {name!r}")
    try:
        module = importlib.import_module(_HF[name])
    except ImportError as exc:
        if (exc.name or "").split(".")[0] not in ("transformers", "accelerate"):
            raise
        raise ImportError(f"hf_demo.{name} needs transformers and accelerate: pip install 'hf-demo[hf]'") from exc
    globals()[name] = value = getattr(module, name)
    return value


__version__ = "0.1.0"
__all__ = [
    "CommStats",
    "DeMo",
    "DeMoArguments",
    "DeMoError",
    "DeMoNonFiniteError",
    "DeMoPayloadError",
    "DeMoSettingsError",
    "DeMoSetupError",
    "DeMoStateError",
    "DeMoSyncError",
    "DeMoTrainer",
    "DeMoTrainerMixin",
    "DeMoTrainingArguments",
    "create_optimizer",
    "disable_gradient_allreduce",
    "install_step_guard",
    "last_complete_checkpoint",
    "log_metrics",
    "muon_style_groups",
    "optimizer_cls_and_kwargs",
    "parse_optim_args",
    "prepare",
    "shutdown",
    "with_demo",
]
