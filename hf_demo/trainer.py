"""``DeMoTrainer``: transformers.Trainer that trains with DeMo when asked to.

With DeMo it (1) stops DDP from all-reducing gradients (a no-op comm hook, registered before the first
backward), (2) saves and restores every rank's own optimizer state with each checkpoint, (3) logs the
communication figures, and (4) refuses set-ups that cannot work. With any other optimizer it is Trainer.

Gradient clipping (``max_grad_norm``) acts on each rank's local gradient before it enters that rank's
momentum. With ``average_tokens_across_devices`` Trainer scales each rank's loss by the world size over the
global token count: each rank's gradient is then exactly the term DDP would have averaged, so DeMo's
momentum sees the same per-rank gradient as DDP's mean would be built from.
"""
from __future__ import annotations

import os

import torch
from transformers import Trainer
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME  # rank 0's state goes in Trainer's own file

from .accelerate_utils import check_supported, disable_gradient_allreduce, unwrap_optimizer
from .errors import DeMoStateError
from .optimizer import DeMo
from .settings import optimizer_cls_and_kwargs



def rank_state_file(rank: int) -> str:
    """File of rank ``rank``'s DeMo state inside a checkpoint (rank 0 uses Trainer's optimizer.pt)."""
    return OPTIMIZER_NAME if rank == 0 else f"optimizer.rank{rank}.pt"


class DeMoTrainer(Trainer):
    """Drop-in for ``transformers.Trainer`` (same constructor) that knows DeMo."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._demo_last_log = None
        if self.uses_demo:
            check_supported(self.accelerator, fp16=bool(self.args.fp16), deepspeed=self.is_deepspeed_enabled,
                            fsdp=self.is_fsdp_enabled)

    @property
    def uses_demo(self) -> bool:
        if unwrap_optimizer(self.optimizer) is not None:
            return True
        if self.optimizer_cls_and_kwargs is not None:
            cls = self.optimizer_cls_and_kwargs[0]
            return isinstance(cls, type) and issubclass(cls, DeMo)
        return str(self.args.optim) == "demo"

    def _build_accelerator_args(self, **kwargs) -> dict:
        """Trainer's accelerator arguments, plus the DDP comm hook of ``--ddp_comm_hook`` (baselines)."""
        args = super()._build_accelerator_args(**kwargs)
        hook = getattr(self.args, "ddp_comm_hook", "no")
        if hook != "no":
            from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

            state = {}
            if "power_sgd" in hook:
                state = {"matrix_approximation_rank": self.args.powersgd_rank,
                         "start_powerSGD_iter": self.args.powersgd_start_iter}
            handlers = []
            for h in args.get("kwargs_handlers", []):
                if isinstance(h, DistributedDataParallelKwargs):
                    h.comm_hook = DDPCommunicationHookType(hook)
                    h.comm_state_option = state
                handlers.append(h)
            args["kwargs_handlers"] = handlers
        return args

    # ------------------------------------------------------------------ optimizer
    def create_optimizer(self, model=None):
        if self.optimizer is None and self.optimizer_cls_and_kwargs is None and str(self.args.optim) == "demo":
            settings = self.args.demo_settings() if hasattr(self.args, "demo_settings") else {}
            self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs(lr=self.args.learning_rate, **settings)
            try:
                return super().create_optimizer(model)
            finally:
                self.optimizer_cls_and_kwargs = None
        return super().create_optimizer(model)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.uses_demo:
            disable_gradient_allreduce(model)   # before the first backward; once
        return super().training_step(model, inputs, num_items_in_batch)

    # ------------------------------------------------------------------ metrics
    def log(self, logs: dict, start_time: float | None = None) -> None:
        opt = unwrap_optimizer(self.optimizer)
        if opt is not None and "loss" in logs:                   # a training log row
            logs.update(self._demo_metrics(opt))
        elif opt is not None and "train_loss" in logs:           # the end-of-training summary: totals only
            logs.update({k: v for k, v in self._demo_metrics(opt).items() if "total" in k or "skipped" in k})
        super().log(logs, start_time)

    def _demo_metrics(self, opt: DeMo) -> dict:
        s = opt.comm_stats
        last = self._demo_last_log or {"steps": 0, "sent": 0, "received": 0, "seconds": 0.0}
        steps = max(s.steps - last["steps"], 1)
        sent = (s.total_bytes_sent - last["sent"]) / steps
        metrics = {
            "demo/bytes_sent_per_step": sent,
            "demo/bytes_received_per_step": (s.total_bytes_received - last["received"]) / steps,
            "demo/comm_seconds_per_step": (s.total_seconds - last["seconds"]) / steps,
            "demo/total_bytes_sent": float(s.total_bytes_sent),
            "demo/total_bytes_received": float(s.total_bytes_received),
            "demo/total_comm_seconds": s.total_seconds,
            "demo/dense_allreduce_bytes_per_step": float(s.dense_bytes),
            "demo/ratio_to_dense": sent / s.dense_bytes if s.dense_bytes else 0.0,
            "demo/skipped_steps": float(opt.skipped_steps),
        }
        self._demo_last_log = {"steps": s.steps, "sent": s.total_bytes_sent, "received": s.total_bytes_received,
                               "seconds": s.total_seconds}
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)   # rank 0: optimizer.pt (its own state), scheduler
        opt = unwrap_optimizer(self.optimizer)
        rank = self.args.process_index
        if opt is not None and rank > 0:
            os.makedirs(output_dir, exist_ok=True)
            torch.save(opt.state_dict(), os.path.join(output_dir, rank_state_file(rank)))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        opt = unwrap_optimizer(self.optimizer)
        if opt is None or checkpoint is None or not os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
            return super()._load_optimizer_and_scheduler(checkpoint)
        rank, world = self.args.process_index, self.args.world_size
        path = os.path.join(checkpoint, rank_state_file(rank))
        if not os.path.isfile(path):
            saved = 1 + sum(1 for f in os.listdir(checkpoint) if f.startswith("optimizer.rank"))
            raise DeMoStateError(f"{checkpoint} holds DeMo optimizer state for {saved} process(es) but this run "
                                 f"has {world}: rank {rank} has no state to resume. Each rank's momentum is its "
                                 f"own; resume with {saved} processes.")
        opt.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
