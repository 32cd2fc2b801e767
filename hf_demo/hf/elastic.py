"""Elastic DeMo under Trainer: ``DeMoTrainer(..., demo_elastic=True)`` (or any ``with_demo`` trainer).

Launch one ``torchrun --nproc_per_node 1`` per replica group, each with ``REPLICA_GROUP_ID`` (0, 1, ...),
``NUM_REPLICA_GROUPS`` and ``TORCHFT_LIGHTHOUSE``, beside one ``torchft_lighthouse``. What it does:

- the optimizer Trainer builds (DeMo) is wrapped in :class:`hf_demo.elastic.Elastic` (``demo_elastic``: ``True``,
  or a dict of ``Elastic``'s keyword arguments: ``min_replicas``, ``timeout``, ``lighthouse``, ``replica_id``,
  ``quorum_timeout``; and ``replicas``, the number of replica groups the data is split into), and the wrapper is
  Trainer's optimizer (``DeMoTrainerMixin.create_optimizer``), as torchft's ``OptimizerWrapper`` would be;
- each step begins with torchft's quorum (:meth:`Elastic.start_step`, from ``on_step_begin``, before the
  step's forward passes: a restarted replica receives the agreed state from a live peer there), and Trainer's
  ``optimizer.step()`` (the wrapper's) commits DeMo's step only where torchft's ``should_commit`` says so;
- Trainer's step counter and learning-rate schedule follow torchft's committed steps: a refused step (a
  replica lost in flight) does not count, and a replica that recovered continues at the quorum's step with
  the schedule's learning rate at that step, so every replica applies the same update;
- each replica group reads its own shard of the training set (replica ``REPLICA_GROUP_ID`` of
  ``NUM_REPLICA_GROUPS``, torchft's static split) as one stream over the epochs (:class:`ShardStream`). The first
  quorum is taken when training begins, before the data loader starts: a restarted replica receives the agreed
  state there and reads its shard from the position of torchft's committed step ``s`` (``s`` batches into its
  stream, where it would be had it never left, as Trainer's resume from a checkpoint skips ``global_step``
  batches). Its shard's batches of the steps it was away are not read: each replica counts them
  (``ElasticStats.samples_unread``: the replicas missing from each committed step's quorum times the samples of a
  replica's step). A refused step's batches are not read again either (Trainer's data loader has moved on):
  ``samples_lost``.

Why Trainer's own collectives do not break when a replica group dies: each replica group is its own
``torchrun`` with a world of one process, so Trainer's default process group (its logging gather, its
barriers) holds only that process; the only traffic between replica groups is DeMo's exchange, over torchft's
reconfigurable group. What this does not do yet: a replica group of several processes (``Elastic`` runs one
process per replica group).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler
from transformers import TrainerCallback

from hf_demo.errors import DeMoSetupError
from hf_demo.refusals import refuse

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


class ShardStream(Sampler):
    """Replica ``rank``'s shard of ``dataset`` (of ``replicas``) as one stream over the epochs: epoch ``e`` is
    ``DistributedSampler``'s shard of the permutation for ``seed + e``. Each iteration runs from :attr:`position`
    (samples into the stream) to the end of that epoch, and the next one from the start of the next epoch, so a
    replica that sets :attr:`position` before its data loader starts (a restarted one, at torchft's committed step)
    reads on from there. Trainer's ``set_epoch`` is ignored: the stream keeps its own."""

    def __init__(self, dataset, rank: int, replicas: int, seed: int):
        self.shard = DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=True, seed=seed)
        self.position = 0

    def __len__(self) -> int:
        return len(self.shard)

    def set_epoch(self, epoch: int) -> None:
        pass  # the stream's epoch follows its position

    def __iter__(self):
        epoch, offset = divmod(self.position, len(self.shard))
        self.shard.set_epoch(epoch)
        order = list(self.shard)[offset:]
        self.position = (epoch + 1) * len(self.shard)
        yield from order


def build(opt, model, chosen: dict, samples_per_step: int):
    """The :class:`~hf_demo.elastic.Elastic` over Trainer's DeMo ``opt``; ``samples_per_step``: one replica's samples
    of one optimizer step (the batch times the accumulation steps), its ``batch_size``."""
    from hf_demo.elastic import Elastic

    if opt is None:
        refuse("elastic_without_demo")
    kwargs = {"batch_size": samples_per_step, **{k: v for k, v in chosen.items() if k not in DATA_KEYS}}
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
    """torchft's quorum at each step's beginning (the first one when training begins, before the data loader
    starts: a joiner's data position follows its recovery); Trainer's step and schedule kept on torchft's committed
    steps; the samples of the replicas missing from a committed step counted."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._quorum_taken = False  # the first step's quorum, taken at train begin

    def on_train_begin(self, args, state, control, **kwargs):
        elastic = self.trainer.demo_elastic
        elastic.start_step()  # a restarted replica receives the agreed state here
        self._quorum_taken = True
        stream = getattr(self.trainer, "_elastic_stream", None)
        if stream is not None:
            stream.position = elastic.manager.current_step() * elastic.batch_size

    def on_step_begin(self, args, state, control, lr_scheduler=None, **kwargs):
        elastic = self.trainer.demo_elastic
        if not self._quorum_taken:
            elastic.start_step()
        self._quorum_taken = False
        step = elastic.manager.current_step()
        if state.global_step != step:  # a refused step, or this replica recovered from a peer
            state.global_step = step
        set_schedule(lr_scheduler if lr_scheduler is not None else self.trainer.lr_scheduler, step)

    def on_step_end(self, args, state, control, **kwargs):
        elastic = self.trainer.demo_elastic
        if elastic.last_committed:
            _, replicas = data_shard(self.trainer._elastic_options)
            elastic.unread(max(replicas - elastic.world, 0) * elastic.batch_size)  # the missing replicas' shards
            return
        state.global_step = elastic.manager.current_step()  # the refused step does not count
        control.should_log = control.should_save = control.should_evaluate = False
        if 0 < state.global_step < state.max_steps:  # max_steps is reached by committed steps only
            control.should_training_stop = False

    def on_train_end(self, args, state, control, **kwargs):
        elastic = self.trainer.demo_elastic
        if elastic is not None:
            elastic.shutdown()
