"""Run recipes/run_clm.py as it is, recording on each rank what its gradients and parameters were.

    accelerate launch ... tests/scripts/record_recipe.py --record_dir DIR [--record_steps 1,4] <run_clm arguments>

Writes DIR/rank<r>.pt with, for each recorded optimizer step (1 = the first): the gradient as the optimizer
sees it (after DDP, its comm hook and Trainer's clipping), this rank's own *local* gradient of the same batch
(recomputed on the unwrapped model, which no DDP hook sees), the batch; at the end of training the
parameters; and whether the model was wrapped in DDP, with its comm hooks and their state. Used by
tests/test_recipe_clm.py to check that recipes/compare.py's baselines are real DDP and DeMo's gradients local.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import run_clm  # noqa: E402
from recipelib import training  # noqa: E402


class Recorder(TrainerCallback):
    def __init__(self, trainer, steps):
        self.trainer, self.steps = trainer, steps
        self.batch, self.record, self.handle = None, {"steps": {}}, None

    def _remember_batch(self, module, args, kwargs):
        if module.training:
            self.batch = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}

    def on_train_begin(self, args, state, control, **kwargs):
        self.handle = self.trainer.model.register_forward_pre_hook(self._remember_batch, with_kwargs=True)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        step = state.global_step + 1  # the step about to be taken
        wrapped = self.trainer.model_wrapped
        if "ddp" not in self.record:
            self.record["ddp"] = isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
            self.hooks = list(getattr(wrapped, "_comm_hooks", []))
            self.record["comm_hooks"] = [hook.__name__ for hook, _ in self.hooks]
        if step not in self.steps:
            return
        model = self.trainer.model
        named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
        with torch.enable_grad():
            loss = model(**self.batch).loss
            local = torch.autograd.grad(loss, [p for _, p in named])  # p.grad untouched, no DDP hook runs
        self.record["steps"][step] = {
            "grad": {n: p.grad.detach().clone() for n, p in named},
            "local_grad": {n: g.detach().clone() for (n, _), g in zip(named, local)},
            "input_ids": self.batch["input_ids"],
        }

    def on_train_end(self, args, state, control, **kwargs):
        self.handle.remove()
        self.record["params"] = {n: p.detach().clone() for n, p in self.trainer.model.named_parameters()}
        self.record["comm_hook_states"] = [_numbers(state) for _, state in self.hooks]
        self.record["comm_hook_groups"] = [_group(state) for _, state in self.hooks]
        self.record["global_step"] = state.global_step


def _numbers(state) -> dict | None:
    """The plain numbers of a comm hook's state (PowerSGDState has __slots__): rank, iter, counts."""
    if state is None:
        return None
    names = getattr(state, "__slots__", None) or list(vars(state))
    values = {name: getattr(state, name, None) for name in names}
    return {k: v for k, v in values.items() if isinstance(v, (int, float, bool))}


def _group(state) -> str | None:
    """Which process group a comm hook's state names: "default" (None or WORLD), "own", or None (no state)."""
    group = getattr(state, "process_group", None) if state is not None else None
    if state is None:
        return None
    return "default" if group is None or group == torch.distributed.group.WORLD else "own"


def _pop(argv, flag, default):
    if flag not in argv:
        return default
    i = argv.index(flag)
    value = argv[i + 1]
    del argv[i : i + 2]
    return value


def main():
    argv = sys.argv[1:]
    record_dir = _pop(argv, "--record_dir", None)
    steps = {int(s) for s in _pop(argv, "--record_steps", "1").split(",")}
    original = training.train_and_report

    def train_and_report(recipe, trainer, **kwargs):
        recorder = Recorder(trainer, steps)
        trainer.add_callback(recorder)
        results = original(recipe, trainer, **kwargs)
        os.makedirs(record_dir, exist_ok=True)
        record = {**recorder.record, "world_size": dist.get_world_size() if dist.is_initialized() else 1}
        torch.save(record, os.path.join(record_dir, f"rank{trainer.args.process_index}.pt"))
        return results

    training.train_and_report = train_and_report
    run_clm.main(argv)


if __name__ == "__main__":
    main()
