"""DeMoTrainingArguments through HfArgumentParser, the factory, and refusals at start-up (in-process)."""

import os
import subprocess
import sys
import warnings

import pytest
import torch
from transformers import (
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    TrainingArguments,
)
from transformers.training_args import OptimizerNames

import hf_demo
from hf_demo.hf.data_parallel import check_supported
from hf_demo.settings import DeMoSettings


def parse(*argv):
    (args,) = HfArgumentParser(hf_demo.DeMoTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "out-never-written", "--use_cpu", "true", *argv]
    )
    return args


def test_optim_demo_and_its_settings():
    args = parse(
        "--optim",
        "demo",
        "--demo_compression_topk",
        "8",
        "--demo_value_format",
        "fp32",
        "--optim_args",
        "compression_chunk=32, value_format=sign,update_rule=raw",
    )
    assert args.optim == "demo" and args.uses_demo
    expected = {
        **DeMoSettings().as_dict(),
        "compression_topk": 8,
        "compression_chunk": 32,
        "value_format": "sign",
        "update_rule": "raw",
    }  # --optim_args wins over --demo_*
    assert args.demo_settings() == expected


def test_optim_stays_demo_everywhere():
    """'demo' is a value of hf_demo's argument classes: kept as given, from start to end."""
    args = hf_demo.DeMoTrainingArguments(output_dir="out-never-written", use_cpu=True, optim="demo")
    assert args.optim == "demo" and args.to_dict()["optim"] == "demo"
    assert hf_demo.hf.training_args.demo_settings(args) == DeMoSettings().as_dict()
    cls, kwargs = hf_demo.DeMoTrainer.get_optimizer_cls_and_kwargs(parse("--optim", "demo", "--demo_drift", "raise"))
    assert cls is hf_demo.DeMo and kwargs["drift"] == "raise" and kwargs["lr"] == 5e-5
    cls, _ = hf_demo.DeMoTrainer.get_optimizer_cls_and_kwargs(parse("--optim", "sgd"))
    assert cls is torch.optim.SGD


def test_plain_trainer_refuses_optim_demo():
    from transformers import Trainer

    with pytest.raises(ValueError, match="needs a DeMo-aware trainer: use hf_demo.DeMoTrainer instead of Trainer"):
        Trainer.get_optimizer_cls_and_kwargs(
            hf_demo.DeMoTrainingArguments(output_dir="out-never-written", use_cpu=True, optim="demo")
        )


def test_the_refusal_names_the_fix_for_the_trainer_at_hand():
    """A DPOTrainer user was sent to the SFT class: the fix is with_demo of the user's own pair."""
    import trl

    from hf_demo.hf.training_args import plain_trainer_fix, with_demo_arguments
    from hf_demo.trl import DeMoSFTConfig

    dpo = with_demo_arguments(trl.DPOConfig)(output_dir="out-never-written", use_cpu=True, optim="demo")
    with pytest.raises(ValueError, match=r"hf_demo\.with_demo\(DPOTrainer, DPOConfig\)") as refused:
        trl.DPOTrainer.get_optimizer_cls_and_kwargs(dpo)
    assert "SFT" not in str(refused.value)
    sft = plain_trainer_fix(trl.SFTConfig)
    assert "hf_demo.with_demo(SFTTrainer, SFTConfig)" in sft and "hf_demo.trl.DeMoSFTTrainer" in sft
    assert plain_trainer_fix(DeMoSFTConfig) == sft  # hf_demo's fields given to plain SFTTrainer: the same fix
    assert "use hf_demo.DeMoTrainer instead of Trainer" in plain_trainer_fix(hf_demo.DeMoTrainingArguments)

    class RunArguments(TrainingArguments):
        pass

    assert "hf_demo.with_demo(YourTrainer, RunArguments)" in plain_trainer_fix(RunArguments)


