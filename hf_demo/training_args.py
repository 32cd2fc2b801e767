"""``DeMoTrainingArguments``: TrainingArguments that also accept ``--optim demo`` and DeMo's settings."""
from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments
from transformers.training_args import OptimizerNames

from .settings import SETTINGS, parse_optim_args  # noqa: F401

DEMO = "demo"


@dataclass
class DeMoTrainingArguments(TrainingArguments):
    """TrainingArguments plus DeMo. ``--optim demo`` selects DeMo; every built-in ``--optim`` still works.

    DeMo's settings come from the ``demo_*`` fields below or from HF's own ``--optim_args
    "compression_topk=16,value_format=sign"`` (keys without the ``demo_`` prefix); ``--optim_args`` wins.
    """

    optim: str = field(
        default=TrainingArguments.__dataclass_fields__["optim"].default,  # Trainer's own default
        metadata={"help": "The optimizer: 'demo' for DeMo (hf_demo), or any Trainer optimizer "
                          f"({', '.join(o.value for o in OptimizerNames)})."},
    )
    demo_compression_decay: float = field(default=SETTINGS["compression_decay"][1],
                                          metadata={"help": "DeMo: " + SETTINGS["compression_decay"][2]})
    demo_compression_topk: int = field(default=SETTINGS["compression_topk"][1],
                                       metadata={"help": "DeMo: " + SETTINGS["compression_topk"][2]})
    demo_compression_chunk: int = field(default=SETTINGS["compression_chunk"][1],
                                        metadata={"help": "DeMo: " + SETTINGS["compression_chunk"][2]})
    demo_value_format: str = field(default=SETTINGS["value_format"][1],
                                   metadata={"help": "DeMo: " + SETTINGS["value_format"][2],
                                             "choices": ["bf16", "fp32", "sign"]})
    demo_update_rule: str = field(default=SETTINGS["update_rule"][1],
                                  metadata={"help": "DeMo: " + SETTINGS["update_rule"][2]})
    demo_nonfinite: str = field(default=SETTINGS["nonfinite"][1],
                                metadata={"help": "DeMo: " + SETTINGS["nonfinite"][2], "choices": ["skip", "raise"]})

    ddp_comm_hook: str = field(default="no", metadata={
        "help": "DDP gradient compression for non-DeMo optimizers (the baselines): no, fp16, bf16, power_sgd, "
                "batched_power_sgd (Accelerate's DDPCommunicationHookType).",
        "choices": ["no", "fp16", "bf16", "power_sgd", "batched_power_sgd"]})
    powersgd_rank: int = field(default=1, metadata={"help": "PowerSGD matrix approximation rank."})
    powersgd_start_iter: int = field(default=2, metadata={
        "help": "PowerSGD: plain all-reduce for the first iterations (torch's default is 1000; must be >= 2)."})

    def __post_init__(self):
        wants_demo = str(getattr(self.optim, "value", self.optim)) == DEMO
        if wants_demo:
            self.optim = OptimizerNames.ADAMW_TORCH  # let TrainingArguments validate everything else
        super().__post_init__()
        if wants_demo:
            self.optim = DEMO
            self.demo_settings()  # unknown or malformed --optim_args fail here, at start-up
            if self.ddp_comm_hook != "no":
                raise ValueError(f"--ddp_comm_hook {self.ddp_comm_hook} compresses DDP's gradient all-reduce; "
                                 "with --optim demo there is none (DeMo moves the momentum): drop it")

    @property
    def uses_demo(self) -> bool:
        return self.optim == DEMO

    def demo_settings(self) -> dict:
        """DeMo keyword arguments (besides lr and weight decay) from the fields and ``--optim_args``."""
        settings = {key: getattr(self, f"demo_{key}") for key in SETTINGS if hasattr(self, f"demo_{key}")}
        settings.update(parse_optim_args(self.optim_args))
        return settings
