"""hf-demo: DeMo (Decoupled Momentum Optimization) for the Hugging Face stack."""
from .comm import CommStats
from .errors import DeMoError, DeMoNonFiniteError, DeMoStateError, DeMoSyncError
from .optimizer import DeMo

__version__ = "0.1.0"
__all__ = ["DeMo", "CommStats", "DeMoError", "DeMoSyncError", "DeMoNonFiniteError", "DeMoStateError"]
