"""What DeMo needs from a data-parallel setup: DDP must not all-reduce gradients, and some set-ups can't work.

``prepare(accelerator, model, optimizer)`` is the one call a custom Accelerate loop makes; DeMoTrainer
does the same through :func:`disable_gradient_allreduce` and :func:`check_supported`.

A loop that forgets (a plain ``Trainer``/``SFTTrainer`` given ``optimizers=(DeMo(...), None)``, or
``accelerator.prepare`` instead of ``hf_demo.prepare``) is stopped at DeMo's first step by
:func:`check_local_gradients`, run from a step pre-hook that :func:`install_step_guard` registers.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn.parallel import DistributedDataParallel

from hf_demo.errors import DDP_ALLREDUCES, DeMoSetupError
from hf_demo.hf import ddp_wrappers
from hf_demo.hf.teardown import install_exit_handler, track
from hf_demo.optim.optimizer import DeMo, _gradient_fingerprint


def unwrap_optimizer(optimizer):
    """The DeMo inside Accelerate's AcceleratedOptimizer (or the optimizer itself); None if not DeMo."""
    while optimizer is not None and not isinstance(optimizer, DeMo) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer if isinstance(optimizer, DeMo) else None


def disable_gradient_allreduce(model: torch.nn.Module) -> bool:
    """Register DDP's no-op comm hook on ``model`` when it is DDP: each rank keeps its local gradient.

    A model the user had wrapped in DDP already, wrapped again by Accelerate (DDP inside DDP), gets the hook
    on every wrapper: the inner one would otherwise all-reduce every gradient densely, uncounted, before the
    outer one's no-op hook. DDP still broadcasts the initial weights (at construction) and buffers; DeMo moves
    the momentum. Returns True when a hook was registered now, False when not DDP or already done.
    """
    registered = False
    while isinstance(model, DistributedDataParallel):
        if not getattr(model, "_hf_demo_noop_hook", False) and ddp_wrappers.allreducing(model):
            model.register_comm_hook(state=None, hook=noop_hook)
            model._hf_demo_noop_hook = True
            registered = True
        model = model.module
    return registered


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


def check_local_gradients(optimizer: DeMo) -> None:
    """Stop DeMo when DDP all-reduces the gradients of its parameters (run at DeMo's first step, every rank).

    DeMo needs each rank's own gradient; DDP's mean would make every rank's momentum the same and DeMo's
    exchange redundant: a different, silently slower optimizer. A live wrapper that holds DeMo's parameters is
    only a suspicion (an earlier baseline's may be alive and unused), settled by the gradients: every rank sends
    (holds a wrapper, fingerprint of the wrapped gradients) in one 16-byte all-gather (a set-up check, left out
    of ``comm_stats``), and every rank raises
    :class:`DeMoSetupError` before any state changed when two ranks' wrapped gradients are bitwise the same
    (a wrapper averaged them, over the world or a subgroup). Otherwise the wrappers are taken for unused ones:
    a warning, and the optimizer checks them again at every ``check_every`` step. With no other rank in DeMo's
    group to compare with, a wrapper raises at once.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    wrappers = ddp_wrappers.live_wrappers(params)
    transport = optimizer._transport_now()
    if transport.world <= 1:
        if wrappers:
            raise DeMoSetupError(DDP_ALLREDUCES)
        return
    held = ddp_wrappers.held_params(wrappers, params)
    mine = torch.tensor([int(bool(held)), _gradient_fingerprint([p.grad for p in held]) if held else 0])
    device = params[0].device if params else torch.device("cpu")
    transport.step = optimizer.steps
    rows = transport.all_gather(mine.view(torch.uint8).to(device), "ddp_check", count=False).cpu().view(torch.int64)
    flags, prints = zip(*rows.tolist())
    averaged = ddp_wrappers.averaging_ranks([bool(f) for f in flags], list(prints))
    if averaged:
        raise DeMoSetupError(
            f"{DDP_ALLREDUCES} Found at optimizer step {optimizer.steps}: the gradients of the parameters such a "
            f"wrapper holds are bitwise identical on ranks {averaged} (it averages them; or those ranks read the "
            "same batches). No state was changed."
        )
    optimizer.watch_ddp_wrappers(wrappers)


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
