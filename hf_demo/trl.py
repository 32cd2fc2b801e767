"""DeMo for TRL: ``DeMoSFTConfig`` and ``DeMoSFTTrainer`` (needs ``pip install trl``).

    from hf_demo.trl import DeMoSFTConfig, DeMoSFTTrainer
    args = DeMoSFTConfig(output_dir="out", optim="demo", demo_compression_topk=16)
    DeMoSFTTrainer(model=model, args=args, train_dataset=data).train()

``DeMoSFTConfig`` is ``SFTConfig`` (first in the bases: its defaults hold) plus the ``--demo_*`` fields.
``DeMoSFTTrainer`` is ``SFTTrainer`` with :class:`hf_demo.DeMoTrainerMixin`: DDP's gradient all-reduce is
off, every rank's optimizer state is saved, checkpoints carry a manifest. Other TRL trainers take the
mixin the same way: ``class DeMoDPOTrainer(DeMoTrainerMixin, DPOTrainer): pass``.
"""

from trl import SFTConfig, SFTTrainer

from .trainer import DeMoTrainerMixin
from .training_args import with_demo_arguments

DeMoSFTConfig = with_demo_arguments(SFTConfig, "DeMoSFTConfig")
DeMoSFTConfig.__module__ = __name__


class DeMoSFTTrainer(DeMoTrainerMixin, SFTTrainer):
    """TRL's SFTTrainer with DeMo (``optim="demo"``, or ``optimizers=(DeMo(...), None)``)."""


__all__ = ["DeMoSFTConfig", "DeMoSFTTrainer"]
