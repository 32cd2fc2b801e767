"""A plain Trainer script on a tiny random Llama, switchable to DeMoTrainer by two names (--trainer demo).

Each rank writes <record_dir>/rank<r>.pt: world size, parameter checksums, the first step's gradient
checksum, the log history. Used by tests/test_trainer.py through `accelerate launch`.
"""

import hashlib
import os
import signal
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import hf_demo


@dataclass
class ScriptArgs:
    trainer: str = field(default="demo", metadata={"help": "demo (DeMoTrainer) or plain (Trainer)"})
    record_dir: str = field(default="")
    stop_at_step: int = field(default=0)
    samples: int = field(default=256)
    seq: int = field(default=64)
    gradient_checkpointing_on: bool = field(default=False)
    arguments: str = field(
        default="demo", metadata={"help": "demo (DeMoTrainingArguments) or plain (TrainingArguments)"}
    )
    kill_rank: int = field(default=-1, metadata={"help": "this rank SIGKILLs itself after the save at kill_at_step"})
    kill_at_step: int = field(default=0)
    resume_last: bool = field(default=False, metadata={"help": "resume from the last complete checkpoint, if any"})
    init_seed_by_rank: bool = field(default=False, metadata={"help": "initialise the model differently on each rank"})
    evaluate_first: bool = field(default=False, metadata={"help": "trainer.evaluate() before trainer.train()"})
    evaluate_after: bool = field(default=False, metadata={"help": "trainer.evaluate() after trainer.train()"})
    save_on_rank0: bool = field(default=False, metadata={"help": "rank 0 alone: trainer.save_model(out/final)"})
    end_with_shutdown: bool = field(default=False, metadata={"help": "hf_demo.shutdown() at the end (not atexit)"})
    stop_rank: int = field(default=-1, metadata={"help": "this rank SIGSTOPs itself at step 5 (stop_at)"})
    stop_at: str = field(default="", metadata={"help": "log: before Trainer's logging gather; data: before a batch"})


def stdlib_blocks(n: int, seq: int) -> Dataset:
    text = b"".join(p.read_bytes() for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("a*.py")))
    ids = list(text[: n * seq])
    blocks = [ids[i * seq : (i + 1) * seq] for i in range(n)]
    return Dataset.from_dict({"input_ids": blocks, "labels": blocks})


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


class Recorder(TrainerCallback):
    def __init__(self, script):
        self.script, self.first_grad, self.trainer = script, None, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.first_grad is None:
            self.first_grad = digest(p.grad for p in self.trainer.model.parameters() if p.grad is not None)

    def on_save(self, args, state, control, **kwargs):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if (
            first_attempt
            and state.global_step == self.script.kill_at_step
            and args.process_index == self.script.kill_rank
        ):
            print(
                f"rank {args.process_index}: killing myself after the step-{state.global_step} checkpoint", flush=True
            )
            os.kill(os.getpid(), signal.SIGKILL)

    def _stop(self, args, state, where: str) -> None:
        if self.script.stop_at == where and args.process_index == self.script.stop_rank and state.global_step == 5:
            print(f"rank {args.process_index} (pid {os.getpid()}): stopping myself ({where})", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)

    def on_step_begin(self, args, state, control, **kwargs):
        self._stop(args, state, "data")  # the others go on into the step: DeMo's exchange waits for this rank

    def on_step_end(self, args, state, control, **kwargs):
        self._stop(args, state, "log")  # at a logging step: the others wait in Trainer's nested_gather
        if self.script.stop_at_step and state.global_step >= self.script.stop_at_step:
            control.should_save = True
            control.should_training_stop = True


def _flag(name: str) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv[:-1] else None


def main():
    plain = "plain" in (_flag("--trainer"), _flag("--arguments"))  # a plain script: plain TrainingArguments
    parser = HfArgumentParser((ScriptArgs, TrainingArguments if plain else hf_demo.DeMoTrainingArguments))
    script, args = parser.parse_args_into_dataclasses()
    TrainerClass = hf_demo.DeMoTrainer if script.trainer == "demo" else Trainer
    torch.manual_seed(int(os.environ.get("RANK", "0")) if script.init_seed_by_rank else 0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=script.seq,
    )
    model = LlamaForCausalLM(config)
    if script.gradient_checkpointing_on:
        args.gradient_checkpointing = True
    recorder = Recorder(script)
    data = stdlib_blocks(script.samples, script.seq)
    trainer = TrainerClass(
        model=model, args=args, train_dataset=data, eval_dataset=data.select(range(8)), callbacks=[recorder]
    )
    recorder.trainer = trainer
    resume = args.resume_from_checkpoint
    if script.resume_last:
        resume = hf_demo.last_complete_checkpoint(args.output_dir)
        print(f"rank {args.process_index}: resuming from {resume}", flush=True)
    if script.evaluate_first:
        trainer.evaluate()
    trainer.train(resume_from_checkpoint=resume)
    eval_after = trainer.evaluate()["eval_loss"] if script.evaluate_after else None
    if script.save_on_rank0 and trainer.is_world_process_zero():
        trainer.save_model(os.path.join(args.output_dir, "final"))
    if script.record_dir:
        os.makedirs(script.record_dir, exist_ok=True)
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.save(
            {
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "params": digest(trainer.model.parameters()),
                "first_grad": recorder.first_grad,
                "log_history": trainer.state.log_history,
                "global_step": trainer.state.global_step,
                "optimizer": type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__,
                "ddp": isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel),
                "find_unused_parameters": getattr(trainer.model_wrapped, "find_unused_parameters", None),
                "resyncs": getattr(getattr(trainer.optimizer, "optimizer", None), "resyncs", None),
                "eval_after": eval_after,
            },
            os.path.join(script.record_dir, f"rank{rank}.pt"),
        )
    # A plain Trainer run (the reference some tests compare with) never builds DeMo or DeMoTrainer, so nothing
    # installs hf_demo's exit handler and torch's gloo exit abort (docs/FAULTS.md) can end it with SIGABRT
    # after training: it ends the way the README tells plain scripts to end.
    if script.end_with_shutdown or script.trainer == "plain":
        hf_demo.shutdown()


if __name__ == "__main__":
    sys.exit(main())
