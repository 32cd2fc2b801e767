"""DeMo in a custom Accelerate loop: the optimizer ``hf_demo.prepare`` returns, and Accelerate's checkpoints.

``hf_demo.prepare`` hands back Accelerate's ``AcceleratedOptimizer`` as a :class:`DeMoAcceleratedOptimizer`
(the same object, so the accelerator's own list and the prepared schedulers keep pointing at it): DeMo's calls
and figures (``flush()``, ``confirm()``, ``averaged_parameters()``, ``comm_stats``, ``skipped_steps``,
``resyncs``, ``tier``) work on it, ``.demo`` is the DeMo inside, and ``demo_metrics()`` is the ``demo/*`` dict that
``hf_demo.log_metrics(accelerator, optimizer, step)`` hands to ``accelerator.log``.

``accelerator.save_state(folder)`` keeps only rank 0's optimizer state (``optimizer.bin``), but each rank's DeMo
momentum is its own. :class:`AcceleratorCheckpoints`, registered on the accelerator by ``hf_demo.prepare``, makes
every other rank write its own (``optimizer.rank<r>.bin``) and, once every file is written, rank 0 writes the
manifest DeMoTrainer's checkpoints have (:mod:`hf_demo.hf.checkpoint`). ``accelerator.load_state(folder)``
checks the folder against it on every rank first (every rank raises the same ``CheckpointError``: also for a
truncated model or optimizer file that a manifest written by hand vouches for), then each rank loads its own DeMo
state and checks the model's weights against it as ``DeMoTrainer`` does (the same ``DeMoStateError`` on every
rank for a model file from another save or run).
"""

from __future__ import annotations

import os

import torch
from accelerate.optimizer import AcceleratedOptimizer

from hf_demo.errors import DeMoStateError
from hf_demo.hf import checkpoint as ckpt
from hf_demo.hf.metrics import CommMetrics
from hf_demo.optim import checkpointing
from hf_demo.optim.optimizer import DeMo

DEMO_ATTRIBUTES = frozenset(
    {"flush", "confirm", "unconfirmed", "averaged_parameters", "comm_stats", "skipped_steps", "resyncs", "tier",
     "in_flight", "policy", "settings", "counters", "unsynced"}
)  # fmt: skip


class DeMoAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper around DeMo, with DeMo's own calls and figures (``DEMO_ATTRIBUTES``)."""

    @property
    def demo(self) -> DeMo:
        """The DeMo optimizer inside."""
        inner = self.optimizer
        while not isinstance(inner, DeMo):
            inner = inner.optimizer
        return inner

    def __getattr__(self, name: str):
        if name in DEMO_ATTRIBUTES:
            return getattr(self.demo, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r} (DeMo itself: .demo)")

    def demo_metrics(self) -> dict[str, float]:
        """The ``demo/*`` figures: per step since the last call, and in total (:mod:`hf_demo.hf.metrics`)."""
        return self.__dict__.setdefault("_demo_metrics", CommMetrics())(self.demo)

    def load_state_dict(self, state_dict) -> None:
        """Accelerate's ``load_state`` hands every rank rank 0's ``optimizer.bin``: inside ``load_state`` each rank
        loads its own DeMo state instead (the one :class:`AcceleratorCheckpoints` read), then checks the model's
        weights, loaded by now, against it (``DeMoTrainer``'s check: the model file and the optimizer files must
        come from one save of one run); every rank raises the same ``DeMoStateError`` when any rank's does not."""
        if "_demo_own_state" not in self.__dict__:  # outside load_state: as Accelerate's
            return super().load_state_dict(state_dict)
        own = self.__dict__.pop("_demo_own_state")
        problem = None
        try:
            super().load_state_dict(own)
            checkpointing.check_model(self.demo)
        except DeMoStateError as exc:
            problem = str(exc)
        ckpt.agree_on_every_rank(
            problem, DeMoStateError, "each rank's optimizer file is its own: which one differs is named"
        )


