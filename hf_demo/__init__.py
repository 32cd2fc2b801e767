"""hf-demo: DeMo (Decoupled Momentum Optimization) for the Hugging Face stack."""
from .comm import CommStats
from .errors import DeMoError, DeMoNonFiniteError, DeMoStateError, DeMoSyncError
from .optimizer import DeMo
from .settings import create_optimizer, optimizer_cls_and_kwargs, parse_optim_args

try:  # the Hugging Face integration needs transformers and accelerate (pip install hf-demo[hf])
    from .accelerate_utils import disable_gradient_allreduce, prepare
    from .trainer import DeMoTrainer
    from .training_args import DeMoTrainingArguments
except ImportError as _exc:  # pragma: no cover - exercised only without transformers
    _MISSING = _exc

    def __getattr__(name):
        if name in ("DeMoTrainer", "DeMoTrainingArguments", "prepare", "disable_gradient_allreduce"):
            raise ImportError(f"hf_demo.{name} needs transformers and accelerate: pip install 'hf-demo[hf]'") \
                from _MISSING
        raise AttributeError(name)

__version__ = "0.1.0"
__all__ = ["DeMo", "CommStats", "DeMoError", "DeMoSyncError", "DeMoNonFiniteError", "DeMoStateError",
           "create_optimizer", "optimizer_cls_and_kwargs", "parse_optim_args", "prepare",
           "disable_gradient_allreduce", "DeMoTrainer", "DeMoTrainingArguments"]
