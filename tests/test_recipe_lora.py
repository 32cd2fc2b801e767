"""PEFT LoRA under DeMo through the recipes' ``--lora_*`` arguments (recipes/recipelib/models.py ``apply_lora``): the
adapters end bitwise identical on both ranks, and a resume from a checkpoint is bitwise the uninterrupted run."""

import json

import pytest

from launch_utils import ROOT, accelerate_launch
from test_recipe_clm import QUICK, import_recipe

LORA = ["--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.1"]  # dropout: the RNG must resume exactly too
STEPS = ["--max_steps", "6", "--learning_rate", "3e-3", "--seed", "1", "--report_to", "none"]
# QUICK's --save_strategy no is overridden: a checkpoint every 3 steps
SAVE = ["--save_strategy", "steps", "--save_steps", "3"]


@pytest.fixture(scope="module")
def models():
    return import_recipe("recipelib.models")


def _clm(tiny_llama_dir, out, *extra):
    accelerate_launch(
        ROOT / "recipes" / "run_clm.py", "--model_name_or_path", tiny_llama_dir, "--output_dir", out, *QUICK, *extra
    )
    return json.loads((out / "results.json").read_text())


# ------------------------------------------------------------------------------------------- the helper
def _model_args(models, argv=()):
    from transformers import HfArgumentParser

    return HfArgumentParser(models.ModelArguments).parse_args_into_dataclasses(args=list(argv))


def test_lora_off_by_default_and_all_linear_on_llama(models, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    (args,) = _model_args(models)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert args.lora_r == 0 and models.apply_lora(model, args, "CAUSAL_LM") is model
    (args,) = _model_args(models, ["--lora_r", "4"])
    peft_model = models.apply_lora(model, args, "CAUSAL_LM")
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    targets = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # not lm_head
    (args,) = _model_args(models, ["--lora_r", "2", "--lora_target_modules", "q_proj", "v_proj"])
    assert models.lora_config(args, "CAUSAL_LM").target_modules == {"q_proj", "v_proj"}
    (args,) = _model_args(models, ["--lora_r", "-1"])
    with pytest.raises(ValueError, match="--lora_r must be 0"):
        models.lora_config(args, "CAUSAL_LM")


def test_lora_on_a_classifier_trains_the_new_head_in_full(models):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    (args,) = _model_args(models, ["--lora_r", "4"])
    model = models.apply_lora(BertForSequenceClassification(config), args, "SEQ_CLS")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("classifier" in n and "lora" not in n for n in trainable)  # the head: peft's modules_to_save
    assert any("query.lora_A" in n for n in trainable) and any("output.dense.lora_B" in n for n in trainable)
    assert not any("classifier" in n and "lora" in n for n in trainable)


# ------------------------------------------------------------------------------------------- launches
@pytest.fixture(scope="module")
def straight(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "straight"
    return out, _clm(tiny_llama_dir, out, *LORA, *STEPS, *SAVE)


@pytest.mark.launch
def test_lora_adapters_bitwise_identical_on_both_ranks(straight):
    out, results = straight
    assert results["world_size"] == 2 and results["global_step"] == 6 and results["ddp"]
    assert results["lora"]["r"] == 8 and results["param_shapes"]
    assert results["trainable_parameters"] < results["parameters"] / 10
    assert results["replicas_identical"] and len(results["replicas"]) == 2
    assert results["replicas"][0]["trainable_sha256"] == results["replicas"][1]["trainable_sha256"]
    assert results["after"]["loss"] < results["before"]["loss"]
    comm = results["communication"]  # DeMo sent the adapters only: less than a dense all-reduce of them
    assert comm["method"] == "DeMo" and 0 < comm["bytes_sent"] < comm["dense_bytes"]
    assert comm["dense_bytes"] == 4 * results["trainable_parameters"] * 6
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    assert {"optimizer.pt", "optimizer.rank1.pt", "adapter_model.safetensors"} <= {
        f.name for f in (out / "checkpoint-3").iterdir()
    }


@pytest.mark.launch
def test_lora_resume_is_bitwise_exact(straight, tiny_llama_dir, tmp_path):
    out, results = straight
    resumed = _clm(
        tiny_llama_dir, tmp_path / "resumed", *LORA, *STEPS, "--resume_from_checkpoint", out / "checkpoint-3"
    )
    assert resumed["global_step"] == 6 and resumed["replicas_identical"]
    assert resumed["before"]["loss"] < results["before"]["loss"]  # evaluated at the start: step 3's adapters
    assert resumed["replicas"] == results["replicas"]  # trainable and all parameters, both ranks


@pytest.mark.launch
@pytest.mark.slow
def test_lora_with_the_many_nodes_preset_stays_identical_and_resumes_exactly(straight, tiny_llama_dir, tmp_path):
    """``--demo_preset many_nodes`` (the all-reduce on the union of nominations) on LoRA adapters."""
    preset = ["--demo_preset", "many_nodes"]
    results = _clm(tiny_llama_dir, tmp_path / "straight", *LORA, *STEPS, *SAVE, *preset)
    assert results["world_size"] == 2 and results["global_step"] == 6 and results["replicas_identical"]
    assert results["after"]["loss"] < results["before"]["loss"]
    comm = results["communication"]
    assert comm["method"] == "DeMo" and 0 < comm["bytes_sent"] < comm["dense_bytes"]
    assert comm["bytes_sent"] != straight[1]["communication"]["bytes_sent"]  # the preset reached the optimizer
    resumed = _clm(
        tiny_llama_dir,
        tmp_path / "resumed",
        *LORA,
        *STEPS,
        *preset,
        "--resume_from_checkpoint",
        tmp_path / "straight" / "checkpoint-3",
    )
    assert resumed["global_step"] == 6 and resumed["replicas"] == results["replicas"]
