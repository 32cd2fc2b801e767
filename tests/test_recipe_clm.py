"""recipes/run_clm.py and recipes/compare.py: smoke tests on a tiny model, the real SmolLM2, clear errors."""
import json
import sys

import pytest

from launch_utils import ROOT, accelerate_launch

sys.path.insert(0, str(ROOT / "recipes"))
import run_clm  # noqa: E402

QUICK = ["--per_device_train_batch_size", "2", "--block_size", "64", "--max_train_samples", "64",
         "--max_eval_samples", "8", "--logging_steps", "1", "--save_strategy", "no", "--use_cpu", "true",
         "--disable_tqdm", "true"]


def test_clm_smoke_two_processes(tiny_llama_dir, tmp_path):
    out = tmp_path / "clm"
    accelerate_launch(ROOT / "recipes" / "run_clm.py", "--model_name_or_path", tiny_llama_dir, "--output_dir", out,
                      "--max_steps", "4", "--learning_rate", "3e-3", "--report_to", "tensorboard", *QUICK)
    results = json.loads((out / "results.json").read_text())
    assert results["world_size"] == 2 and results["optim"] == "demo" and results["global_step"] == 4
    for when in ("before", "after"):
        assert results[when]["perplexity"] > 1 and 0 <= results[when]["next_token_accuracy"] <= 1
    assert results["after"]["loss"] < results["before"]["loss"]
    comm = results["communication"]
    assert comm["method"] == "DeMo" and 0 < comm["bytes_sent"] < comm["dense_bytes"] / 10
    assert (out / "training.png").stat().st_size > 1000 and (out / "model.safetensors").is_file()
    assert list((out / "runs").rglob("events.out.tfevents.*"))


def test_compare_three_methods(tiny_llama_dir, tmp_path):
    import compare
    rows = compare.main(["--output_dir", str(tmp_path), "--steps", "3", "--eval_steps", "3", "--demo_lr", "3e-3",
                         "--adamw_lr", "3e-3", "--", "--model_name_or_path", str(tiny_llama_dir),
                         "--per_device_train_batch_size", "2", "--block_size", "64", "--max_train_samples", "32",
                         "--max_eval_samples", "4", "--disable_tqdm", "true"])
    by = {r["method"]: r for r in rows}
    assert set(by) == {"DeMo", "DDP-AdamW", "DDP-AdamW+PowerSGD"}
    assert by["DeMo"]["bytes_per_step"] < by["DDP-AdamW+PowerSGD"]["bytes_per_step"] < by["DDP-AdamW"]["bytes_per_step"]
    table = (tmp_path / "compare.md").read_text()
    assert "| DeMo |" in table and "final eval loss" in table
    assert (tmp_path / "compare.png").stat().st_size > 1000


def test_real_smollm2_two_steps_two_processes(tmp_path):
    import sysconfig
    from pathlib import Path
    out = tmp_path / "smol"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train = tmp_path / "train.txt"     # a few real stdlib modules: the full corpus is the main job's
    train.write_text("".join((stdlib / name).read_text() for name in ("abc.py", "bisect.py", "colorsys.py")))
    accelerate_launch(ROOT / "recipes" / "run_clm.py", "--output_dir", out, "--max_steps", "2",
                      "--train_file", train, "--validation_split_percentage", "20",
                      "--learning_rate", "1e-4", "--report_to", "none", "--per_device_train_batch_size", "1",
                      "--block_size", "64", "--max_train_samples", "8", "--max_eval_samples", "4",
                      "--save_strategy", "no", "--use_cpu", "true", "--disable_tqdm", "true", timeout=600)
    results = json.loads((out / "results.json").read_text())
    assert results["world_size"] == 2 and results["global_step"] == 2
    assert 130e6 < results["parameters"] < 140e6                       # SmolLM2-135M
    assert results["before"]["perplexity"] < 1000                       # a real, trained model
    assert results["communication"]["bytes_per_param_per_step"] < 0.035


@pytest.mark.parametrize("content,suffix,match", [
    ("{not json", ".json", "could not read"),
    ("a,b\n1,2\n", ".csv", "--text_column 'text' is not a column"),
    ("whatever", ".parquet", "unsupported extension"),
])
def test_bad_train_file_names_the_problem(tmp_path, tiny_llama_dir, content, suffix, match):
    bad = tmp_path / f"train{suffix}"
    bad.write_text(content)
    with pytest.raises(ValueError, match=match):
        run_clm.main(["--model_name_or_path", str(tiny_llama_dir), "--output_dir", str(tmp_path / "o"),
                      "--train_file", str(bad), "--use_cpu", "true"])


def test_missing_train_file_and_missing_model(tmp_path, tiny_llama_dir):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        run_clm.main(["--output_dir", str(tmp_path / "o"), "--train_file", str(tmp_path / "nope.txt"),
                      "--use_cpu", "true"])
    good = tmp_path / "t.txt"
    good.write_text("hello world\n" * 100)
    with pytest.raises(ValueError, match="could not load model '/no/such/model'"):
        run_clm.main(["--model_name_or_path", "/no/such/model", "--output_dir", str(tmp_path / "o"),
                      "--train_file", str(good), "--use_cpu", "true"])