def adopt(optimizer: AcceleratedOptimizer) -> DeMoAcceleratedOptimizer:
    """``optimizer`` (Accelerate's wrapper around a DeMo) as a :class:`DeMoAcceleratedOptimizer`: the same object,
    its class changed, so every reference the accelerator holds sees DeMo's calls too."""
    optimizer.__class__ = DeMoAcceleratedOptimizer
    return optimizer


def rank_state_file(index: int, rank: int) -> str:
    """The file of rank ``rank``'s state of the accelerator's ``index``-th optimizer (rank 0: Accelerate's own)."""
    name = "optimizer.bin" if index == 0 else f"optimizer_{index}.bin"
    return name if rank == 0 else name.replace(".bin", f".rank{rank}.bin")


class AcceleratorCheckpoints:
    """Every rank's DeMo state and the manifest in ``accelerator.save_state``; the check and each rank's own state
    in ``accelerator.load_state``. Registered once per accelerator (:func:`register`)."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.folder: str | None = None

    def demo_optimizers(self) -> list[tuple[int, DeMoAcceleratedOptimizer]]:
        return [(i, o) for i, o in enumerate(self.accelerator._optimizers) if isinstance(o, DeMoAcceleratedOptimizer)]

    def _last(self) -> int:
        """This object last among the accelerator's registered objects (saved last: the manifest covers the others'
        files), at save and load alike; returns its index (its file is ``custom_checkpoint_<index>.pkl``)."""
        objects = self.accelerator._custom_objects
        objects.remove(self)
        objects.append(self)
        return len(objects) - 1

    def before_save(self, models, weights, output_dir: str) -> None:
        """Save pre-hook, on every rank: the last step's verdict is read first (``confirm()``: a step refused by any
        rank is undone and raised on every rank, and nothing is saved), then ranks other than 0 write their DeMo
        state (Accelerate writes rank 0's)."""
        self.folder = output_dir
        rank = self.accelerator.process_index
        for _, opt in self.demo_optimizers():
            opt.demo.confirm()
        for index, opt in self.demo_optimizers():
            if rank > 0:
                torch.save(opt.demo.state_dict(), os.path.join(output_dir, rank_state_file(index, rank)))

    def state_dict(self) -> dict:
        """Called by ``save_state`` on every rank after every other file is written: rank 0 writes the manifest."""
        index = self._last()
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            steps = [opt.demo.counters.steps for _, opt in self.demo_optimizers()]
            ckpt.write_manifest(
                self.folder,
                self.accelerator.num_processes,
                steps[0] if steps else None,
                skip=(f"custom_checkpoint_{index}.pkl",),
            )
        self.accelerator.wait_for_everyone()
        return {"format": ckpt.FORMAT}

    def before_load(self, models, input_dir: str) -> None:
        """Load pre-hook: the folder checked on every rank, then each rank told which DeMo state is its own."""
        self._last()
        ckpt.verify_on_every_rank(str(input_dir), self.accelerator.num_processes)
        rank, problem, states = self.accelerator.process_index, None, []
        try:  # each rank's own file read now: a damaged one is named on every rank, not raised by one alone
            for index, opt in self.demo_optimizers():
                states.append((opt, ckpt.read_state(os.path.join(input_dir, rank_state_file(index, rank)))))
        except ckpt.CheckpointError as exc:
            problem = str(exc)
        ckpt.agree_on_every_rank(problem, ckpt.CheckpointError, "each rank's optimizer file is its own")
        for opt, state in states:
            opt._demo_own_state = state

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: this object's file only marks the checkpoint as written through hf_demo."""


def register(accelerator) -> AcceleratorCheckpoints:
    """:class:`AcceleratorCheckpoints` on ``accelerator`` (once): its save and load pre-hooks, and itself as a
    registered object (saved after every file of ``save_state``)."""
    found = getattr(accelerator, "_hf_demo_checkpoints", None)
    if found is not None:
        return found
    hooks = AcceleratorCheckpoints(accelerator)
    accelerator.register_save_state_pre_hook(hooks.before_save)
    accelerator.register_load_state_pre_hook(hooks.before_load)
    accelerator.register_for_checkpointing(hooks)
    accelerator._hf_demo_checkpoints = hooks
    return hooks
