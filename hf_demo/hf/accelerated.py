"""DeMo in a custom Accelerate loop: the optimizer ``hf_demo.prepare`` returns, and Accelerate's checkpoints.

``hf_demo.prepare`` wraps DeMo in a :class:`DeMoAcceleratedOptimizer` (Accelerate's ``AcceleratedOptimizer`` with
DeMo's calls and figures), hands that to ``accelerator.prepare`` and returns it: ``flush()``, ``confirm()``,
``averaged_parameters()``, ``comm_stats``, ``skipped_steps``, ``resyncs``, ``tier`` work on it, ``.demo`` is the DeMo
inside, and ``demo_metrics()`` is the ``demo/*`` dict that ``hf_demo.log_metrics(accelerator, optimizer, step)`` hands
to ``accelerator.log``. Accelerate wraps it in turn, as it wraps any optimizer: its own list and the prepared schedulers
hold that wrapper, whose calls (``step``, ``state_dict``, ``load_state_dict``, ...) all come to this one.

``accelerator.save_state(folder)`` keeps only rank 0's optimizer state (``optimizer.bin``), but each rank's DeMo
momentum is its own. :class:`AcceleratorCheckpoints`, whose hooks ``hf_demo.prepare`` registers on the accelerator,
makes every other rank write its own (``optimizer.rank<r>.bin``) and, once every file is written, rank 0 writes the
manifest DeMoTrainer's checkpoints have (:mod:`hf_demo.hf.checkpoint`). ``accelerator.load_state(folder)``
checks the folder against it on every rank first (every rank raises the same ``CheckpointError``: also for a
truncated model or optimizer file that a manifest written by hand vouches for), then each rank loads its own DeMo
state and checks the model's weights against it as ``DeMoTrainer`` does (the same ``DeMoStateError`` on every
rank for a model file from another save or run). Only Accelerate's public calls are used, besides reading (never
changing) its lists of optimizers and registered objects to name the files as Accelerate does.
"""

from __future__ import annotations

import os
import weakref

import torch
from accelerate.optimizer import AcceleratedOptimizer

from hf_demo.errors import DeMoStateError
from hf_demo.hf import checkpoint as ckpt
from hf_demo.hf.metrics import CommMetrics
from hf_demo.optim import checkpointing
from hf_demo.optim.optimizer import DeMo
from hf_demo.refusals import refuse

DEMO_ATTRIBUTES = frozenset(
    {"flush", "confirm", "unconfirmed", "averaged_parameters", "comm_stats", "skipped_steps", "resyncs", "tier",
     "in_flight", "policy", "settings", "counters", "unsynced"}
)  # fmt: skip


class DeMoAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper around DeMo, with DeMo's own calls and figures (``DEMO_ATTRIBUTES``). Built by
    ``hf_demo.prepare`` around DeMo; Accelerate's own wrapper around it places the state on the device."""

    def __init__(self, optimizer):
        super().__init__(optimizer, device_placement=False)
        self._demo_metrics = CommMetrics()
        self._own_state = None  # this rank's DeMo state for the next load_state_dict (AcceleratorCheckpoints)

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
        return self._demo_metrics(self.demo)

    def expect_own_state(self, state: dict) -> None:
        """Inside ``load_state``: the next :meth:`load_state_dict` loads ``state``, this rank's own DeMo state."""
        self._own_state = state

    def load_state_dict(self, state_dict) -> None:
        """Accelerate's ``load_state`` hands every rank rank 0's ``optimizer.bin``: inside ``load_state`` each rank
        loads its own DeMo state instead (the one :class:`AcceleratorCheckpoints` read), then checks the model's
        weights, loaded by now, against it (``DeMoTrainer``'s check: the model file and the optimizer files must
        come from one save of one run); every rank raises the same ``DeMoStateError`` when any rank's does not."""
        if self._own_state is None:  # outside load_state: as Accelerate's
            return super().load_state_dict(state_dict)
        own, self._own_state = self._own_state, None
        problem = None
        try:
            super().load_state_dict(own)
            checkpointing.check_model(self.demo)
        except DeMoStateError as exc:
            problem = str(exc)
        ckpt.agree_on_every_rank(
            problem, DeMoStateError, "each rank's optimizer file is its own: which one differs is named"
        )


def rank_state_file(index: int, rank: int) -> str:
    """The file of rank ``rank``'s state of the accelerator's ``index``-th optimizer (rank 0: Accelerate's own)."""
    name = "optimizer.bin" if index == 0 else f"optimizer_{index}.bin"
    return name if rank == 0 else name.replace(".bin", f".rank{rank}.bin")


