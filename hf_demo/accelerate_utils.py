"""What DeMo needs from a data-parallel setup: DDP must not all-reduce gradients, and some set-ups can't work.

``prepare(accelerator, model, optimizer)`` is the one call a custom Accelerate loop makes; DeMoTrainer
does the same through :func:`disable_gradient_allreduce` and :func:`check_supported`.
"""
from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn.parallel import DistributedDataParallel

from .optimizer import DeMo


def unwrap_optimizer(optimizer):
    """The DeMo inside Accelerate's AcceleratedOptimizer (or the optimizer itself); None if not DeMo."""
    while optimizer is not None and not isinstance(optimizer, DeMo) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer if isinstance(optimizer, DeMo) else None


def disable_gradient_allreduce(model: torch.nn.Module) -> bool:
    """Register DDP's no-op comm hook on ``model`` when it is DDP: each rank keeps its local gradient.

    DDP still broadcasts the initial weights (at construction) and buffers; DeMo moves the momentum.
    Returns True when a hook was registered now, False when not DDP or already done.
    """
    if not isinstance(model, DistributedDataParallel) or getattr(model, "_hf_demo_noop_hook", False):
        return False
    model.register_comm_hook(state=None, hook=noop_hook)
    model._hf_demo_noop_hook = True
    return True


def check_supported(accelerator=None, *, fp16: bool = False, deepspeed: bool = False, fsdp: bool = False) -> None:
    """Stop at start-up, with a message, for set-ups DeMo cannot run in (instead of a hang or silent drift)."""
    if accelerator is not None:
        from accelerate.utils import DistributedType

        dt = accelerator.distributed_type
        deepspeed = deepspeed or dt == DistributedType.DEEPSPEED
        fsdp = fsdp or dt == DistributedType.FSDP
        fp16 = fp16 or accelerator.mixed_precision == "fp16"
    if deepspeed:
        raise ValueError("DeMo cannot run under DeepSpeed: DeepSpeed owns the optimizer step and all-reduces "
                         "gradients itself. Use plain DDP (accelerate_configs/multi_gpu.yaml).")
    if fsdp:
        raise ValueError("DeMo cannot run under FSDP: each rank must hold whole parameters and its own "
                         "momentum, FSDP shards them. Use plain DDP (accelerate_configs/multi_gpu.yaml).")
    if fp16:
        raise ValueError("DeMo does not support fp16 with a GradScaler yet: the scaler's inf check would need "
                         "to agree across ranks before DeMo's step. Use --bf16 (or fp32) instead.")


def prepare(accelerator, model, optimizer, *others):
    """``accelerator.prepare`` for a DeMo loop: also stops DDP from all-reducing gradients.

    Returns what ``accelerator.prepare(model, optimizer, *others)`` returns.
    """
    check_supported(accelerator)
    prepared = accelerator.prepare(model, optimizer, *others)
    disable_gradient_allreduce(prepared[0])
    return prepared
