"""hf-demo: DeMo (Decoupled Momentum Optimization) for the Hugging Face stack."""

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

try:  # the Hugging Face integration needs transformers and accelerate (pip install hf-demo[hf])
    from hf_demo.hf.trainer import DeMoTrainer, DeMoTrainerMixin, with_demo
    from hf_demo.hf.training_args import DeMoArguments, DeMoTrainingArguments
except ImportError as _exc:  # pragma: no cover - exercised only without transformers
    _MISSING = _exc

    def __getattr__(name):
        if name in ("DeMoTrainer", "DeMoTrainerMixin", "DeMoArguments", "DeMoTrainingArguments", "with_demo"):
            raise ImportError(
                f"hf_demo.{name} needs transformers and accelerate: pip install 'hf-demo[hf]'"
            ) from _MISSING
        raise AttributeError(name)


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