class AcceleratorCheckpoints:
    """Every rank's DeMo state and the manifest in ``accelerator.save_state``; the check and each rank's own state
    in ``accelerator.load_state``. One per accelerator (:func:`register`); its object for checkpointing is registered
    at the first save or load, after the user's, so that its file, which writes the manifest, is saved last."""

    def __init__(self, accelerator):
        self._accelerator = weakref.ref(accelerator)
        self.optimizers: list[DeMoAcceleratedOptimizer] = []  # what hf_demo.prepare returned, in order
        self.index: int | None = None  # this object's place among the accelerator's registered objects
        self.folder: str | None = None

    @property
    def accelerator(self):
        return self._accelerator()

    def demo_optimizers(self) -> list[tuple[int, DeMoAcceleratedOptimizer]]:
        """(Accelerate's index, the optimizer) of every DeMo optimizer prepared through hf_demo."""
        ours = {id(opt): opt for opt in self.optimizers}
        held = enumerate(self.accelerator._optimizers)  # read only: Accelerate's order names the files
        return [(i, ours[id(o.optimizer)]) for i, o in held if id(o.optimizer) in ours]

    def _registered_last(self) -> int:
        """Register this object for checkpointing once (last of the accelerator's objects so far); refuse when an
        object was registered after it. Returns its index (its file is ``custom_checkpoint_<index>.pkl``)."""
        objects = self.accelerator._custom_objects  # read only
        if self.index is None:
            self.accelerator.register_for_checkpointing(self)
            self.index = len(objects) - 1
        if objects[-1] is not self:
            refuse("late_checkpoint_object")
        return self.index

    def before_save(self, models, weights, output_dir: str) -> None:
        """Save pre-hook, on every rank: the last step's verdict is read first (``confirm()``: a step refused by any
        rank is undone and raised on every rank, and nothing is saved), then ranks other than 0 write their DeMo
        state (Accelerate writes rank 0's)."""
        self._registered_last()
        self.folder = output_dir
        rank = self.accelerator.process_index
        for _, opt in self.demo_optimizers():
            opt.demo.confirm()
        for index, opt in self.demo_optimizers():
            if rank > 0:
                torch.save(opt.demo.state_dict(), os.path.join(output_dir, rank_state_file(index, rank)))

    def state_dict(self) -> dict:
        """Called by ``save_state`` on every rank after every other file is written: rank 0 writes the manifest."""
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            steps = [opt.demo.counters.steps for _, opt in self.demo_optimizers()]
            ckpt.write_manifest(
                self.folder,
                self.accelerator.num_processes,
                steps[0] if steps else None,
                skip=(f"custom_checkpoint_{self.index}.pkl",),
            )
        self.accelerator.wait_for_everyone()
        return {"format": ckpt.FORMAT}

    def before_load(self, models, input_dir: str) -> None:
        """Load pre-hook: the folder checked on every rank, then each rank told which DeMo state is its own."""
        self._registered_last()
        ckpt.verify_on_every_rank(str(input_dir), self.accelerator.num_processes)
        rank, problem, states = self.accelerator.process_index, None, []
        try:  # each rank's own file read now: a damaged one is named on every rank, not raised by one alone
            for index, opt in self.demo_optimizers():
                states.append((opt, ckpt.read_state(os.path.join(input_dir, rank_state_file(index, rank)))))
        except ckpt.CheckpointError as exc:
            problem = str(exc)
        ckpt.agree_on_every_rank(problem, ckpt.CheckpointError, "each rank's optimizer file is its own")
        for opt, state in states:
            opt.expect_own_state(state)

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: this object's file only marks the checkpoint as written through hf_demo."""


_REGISTERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # accelerator: its AcceleratorCheckpoints


def register(accelerator, optimizer: DeMoAcceleratedOptimizer) -> AcceleratorCheckpoints:
    """``optimizer`` (what ``hf_demo.prepare`` returns) in ``accelerator``'s :class:`AcceleratorCheckpoints`, made
    once per accelerator with its save and load pre-hooks."""
    hooks = _REGISTERED.get(accelerator)
    if hooks is None:
        hooks = _REGISTERED[accelerator] = AcceleratorCheckpoints(accelerator)
        accelerator.register_save_state_pre_hook(hooks.before_save)
        accelerator.register_load_state_pre_hook(hooks.before_load)
    hooks.optimizers.append(optimizer)
    return hooks