def test_demo_fields_are_the_settings_table():
    """DeMoArguments is written out; its demo_* fields are DeMoSettings' settings: names, types, help, choices."""
    import dataclasses
    import typing

    from hf_demo.hf.training_args import DeMoArguments
    from hf_demo.settings import PRESETS

    fields = {f.name: f for f in dataclasses.fields(DeMoArguments)}
    hints = typing.get_type_hints(DeMoArguments)
    assert list(fields) == ["demo_preset", *(f"demo_{n}" for n in _grouped(DeMoArguments.__doc__))]
    assert set(fields) == {"demo_preset"} | {f"demo_{n}" for n in DeMoSettings.names()}
    assert fields["demo_preset"].metadata["choices"] == list(PRESETS) and hints["demo_preset"] == str | None
    for name, kind, default, help, choices in DeMoSettings.describe():
        f = fields[f"demo_{name}"]
        assert f.default is None and hints[f.name] == kind | None, name
        assert f.metadata["help"] == f"DeMo: {help} (default: {default})".replace("%", "%%"), name
        assert f.metadata.get("choices") == (list(choices) if choices is not None else None), name
        assert (f.metadata.get("nargs"), f.metadata.get("const")) == (("?", True) if kind is bool else (None, None))


def _grouped(doc: str) -> list[str]:
    """The setting names in the order DeMoArguments' docstring groups them (each once)."""
    import re

    names = [n for n in re.findall(r"\bdemo_(\w+)", doc) if n != "preset"]
    assert len(names) == len(set(names)), names
    return names


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "sgd", "adafactor", "rmsprop"])
def test_builtin_optimizers_still_parse(optim):
    args = parse("--optim", optim)
    assert args.optim == OptimizerNames(optim) and not args.uses_demo


def test_default_is_trainers_default():
    assert parse().optim == TrainingArguments(output_dir="out-never-written", use_cpu=True).optim


@pytest.mark.parametrize(
    "optim_args,match",
    [
        ("compression_topk=16,bogus=1", "unknown DeMo setting 'bogus'"),
        ("compression_topk", "malformed --optim_args entry 'compression_topk'"),
        ("compression_topk=sixteen", "compression_topk='sixteen' is not a valid int"),
        ("comm_timeout=soon", "comm_timeout='soon' is not a valid float"),
        ("update_rule=maybe", "invalid update_rule='maybe'; expected one of"),
        ("sign_update=false", "unknown DeMo setting 'sign_update'"),
    ],
)
def test_bad_optim_args_name_the_key(optim_args, match):
    with pytest.raises(ValueError, match=match):
        parse("--optim", "demo", "--optim_args", optim_args)


def test_unknown_optim_is_still_rejected():
    with pytest.raises(SystemExit):  # argparse: not among the choices
        parse("--optim", "not_an_optimizer")
    with pytest.raises(ValueError, match="not_an_optimizer is not a valid OptimizerNames"):
        hf_demo.DeMoTrainingArguments(output_dir="out-never-written", use_cpu=True, optim="not_an_optimizer")


def test_invalid_choice_of_a_demo_field_is_rejected_by_the_parser():
    with pytest.raises(SystemExit):
        parse("--optim", "demo", "--demo_value_format", "fp8")


