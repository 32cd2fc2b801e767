"""DeMoTrainingArguments through HfArgumentParser, the factory, and refusals at start-up (in-process)."""
import pytest
import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, TrainingArguments
from transformers.training_args import OptimizerNames

import hf_demo
from hf_demo.accelerate_utils import check_supported


def parse(*argv):
    (args,) = HfArgumentParser(hf_demo.DeMoTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "/tmp/hf_demo_args", "--use_cpu", "true", *argv])
    return args


def test_optim_demo_and_its_settings():
    args = parse("--optim", "demo", "--demo_compression_topk", "8", "--optim_args",
                 "compression_chunk=32, value_format=sign,sign_update=false")
    assert args.optim == "demo" and args.uses_demo
    assert args.demo_settings() == {"compression_decay": 0.999, "compression_topk": 8, "compression_chunk": 32,
                                    "value_format": "sign", "sign_update": False, "nonfinite": "skip"}


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "sgd", "adafactor", "rmsprop"])
def test_builtin_optimizers_still_parse(optim):
    args = parse("--optim", optim)
    assert args.optim == OptimizerNames(optim) and not args.uses_demo


def test_default_is_trainers_default():
    assert parse().optim == TrainingArguments(output_dir="/tmp/x", use_cpu=True).optim


@pytest.mark.parametrize("optim_args,match", [
    ("compression_topk=16,bogus=1", "unknown DeMo setting 'bogus'"),
    ("compression_topk", "malformed --optim_args entry 'compression_topk'"),
    ("compression_topk=sixteen", "compression_topk='sixteen' is not a valid int"),
    ("sign_update=maybe", "sign_update='maybe' is not a valid bool"),
])
def test_bad_optim_args_name_the_key(optim_args, match):
    with pytest.raises(ValueError, match=match):
        parse("--optim", "demo", "--optim_args", optim_args)


def test_unknown_optim_is_still_rejected():
    with pytest.raises(ValueError):
        parse("--optim", "not_an_optimizer")


def test_help_lists_demo_settings(capsys):
    with pytest.raises(SystemExit):
        HfArgumentParser(hf_demo.DeMoTrainingArguments).parse_args_into_dataclasses(["--help"])
    out = capsys.readouterr().out
    for name in ["--demo_compression_topk", "--demo_compression_chunk", "--demo_value_format", "'demo' for DeMo"]:
        assert name in out


def test_factory_groups_and_cls_and_kwargs():
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    opt = hf_demo.create_optimizer(model, lr=1e-3, weight_decay=0.1, compression_topk=8)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 1 for p in no_decay["params"])          # norms
    cls, kwargs = hf_demo.optimizer_cls_and_kwargs(lr=2e-3, value_format="sign")
    assert cls is hf_demo.DeMo and kwargs["value_format"] == "sign"
    with pytest.raises(ValueError, match="unknown DeMo setting"):
        hf_demo.create_optimizer(model, topk=3)


def _tiny_trainer(**arg_overrides):
    from datasets import Dataset
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    data = Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 8, "labels": [[1, 2, 3, 4]] * 8})
    args = hf_demo.DeMoTrainingArguments(output_dir="/tmp/hf_demo_tiny", use_cpu=True, report_to="none",
                                         max_steps=3, per_device_train_batch_size=4, **arg_overrides)
    return hf_demo.DeMoTrainer(model=model, args=args, train_dataset=data)


def test_trainer_with_optimizer_cls_and_kwargs_uses_demo_in_one_process():
    trainer = _tiny_trainer(optim="adamw_torch")
    trainer.optimizer_cls_and_kwargs = hf_demo.optimizer_cls_and_kwargs(lr=1e-3)
    trainer.train()
    assert isinstance(hf_demo.accelerate_utils.unwrap_optimizer(trainer.optimizer), hf_demo.DeMo)
    assert any("demo/total_bytes_sent" in row for row in trainer.state.log_history)


def test_unsupported_setups_stop_at_start_up():
    with pytest.raises(ValueError, match="fp16 with a GradScaler"):
        check_supported(fp16=True)
    with pytest.raises(ValueError, match="DeepSpeed"):
        check_supported(deepspeed=True)
    with pytest.raises(ValueError, match="FSDP"):
        check_supported(fsdp=True)


def test_trainer_refuses_fp16_with_demo():
    try:
        trainer_args = dict(optim="demo", fp16=True)
        with pytest.raises(ValueError, match="DeMo does not support fp16"):
            _tiny_trainer(**trainer_args)
    finally:
        torch.set_default_dtype(torch.float32)
