"""``DeMoTrainer``: transformers.Trainer that trains with DeMo when asked to; ``DeMoTrainerMixin`` for others.

With DeMo it (1) builds the optimizer through Trainer's own extension point
(``get_optimizer_cls_and_kwargs``) from ``--optim demo`` and DeMo's settings, (2) stops DDP from
all-reducing gradients (a no-op comm hook, registered before the first backward), (3) saves and restores
every rank's own optimizer state with each checkpoint, (4) logs the communication figures, and (5) refuses
set-ups that cannot work. With any optimizer it also writes a manifest into each checkpoint and checks it
on resume (:mod:`hf_demo.hf.checkpoint`), stops when the launcher started more processes than Trainer sees,
and tears the process group down at exit (:mod:`hf_demo.exchange.teardown`). With another optimizer it is Trainer.
It works through Trainer's public methods and callbacks; the three private methods it overrides (no public seam
serves them) live in :mod:`hf_demo.hf.trainer_private`, checked against the supported transformers range.

With ``demo_elastic=True`` (or a dict of :class:`hf_demo.elastic.Elastic`'s arguments) it trains elastically on
torchft, one replica group per ``torchrun``: a lost replica costs a step, not the run (:mod:`hf_demo.hf.elastic`).

``DeMoTrainerMixin`` brings the same to any Trainer subclass: put it first,
``class DeMoSFTTrainer(DeMoTrainerMixin, SFTTrainer)`` (ready-made in :mod:`hf_demo.trl`).

Gradient clipping (``max_grad_norm``) acts on each rank's local gradient before it enters that rank's
momentum. With ``average_tokens_across_devices`` Trainer scales each rank's loss by the world size over the
global token count: each rank's gradient is then exactly the term DDP would have averaged, so DeMo's
momentum sees the same per-rank gradient as DDP's mean would be built from.
"""

from __future__ import annotations

import contextlib
import types
import warnings

import torch.distributed as dist
from transformers import Trainer

from hf_demo import fsdp
from hf_demo.exchange import liveness
from hf_demo.exchange.teardown import install_exit_handler
from hf_demo.hf import checkpoint as ckpt
from hf_demo.hf import elastic as elastic_trainer
from hf_demo.hf import metrics, runtime_classes
from hf_demo.hf.data_parallel import check_supported, disable_gradient_allreduce, unwrap_optimizer
from hf_demo.hf.launch_env import fsdp_requested, refuse_fsdp_on_cpu
from hf_demo.hf.trainer_private import PrivateTrainerHooks
from hf_demo.hf.training_args import DeMoArguments, demo_settings, given_demo_fields, selects_demo, with_demo_arguments
from hf_demo.ops import callbacks as ops_callbacks
from hf_demo.optim import update_rules
from hf_demo.optim.factory import optimizer_cls_and_kwargs
from hf_demo.optim.optimizer import DeMo
from hf_demo.optim.param_groups import model_groups
from hf_demo.refusals import refuse
from hf_demo.settings import DeMoSettings


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def refuse_world_apart(trainer_world: int) -> None:
    """Refuse a launch where torch.distributed has another world size than Trainer's ``trainer_world``."""
    if _distributed() and dist.get_world_size() != trainer_world:
        refuse("trainer_world_apart", world=dist.get_world_size(), trainer_world=trainer_world)


def _refuse_fsdp_on_cpu(args, kwargs: dict) -> None:
    """FSDP asked for on the CPU, with DeMo to train (``--optim demo`` or a DeMo given), stops with DeMo's message
    before Trainer builds the Accelerator (whose checks would stop it with another)."""
    optimizer = (kwargs.get("optimizers") or (None, None))[0]
    cls = (kwargs.get("optimizer_cls_and_kwargs") or (None, None))[0]
    if (
        selects_demo(getattr(args, "optim", None))
        or unwrap_optimizer(optimizer) is not None
        or (isinstance(cls, type) and issubclass(cls, DeMo))
    ):
        refuse_fsdp_on_cpu(args)


