"""Elastic DeMo under Trainer: ``DeMoTrainer(..., demo_elastic=True)`` (or any ``with_demo`` trainer).

Launch one ``torchrun --nproc_per_node 1`` per replica group, each with ``REPLICA_GROUP_ID`` (0, 1, ...),
``NUM_REPLICA_GROUPS`` and ``TORCHFT_LIGHTHOUSE``, beside one ``torchft_lighthouse``. What it does:

- the optimizer Trainer builds (DeMo) is wrapped in :class:`hf_demo.elastic.Elastic` (``demo_elastic``: ``True``,
  or a dict of ``Elastic``'s keyword arguments: ``min_replicas``, ``timeout``, ``lighthouse``, ``replica_id``,
  ``quorum_timeout``; and ``replicas``, the number of replica groups the data is split into);
- each step begins with torchft's quorum (:meth:`Elastic.start_step`, from ``on_step_begin``, before the
  step's forward passes: a restarted replica receives the agreed state from a live peer there), and DeMo's
  ``optimizer.step()`` commits only where torchft's ``should_commit`` says so;
- Trainer's step counter and learning-rate schedule follow torchft's committed steps: a refused step (a
  replica lost in flight) does not count, and a replica that recovered continues at the quorum's step with
  the schedule's learning rate at that step, so every replica applies the same update;
- each replica group reads its own shard of the training set (replica ``REPLICA_GROUP_ID`` of
  ``NUM_REPLICA_GROUPS``, torchft's static split): a lost replica's shard is not read while it is away.

Why Trainer's own collectives do not break when a replica group dies: each replica group is its own
``torchrun`` with a world of one process, so Trainer's default process group (its logging gather, its
barriers) holds only that process; the only traffic between replica groups is DeMo's exchange, over torchft's
reconfigurable group. What this does not do yet: a replica group of several processes (``Elastic`` runs one
process per replica group), and a restarted replica's position in its data shard (it reads its shard from the
start of the epoch again: duplicates, not losses).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

from transformers import TrainerCallback

from hf_demo.errors import DeMoSetupError

DATA_KEYS = ("replicas",)  # demo_elastic's keys that are not Elastic's


def options(demo_elastic) -> dict | None:
    """``demo_elastic`` as a dict (``True``: every default), or None for ``None``/``False``; a clear error else."""
    if demo_elastic is None or demo_elastic is False:
        return None
    if demo_elastic is True:
        return {}
    if isinstance(demo_elastic, Mapping):
        return dict(demo_elastic)
    raise TypeError(
        f"demo_elastic must be True, False or a dict of hf_demo.elastic.Elastic's keyword arguments (and 'replicas'),"
        f" not {type(demo_elastic).__name__}"
    )


def data_shard(chosen: dict) -> tuple[int, int]:
    """(this replica group's shard, the number of shards): ``replica_id`` (``REPLICA_GROUP_ID``) of ``replicas``
    (``NUM_REPLICA_GROUPS``), whole numbers with the first below the second."""
    rid = chosen.get("replica_id", os.environ.get("REPLICA_GROUP_ID"))
    n = chosen.get("replicas", os.environ.get("NUM_REPLICA_GROUPS"))
    try:
        rid, n = int(rid), int(n)
    except (TypeError, ValueError):
        raise DeMoSetupError(
            f"demo_elastic: each replica group reads its own shard of the data, replica_id of replicas; got "
            f"replica_id={rid!r}, replicas={n!r}. Set REPLICA_GROUP_ID=0, 1, ... and NUM_REPLICA_GROUPS (or give "
            "demo_elastic={'replica_id': ..., 'replicas': ...}), whole numbers"
        ) from None
    if not 0 <= rid < n:
        raise DeMoSetupError(f"demo_elastic: replica_id {rid} is not one of the {n} replica groups (0 to {n - 1})")
    return rid, n


def build(opt, model, chosen: dict):
    """The :class:`~hf_demo.elastic.Elastic` over Trainer's DeMo ``opt``."""
    from hf_demo.elastic import Elastic

    if opt is None:
        raise DeMoSetupError("demo_elastic trains DeMo elastically: give --optim demo (or a DeMo optimizer)")
    kwargs = {k: v for k, v in chosen.items() if k not in DATA_KEYS}
    if "replica_id" in kwargs:
        kwargs["replica_id"] = str(kwargs["replica_id"])
    return Elastic(opt, model, **kwargs)


def set_schedule(lr_scheduler, step: int) -> None:
    """The learning-rate schedule at ``step`` (what a fresh schedule stepped ``step`` times gives): every replica's
    learning rate is the same function of torchft's committed step."""
    sched = getattr(lr_scheduler, "scheduler", lr_scheduler)  # accelerate's wrapper, if any
    if sched is None or getattr(sched, "last_epoch", step) == step:
        return
    sched.last_epoch = step - 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": on purpose here
        sched.step()


class ElasticCallback(TrainerCallback):
    """torchft's quorum at each step's beginning; Trainer's step and schedule kept on torchft's committed steps."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_begin(self, args, state, control, lr_scheduler=None, **kwargs):
        elastic = self.trainer.demo_elastic
        elastic.start_step()
        step = elastic.manager.current_step()
        if state.global_step != step:  # a refused step, or this replica recovered from a peer
            state.global_step = step
        set_schedule(lr_scheduler if lr_scheduler is not None else self.trainer.lr_scheduler, step)

    def on_step_end(self, args, state, control, **kwargs):
        elastic = self.trainer.demo_elastic
        if elastic.last_committed:
            return
        state.global_step = elastic.manager.current_step()  # the refused step does not count
        control.should_log = control.should_save = control.should_evaluate = False
        if 0 < state.global_step < state.max_steps:  # max_steps is reached by committed steps only
            control.should_training_stop = False

    def on_train_end(self, args, state, control, **kwargs):
        elastic = self.trainer.demo_elastic
        if elastic is not None:
            elastic.shutdown()
