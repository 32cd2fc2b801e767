"""``--optim demo`` and DeMo's settings as training arguments, generated from :class:`hf_demo.settings.DeMoSettings`.

* ``"demo"`` is registered as a value of transformers' ``OptimizerNames`` (:func:`register_optimizer_name`,
  done on import), so ``TrainingArguments(optim="demo")``, ``SFTConfig(optim="demo")`` and ``--optim demo``
  all parse and validate like any other optimizer, and ``args.optim`` is ``"demo"`` from start to end.
  Only a DeMo-aware trainer (:class:`hf_demo.DeMoTrainer`, or any trainer class with
  :class:`hf_demo.DeMoTrainerMixin`) builds DeMo from it, through Trainer's own extension point
  ``get_optimizer_cls_and_kwargs``; a plain Trainer refuses it at start-up (it would all-reduce gradients).
* :class:`DeMoArguments` holds one optional ``demo_<name>`` field per DeMo setting, generated from
  ``DeMoSettings.describe()`` (type, help, choices), so ``--help`` shows every setting and a setting added
  to ``DeMoSettings`` appears here without an edit. :func:`with_demo_arguments` combines it with any
  TrainingArguments subclass, that class first (its defaults must win), and adds the start-up checks
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

from hf_demo.hf.launch_env import prepare_launch
from hf_demo.optim.factory import parse_optim_args
from hf_demo.settings import PRESETS, DeMoSettings

DEMO = "demo"  # the one spelling of DeMo's optimizer name


# ---------------------------------------------------------------------- the optimizer name
def register_optimizer_name() -> None:
    """Make ``"demo"`` a member of transformers' ``OptimizerNames`` (idempotent).

    ``TrainingArguments.__post_init__`` converts ``optim`` with ``OptimizerNames(optim)`` and
    ``HfArgumentParser`` takes ``--optim``'s choices from the enum: with the member added, every
    TrainingArguments class (TRL's configs included) accepts ``optim="demo"`` and keeps it as given. A
    handler in Trainer's optimizer registry makes a DeMo-unaware Trainer stop with a message naming the fix.
    """
    if DEMO not in OptimizerNames._value2member_map_:
        member = str.__new__(OptimizerNames, DEMO)
        member._name_, member._value_ = "DEMO", DEMO
        member.__objclass__ = OptimizerNames
        member._sort_order_ = len(OptimizerNames._member_names_)
        OptimizerNames._member_map_["DEMO"] = member
        OptimizerNames._value2member_map_[DEMO] = member
        OptimizerNames._member_names_.append("DEMO")
    try:  # transformers >= 5: a registry of optimizer handlers (private; absent elsewhere: its own error then)
        from transformers.trainer_optimizer import _OPTIMIZER_HANDLERS
    except ImportError:  # pragma: no cover - older transformers
        return
    _OPTIMIZER_HANDLERS.setdefault(OptimizerNames(DEMO), _refuse_plain_trainer)


def _refuse_plain_trainer(ctx):
    raise ValueError(
        "optim='demo' needs a DeMo-aware trainer: use hf_demo.DeMoTrainer instead of Trainer, or for another "
        "trainer class (TRL's SFTTrainer, ...) a subclass with hf_demo.DeMoTrainerMixin first, e.g. "
        "hf_demo.trl.DeMoSFTTrainer. A plain Trainer would keep DDP's gradient all-reduce under DeMo."
    )


register_optimizer_name()


def selects_demo(optim) -> bool:
    """Whether an ``optim`` value (a string or an ``OptimizerNames`` member) names DeMo."""
    return getattr(optim, "value", optim) == DEMO


# ---------------------------------------------------------------------- the settings as fields
def _demo_fields() -> list[tuple[str, object, dataclasses.Field]]:
    preset_help = "DeMo: a named starting point, " + "; ".join(
        f"{name}: {', '.join(f'{k}={v}' for k, v in values.items()) or 'the defaults'}"
        for name, values in PRESETS.items()
    )
    fields = [
        ("demo_preset", str | None, field(default=None, metadata={"help": preset_help, "choices": list(PRESETS)}))
    ]
    for name, kind, default, help, choices in DeMoSettings.describe():
        meta = {"help": f"DeMo: {help} (default: {default})".replace("%", "%%")}  # argparse %-formats help
        if choices is not None:
            meta["choices"] = list(choices)
        if kind is bool:  # a bare --demo_overlap means true, as Trainer's own switches (--do_train) do
            meta.update(nargs="?", const=True)
        fields.append((f"demo_{name}", kind | None, field(default=None, metadata=meta)))
    return fields


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


class _DeMoArgumentsMethods:
    @property
    def uses_demo(self) -> bool:
        """``--optim demo`` was chosen."""
        return selects_demo(self.optim)

    def demo_settings(self) -> dict:
        """DeMo keyword arguments (besides lr and weight decay): see :func:`demo_settings`."""
        return demo_settings(self)

    def _check_demo_arguments(self) -> None:
        """Start-up checks; called by ``__post_init__`` of the classes defined here."""
        if not self.uses_demo:
            return
        self.demo_settings()  # unknown, malformed or invalid settings fail at start-up
        if self.ddp_comm_hook != "no":
            raise ValueError(
                f"--ddp_comm_hook {self.ddp_comm_hook} compresses DDP's gradient all-reduce; with --optim demo "
                "there is none (DeMo moves the momentum): drop it"
            )


_BASELINE_FIELDS = [
    (
        "ddp_comm_hook",
        str,
        field(
            default="no",
            metadata={
                "help": "DDP gradient compression for non-DeMo optimizers (the baselines): no, fp16, bf16, power_sgd, "
                "batched_power_sgd (Accelerate's DDPCommunicationHookType).",
                "choices": ["no", "fp16", "bf16", "power_sgd", "batched_power_sgd"],
            },
        ),
    ),
    ("powersgd_rank", int, field(default=1, metadata={"help": "PowerSGD matrix approximation rank."})),
    (
        "powersgd_start_iter",
        int,
        field(
            default=2,
            metadata={
                "help": "PowerSGD: plain all-reduce for the first iterations (torch's default is 1000; must be >= 2)."
            },
        ),
    ),
]

DeMoArguments = dataclasses.make_dataclass(
    "DeMoArguments", _demo_fields() + _BASELINE_FIELDS, bases=(_DeMoArgumentsMethods,)
)
DeMoArguments.__module__ = __name__
DeMoArguments.__doc__ = (
    "DeMo's settings as optional ``demo_<name>`` fields (None: the default), generated from DeMoSettings, "
    "plus the baselines' DDP comm-hook fields. Put it after a TrainingArguments class in the bases: "
    "``@dataclass class MyConfig(SFTConfig, DeMoArguments)``."
)


@dataclass
class DeMoTrainingArguments(TrainingArguments, DeMoArguments):
    """TrainingArguments plus DeMo: ``--optim demo`` and one ``--demo_<name>`` per setting.

    Every built-in ``--optim`` still works. Before Trainer sets up the devices,
    :func:`hf_demo.hf.launch_env.prepare_launch`
    fixes two launch pitfalls: processes launched without the CPU switch on a machine without GPU get
    ``use_cpu=True`` (they train together, world size N, instead of each alone), and workers restarted by
    ``torchrun --max-restarts`` rendezvous on a fresh store prefix.
    """

    optim: OptimizerNames | str = field(
        default=TrainingArguments.__dataclass_fields__["optim"].default,  # Trainer's own default
        metadata={
            "help": "The optimizer: 'demo' for DeMo (hf_demo), or any Trainer optimizer "
            f"({', '.join(o.value for o in OptimizerNames if o.value != DEMO)})."
        },
    )

    def __post_init__(self):
        prepare_launch(self)  # CPU-only launch without the switch; torchrun restarts (hf_demo.hf.launch_env)
        super().__post_init__()
        self._check_demo_arguments()


def with_demo_arguments(config_cls: type, name: str | None = None) -> type:
    """``config_cls`` (a TrainingArguments subclass, e.g. TRL's SFTConfig) plus :class:`DeMoArguments`.

    ``config_cls`` stays first in the bases, so its defaults (SFTConfig's bf16, learning rate, ...) hold.
    """

    def __post_init__(self):
        prepare_launch(self)
        super(cls, self).__post_init__()
        self._check_demo_arguments()

    cls = dataclasses.make_dataclass(
        name or f"DeMo{config_cls.__name__}",
        [],
        bases=(config_cls, DeMoArguments),
        namespace={"__post_init__": __post_init__},
    )
    return cls


__all__ = [
    "DEMO",
    "DeMoArguments",
    "DeMoTrainingArguments",
    "demo_settings",
    "register_optimizer_name",
    "selects_demo",
    "with_demo_arguments",
]
