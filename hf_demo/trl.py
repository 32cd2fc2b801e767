"""DeMo for TRL: ``DeMoSFTConfig`` and ``DeMoSFTTrainer`` (needs ``pip install trl``).

    from hf_demo.trl import DeMoSFTConfig, DeMoSFTTrainer
    args = DeMoSFTConfig(output_dir="out", optim="demo", demo_compression_topk=16)
    DeMoSFTTrainer(model=model, args=args, train_dataset=data).train()

Both are :func:`hf_demo.with_demo` of TRL's classes: ``SFTConfig``'s own defaults hold (it comes first in
the bases) plus the ``--demo_*`` fields; the trainer is ``SFTTrainer`` with :class:`hf_demo.DeMoTrainerMixin`
(DDP's gradient all-reduce off, every rank's optimizer state saved, checkpoints with a manifest). Other TRL
trainers the same way: ``DeMoDPOTrainer, DeMoDPOConfig = hf_demo.with_demo(DPOTrainer, DPOConfig)``.
"""

from trl import SFTConfig, SFTTrainer

from hf_demo.hf.trainer import with_demo

DeMoSFTTrainer, DeMoSFTConfig = with_demo(SFTTrainer, SFTConfig)

__all__ = ["DeMoSFTConfig", "DeMoSFTTrainer"]