class DeMoTrainerMixin(PrivateTrainerHooks):
    """DeMo for a Trainer class: ``class MyTrainer(DeMoTrainerMixin, SomeTrainer)``, the mixin first."""

    def __init__(self, *args, demo_ops=None, demo_elastic=None, **kwargs):
        self.demo_ops = None  # the ops callbacks (hf_demo.ops): demo_ops=OpsSettings(...), or False for none
        self.demo_elastic = None  # hf_demo.elastic.Elastic over the optimizer, once built (demo_elastic=True)
        self._elastic_options = elastic_trainer.options(demo_elastic)
        _refuse_fsdp_on_cpu(args[1] if len(args) > 1 else kwargs.get("args"), kwargs)  # before Accelerate's checks
        super().__init__(*args, **kwargs)
        self._demo_metrics = metrics.CommMetrics()  # the demo/* figures of each log row (hf_demo.hf.metrics)
        refuse_world_apart(self.args.world_size)
        if _distributed():
            install_exit_handler()
        self._check_settings_reach_the_optimizer()
        if self.uses_demo:
            if selects_demo(self.args.optim):
                demo_settings(self.args)  # invalid settings fail now, not at the first step
            check_supported(
                self.accelerator,
                fp16=bool(self.args.fp16),
                deepspeed=self.is_deepspeed_enabled,
                fsdp=self.is_fsdp_enabled,
                fsdp_requested=fsdp_requested(self.args),
            )
            if _distributed():  # Trainer's own collectives (logging gather, batch counts, barriers) bounded too
                liveness.guard(self._demo_comm_timeout())
        if self._elastic_options is not None:
            self._start_elastic()
        self.demo_ops = ops_callbacks.for_trainer(self, demo_ops)

    def _start_elastic(self) -> None:
        """``demo_elastic``: checked now (DeMo, torchft, one process per replica group, the data shard); the
        quorum's callback added before the ops callbacks, so they see the step it settles."""
        from hf_demo.elastic import require_torchft

        if not self.uses_demo:
            refuse("elastic_without_demo")
        require_torchft()
        if self.args.world_size != 1:
            refuse("elastic_trainer_processes", world=self.args.world_size)
        elastic_trainer.data_shard(self._elastic_options)
        self.add_callback(elastic_trainer.ElasticCallback(self))

    def _demo_comm_timeout(self) -> float:
        """The ``comm_timeout`` DeMo will train with: the built optimizer's, else the arguments' (or the default)."""
        opt = unwrap_optimizer(self.optimizer) if self.optimizer is not None else None
        if opt is not None and hasattr(opt, "settings"):
            return opt.settings.comm_timeout
        chosen = demo_settings(self.args) if selects_demo(self.args.optim) else {}
        if self.optimizer_cls_and_kwargs is not None:
            chosen = {**chosen, **self.optimizer_cls_and_kwargs[1]}
        return float(chosen.get("comm_timeout", DeMoSettings.__dataclass_fields__["comm_timeout"].default))

    def _check_settings_reach_the_optimizer(self) -> None:
        """Say so when DeMo settings given in the arguments are not the ones that train (one source of truth)."""
        given = given_demo_fields(self.args)
        passed = self.optimizer is not None or self.optimizer_cls_and_kwargs is not None
        if passed and (given or selects_demo(self.args.optim)):
            warnings.warn(
                f"{type(self).__name__}: an optimizer was given to the trainer (optimizers= or "
                "optimizer_cls_and_kwargs=), so it trains with that one's settings: "
                f"{', '.join(given + (['--optim demo'] if selects_demo(self.args.optim) else []))} are not used. "
                "Give the settings in one place: drop them, or drop the optimizer and use --optim demo",
                stacklevel=3,
            )
        elif given and not self.uses_demo:
            warnings.warn(
                f"{type(self).__name__}: {', '.join(given)} set, but the optimizer is "
                f"{getattr(self.args.optim, 'value', self.args.optim)!r}, not "
                "DeMo: they are not used. Add --optim demo to train with DeMo",
                stacklevel=3,
            )

    @property
    def uses_demo(self) -> bool:
        """Whether this trainer's optimizer is (or will be) DeMo: built, given as a class, or ``--optim demo``."""
        if self.optimizer is not None:
            return unwrap_optimizer(self.optimizer) is not None
        if self.optimizer_cls_and_kwargs is not None:
            cls = self.optimizer_cls_and_kwargs[0]
            return isinstance(cls, type) and issubclass(cls, DeMo)
        return selects_demo(self.args.optim)

    @classmethod
    def get_optimizer_cls_and_kwargs(cls, args, model=None):
        """``(DeMo, kwargs)`` for ``--optim demo``; Trainer's own answer for every other optimizer. With an
        orthogonal rule (``update_rules.ORTHOGONAL``, as ``update_rule`` or ``inner_rule``) the kwargs carry the
        model's Muon-style groups (``params``, which Trainer uses instead of its decay/no-decay groups:
        :func:`hf_demo.optim.param_groups.model_groups`)."""
        if selects_demo(args.optim):
            cls_, kwargs = optimizer_cls_and_kwargs(lr=args.learning_rate, **demo_settings(args))
            rules = (kwargs["update_rule"], kwargs["inner_rule"])
            if model is not None and set(rules) & set(update_rules.ORTHOGONAL):
                kwargs["params"] = model_groups(model, args.weight_decay, *rules)
            return cls_, kwargs
        return super().get_optimizer_cls_and_kwargs(args, model)

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator, without DDP's search for unused parameters unless asked for (Trainer's default for a
        PreTrainedModel makes DDP warn on every run): ``ddp_find_unused_parameters`` left unset is False while the
        accelerator is built, and unset again after it (the arguments stay as given)."""
        if self.args.ddp_find_unused_parameters is not None:
            return super().create_accelerator_and_postprocess()
        self.args.ddp_find_unused_parameters = False
        try:
            return super().create_accelerator_and_postprocess()
        finally:
            self.args.ddp_find_unused_parameters = None

    def create_optimizer(self, model=None):
        """Trainer's optimizer. With DeMo under FSDP (on GPUs) the model is sharded first, on the shard dimension of
        Accelerate's mesh, so that the optimizer holds the sharded parameters and FSDP2 reduce-scatters gradients
        inside each shard group: nothing crosses the replicate dimension but DeMo's exchange (Accelerate keeps a
        model that is already FSDP2; Trainer builds the optimizer before it prepares an FSDP2 model)."""
        if self.uses_demo and self.is_fsdp_enabled and not fsdp.is_fsdp2(self.model):
            self._demo_mesh = fsdp.shard_with_accelerate(self.model, self.accelerator)
        with self._built_on_mesh(model if model is not None else self.model):
            optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        opt = unwrap_optimizer(optimizer)
        if self._elastic_options is not None and self.demo_elastic is None:
            per_step = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
            self.demo_elastic = elastic_trainer.build(opt, self.model, self._elastic_options, per_step)
            optimizer = self.optimizer = self.demo_elastic  # Trainer steps the wrapper: torchft decides each commit
        return optimizer

    @contextlib.contextmanager
    def _built_on_mesh(self, model):
        """While Trainer builds its optimizer: under HSDP (the model sharded here on a 2-D mesh) DeMo is given
        Accelerate's (replicate, shard) mesh at construction (``device_mesh``), and exchanges across its replicate
        dimension. Trainer's own optimizer class and kwargs (or the ones given to it) are put back after."""
        mesh, given = getattr(self, "_demo_mesh", None), self.optimizer_cls_and_kwargs
        if self.optimizer is not None or mesh is None or mesh.ndim != 2:
            yield
            return
        cls, kwargs = given if given is not None else self.get_optimizer_cls_and_kwargs(self.args, model)
        if isinstance(cls, type) and issubclass(cls, DeMo):
            self.optimizer_cls_and_kwargs = (cls, {**kwargs, "device_mesh": mesh})
        try:
            yield
        finally:
            self.optimizer_cls_and_kwargs = given

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.uses_demo:
            disable_gradient_allreduce(model)  # before the first backward; once
            unwrap_optimizer(self.optimizer).run_by("trainer")  # its errors name Trainer's switches
        if self.demo_ops is not None:
            self.demo_ops.watch_forward(model)  # DDP's buffer broadcast: a wait, not this rank's own time
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.demo_ops is not None:
            self.demo_ops.record_loss(loss)
            self.demo_ops.record_inputs(inputs)
        return loss

    # ------------------------------------------------------------------ metrics
    def log(self, logs: dict, start_time: float | None = None) -> None:
        opt = unwrap_optimizer(self.optimizer)
        summary = opt is not None and "loss" not in logs and "train_loss" in logs  # the end-of-training row
        if opt is not None and "loss" in logs:  # a training log row
            logs.update(self._demo_metrics(opt))
            if self.demo_ops is not None:  # every rank's step split, alerts, cost (gathered on every rank)
                logs.update(self.demo_ops.log_metrics(self.state.global_step))
        elif summary:  # totals only
            logs.update(metrics.totals(self._demo_metrics(opt)))
        super().log(logs, start_time)
        if summary and self.args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self._land_before_best_model(opt)

    @staticmethod
    def _land_before_best_model(opt) -> None:
        """Trainer writes the end-of-training row once every step, evaluation and save is done, and then loads the
        best checkpoint (``load_best_model_at_end``): the last step's verdict is read and overlap's exchange in flight
        lands first, on every rank, so that the best checkpoint's weights are what ``train()`` ends with (the flush
        after ``train()`` would add it on top)."""
        opt.confirm()
        if opt.in_flight:
            opt.flush()

    # ------------------------------------------------------------------ checkpoints
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """Trainer's ``train``; ``resume_from_checkpoint=True`` takes the last *complete* checkpoint, and the
        checkpoint is checked against its manifest on every rank before anything is loaded."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = ckpt.last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No complete checkpoint found in output directory ({self.args.output_dir})")
        if resume_from_checkpoint:
            self._verify_checkpoint(str(resume_from_checkpoint))
        output = super().train(
            resume_from_checkpoint=resume_from_checkpoint or None,
            trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval,
            **kwargs,
        )
        opt = unwrap_optimizer(self.optimizer)
        if opt is not None and hasattr(opt, "flush"):
            opt.flush()  # overlap=True: the last step's exchange lands before evaluate/save_model
        return output

    def _verify_checkpoint(self, folder: str) -> None:
        """Every rank checks ``folder`` against its manifest; the ranks compare verdicts, so all raise the same."""
        ckpt.verify_on_every_rank(folder, self.args.world_size if self.uses_demo else None)

    def _averaged(self):
        """The ranks' mean parameters for the ``with`` block inside a local phase (DeMo.averaged_parameters)."""
        opt = unwrap_optimizer(self.optimizer)
        return opt.averaged_parameters() if opt is not None else contextlib.nullcontext()

    def evaluation_loop(self, *args, **kwargs):
        """Trainer's evaluation (``evaluate``, ``predict``, in training and after it); inside a local phase on the
        ranks' mean parameters, the model ``train()`` ends with, not each rank its own on its shard of the data."""
        self._wrap_before_first_evaluation()
        with self._averaged():
            return super().evaluation_loop(*args, **kwargs)

    def _wrap_before_first_evaluation(self) -> None:
        """An evaluation before ``train()`` in a run of several processes: Trainer would ask Accelerate to prepare the
        bare model for evaluation only, which Accelerate then counts as prepared, so ``train()`` would never wrap it
        in DistributedDataParallel: nothing would broadcast the initial weights, and DDP's gradient averaging (the
        baselines') would never happen. The model is prepared for training here instead, through Accelerate's
        ``prepare_model`` (DDP broadcasts rank 0's weights): Trainer evaluates the model inside the wrapper, and
        ``train()`` trains the wrapper it finds."""
        if (
            self.model_wrapped is not self.model
            or self.is_in_train
            or self.train_dataset is None
            or self.is_deepspeed_enabled
            or self.is_fsdp_enabled
            or not self.accelerator.distributed_type.value.startswith("MULTI_")
        ):
            return
        self.model_wrapped = self.accelerator.prepare_model(self.model)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's ``save_model``; inside a local phase the model file holds the ranks' mean parameters (what
        ``load_best_model_at_end`` and other readers of a checkpoint's model take), while each rank's own stay in
        its optimizer state for an exact resume. Every rank must call it (Trainer's checkpoints do)."""
        if not _internal_call:  # a user's call may come from rank 0 alone (after train() the phase has ended,
            return super().save_model(output_dir, _internal_call)  # except with end_local_phase='warn')
        with self._averaged():
            return super().save_model(output_dir, _internal_call)

    def _barrier(self) -> None:
        if self.args.world_size > 1:
            self.accelerator.wait_for_everyone()


class DeMoTrainer(DeMoTrainerMixin, Trainer):
    """Drop-in for ``transformers.Trainer`` (same constructor) that knows DeMo."""


_MADE: dict = {}


def demo_trainer_class(trainer_cls: type) -> type:
    """``trainer_cls`` with :class:`DeMoTrainerMixin` first (once per class; as it is when DeMo-aware already)."""
    if issubclass(trainer_cls, DeMoTrainerMixin):
        return trainer_cls
    if trainer_cls not in _MADE:
        made = types.new_class(
            f"DeMo{trainer_cls.__name__}",
            (DeMoTrainerMixin, trainer_cls, runtime_classes.Made),
            exec_body=lambda ns: ns.update(
                __doc__=f"{trainer_cls.__name__} with DeMo (``optim='demo'``): see hf_demo.with_demo."
            ),
        )
        _MADE[trainer_cls] = runtime_classes.publish(made, "trainer", trainer_cls)
    return _MADE[trainer_cls]


def demo_config_class(config_cls: type) -> type:
    """``config_cls`` plus the ``--demo_*`` fields (once per class; as it is when it has them already)."""
    if issubclass(config_cls, DeMoArguments):
        return config_cls
    if config_cls not in _MADE:
        made = with_demo_arguments(config_cls, bases=(runtime_classes.Made,))
        _MADE[config_cls] = runtime_classes.publish(made, "config", config_cls)
    return _MADE[config_cls]


runtime_classes.MAKERS.update(trainer=demo_trainer_class, config=demo_config_class)


def with_demo(trainer_cls: type, config_cls: type) -> tuple[type, type]:
    """DeMo versions of any Trainer subclass and its config class: ``(trainer class, config class)``.

        DeMoSFTTrainer, DeMoSFTConfig = hf_demo.with_demo(SFTTrainer, SFTConfig)
        args = DeMoSFTConfig(output_dir="out", optim="demo", demo_compression_topk=16)

    The trainer class is ``trainer_cls`` with :class:`DeMoTrainerMixin` first; the config class is
    ``config_cls`` first (its own defaults hold: SFTConfig's learning rate, bf16, logging) plus the
    ``--demo_*`` fields. The classes are made once per class and live in :mod:`hf_demo.hf.runtime_classes`, so
    Trainer can pickle the arguments with each checkpoint, and a fresh process unpickles them without calling
    ``with_demo`` first.
    """
    from transformers import TrainingArguments

    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise TypeError(f"with_demo: {trainer_cls!r} is not a transformers.Trainer subclass")
    if not (isinstance(config_cls, type) and issubclass(config_cls, TrainingArguments)):
        raise TypeError(f"with_demo: {config_cls!r} is not a transformers.TrainingArguments subclass")
    return demo_trainer_class(trainer_cls), demo_config_class(config_cls)
