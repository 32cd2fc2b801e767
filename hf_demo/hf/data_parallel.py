"""What DeMo needs from a data-parallel setup: DDP must not all-reduce gradients, and some set-ups can't work.

``prepare(accelerator, model, optimizer)`` is the one call a custom Accelerate loop makes; DeMoTrainer
does the same through :func:`disable_gradient_allreduce` and :func:`check_supported`.

A loop that forgets (a plain ``Trainer``/``SFTTrainer`` given ``optimizers=(DeMo(...), None)``, or
``accelerator.prepare`` instead of ``hf_demo.prepare``) is stopped at DeMo's first step by DeMo's own guard
(:func:`hf_demo.guards.first_step_check`).
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn.parallel import DistributedDataParallel

from hf_demo import guards as ddp_wrappers
from hf_demo.exchange import liveness
from hf_demo.exchange.teardown import install_exit_handler
from hf_demo.hf.launch_env import fsdp_requested
from hf_demo.optim.optimizer import DeMo
from hf_demo.refusals import refuse


def unwrap_optimizer(optimizer):
    """The DeMo inside Accelerate's AcceleratedOptimizer (or the optimizer itself); None if not DeMo."""
    while optimizer is not None and not isinstance(optimizer, DeMo) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer if isinstance(optimizer, DeMo) else None


def unwrap_stepped(optimizer):
    """What is stepped inside Accelerate's AcceleratedOptimizer: DeMo, or the elastic wrapper around it
    (:class:`hf_demo.elastic.Elastic`, what has ``add_listener``); None if no DeMo is inside."""
    if unwrap_optimizer(optimizer) is None:
        return None
    while not isinstance(optimizer, DeMo) and not hasattr(optimizer, "add_listener"):
        optimizer = optimizer.optimizer
    return optimizer


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


def check_supported(accelerator=None, *, fp16: bool = False, deepspeed: bool = False, fsdp: bool = False,
                    fsdp_requested: bool = False) -> None:  # fmt: skip
    """Stop at start-up, with a message, for set-ups DeMo cannot run in (instead of a hang or silent drift).
    ``fsdp``: Accelerate runs FSDP; ``fsdp_requested``: the arguments or the launch asked for it."""
    fsdp_version = None
    if accelerator is not None:
        from accelerate.utils import DistributedType

        dt = accelerator.distributed_type
        deepspeed = deepspeed or dt == DistributedType.DEEPSPEED
        fsdp = fsdp or dt == DistributedType.FSDP
        fp16 = fp16 or accelerator.mixed_precision == "fp16"
        fsdp_version = getattr(getattr(accelerator.state, "fsdp_plugin", None), "fsdp_version", None)
    if deepspeed:
        refuse("deepspeed")
    if fsdp and fsdp_version not in (None, 2):
        refuse("fsdp1", version=fsdp_version)
    if fsdp_requested and not fsdp:
        refuse("fsdp_not_run")
    if fp16:
        refuse("fp16")


def prepare(accelerator, model, optimizer, *others):
    """``accelerator.prepare`` for a DeMo loop: also stops DDP from all-reducing gradients, hands back DeMo as a
    :class:`hf_demo.hf.accelerated.DeMoAcceleratedOptimizer` (Accelerate's optimizer wrapper with DeMo's calls:
    ``flush()``, ``comm_stats``, ...) and makes ``accelerator.save_state``/``load_state`` save and restore every rank's
    DeMo state, with a manifest checked on every rank (:class:`hf_demo.hf.accelerated.AcceleratorCheckpoints`).

    A model already sharded by FSDP2 (:mod:`hf_demo.fsdp`) is returned as it is where Accelerate does not run
    FSDP itself (on CPU it would wrap it in DDP): the optimizer and the rest are prepared.
    Returns what ``accelerator.prepare(model, optimizer, *others)`` returns, the optimizer as DeMo's wrapper.
    """
    from hf_demo.fsdp import is_fsdp2
    from hf_demo.hf import accelerated

    check_supported(accelerator, fsdp_requested=fsdp_requested())
    demo = unwrap_optimizer(optimizer)
    handed = accelerated.DeMoAcceleratedOptimizer(optimizer) if demo is not None else optimizer
    if is_fsdp2(model):
        rest = accelerator.prepare(handed, *others)
        prepared = (model, *(rest if others else (rest,)))
    else:
        prepared = accelerator.prepare(model, handed, *others)
    disable_gradient_allreduce(prepared[0])
    if demo is not None:  # Accelerate's wrapper around it stays in the accelerator's list
        accelerated.register(accelerator, handed)
        prepared = (prepared[0], handed, *prepared[2:])
    install_exit_handler()
    if demo is not None:  # Trainer's and the loop's own collectives: bounded by comm_timeout too
        liveness.guard(demo.settings.comm_timeout)
    return prepared


def log_metrics(accelerator, optimizer, step: int | None = None) -> dict[str, float]:
    """Log the ``demo/*`` figures of ``optimizer`` (what :func:`prepare` returned) with ``accelerator.log``: bytes
    and seconds per step since the last call and in total, skipped steps, resyncs, tier (the dict DeMoTrainer
    logs, docs/reference/metrics.md). Call it on every rank (trackers write on the main process). Returns the dict.
    """
    if not hasattr(optimizer, "demo_metrics"):
        raise TypeError(
            f"hf_demo.log_metrics needs the optimizer hf_demo.prepare returned, not {type(optimizer).__name__}: "
            "model, optimizer, ... = hf_demo.prepare(accelerator, model, optimizer, ...)"
        )
    metrics = optimizer.demo_metrics()
    accelerator.log(metrics, step=step)
    return metrics


def install_step_guard() -> None:
    """Kept for scripts that call it: DeMo runs its first-step guard itself (exit handler, the DDP check) in
    :meth:`hf_demo.DeMo.step`, for itself only; no hook on other optimizers is installed."""
    warnings.warn(
        "hf_demo.install_step_guard() does nothing: DeMo checks for DDP and installs its exit handler at its own "
        "first step. Remove the call.",
        DeprecationWarning,
        stacklevel=2,
    )
