"""The baselines of recipes/compare.py: DDP-AdamW with a gradient-compression comm hook (PowerSGD, fp16, bf16).

DeMo does not need any of this (it moves compressed momentum, not gradients); a recipe that compare.py runs
parses :class:`BaselineArguments` beside its own and calls :func:`use_ddp_comm_hook` on its trainer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.distributed as dist
from transformers import TrainerCallback

COMM_HOOKS = ["no", "fp16", "bf16", "power_sgd", "batched_power_sgd"]  # Accelerate's DDPCommunicationHookType


@dataclass
class BaselineArguments:
    ddp_comm_hook: str = field(
        default="no",
        metadata={
            "help": "DDP gradient compression for a non-DeMo optimizer (the baselines of recipes/compare.py).",
            "choices": COMM_HOOKS,
        },
    )
    powersgd_rank: int = field(default=1, metadata={"help": "PowerSGD matrix approximation rank."})
    powersgd_start_iter: int = field(
        default=2,
        metadata={"help": "PowerSGD: plain all-reduce for the first iterations (torch's default is 1000; >= 2)."},
    )


def use_ddp_comm_hook(trainer, baseline_args: BaselineArguments) -> None:
    """Make ``trainer`` compress DDP's gradient all-reduce as ``--ddp_comm_hook`` asks (nothing with ``no``).

    Call it after the trainer is made and before ``train()``: Accelerate registers the hook when it wraps the
    model in DistributedDataParallel.
    """
    hook = baseline_args.ddp_comm_hook
    if hook == "no":
        return
    if trainer.uses_demo:
        raise ValueError(
            f"--ddp_comm_hook {hook} compresses DDP's gradient all-reduce; with DeMo as the optimizer there is none "
            "(DeMo moves the momentum): drop it"
        )
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    if trainer.accelerator.ddp_handler is None:
        trainer.accelerator.ddp_handler = DistributedDataParallelKwargs()
    handler = trainer.accelerator.ddp_handler
    handler.comm_hook = DDPCommunicationHookType(hook)
    if "power_sgd" in hook:
        handler.comm_state_option = {
            "matrix_approximation_rank": baseline_args.powersgd_rank,
            "start_powerSGD_iter": baseline_args.powersgd_start_iter,
        }
        trainer.add_callback(PowerSGDOwnGroup(trainer))


class PowerSGDOwnGroup(TrainerCallback):
    """Give the DDP model's PowerSGD hook state a process group of its own, on every rank, before the first backward.

    torch's PowerSGD hook issues its P and Q all-reduces from future callbacks on gloo's worker threads, on
    ``state.process_group``, which Accelerate leaves ``None`` (the default group). Every other collective of a
    training run (Trainer's gathers of the loss and token counts, evaluation's gathers, DDP's buffer broadcasts)
    runs on the default group from the main thread; sharing the group's collective sequence with another thread
    lets the ranks disagree on which collective comes next (``gloo::EnforceNotMet ... Received data size doesn't
    match expected size`` mid-run). A group of the hook's own keeps its collectives in one sequence of their own.
    """

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):  # the model is wrapped in DDP by now
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        for _, hook_state in getattr(self.trainer.model_wrapped, "_comm_hooks", []):
            if isinstance(hook_state, PowerSGDState) and hook_state.process_group is None:
                hook_state.process_group = dist.new_group(backend=dist.get_backend())


def powersgd_bytes_per_step(shapes, rank: int, min_compression_rate: float = 2.0) -> int:
    """Bytes one rank hands to PowerSGD's all-reduces per step (fp32), from the parameter shapes (torch's rule:
    a matrix, viewed as (shape[0], -1), whose rank-r factors are smaller than 1/min_compression_rate of it sends
    P (n x r) and Q (m x r); 1-D tensors and the other matrices go uncompressed)."""
    floats = 0
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) <= 1:
            floats += numel
            continue
        n, m = shape[0], numel // shape[0]
        r = min(n, m, rank)
        floats += (n + m) * r if (n + m) * r * min_compression_rate < n * m else numel
    return 4 * floats
