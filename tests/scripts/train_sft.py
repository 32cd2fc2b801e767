"""TRL's SFTTrainer with DeMo on a tiny Llama, for tests/test_launch.py (run with accelerate launch).

--trainer demo: hf_demo.trl.DeMoSFTTrainer with DeMoSFTConfig(optim="demo") (the supported way).
--trainer plain: plain SFTTrainer given optimizers=(DeMo, None): DDP would average gradients; must fail loudly.
Each rank writes <record_dir>/rank<r>.pt (world size, parameter and first-gradient checksums).
"""

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, TrainerCallback
from trl import SFTTrainer

import hf_demo
from hf_demo.trl import DeMoSFTConfig, DeMoSFTTrainer


@dataclass
class ScriptArgs:
    model_dir: str = field(default="")
    trainer: str = field(default="demo", metadata={"help": "demo (DeMoSFTTrainer) or plain (SFTTrainer)"})
    record_dir: str = field(default="")


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


class FirstGrad(TrainerCallback):
    value, model = None, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.value is None:
            self.value = digest(p.grad for p in self.model.parameters() if p.grad is not None)


def main():
    script, args = HfArgumentParser((ScriptArgs, DeMoSFTConfig)).parse_args_into_dataclasses()
    lines = [ln for ln in (Path(sysconfig.get_paths()["stdlib"]) / "abc.py").read_text().splitlines() if ln.strip()]
    data = Dataset.from_dict({"text": lines[:64]})
    tokenizer = AutoTokenizer.from_pretrained(script.model_dir)
    model = AutoModelForCausalLM.from_pretrained(script.model_dir)
    first = FirstGrad()
    first.model = model
    if script.trainer == "demo":
        trainer = DeMoSFTTrainer(
            model=model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[first]
        )
    else:
        optimizer = hf_demo.create_optimizer(model, lr=args.learning_rate, compression_topk=8)
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=data,
            processing_class=tokenizer,
            optimizers=(optimizer, None),
            callbacks=[first],
        )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if script.record_dir:
        os.makedirs(script.record_dir, exist_ok=True)
        torch.save(
            {
                "world_size": dist.get_world_size(),
                "params": digest(trainer.model.parameters()),
                "first_grad": first.value,
                "global_step": trainer.state.global_step,
                "optimizer": type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__,
                "settings": getattr(getattr(trainer.optimizer, "optimizer", trainer.optimizer), "settings", None),
                "log_history": trainer.state.log_history,
            },
            os.path.join(script.record_dir, f"rank{dist.get_rank()}.pt"),
        )
    trainer.end()


if __name__ == "__main__":
    sys.exit(main())
