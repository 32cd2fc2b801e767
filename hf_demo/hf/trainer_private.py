"""The private ``transformers.Trainer`` methods hf_demo overrides or calls: all of them, here, for one range.

:class:`hf_demo.hf.trainer.DeMoTrainerMixin` reaches Trainer through its public seams wherever one serves:
``get_optimizer_cls_and_kwargs`` and ``create_optimizer`` (DeMo built; the model sharded for FSDP2 before it),
``create_accelerator_and_postprocess`` (DDP's search for unused parameters off unless asked for), ``training_step``,
``log`` (the figures; an exchange in flight lands before ``load_best_model_at_end``), ``evaluation_loop`` and
``save_model`` (the ranks' mean inside a local phase; a model evaluated before ``train()`` is prepared for training
first), ``train`` and ``TrainerCallback`` events (the elastic quorum). Three jobs have no public seam, and
:class:`PrivateTrainerHooks` overrides a private method for each:

- ``_get_train_sampler``: with ``demo_elastic``, the replica group's shard of the data as a stream a restarted replica
  sets the position of (Trainer builds its data loader around the sampler; no public method hands one in).
- ``_save_checkpoint``: the last step's verdict read before anything is written, every rank's own optimizer state
  written beside rank 0's ``optimizer.pt``, then the manifest, and only then Trainer's rotation of old checkpoints
  (Trainer rotates inside this method, before ``on_save``: a run that died in between would keep no complete one).
- ``_load_optimizer_and_scheduler``: each rank loads its own optimizer state (Trainer loads rank 0's on every rank,
  between preparing the model and ``on_train_begin``), checked on every rank before any rank loads.

:data:`PRIVATE` names each private method used, with the parameters relied on; :data:`PUBLIC` the public ones
overridden. ``tests/test_trainer_private.py`` checks them against the installed transformers, which must be in
:data:`TRANSFORMERS_RANGE` (pyproject's ``transformers`` requirement is that range, checked there too).
"""

from __future__ import annotations

import os

import torch
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME  # rank 0's state goes in Trainer's own file
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_demo.errors import DeMoStateError
from hf_demo.hf import checkpoint as ckpt
from hf_demo.hf import elastic as elastic_trainer
from hf_demo.hf.data_parallel import unwrap_optimizer
from hf_demo.optim import checkpointing

TRANSFORMERS_RANGE = ">=4.56,<6"  # the versions these methods are checked against; pyproject requires the same

# private Trainer methods: {name: the parameters hf_demo relies on, in order}; the overridden ones live below
PRIVATE = {
    "_get_train_sampler": ("self", "train_dataset"),
    "_save_checkpoint": ("self", "model", "trial"),
    "_load_optimizer_and_scheduler": ("self", "checkpoint"),
    "_get_output_dir": ("self", "trial"),  # called by _save_checkpoint, not overridden
}
# public Trainer methods DeMoTrainerMixin overrides, with the parameters it passes on
PUBLIC = {
    "create_accelerator_and_postprocess": ("self",),
    "get_optimizer_cls_and_kwargs": ("args", "model"),
    "create_optimizer": ("self", "model"),
    "training_step": ("self", "model", "inputs", "num_items_in_batch"),
    "log": ("self", "logs", "start_time"),
    "train": ("self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"),
    "evaluation_loop": ("self", "dataloader", "description", "prediction_loss_only", "ignore_keys"),
    "save_model": ("self", "output_dir", "_internal_call"),
}


def rank_state_file(rank: int) -> str:
    """File of rank ``rank``'s DeMo state inside a checkpoint (rank 0 uses Trainer's optimizer.pt)."""
    return OPTIMIZER_NAME if rank == 0 else f"optimizer.rank{rank}.pt"


class PrivateTrainerHooks:
    """The private Trainer overrides (:data:`PRIVATE`); a base of :class:`hf_demo.hf.trainer.DeMoTrainerMixin`, which
    provides ``_elastic_options`` and ``_barrier``."""

    def _get_train_sampler(self, train_dataset=None):
        """Trainer's sampler; with ``demo_elastic`` this replica group's shard of the training set (torchft's static
        split: replica ``REPLICA_GROUP_ID`` of ``NUM_REPLICA_GROUPS``, shuffled with the run's seed), read as a
        stream whose position a restarted replica sets from torchft's committed step (``ShardStream``)."""
        if self._elastic_options is None:
            return super()._get_train_sampler(train_dataset)
        rid, n = elastic_trainer.data_shard(self._elastic_options)
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        self._elastic_stream = elastic_trainer.ShardStream(dataset, rid, n, self.args.seed)
        return self._elastic_stream

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's save, every rank's own DeMo state, then (after a barrier) rank 0's manifest, then the rotation of
        old checkpoints.

        Old checkpoints are deleted only once the new one is complete (Trainer rotates before that). The last
        step's verdict is read first on every rank (``confirm()``): a step that any rank refused is undone and
        raised on every rank before anything is written.
        """
        opt = unwrap_optimizer(self.optimizer)
        if opt is not None:
            opt.confirm()
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # Trainer's rotation waits until the manifest is written
        try:
            super()._save_checkpoint(model, trial)  # rank 0: optimizer.pt (its own state), the scheduler
        finally:
            self.args.save_total_limit = limit
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        rank = self.args.process_index
        if opt is not None and rank > 0 and not self.args.save_only_model:
            os.makedirs(folder, exist_ok=True)
            torch.save(opt.state_dict(), os.path.join(folder, rank_state_file(rank)))
        self._barrier()
        if self.args.should_save:
            ckpt.write_manifest(folder, self.args.world_size, self.state.global_step)
            if limit:
                from transformers.trainer_utils import rotate_checkpoints  # transformers 5 (Trainer's own before)

                rotate_checkpoints(
                    output_dir=run_dir,
                    save_total_limit=limit,
                    best_model_checkpoint=self.state.best_model_checkpoint,
                    use_mtime=True,
                )
        self._barrier()

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Each rank's own DeMo state (rank 0's in ``optimizer.pt``), every rank's file read and checked before any
        rank loads; Trainer's own loading for any other optimizer or checkpoint."""
        opt = unwrap_optimizer(self.optimizer)
        if opt is None or checkpoint is None or not os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
            return super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, rank_state_file(self.args.process_index))
        if not os.path.isfile(path):  # only without a manifest (verify_checkpoint catches it otherwise)
            raise DeMoStateError(
                f"{checkpoint} has no DeMo optimizer state for rank {self.args.process_index} "
                f"({rank_state_file(self.args.process_index)})"
            )
        state, problem = None, None
        try:  # every rank's file read first: a damaged one is named on every rank before any rank loads
            state = ckpt.read_state(path)
        except ckpt.CheckpointError as exc:
            problem = str(exc)
        ckpt.agree_on_every_rank(problem, ckpt.CheckpointError, "each rank's optimizer file is its own")
        # DeMo.load_state_dict checks rank, world size, and every rank's run and step (keeping the requested
        # settings, with a warning); then the model's weights, loaded by now, against this rank's state
        try:
            opt.load_state_dict(state)
            checkpointing.check_model(opt)
            problem = None
        except DeMoStateError as exc:
            problem = str(exc)
        ckpt.agree_on_every_rank(
            problem, DeMoStateError, "each rank's optimizer file is its own: which one differs is named"
        )
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
