"""The integrations on public seams: the private ``Trainer`` methods hf_demo still relies on live in one module
(``hf_demo.hf.trainer_private``) and are checked here against the installed transformers, which must be in the one
supported range; Accelerate's own optimizer wrapper is left as Accelerate made it (``hf_demo.prepare`` wraps DeMo
before Accelerate does, instead of changing the class of Accelerate's wrapper)."""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers  # noqa: E402
from packaging.specifiers import SpecifierSet  # noqa: E402
from packaging.version import Version  # noqa: E402
from transformers import Trainer  # noqa: E402

from dist_utils import expect_ok, run_ranks  # noqa: E402
from hf_demo.hf import trainer_private  # noqa: E402
from hf_demo.hf.trainer import DeMoTrainerMixin  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
INSTALLED = transformers.__version__


def test_the_installed_transformers_is_in_the_supported_range():
    assert Version(INSTALLED) in SpecifierSet(trainer_private.TRANSFORMERS_RANGE), (
        f"transformers {INSTALLED} is outside {trainer_private.TRANSFORMERS_RANGE}: check every method of "
        "hf_demo.hf.trainer_private.PRIVATE against it, then move the range (there and in pyproject.toml)"
    )


def test_pyproject_requires_the_supported_range_wherever_it_names_transformers():
    found = re.findall(r'"transformers([^"]*)"', (ROOT / "pyproject.toml").read_text())
    assert found and set(found) == {trainer_private.TRANSFORMERS_RANGE}, found


def _parameters(name: str) -> tuple[str, ...]:
    method = getattr(Trainer, name, None)
    assert callable(method), f"transformers {INSTALLED}: Trainer.{name} is gone (hf_demo.hf.trainer_private)"
    return tuple(inspect.signature(method).parameters)


@pytest.mark.parametrize("name", sorted(trainer_private.PRIVATE))
def test_each_private_method_relied_on_exists_upstream_with_its_parameters(name):
    expected = trainer_private.PRIVATE[name]
    assert _parameters(name)[: len(expected)] == expected, f"transformers {INSTALLED}: Trainer.{name} changed"


@pytest.mark.parametrize("name", sorted(trainer_private.PUBLIC))
def test_each_public_method_overridden_exists_upstream_with_its_parameters(name):
    expected = trainer_private.PUBLIC[name]
    assert _parameters(name)[: len(expected)] == expected, f"transformers {INSTALLED}: Trainer.{name} changed"


def _overridden() -> dict[str, set[str]]:
    """{hf_demo class in DeMoTrainerMixin's bases: the Trainer methods it defines again}."""
    out = {}
    for cls in DeMoTrainerMixin.__mro__:
        if cls.__module__.startswith("hf_demo."):
            out[cls.__qualname__] = {
                name for name in vars(cls) if not name.startswith("__") and callable(getattr(Trainer, name, None))
            }
    return out


def test_private_trainer_methods_are_overridden_in_trainer_private_only():
    """Before: seven private methods overridden in hf_demo/hf/trainer.py; now three, all in trainer_private."""
    overridden = _overridden()
    private = trainer_private.PrivateTrainerHooks.__qualname__
    outside = {cls: sorted(n for n in names if n[0] == "_") for cls, names in overridden.items() if cls != private}
    assert not any(outside.values()), f"private Trainer methods overridden outside trainer_private: {outside}"
    assert overridden[private] <= set(trainer_private.PRIVATE)
    public = set().union(*(names for cls, names in overridden.items() if cls != private))
    assert public == set(trainer_private.PUBLIC), public ^ set(trainer_private.PUBLIC)


# ---------------------------------------------------------------- Accelerate's wrapper, as Accelerate made it
class _Counter:
    """An object registered for checkpointing after the first save_state."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _prepared_loop(rank, world, folder):
    os.environ.update(ACCELERATE_USE_CPU="1", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import AcceleratorState

    import hf_demo

    AcceleratorState._reset_state(reset_partial_state=True)  # not a one-process state an earlier test left here
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    demo = hf_demo.create_optimizer(model, lr=1e-2, compression_topk=8, compression_chunk=16)
    model, opt = hf_demo.prepare(accelerator, model, demo)
    held = accelerator._optimizers[0]
    facts = (type(opt).__name__, type(held) is AcceleratedOptimizer, held.optimizer is opt, opt.demo is demo)

    def step(i):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * rank + i))
        accelerator.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()

    for i in range(3):
        step(i)
    accelerator.save_state(folder)
    saved = [s["momentum"].clone() for s in demo.state.values()]
    step(3)
    accelerator.load_state(folder)
    restored = all(torch.equal(a, s["momentum"]) for a, s in zip(saved, demo.state.values()))
    accelerator.register_for_checkpointing(_Counter())
    try:
        accelerator.save_state(folder + "-late")
        late = None
    except hf_demo.DeMoSetupError as exc:
        late = str(exc)
    return facts, restored, opt.counters.steps, late


@pytest.mark.ranks
def test_prepare_leaves_accelerates_wrapper_as_it_is_and_save_load_keep_every_ranks_own_state(tmp_path):
    results = expect_ok(run_ranks(_prepared_loop, 2, str(tmp_path / "state")))
    for facts, restored, steps, late in results:
        assert facts == ("DeMoAcceleratedOptimizer", True, True, True)  # Accelerate's wrapper holds DeMo's
        assert restored and steps == 3  # each rank's own momentum back, from its own file
        assert late is not None and "register every object before the first save_state" in late.lower()
    assert {"optimizer.bin", "optimizer.rank1.bin", "hf_demo_manifest.json"} <= set(os.listdir(tmp_path / "state"))


@pytest.mark.parametrize("given", [None, True])
def test_ddps_search_for_unused_parameters_is_off_unless_asked_and_the_arguments_stay_as_given(tmp_path, given):
    import hf_demo
    from models import tiny_mlp

    args = hf_demo.DeMoTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", ddp_find_unused_parameters=given
    )
    trainer = hf_demo.DeMoTrainer(model=tiny_mlp(), args=args)
    assert trainer.accelerator.ddp_handler.find_unused_parameters is bool(given)
    assert args.ddp_find_unused_parameters is given


def test_no_class_is_swapped_and_accelerates_private_state_is_only_read():
    """Before: hf_demo changed the class of Accelerate's optimizer wrapper, removed the model Accelerate had prepared
    for evaluation from its list, and stored its own object on the accelerator. Now it reads two of Accelerate's
    lists (to name the files as Accelerate does, and to see that its manifest is saved last), and writes none."""
    import ast

    read = set()
    for path in sorted((ROOT / "hf_demo").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.Delete)):
                assert not any(isinstance(t, ast.Attribute) and t.attr == "__class__" for t in node.targets), path
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
                if owner == "accelerator":
                    assert isinstance(node.ctx, ast.Load), f"{path.name}: accelerator.{node.attr} written"
                    read.add((path.name, node.attr))
    assert read == {("accelerated.py", "_optimizers"), ("accelerated.py", "_custom_objects")}, read
