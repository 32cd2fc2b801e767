"""What DeMo needs from a data-parallel setup: DDP must not all-reduce gradients, and some set-ups can't work.

``prepare(accelerator, model, optimizer)`` is the one call a custom Accelerate loop makes; DeMoTrainer
does the same through :func:`disable_gradient_allreduce` and :func:`check_supported`.

A loop that forgets (a plain ``Trainer``/``SFTTrainer`` given ``optimizers=(DeMo(...), None)``, or
``accelerator.prepare`` instead of ``hf_demo.prepare``) is stopped at DeMo's first step by
:func:`check_local_gradients`, run from a step pre-hook that :func:`install_step_guard` registers.
"""

from __future__ import annotations

import gc
from itertools import compress

import torch
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn.parallel import DistributedDataParallel

from .errors import DDP_ALLREDUCES, DeMoSetupError
from .optimizer import DeMo
from .teardown import install_exit_handler, track


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
        raise ValueError(
            "DeMo cannot run under DeepSpeed: DeepSpeed owns the optimizer step and all-reduces "
            "gradients itself. Use plain DDP (an accelerate config with distributed_type: MULTI_GPU)."
        )
    if fsdp:
        raise ValueError(
            "DeMo cannot run under FSDP: each rank must hold whole parameters and its own "
            "momentum, FSDP shards them. Use plain DDP (an accelerate config with distributed_type: MULTI_GPU)."
        )
    if fp16:
        raise ValueError(
            "DeMo does not support fp16 with a GradScaler yet: the scaler's inf check would need "
            "to agree across ranks before DeMo's step. Use --bf16 (or fp32) instead."
        )


def prepare(accelerator, model, optimizer, *others):
    """``accelerator.prepare`` for a DeMo loop: also stops DDP from all-reducing gradients.

    Returns what ``accelerator.prepare(model, optimizer, *others)`` returns.
    """
    check_supported(accelerator)
    prepared = accelerator.prepare(model, optimizer, *others)
    disable_gradient_allreduce(prepared[0])
    install_exit_handler()
    return prepared


def _subclasses(kind: type) -> set[type]:
    """``kind`` and every class derived from it, at any depth."""
    found, todo = {kind}, [kind]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def _allreducing_ddp(params) -> list[torch.Tensor]:
    """Those of ``params`` that a DDP wrapper holds and may all-reduce the gradients of (no no-op comm hook)."""
    ids = {id(p): p for p in params}
    objects = gc.get_objects()
    # DDP's classes from the class tree, then the objects of those classes, picked out in C: the Python loop over
    # every object this replaced (~4*10^5 in a transformers process) took 0.53 s of a first step on 4 ranks sharing
    # 2 cores, a pass over the objects' types with issubclass 0.32 s, this ~0.2 s (docs/WAN.md, §10 and §12)
    ddp_types = _subclasses(DistributedDataParallel)
    wrappers = compress(objects, map(ddp_types.__contains__, map(type, objects)))
    held: dict[int, torch.Tensor] = {}
    for obj in wrappers:
        if not any(hook is noop_hook for hook, _ in getattr(obj, "_comm_hooks", [])):
            held.update((id(p), ids[id(p)]) for p in obj.module.parameters() if id(p) in ids)
    return [p for p in params if id(p) in held]  # in the optimizer's order: the same on every rank


def check_local_gradients(optimizer: DeMo) -> None:
    """Stop DeMo when DDP all-reduces the gradients of its parameters.

    DeMo needs each rank's own gradient; DDP's mean would make every rank's momentum the same and DeMo's
    exchange redundant: a different, silently slower optimizer. Python sees a wrapper that could all-reduce,
    not whether its reducer still runs (an earlier baseline's wrapper may be alive and unused). So where this
    step exchanges with other ranks, the wrapped parameters become the optimizer's suspects: every rank sends
    the fingerprint of their gradients in the exchange's header, and every rank raises
    :class:`DeMoSetupError` before any state changed when they are bitwise the same on all ranks (the wrapper
    averaged them), or goes on with a warning when they differ (the wrapper is unused). Where it cannot tell (no
    other rank in DeMo's group, or a local step first), it raises here.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    wrapped = _allreducing_ddp(params)
    optimizer._ddp_suspects = wrapped if wrapped and optimizer.exchanges_next() else []
    if wrapped and not optimizer._ddp_suspects:
        raise DeMoSetupError(DDP_ALLREDUCES)


def _first_step(optimizer, args, kwargs) -> None:
    if not isinstance(optimizer, DeMo) or getattr(optimizer, "_hf_demo_checked", False):
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        install_exit_handler()
        track(optimizer)
        check_local_gradients(optimizer)
    optimizer._hf_demo_checked = True


_guard = None


def install_step_guard() -> None:
    """Register (once) a global optimizer step pre-hook that runs the checks above at DeMo's first step.

    Other optimizers pay one ``isinstance`` per step; a DeMo pays one scan of the live objects, once.
    """
    global _guard
    if _guard is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _guard = register_optimizer_step_pre_hook(_first_step)
