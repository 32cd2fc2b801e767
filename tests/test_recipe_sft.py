"""recipes/run_sft.py: TRL's SFTTrainer with DeMo on 2 processes (tiny Llama, the stdlib instruction data set),
fully and with LoRA; the data set it builds offline."""

import json

import pytest

from launch_utils import ROOT, accelerate_launch
from test_recipe_clm import import_recipe

# a ChatML template for the tiny model's WordPiece tokenizer (SmolLM2 brings its own)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|> ' + message['content'] + ' [SEP] ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)
QUICK = (
    "--max_steps 2 --per_device_train_batch_size 2 --per_device_eval_batch_size 4 --max_length 64 "
    "--max_train_samples 16 --max_eval_samples 4 --logging_steps 1 --learning_rate 1e-3 --save_strategy no "
    "--report_to none --use_cpu true --disable_tqdm true --eos_token [SEP] --seed 1"
).split()


def test_stdlib_instructions_are_deterministic_conversations():
    run_sft = import_recipe("run_sft")
    data = run_sft.stdlib_instructions()
    assert 300 <= len(data) <= 2000 and data.column_names == ["prompt", "completion"]
    again = run_sft.stdlib_instructions()
    assert again[:50] == data[:50] and again[-50:] == data[-50:]
    questions = [p[0]["content"] for p in data["prompt"]]
    assert sum(q.startswith("What does the Python module") for q in questions) > 100
    assert sum(q.startswith("Write a Python function") for q in questions) > 100
    first = data[0]
    assert first["prompt"][0]["role"] == "user" and first["completion"][0]["role"] == "assistant"
    code = next(c[0]["content"] for c in data["completion"] if c[0]["content"].startswith("```python\ndef "))
    assert code.endswith("\n```")


@pytest.mark.launch
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sft_two_processes(tiny_llama_dir, tmp_path, lora):
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    out = tmp_path / "sft"
    extra = ["--lora_r", "4", "--learning_rate", "1e-2"] if lora else []
    proc = accelerate_launch(
        ROOT / "recipes" / "run_sft.py",
        "--model_name_or_path",
        tiny_llama_dir,
        "--chat_template_path",
        template,
        "--output_dir",
        out,
        *QUICK,
        *extra,
    )
    results = json.loads((out / "results.json").read_text())
    assert results["recipe"] == "run_sft" and results["optim"] == "demo"
    assert results["world_size"] == 2 and results["global_step"] == 2 and results["ddp"]
    assert 12 <= results["train_samples"] <= 16 and results["eval_samples"] == 4  # TRL drops fully truncated answers
    assert results["replicas_identical"] and len(results["replicas"]) == 2  # both ranks ended bitwise identical
    for when in ("before", "after"):
        assert results[when]["loss"] > 0 and 0 <= results[when]["mean_token_accuracy"] <= 1
    assert results["after"]["loss"] < results["before"]["loss"]
    comm = results["communication"]
    assert comm["method"] == "DeMo" and 0 < comm["bytes_sent"] < comm["dense_bytes"]
    assert results["demo_counters"]["total_bytes_sent"] == comm["bytes_sent"]
    if lora:
        assert results["lora"]["r"] == 4 and results["trainable_parameters"] < results["parameters"] / 10
        assert (out / "adapter_model.safetensors").is_file()
    else:
        assert results["lora"] is None and results["trainable_parameters"] == results["parameters"]
        assert (out / "model.safetensors").is_file()
    assert "demo fine-tune of" in proc.stdout and "mean token accuracy" in proc.stdout
    assert "bitwise identical on 2 ranks" in proc.stdout and "terminate called" not in proc.stdout