def test_help_lists_demo_settings(capsys):
    with pytest.raises(SystemExit):
        HfArgumentParser(hf_demo.DeMoTrainingArguments).parse_args_into_dataclasses(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "'demo' for DeMo" in out
    for name, _, default, _help, choices in DeMoSettings.describe():
        assert f"--demo_{name}" in out and f"(default: {default})" in out
        if choices:
            assert "{" + ",".join(choices) + "}" in out


def test_cpu_launch_without_the_switch_is_detected(monkeypatch):
    from hf_demo.hf.launch_env import launched_on_cpu_without_switch

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launched_on_cpu_without_switch(False) == (not torch.cuda.is_available())
    assert not launched_on_cpu_without_switch(True)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    assert not launched_on_cpu_without_switch(False)


def test_trl_config_keeps_sftconfig_defaults():
    import trl

    from hf_demo.trl import DeMoSFTConfig

    plain = trl.SFTConfig(output_dir="out-never-written", use_cpu=True)
    ours = DeMoSFTConfig(output_dir="out-never-written", use_cpu=True, optim="demo", demo_compression_topk=4)
    assert ours.optim == "demo"
    for name in ("bf16", "learning_rate", "logging_steps", "gradient_checkpointing", "max_length"):
        assert getattr(ours, name) == getattr(plain, name), name
    assert ours.demo_settings()["compression_topk"] == 4
    (parsed,) = HfArgumentParser(DeMoSFTConfig).parse_args_into_dataclasses(
        ["--output_dir", "out-never-written", "--use_cpu", "true", "--optim", "demo", "--demo_value_format", "sign"]
    )
    assert parsed.demo_settings()["value_format"] == "sign" and parsed.learning_rate == plain.learning_rate


def test_with_demo_makes_any_trainer_and_config_demo_aware():
    """hf_demo.with_demo(TrainerCls, ConfigCls): the config keeps its own defaults, the trainer is DeMo-aware,
    made once per pair, picklable (Trainer saves the arguments with each checkpoint)."""
    import pickle

    import trl

    from hf_demo.trl import DeMoSFTConfig, DeMoSFTTrainer

    assert hf_demo.with_demo(trl.SFTTrainer, trl.SFTConfig) == (DeMoSFTTrainer, DeMoSFTConfig)
    dpo_trainer, dpo_config = hf_demo.with_demo(trl.DPOTrainer, trl.DPOConfig)
    assert hf_demo.with_demo(trl.DPOTrainer, trl.DPOConfig) == (dpo_trainer, dpo_config)
    assert issubclass(dpo_trainer, hf_demo.DeMoTrainerMixin) and issubclass(dpo_trainer, trl.DPOTrainer)
    assert dpo_trainer.__mro__[1] is hf_demo.DeMoTrainerMixin  # the mixin first
    plain = trl.DPOConfig(output_dir="out-never-written", use_cpu=True)
    ours = dpo_config(output_dir="out-never-written", use_cpu=True, optim="demo", demo_compression_topk=8)
    for name in ("bf16", "learning_rate", "logging_steps", "beta", "max_length"):
        assert getattr(ours, name) == getattr(plain, name), name
    assert ours.demo_settings()["compression_topk"] == 8
    assert pickle.loads(pickle.dumps(ours)).demo_compression_topk == 8
    assert dpo_trainer.get_optimizer_cls_and_kwargs(ours)[0] is hf_demo.DeMo
    assert hf_demo.with_demo(hf_demo.DeMoTrainer, hf_demo.DeMoTrainingArguments) == (
        hf_demo.DeMoTrainer,
        hf_demo.DeMoTrainingArguments,
    )
    with pytest.raises(TypeError, match="not a transformers.Trainer subclass"):
        hf_demo.with_demo(object, trl.SFTConfig)


def test_with_demo_training_args_unpickle_in_a_fresh_process(tmp_path):
    """training_args.bin of a with_demo(DPOTrainer, DPOConfig) run loads in a process that never called with_demo
    (it used to fail: Can't get attribute 'DeMoDPOConfig'); the trainer class pickles the same way (issue 44)."""
    import subprocess
    import sys

    import trl

    dpo_trainer, dpo_config = hf_demo.with_demo(trl.DPOTrainer, trl.DPOConfig)
    args = dpo_config(output_dir=str(tmp_path / "out"), use_cpu=True, optim="demo", demo_compression_topk=8)
    torch.save(args, tmp_path / "training_args.bin")  # as Trainer writes it
    torch.save(dpo_trainer, tmp_path / "trainer_class.bin")
    check = (
        "import sys, torch\n"
        "args = torch.load(sys.argv[1] + '/training_args.bin', weights_only=False)\n"
        "cls = torch.load(sys.argv[1] + '/trainer_class.bin', weights_only=False)\n"
        "import trl\n"
        "assert isinstance(args, trl.DPOConfig) and args.demo_compression_topk == 8 and args.optim == 'demo'\n"
        "assert issubclass(cls, trl.DPOTrainer) and cls.__name__ == 'DeMoDPOTrainer', cls\n"
        "print('loaded', type(args).__module__, type(args).__name__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", check, str(tmp_path)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded hf_demo.hf.runtime_classes DeMoDPOConfig" in proc.stdout


class _UserConfig(TrainingArguments):  # a user's own subclass of a made class pickles by its own name
    pass


def test_a_subclass_of_a_made_class_pickles_by_its_own_name():
    import pickle

    made = hf_demo.with_demo(hf_demo.DeMoTrainer, _UserConfig)[1]
    sub = type("Sub", (made,), {"__module__": __name__})
    globals()["Sub"] = sub
    try:
        assert pickle.loads(pickle.dumps(sub)) is sub and pickle.loads(pickle.dumps(made)) is made
    finally:
        del globals()["Sub"]


def test_every_demo_argument_class_accepts_optim_demo_and_transformers_names_stay_as_they_are():
    """hf_demo's argument classes built on TRL's configs take 'demo' as a value and as a command-line choice, and
    keep every other optimizer; their plain trainers refuse to build it (they would keep DDP's all-reduce). The
    plain configs do not know 'demo' (transformers refuses it): hf_demo adds no member to OptimizerNames."""
    import trl

    from hf_demo.hf.training_args import with_demo_arguments
    from hf_demo.trl import DeMoSFTConfig

    for config_cls in (trl.SFTConfig, trl.DPOConfig, trl.RewardConfig):
        demo_cls = with_demo_arguments(config_cls)
        assert demo_cls(output_dir="out-never-written", use_cpu=True, optim="demo").optim == "demo"
        for cls, optim in ((demo_cls, "demo"), (demo_cls, "sgd"), (config_cls, "sgd")):
            (parsed,) = HfArgumentParser(cls).parse_args_into_dataclasses(
                ["--output_dir", "out-never-written", "--use_cpu", "true", "--optim", optim]
            )
            assert parsed.optim == optim
        default = HfArgumentParser(demo_cls).parse_args_into_dataclasses(["--output_dir", "x", "--use_cpu", "true"])
        assert default[0].optim == config_cls(output_dir="x", use_cpu=True).optim
        with pytest.raises(ValueError, match="demo is not a valid OptimizerNames"):
            config_cls(output_dir="out-never-written", use_cpu=True, optim="demo")
    with pytest.raises(ValueError, match="needs a DeMo-aware trainer"):
        trl.SFTTrainer.get_optimizer_cls_and_kwargs(DeMoSFTConfig(output_dir="x", use_cpu=True, optim="demo"))


UNTOUCHED = """
from transformers import HfArgumentParser
from transformers.training_args import OptimizerNames

def names():
    return (list(OptimizerNames), list(OptimizerNames._member_names_), dict(OptimizerNames._member_map_),
            dict(OptimizerNames._value2member_map_))

before = names()
import hf_demo, hf_demo.trl
args = hf_demo.DeMoTrainingArguments(output_dir="x", use_cpu=True, optim="demo")
hf_demo.DeMoTrainer.get_optimizer_cls_and_kwargs(args)
hf_demo.trl.DeMoSFTConfig(output_dir="x", use_cpu=True, optim="demo")
HfArgumentParser(hf_demo.DeMoTrainingArguments).parse_args_into_dataclasses(
    ["--output_dir", "x", "--use_cpu", "true", "--optim", "demo"])
assert names() == before, "hf_demo changed transformers' OptimizerNames"
assert "demo" not in OptimizerNames._value2member_map_
print("untouched")
"""


def test_transformers_optimizer_names_are_untouched_by_hf_demo():
    """Importing hf_demo, building and parsing its arguments with optim 'demo', and asking DeMoTrainer for the
    optimizer leave transformers' OptimizerNames enum exactly as it was (a fresh process: nothing imported before)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", UNTOUCHED], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "untouched" in done.stdout, done.stderr[-3000:]


def _tiny_llama():
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )


def test_factory_groups_and_cls_and_kwargs():
    model = _tiny_llama()
    opt = hf_demo.create_optimizer(model, lr=1e-3, weight_decay=0.1, compression_topk=8)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 1 for p in no_decay["params"])  # norms
    cls, kwargs = hf_demo.optimizer_cls_and_kwargs(lr=2e-3, value_format="sign")
    assert cls is hf_demo.DeMo and kwargs["value_format"] == "sign"
    with pytest.raises(ValueError, match="unknown DeMo setting"):
        hf_demo.create_optimizer(model, topk=3)


def _tiny_trainer(output_dir, trainer_kw=None, **arg_overrides):
    from datasets import Dataset

    model = _tiny_llama()
    data = Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 8, "labels": [[1, 2, 3, 4]] * 8})
    args = hf_demo.DeMoTrainingArguments(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to="none",
        max_steps=3,
        per_device_train_batch_size=4,
        **arg_overrides,
    )
    return hf_demo.DeMoTrainer(model=model, args=args, train_dataset=data, **(trainer_kw or {}))


def test_trainer_with_optimizer_cls_and_kwargs_uses_demo_in_one_process(tmp_path):
    trainer = _tiny_trainer(tmp_path, optim="adamw_torch", logging_steps=1)
    trainer.optimizer_cls_and_kwargs = hf_demo.optimizer_cls_and_kwargs(lr=1e-3)
    trainer.train()
    assert isinstance(hf_demo.hf.data_parallel.unwrap_optimizer(trainer.optimizer), hf_demo.DeMo)
    steps = [row for row in trainer.state.log_history if "loss" in row]  # a row per step: the tier and its moves
    assert len(steps) == 3 and all({"demo/tier", "demo/tier_moves_down", "demo/tier_moves_up"} <= set(r) for r in steps)
    assert any("demo/total_bytes_sent" in row for row in trainer.state.log_history)


def test_unsupported_setups_stop_at_start_up():
    with pytest.raises(ValueError, match="fp16 with a GradScaler"):
        check_supported(fp16=True)
    with pytest.raises(ValueError, match="DeepSpeed"):
        check_supported(deepspeed=True)
    check_supported(fsdp=True)  # FSDP2: DeMo steps its shards (tests/test_fsdp.py)
    with pytest.raises(hf_demo.DeMoSetupError, match="runs FSDP only on GPUs.*hf_demo.fsdp"):
        check_supported(fsdp_requested=True)  # asked for, but Accelerate did not turn it on (a CPU run)


def test_fsdp_asked_for_in_the_arguments_on_cpu_stops(tmp_path):
    """``--fsdp full_shard`` on CPU: Accelerate turns FSDP off, and the run trained as plain DDP + DeMo without a
    word; the arguments now stop naming hf_demo.fsdp, and so does DeMoTrainer given plain arguments and a DeMo."""
    with pytest.raises(hf_demo.DeMoSetupError, match="Accelerate does not run it here: it runs FSDP only on GPUs"):
        parse("--optim", "demo", "--fsdp", "full_shard")
    assert not parse("--optim", "adamw_torch", "--fsdp", "full_shard").uses_demo  # not DeMo's business
    model = _tiny_llama()
    plain = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, fsdp="full_shard")
    with pytest.raises(hf_demo.DeMoSetupError, match="runs FSDP only on GPUs.*hf_demo.fsdp"):
        hf_demo.DeMoTrainer(model=model, args=plain, optimizers=(hf_demo.DeMo(model.parameters(), lr=1e-3), None))


def _launch_env(config: str) -> dict:
    """The environment `ACCELERATE_USE_CPU=1 accelerate launch --config_file <config> --num_machines 1
    --num_processes 2` gives each process (Accelerate's own launcher code)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    argv = ["--config_file", config, "--num_machines", "1", "--num_processes", "2", "--machine_rank", "0", "x.py"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    return {k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith(("ACCELERATE", "FSDP", "PARALLEL"))}


def test_fsdp_config_on_cpu_stops_with_demos_message_first(tmp_path, monkeypatch):
    """accelerate_configs/fsdp2_hsdp.yaml on CPU: Accelerate's `ParallelismConfig is only compatible ...` error
    came before the documented DeMoSetupError; DeMo's message now comes first, from the arguments and from the
    trainer given plain arguments and a DeMo (issue 44, item 3)."""
    from launch_utils import ROOT

    env = _launch_env(str(ROOT / "accelerate_configs" / "fsdp2_hsdp.yaml"))
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    for k, v in {**env, "ACCELERATE_USE_CPU": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(hf_demo.DeMoSetupError, match="runs FSDP only on GPUs"):
        hf_demo.DeMoTrainingArguments(output_dir=str(tmp_path), optim="demo", report_to="none")
    import trl

    config = hf_demo.with_demo(trl.SFTTrainer, trl.SFTConfig)[1]
    with pytest.raises(hf_demo.DeMoSetupError, match="runs FSDP only on GPUs"):
        config(output_dir=str(tmp_path), optim="demo", report_to="none")
    model = _tiny_llama()
    plain = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(hf_demo.DeMoSetupError, match="runs FSDP only on GPUs"):
        hf_demo.DeMoTrainer(model=model, args=plain, optimizers=(hf_demo.DeMo(model.parameters(), lr=1e-3), None))


def test_a_custom_loop_launched_with_the_fsdp_config_on_cpu_is_refused_at_first_use_not_at_import():
    """A custom loop under accelerate_configs/fsdp2_hsdp.yaml on CPU: ``import hf_demo`` raises nothing; DeMo's first
    use (building the optimizer) is refused with the same documented message, before any DeMo state exists."""
    from launch_utils import ROOT

    env = _launch_env(str(ROOT / "accelerate_configs" / "fsdp2_hsdp.yaml"))
    script = (
        "import torch\nimport hf_demo\nprint('imported', flush=True)\n"
        "hf_demo.DeMo([torch.nn.Parameter(torch.zeros(2, 2))], lr=1e-3)\nprint('built', flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, **env, "ACCELERATE_USE_CPU": "1"}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "imported" in proc.stdout and "built" not in proc.stdout, (proc.stdout, proc.stderr[-2000:])
    assert "DeMoSetupError" in proc.stderr and "runs FSDP only on GPUs" in proc.stderr, proc.stderr[-2000:]


def test_trainer_refuses_fp16_with_demo(tmp_path):
    try:
        trainer_args = {"optim": "demo", "fp16": True}
        with pytest.raises(ValueError, match="DeMo does not support fp16"):
            _tiny_trainer(tmp_path, **trainer_args)
    finally:
        torch.set_default_dtype(torch.float32)


def test_presets_sit_under_settings_given_by_name():
    """default < preset < --demo_<name> < --optim_args, in DeMo, the factory and the training arguments."""
    from hf_demo.settings import PRESETS

    model = torch.nn.Linear(8, 8)
    assert hf_demo.DeMo(model.parameters(), preset="extreme").settings.compression_topk == 4
    lean = hf_demo.create_optimizer(model, preset="lean", compression_topk=8)
    assert lean.settings.value_format == "sign" and lean.settings.compression_topk == 8
    assert parse("--optim", "demo", "--demo_preset", "extreme").demo_settings()["value_format"] == "sign"
    args = parse("--optim", "demo", "--demo_preset", "extreme", "--demo_compression_topk", "16")
    assert args.demo_settings()["compression_topk"] == 16
    assert parse("--optim", "demo", "--demo_preset", "balanced").demo_settings()["compression_topk"] == 64
    args = parse("--optim", "demo", "--demo_preset", "balanced", "--optim_args", "preset=lean")
    assert args.demo_settings()["compression_topk"] == 32  # --optim_args wins: lean keeps the default top-32
    assert set(PRESETS) == {"balanced", "lean", "extreme", "many_nodes", "from_scratch", "from_scratch_few_bytes"}
    many = hf_demo.DeMo(model.parameters(), preset="many_nodes").settings
    assert (many.exchange, many.compression_topk, many.value_format) == ("all_reduce", 128, "bf16")
    listed = "unknown preset 'fast'; presets: balanced, lean, extreme, many_nodes, from_scratch, from_scratch_few_bytes"
    with pytest.raises(ValueError, match=listed):
        hf_demo.DeMo(model.parameters(), preset="fast")
    with pytest.raises(SystemExit):
        parse("--optim", "demo", "--demo_preset", "fast")


def test_settings_that_do_not_reach_the_optimizer_are_named(tmp_path):
    """--demo_* flags without --optim demo, or beside an optimizer given to the trainer, were dropped silently."""
    with pytest.warns(
        UserWarning, match=r"--demo_compression_topk set, but the optimizer is 'adamw_torch'.*--optim demo"
    ):
        _tiny_trainer(tmp_path, optim="adamw_torch", demo_compression_topk=16)
    given = {"optimizer_cls_and_kwargs": hf_demo.optimizer_cls_and_kwargs(lr=1e-3, compression_topk=8)}
    with pytest.warns(UserWarning, match=r"an optimizer was given.*--demo_sync_every, --optim demo are not used"):
        _tiny_trainer(tmp_path, given, optim="demo", demo_sync_every=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one source of settings: nothing to say
        _tiny_trainer(tmp_path, optim="demo", demo_compression_topk=16)
        _tiny_trainer(tmp_path, given, optim="adamw_torch")


def test_a_bare_boolean_demo_flag_means_true():
    """--demo_overlap alone was refused ("expected one argument"), unlike Trainer's own switches."""
    assert parse("--optim", "demo", "--demo_overlap").demo_overlap is True
    assert parse("--optim", "demo", "--demo_overlap", "false").demo_overlap is False
    assert parse("--optim", "demo").demo_overlap is None  # not given: the default (or the preset) holds


def test_overlap_with_load_best_model_at_end_ends_with_the_best_checkpoints_weights(tmp_path):
    """flush() after train() applied overlap's last exchange in flight on top of the best checkpoint's weights."""
    from datasets import Dataset
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = _tiny_llama()
    ids = torch.randint(0, 64, (64, 4), generator=torch.Generator().manual_seed(0)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = hf_demo.DeMoTrainingArguments(
        output_dir=str(tmp_path), optim="demo", demo_overlap=True, demo_compression_topk=4,
        demo_compression_chunk=8, learning_rate=1e-2, per_device_train_batch_size=4, max_steps=6,
        eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, load_best_model_at_end=True,
        metric_for_best_model="eval_loss", greater_is_better=True,  # the first evaluation is "best": not the last
        report_to="none", use_cpu=True, logging_steps=100, disable_tqdm=True,
    )  # fmt: skip
    trainer = hf_demo.DeMoTrainer(model=model, args=args, train_dataset=data, eval_dataset=data.select(range(8)))
    trainer.train()
    assert not trainer.state.best_model_checkpoint.endswith("checkpoint-6")
    saved = load_file(f"{trainer.state.best_model_checkpoint}/model.safetensors")
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items() if k in saved)
