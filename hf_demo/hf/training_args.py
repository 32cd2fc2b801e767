"""``--optim demo`` and DeMo's settings as training arguments (:class:`DeMoArguments`, :class:`DeMoTrainingArguments`).

* ``"demo"`` is a value of ``optim`` in hf_demo's argument classes (:class:`DeMoTrainingArguments`, and every
  class :func:`with_demo_arguments` makes: ``hf_demo.trl.DeMoSFTConfig``, ``hf_demo.with_demo``'s), not of
  transformers' ``OptimizerNames``, which hf_demo leaves as it is: those classes redeclare ``optim`` (a string
  whose choices are Trainer's optimizers and ``demo``, so ``--optim demo`` parses) and validate any other value
  as Trainer does (:func:`validate_optim`). ``args.optim`` is ``"demo"`` from start to end. Only a DeMo-aware
  trainer (:class:`hf_demo.DeMoTrainer`, or any trainer class with :class:`hf_demo.DeMoTrainerMixin`) builds
  DeMo from it, through Trainer's own extension point ``get_optimizer_cls_and_kwargs``; a plain Trainer given
  such arguments refuses it at start-up (it would all-reduce gradients). A plain ``TrainingArguments`` (or TRL
  config) does not know ``demo``: transformers refuses it there ("is not a valid OptimizerNames").
* :class:`DeMoArguments` holds one optional ``demo_<name>`` field per DeMo setting, written out and grouped;
  each field's help and choices are read from :class:`hf_demo.settings.DeMoSettings` (a test checks that the
  fields and the settings are the same). :func:`with_demo_arguments` combines it with any TrainingArguments
  subclass, that class first (its defaults must win), and adds the start-up checks
  (``hf_demo.trl.DeMoSFTConfig = with_demo_arguments(SFTConfig)``).
* :class:`DeMoTrainingArguments` is ``TrainingArguments`` + :class:`DeMoArguments`.

Where a setting's value comes from, lowest to highest: ``DeMoSettings``'s default, the preset
(``--demo_preset``, or ``preset=`` in ``--optim_args``), a ``--demo_<name>`` given on the command line,
``--optim_args "name=value,..."``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from transformers import TrainingArguments
from transformers.training_args import OptimizerNames

from hf_demo.hf.launch_env import prepare_launch, refuse_fsdp_on_cpu
from hf_demo.optim.factory import parse_optim_args
from hf_demo.refusals import refuse, text
from hf_demo.settings import PRESETS, DeMoSettings

DEMO = "demo"  # the one spelling of DeMo's optimizer name


# ---------------------------------------------------------------------- the optimizer name
def optim_field(config_cls: type) -> dataclasses.Field:
    """``optim`` redeclared for an argument class built on ``config_cls``: a string, ``config_cls``'s own default,
    whose choices (``HfArgumentParser``'s ``--optim``) are Trainer's optimizers and ``demo``."""
    names = [o.value for o in OptimizerNames]
    return field(
        default=config_cls.__dataclass_fields__["optim"].default,  # Trainer's own default (or the config's)
        metadata={
            "help": f"The optimizer: '{DEMO}' for DeMo (hf_demo), or any Trainer optimizer ({', '.join(names)}).",
            "choices": [*names, DEMO],
        },
    )


def validate_optim(args, post_init) -> None:
    """``post_init`` (TrainingArguments' own ``__post_init__``, which makes ``optim`` an ``OptimizerNames``) for
    arguments whose ``optim`` may be ``demo``: that value is not Trainer's, so ``OptimizerNames.ADAMW_TORCH``
    stands in for it while Trainer validates the rest (nothing else there reads ``optim``) and ``demo`` is put
    back after, also where it raises. Any other value is Trainer's to accept or refuse."""
    if not selects_demo(args.optim):
        return post_init()
    args.optim = OptimizerNames.ADAMW_TORCH
    try:
        post_init()
    finally:
        args.optim = DEMO


def register_plain_trainer_refusal() -> None:
    """A handler for ``demo`` in Trainer's optimizer registry (transformers >= 5), keyed by the string: a
    DeMo-unaware Trainer given arguments with ``optim="demo"`` stops with a message naming the fix (idempotent;
    transformers' ``OptimizerNames`` is not touched)."""
    try:  # transformers >= 5: a registry of optimizer handlers (private; absent elsewhere: its own error then)
        from transformers.trainer_optimizer import _OPTIMIZER_HANDLERS
    except ImportError:  # pragma: no cover - older transformers
        return
    _OPTIMIZER_HANDLERS.setdefault(DEMO, _refuse_plain_trainer)


def _refuse_plain_trainer(ctx):
    refuse("plain_trainer", fix=_fix(type(ctx.args)))


def plain_trainer_fix(config_cls: type) -> str:
    """What a trainer that is not DeMo-aware says when its arguments (of class ``config_cls``) ask for DeMo.

    Trainer builds the optimizer in a static method that gets the arguments, not the trainer: the fix is
    named after the arguments' class (without hf_demo's fields), by TRL's convention ``XConfig`` for ``XTrainer``.
    """
    return text("plain_trainer", fix=_fix(config_cls))


def _fix(config_cls: type) -> str:
    """The fix :func:`plain_trainer_fix` names for arguments of class ``config_cls``."""
    base = next(c for c in config_cls.__mro__ if not issubclass(c, DeMoArguments))
    name = base.__name__
    if base is TrainingArguments:
        fix = (
            "use hf_demo.DeMoTrainer instead of Trainer (hf_demo.DeMoTrainingArguments add the --demo_* settings); "
            "for a subclass of Trainer: DeMoMyTrainer, DeMoArgs = hf_demo.with_demo(MyTrainer, TrainingArguments)"
        )
    else:
        trainer = name[: -len("Config")] + "Trainer" if name.endswith("Config") and name != "Config" else "YourTrainer"
        fix = f"DeMo{trainer}, DeMo{name} = hf_demo.with_demo({trainer}, {name}), and train with those two"
        if name == "SFTConfig":
            fix += " (ready-made: hf_demo.trl.DeMoSFTTrainer and hf_demo.trl.DeMoSFTConfig)"
    return fix


register_plain_trainer_refusal()


def selects_demo(optim) -> bool:
    """Whether an ``optim`` value (a string or an ``OptimizerNames`` member) names DeMo."""
    return getattr(optim, "value", optim) == DEMO


# ---------------------------------------------------------------------- the settings as fields
def _preset_field() -> dataclasses.Field:
    presets = "; ".join(
        f"{name}: {', '.join(f'{k}={v}' for k, v in values.items()) or 'the defaults'}"
        for name, values in PRESETS.items()
    )
    return field(default=None, metadata={"help": f"DeMo: a named starting point, {presets}", "choices": list(PRESETS)})


def _setting_field(name: str) -> dataclasses.Field:
    """The ``demo_<name>`` field of DeMo's setting ``name``: None (the setting's default, or the preset's) unless
    given; help and choices read from :class:`DeMoSettings`, the one place they are written."""
    described = {row[0]: row[1:] for row in DeMoSettings.describe()}
    if name not in described:
        raise KeyError(f"DeMoSettings has no setting {name!r}")
    kind, default, help, choices = described[name]
    meta = {"help": f"DeMo: {help} (default: {default})".replace("%", "%%")}  # argparse %-formats help
    if choices is not None:
        meta["choices"] = list(choices)
    if kind is bool:  # a bare --demo_overlap means true, as Trainer's own switches (--do_train) do
        meta.update(nargs="?", const=True)
    return field(default=None, metadata=meta)


def given_demo_fields(args) -> list[str]:
    """The ``--demo_*`` fields these arguments set (not left at None), as ``--demo_<name>`` flags."""
    names = ["preset", *DeMoSettings.names()]
    return [f"--demo_{name}" for name in names if getattr(args, f"demo_{name}", None) is not None]


def demo_settings(args) -> dict:
    """Every DeMo setting (besides lr and weight decay) for these arguments, validated.

    Works with any TrainingArguments: ``demo_<name>`` attributes that are set, then ``--optim_args``.
    Unknown keys, malformed entries and invalid values raise ``ValueError`` naming them.
    """
    chosen = {}
    for name in DeMoSettings.names():
        value = getattr(args, f"demo_{name}", None)
        if value is not None:
            chosen[name] = value
    chosen.update(parse_optim_args(getattr(args, "optim_args", None)))
    preset = chosen.pop("preset", None) or getattr(args, "demo_preset", None)
    return DeMoSettings.resolve(preset, **chosen).as_dict()  # defaults filled in; invalid values fail here


@dataclass
class DeMoArguments:
    """DeMo's settings as optional ``demo_<name>`` fields, one per :class:`hf_demo.settings.DeMoSettings` setting.

    None (the default of every field) leaves the setting at the preset's value, or DeMoSettings' default; the
    help and choices of each field are DeMoSettings' own. Put this class after a TrainingArguments class in the
    bases, ``@dataclass class MyConfig(SFTConfig, DeMoArguments)``, or use :func:`with_demo_arguments`.

    Starting point:
        demo_preset: a named set of settings (:data:`hf_demo.settings.PRESETS`).
    Compression (what each block of a parameter sends):
        demo_compression_decay, demo_compression_topk, demo_compression_chunk, demo_transform.
    Wire format:
        demo_value_format, demo_index_coding.
    Exchange (how the coefficients move between ranks):
        demo_exchange, demo_reduce_positions, demo_overlap.
    Update (how the averaged coefficients become a step):
        demo_update_rule, demo_param_rounding.
    Local steps between synchronisations:
        demo_sync_every, demo_sync_decay, demo_inner_rule, demo_outer_lr, demo_outer_lr_scaling,
        demo_end_local_phase.
    Communication budget (tiers chosen as the network changes):
        demo_comm_budget, demo_policy_patience, demo_policy_sync_every.
    Faults and guards:
        demo_nonfinite, demo_nonfinite_patience, demo_comm_timeout, demo_check_every, demo_drift,
        demo_identical_gradients, demo_full_sync_every, demo_commit_vote.
    """

    # starting point
    demo_preset: str | None = _preset_field()
    # compression
    demo_compression_decay: float | None = _setting_field("compression_decay")
    demo_compression_topk: int | None = _setting_field("compression_topk")
    demo_compression_chunk: int | None = _setting_field("compression_chunk")
    demo_transform: str | None = _setting_field("transform")
    # wire format
    demo_value_format: str | None = _setting_field("value_format")
    demo_index_coding: str | None = _setting_field("index_coding")
    # exchange
    demo_exchange: str | None = _setting_field("exchange")
    demo_reduce_positions: str | None = _setting_field("reduce_positions")
    demo_overlap: bool | None = _setting_field("overlap")
    # update
    demo_update_rule: str | None = _setting_field("update_rule")
    demo_param_rounding: str | None = _setting_field("param_rounding")
    # local steps
    demo_sync_every: int | None = _setting_field("sync_every")
    demo_sync_decay: float | None = _setting_field("sync_decay")
    demo_inner_rule: str | None = _setting_field("inner_rule")
    demo_outer_lr: float | None = _setting_field("outer_lr")
    demo_outer_lr_scaling: str | None = _setting_field("outer_lr_scaling")
    demo_end_local_phase: str | None = _setting_field("end_local_phase")
    # communication budget
    demo_comm_budget: float | None = _setting_field("comm_budget")
    demo_policy_patience: int | None = _setting_field("policy_patience")
    demo_policy_sync_every: int | None = _setting_field("policy_sync_every")
    # faults and guards
    demo_nonfinite: str | None = _setting_field("nonfinite")
    demo_nonfinite_patience: int | None = _setting_field("nonfinite_patience")
    demo_comm_timeout: float | None = _setting_field("comm_timeout")
    demo_check_every: int | None = _setting_field("check_every")
    demo_drift: str | None = _setting_field("drift")
    demo_identical_gradients: str | None = _setting_field("identical_gradients")
    demo_full_sync_every: int | None = _setting_field("full_sync_every")
    demo_commit_vote: str | None = _setting_field("commit_vote")

    @property
    def uses_demo(self) -> bool:
        """``--optim demo`` was chosen."""
        return selects_demo(self.optim)

    def demo_settings(self) -> dict:
        """DeMo keyword arguments (besides lr and weight decay): see :func:`demo_settings`."""
        return demo_settings(self)

    def _refuse_fsdp_on_cpu(self) -> None:
        """Before TrainingArguments and Accelerate look at the launch: FSDP asked for on the CPU stops with DeMo's
        message (:func:`hf_demo.hf.launch_env.refuse_fsdp_on_cpu`)."""
        if selects_demo(self.optim):
            refuse_fsdp_on_cpu(self)

    def _check_demo_arguments(self) -> None:
        """Start-up checks (unknown, malformed or invalid settings); called by ``__post_init__`` of the
        classes defined here."""
        if self.uses_demo:
            self.demo_settings()


@dataclass
class DeMoTrainingArguments(TrainingArguments, DeMoArguments):
    """TrainingArguments plus DeMo: ``--optim demo`` and one ``--demo_<name>`` per setting (see
    :class:`DeMoArguments`).

    Every built-in ``--optim`` still works. Before Trainer sets up the devices,
    :func:`hf_demo.hf.launch_env.prepare_launch`
    fixes two launch pitfalls: processes launched without the CPU switch on a machine without GPU get
    ``use_cpu=True`` (they train together, world size N, instead of each alone), and workers restarted by
    ``torchrun --max-restarts`` rendezvous on a fresh store prefix.
    """

    optim: str = optim_field(TrainingArguments)

    def __post_init__(self):
        prepare_launch(self)  # CPU-only launch without the switch; torchrun restarts (hf_demo.hf.launch_env)
        self._refuse_fsdp_on_cpu()
        validate_optim(self, super().__post_init__)
        self._check_demo_arguments()


def with_demo_arguments(config_cls: type, name: str | None = None, bases: tuple[type, ...] = ()) -> type:
    """``config_cls`` (a TrainingArguments subclass, e.g. TRL's SFTConfig) plus :class:`DeMoArguments` (and
    ``bases``, last).

    ``config_cls`` stays first in the bases, so its defaults (SFTConfig's bf16, learning rate, ...) hold.
    """

    def __post_init__(self):
        prepare_launch(self)
        self._refuse_fsdp_on_cpu()
        validate_optim(self, super(cls, self).__post_init__)
        self._check_demo_arguments()

    cls = dataclasses.make_dataclass(
        name or f"DeMo{config_cls.__name__}",
        [("optim", str, optim_field(config_cls))],  # here: config_cls's own optim would win over a base's
        bases=(config_cls, DeMoArguments, *bases),
        namespace={"__post_init__": __post_init__},
    )
    return cls


__all__ = [
    "DEMO",
    "DeMoArguments",
    "DeMoTrainingArguments",
    "demo_settings",
    "plain_trainer_fix",
    "optim_field",
    "register_plain_trainer_refusal",
    "selects_demo",
    "validate_optim",
    "with_demo_arguments",
]
