"""recipes/run_clm.py, recipes/compare.py and recipes/recipelib: launches on a tiny model and the real SmolLM2,
clear errors, the shared arguments, results layout and exit."""

import argparse
import importlib
import json
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import hf_demo
from dist_utils import free_port
from launch_utils import ROOT, accelerate_launch, load_records

RECORD_RECIPE = ROOT / "tests" / "scripts" / "record_recipe.py"

QUICK = [
    "--per_device_train_batch_size",
    "2",
    "--block_size",
    "64",
    "--max_train_samples",
    "64",
    "--max_eval_samples",
    "8",
    "--logging_steps",
    "1",
    "--save_strategy",
    "no",
    "--use_cpu",
    "true",
    "--disable_tqdm",
    "true",
]


def import_recipe(name):
    """A module of recipes/, imported as the scripts import each other (their folder on sys.path)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT / "recipes"))
        return importlib.import_module(name)


@pytest.fixture(scope="module")
def run_clm():
    return import_recipe("run_clm")


@pytest.fixture(scope="module")
def recipelib():
    """The recipes' shared package (recipes/recipelib), imported as the scripts import it."""
    modules = ("arguments", "baselines", "data", "models", "plots", "results", "training")
    return SimpleNamespace(**{name: import_recipe(f"recipelib.{name}") for name in modules})


# ------------------------------------------------------------------------------------------- launches
@pytest.mark.launch
@pytest.mark.slow  # the fast run keeps the real SmolLM2 two-process run of the same recipe
def test_clm_smoke_two_processes(tiny_llama_dir, tmp_path):
    out = tmp_path / "clm"
    proc = accelerate_launch(
        ROOT / "recipes" / "run_clm.py",
        "--model_name_or_path",
        tiny_llama_dir,
        "--output_dir",
        out,
        "--max_steps",
        "4",
        "--learning_rate",
        "3e-3",
        "--report_to",
        "tensorboard",
        *QUICK,
    )
    results = json.loads((out / "results.json").read_text())
    assert results["recipe"] == "run_clm" and results["world_size"] == 2 and results["optim"] == "demo"
    assert results["global_step"] == 4 and results["ddp"]
    for when in ("before", "after"):
        assert results[when]["perplexity"] > 1 and 0 <= results[when]["next_token_accuracy"] <= 1
    assert results["after"]["loss"] < results["before"]["loss"]
    comm = results["communication"]
    assert comm["method"] == "DeMo" and 0 < comm["bytes_sent"] < comm["dense_bytes"] / 10
    assert results["demo_counters"]["total_bytes_sent"] == comm["bytes_sent"]
    assert [step for step, _ in results["train_loss_curve"]] == [1, 2, 3, 4]  # every step, for training.png
    assert (out / "training.png").stat().st_size > 1000 and (out / "model.safetensors").is_file()
    assert list((out / "runs").rglob("events.out.tfevents.*"))
    assert "demo fine-tune of" in proc.stdout and "(2 processes, 4 steps)" in proc.stdout
    assert "perplexity" in proc.stdout and "terminate called" not in proc.stdout


@pytest.mark.launch
@pytest.mark.slow  # the fast run keeps each method's exact command line (test_compare_methods_are_what_they_claim)
def test_compare_three_methods(tiny_llama_dir, tmp_path):
    compare = import_recipe("compare")
    rows = compare.main(
        [
            "--output_dir",
            str(tmp_path),
            "--steps",
            "3",
            "--eval_steps",
            "3",
            "--demo_lr",
            "3e-3",
            "--adamw_lr",
            "3e-3",
            "--",
            "--model_name_or_path",
            str(tiny_llama_dir),
            "--per_device_train_batch_size",
            "2",
            "--block_size",
            "64",
            "--max_train_samples",
            "32",
            "--max_eval_samples",
            "4",
            "--disable_tqdm",
            "true",
        ]
    )
    by = {r["method"]: r for r in rows}
    assert set(by) == {"DeMo", "DDP-AdamW", "DDP-AdamW+PowerSGD"}
    assert by["DeMo"]["bytes_per_step"] < by["DDP-AdamW+PowerSGD"]["bytes_per_step"] < by["DDP-AdamW"]["bytes_per_step"]
    # the baselines really are DDP (an evaluate() before train() used to leave the model unwrapped)
    assert by["DDP-AdamW"]["ddp"] and by["DDP-AdamW+PowerSGD"]["ddp"]
    table = (tmp_path / "compare.md").read_text()
    assert "| DeMo |" in table and "final eval loss" in table and "| perplexity |" in table
    assert (tmp_path / "compare.png").stat().st_size > 1000


def _fit(grad: dict, reference: dict) -> float:
    """Relative error of the best ``grad ≈ c · reference`` over all parameters together (c absorbs clipping
    and loss scaling): 0 when ``grad`` is ``reference`` up to one scalar."""
    g = torch.cat([grad[n].flatten() for n in reference])
    r = torch.cat([reference[n].flatten() for n in reference])
    c = (g @ r) / (r @ r)
    return float((g - c * r).norm() / g.norm())


@pytest.mark.launch
@pytest.mark.parametrize(
    "method",
    [  # plain DDP in the slow tier: the PowerSGD case checks DDP's average at step 1 (before the hook starts)
        pytest.param("DDP-AdamW", marks=pytest.mark.slow),
        "DDP-AdamW+PowerSGD",
        "DeMo",
    ],
)
def test_compare_methods_are_what_they_claim(method, tiny_llama_dir, tmp_path):
    """compare.py's exact recipe command lines on 2 real processes: the baselines are real DDP (each rank's
    gradient is the average of both ranks' local gradients; PowerSGD's hook compresses it), DeMo's gradients
    stay local, and every method ends with bitwise identical parameters on both ranks."""
    compare = import_recipe("compare")
    passthrough = ["--model_name_or_path", str(tiny_llama_dir), "--per_device_train_batch_size", "2"]
    passthrough += ["--block_size", "64", "--max_train_samples", "32", "--max_eval_samples", "4"]
    passthrough += ["--disable_tqdm", "true"]
    args = argparse.Namespace(
        steps=4, eval_steps=4, demo_lr=3e-3, adamw_lr=3e-3, powersgd_rank=4, demo_preset=None, demo_args=""
    )
    args.passthrough = passthrough
    recipe_args = compare.recipe_args(compare.methods(args)[method], args, tmp_path / "out")
    accelerate_launch(RECORD_RECIPE, "--record_dir", tmp_path / "rec", "--record_steps", "1,4", *recipe_args)
    r0, r1 = load_records(tmp_path / "rec", 2)
    assert r0["ddp"] and r1["ddp"] and r0["global_step"] == 4
    assert json.loads((tmp_path / "out" / "results.json").read_text())["ddp"]
    for step in (1, 4):  # the ranks read different batches, so equal gradients come from communication
        assert not torch.equal(r0["steps"][step]["input_ids"], r1["steps"][step]["input_ids"])
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), f"{name} differs across ranks after training"

    def grads_equal(step):
        g0, g1 = r0["steps"][step]["grad"], r1["steps"][step]["grad"]
        return all(torch.equal(g0[n], g1[n]) for n in g0)

    def error_to_average(step):  # of the optimizer's gradient against the mean of both ranks' local gradients
        l0, l1 = r0["steps"][step]["local_grad"], r1["steps"][step]["local_grad"]
        return _fit(r0["steps"][step]["grad"], {n: (l0[n] + l1[n]) / 2 for n in l0})

    if method == "DeMo":
        assert r0["comm_hooks"] == ["noop_hook"]  # DeMo moves the momentum, not the gradient
        assert not grads_equal(1) and not grads_equal(4)
        assert _fit(r0["steps"][1]["grad"], r0["steps"][1]["local_grad"]) < 1e-4  # its own local gradient
        assert error_to_average(1) > 0.1  # (measured: 0.72)
        return
    assert grads_equal(1) and grads_equal(4)
    assert error_to_average(1) < 1e-4  # the average (PowerSGD too: plain all-reduce before its start_iter 2)
    assert _fit(r0["steps"][1]["grad"], r0["steps"][1]["local_grad"]) > 0.1  # not rank 0's own (measured: 0.72)
    if method == "DDP-AdamW":
        assert r0["comm_hooks"] == [] and error_to_average(4) < 1e-4  # DDP's own all-reduce
    else:
        assert r0["comm_hooks"] == ["powerSGD_hook"]
        state = r0["comm_hook_states"][0]
        assert state["matrix_approximation_rank"] == args.powersgd_rank and state["start_powerSGD_iter"] == 2
        assert state["iter"] == 4  # the hook ran at every step
        # its chained all-reduces run on gloo's threads: on the default group they could interleave with the
        # main thread's collectives (compare's SmolLM2 run crashed at step 16/18 with "data size doesn't match")
        assert r0["comm_hook_groups"] == r1["comm_hook_groups"] == ["own"]
        assert state["total_numel_after_compression"] < state["total_numel_before_compression"] / 2
        assert error_to_average(4) > 0.01  # a compressed (low-rank) average, not the exact one (measured: 0.71)


@pytest.mark.launch
@pytest.mark.slow  # the main job's path (make demo) with the real 135M model: a minute; the fast tiers use tiny models
def test_real_smollm2_two_steps_two_processes(tmp_path):
    out = tmp_path / "smol"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train = tmp_path / "train.txt"  # a few real stdlib modules: the full corpus is the main job's
    train.write_text("".join((stdlib / name).read_text() for name in ("abc.py", "bisect.py", "colorsys.py")))
    accelerate_launch(
        ROOT / "recipes" / "run_clm.py",
        "--output_dir",
        out,
        "--max_steps",
        "2",
        "--train_file",
        train,
        "--validation_split_percentage",
        "20",
        "--learning_rate",
        "1e-4",
        "--report_to",
        "none",
        "--per_device_train_batch_size",
        "1",
        "--block_size",
        "64",
        "--max_train_samples",
        "8",
        "--max_eval_samples",
        "4",
        "--save_strategy",
        "no",
        "--use_cpu",
        "true",
        "--disable_tqdm",
        "true",
        timeout=600,
    )
    results = json.loads((out / "results.json").read_text())
    assert results["world_size"] == 2 and results["global_step"] == 2
    assert 130e6 < results["parameters"] < 140e6  # SmolLM2-135M
    assert results["before"]["perplexity"] < 1000  # a real, trained model
    assert results["communication"]["bytes_per_param_per_step"] < 0.035


# ------------------------------------------------------------------------------------------- clear errors
@pytest.mark.parametrize(
    "content,suffix,match",
    [
        ("{not json", ".json", "could not be parsed as json"),
        ("a,b\n1,2\n", ".csv", r"no --text_column given .*\['a', 'b'\]"),
        ("whatever", ".parquet", "unsupported extension '.parquet'"),
    ],
)
def test_bad_train_file_names_the_problem(run_clm, tmp_path, tiny_llama_dir, content, suffix, match):
    bad = tmp_path / f"train{suffix}"
    bad.write_text(content)
    with pytest.raises(ValueError, match=match):
        run_clm.main(
            [
                "--model_name_or_path",
                tiny_llama_dir,
                "--output_dir",
                tmp_path / "o",
                "--train_file",
                bad,
                "--use_cpu",
                "true",
            ]
        )


def test_missing_train_file_and_missing_model(run_clm, tmp_path, tiny_llama_dir):
    with pytest.raises(FileNotFoundError, match="nope.txt does not exist"):
        run_clm.main(["--output_dir", tmp_path / "o", "--train_file", tmp_path / "nope.txt", "--use_cpu", "true"])
    good = tmp_path / "t.txt"
    good.write_text("hello world\n" * 100)
    with pytest.raises(FileNotFoundError, match="model path /no/such/model does not exist"):
        run_clm.main(
            [
                "--model_name_or_path",
                "/no/such/model",
                "--output_dir",
                tmp_path / "o",
                "--train_file",
                good,
                "--use_cpu",
                "true",
            ]
        )


# ------------------------------------------------------------------------------------------- recipelib
def test_one_way_to_default_to_demo(run_clm, recipelib, tmp_path):
    types = (run_clm.ModelArguments, run_clm.DataTrainingArguments, hf_demo.DeMoTrainingArguments)
    _, data, args = recipelib.arguments.parse_args(
        types, ["--output_dir", tmp_path, "--use_cpu", "true"], max_eval_samples=64
    )
    assert args.optim == "demo" and args.eval_on_start and data.max_eval_samples == 64
    _, _, args = recipelib.arguments.parse_args(
        types, ["--output_dir", tmp_path, "--optim", "adamw_torch", "--use_cpu", "true", "--eval_on_start", "false"]
    )
    assert recipelib.arguments.optim_name(args) == "adamw_torch" and not args.eval_on_start
    config = tmp_path / "args.json"  # a config file gets the same defaults
    config.write_text(json.dumps({"output_dir": str(tmp_path), "use_cpu": True, "block_size": 32}))
    _, data, args = recipelib.arguments.parse_args(types, [config])
    assert args.optim == "demo" and args.eval_on_start and data.block_size == 32
    assert isinstance(data.validation_split_percentage, float)


def test_compare_gives_demo_alone_its_preset(run_clm, recipelib, tmp_path):
    """``compare.py --demo_preset from_scratch``: the DeMo run's recipe arguments resolve to the preset's local
    Muon steps; the baselines' command lines do not carry it."""
    compare = import_recipe("compare")
    args = argparse.Namespace(demo_lr=1e-3, adamw_lr=1e-4, powersgd_rank=4, demo_preset="from_scratch", demo_args="")
    commands = compare.methods(args)
    assert all("--demo_preset" not in extra for name, extra in commands.items() if name != "DeMo")
    types = (run_clm.ModelArguments, run_clm.DataTrainingArguments, hf_demo.DeMoTrainingArguments)
    argv = ["--output_dir", tmp_path, "--use_cpu", "true", *commands["DeMo"]]
    _, _, parsed = recipelib.arguments.parse_args(types, argv)
    settings = hf_demo.settings.DeMoSettings.resolve(parsed.demo_preset)
    assert parsed.learning_rate == 1e-3 and (settings.inner_rule, settings.sync_every) == ("orthogonal", 2)
    # --demo_args: settings of the DeMo run alone, over its preset's
    args.demo_args = "--demo_sync_every 4 --demo_compression_topk 48"
    commands = compare.methods(args)
    assert all("--demo_sync_every" not in extra for name, extra in commands.items() if name != "DeMo")
    _, _, parsed = recipelib.arguments.parse_args(
        types, ["--output_dir", tmp_path, "--use_cpu", "true", *commands["DeMo"]]
    )
    assert (parsed.demo_sync_every, parsed.demo_compression_topk, parsed.demo_preset) == (4, 48, "from_scratch")


def test_split_take_and_text_column(recipelib):
    from datasets import Dataset, DatasetDict

    raw = DatasetDict(train=Dataset.from_dict({"content": [f"doc {i}" for i in range(20)]}))
    assert recipelib.data.resolve_text_column(raw, None, "x") == "content"
    split = recipelib.data.split_off_validation(raw, 10.0, seed=0)
    assert (len(split["train"]), len(split["validation"])) == (18, 2)
    assert recipelib.data.take(split["train"], 5)["content"] == split["train"]["content"][:5]
    assert (
        len(recipelib.data.take(split["train"], 5, seed=1)) == 5
        and recipelib.data.take(split["train"], None) is split["train"]
    )
    with pytest.raises(ValueError, match="too few"):
        recipelib.data.split_off_validation(DatasetDict(train=raw["train"].select([0])), 10.0, seed=0)
    with pytest.raises(ValueError, match="must be in"):
        recipelib.data.split_off_validation(raw, 100.0, seed=0)


def test_summary_and_compare_read_one_layout(recipelib):
    compare = import_recipe("compare")
    log = [
        {"step": 0, "eval_loss": 3.0},
        {"step": 2, "loss": 2.5, "demo/total_bytes_sent": 100.0},
        {"step": 2, "eval_loss": 2.0},
    ]
    base = {
        "model": "m",
        "data": "d",
        "world_size": 2,
        "global_step": 2,
        "parameters": 1000,
        "param_shapes": [[10, 100]],
        "train_runtime_s": 1.0,
        "ddp": True,
        "log_history": log,
        "plot": None,
    }
    clm = {
        **base,
        "optim": "demo",
        "before": {"loss": 3.0, "perplexity": 20.0, "next_token_accuracy": 0.1},
        "after": {"loss": 2.0, "perplexity": 7.389, "next_token_accuracy": 0.5},
        "communication": recipelib.results.communication(log, 1000, 2),
    }
    text = recipelib.results.summary(clm, "out", "out/results.json")
    assert "demo fine-tune of m on d (2 processes, 2 steps)" in text
    assert "  perplexity              20.000 -> 7.389" in text
    assert "  next-token accuracy     0.1000 -> 0.5000" in text and "80x less" in text
    cls = {
        **base,
        "optim": "adamw_torch",
        "before": None,
        "after": {"loss": 0.5, "accuracy": 0.9, "f1": 0.8},
        "communication": recipelib.results.communication([], 1000, 2),
    }
    assert "  accuracy            0.9000" in recipelib.results.summary(cls, "out", "out/results.json")
    for name, results in (("DeMo", clm), ("DDP-AdamW", cls)):
        points, total = compare.curves(name, results, _Args())
        row = compare.row(name, results, total, wall=1.0)
        assert [p[:2] for p in points] == [(0, 3.0), (2, 2.0)] and row["final_eval_loss"] == results["after"]["loss"]
    assert row["metric"] == "accuracy" and row["bytes_per_step"] == 4000


class _Args:
    powersgd_rank = 4


def test_plot_data_draws_every_step_smoothed_evaluations_and_the_saving(recipelib, tmp_path):
    losses = [3.0, 2.6, 2.9, 2.4, 2.5, 2.2]
    log = [{"step": 0, "eval_loss": 3.1}]
    for step, loss in enumerate(losses, start=1):
        log.append({"step": step, "loss": loss, "demo/total_bytes_sent": 10.0 * step})
        if step == 3:
            log.append({"step": 3, "eval_loss": 2.7})
    log.append({"step": 6, "eval_loss": 2.3})
    results = {
        "optim": "demo",
        "model": "m",
        "data": "d",
        "world_size": 2,
        "global_step": 6,
        "parameters": 1000,
        "log_history": log,
        "communication": recipelib.results.communication(log, 1000, 6),
    }
    d = recipelib.plots.plot_data(results)
    assert d["train_steps"] == [1, 2, 3, 4, 5, 6] and d["train_loss"] == losses
    assert recipelib.results.loss_curve(log) == [[s, v] for s, v in zip(d["train_steps"], losses)]
    smoothed = d["train_smoothed"]  # bias-corrected EMA: starts at the first loss, moves less than the raw curve
    assert smoothed[0] == pytest.approx(3.0) and len(smoothed) == 6
    assert max(smoothed) - min(smoothed) < max(losses) - min(losses) and smoothed[-1] < smoothed[0]
    assert d["eval_steps"] == [0, 3, 6] and d["eval_loss"] == [3.1, 2.7, 2.3]  # before, in between, after
    assert d["comm_steps"] == [1, 2, 3, 4, 5, 6]
    assert d["dense_mb"] == pytest.approx([4000 * s / 1e6 for s in range(1, 7)])
    assert d["demo_mb"] == pytest.approx([10 * s / 1e6 for s in range(1, 7)]) and d["saving"] == pytest.approx(400)
    assert "DeMo fine-tune of m on d" in d["title"] and "6 steps" in d["title"]
    assert d["loss_title"] == "it learns: held-out loss 3.100 -> 2.300"
    recipelib.training.report({**results, "before": None, "after": {"loss": 2.3}, "plot": None}, str(tmp_path))
    assert (tmp_path / "training.png").stat().st_size > 1000
    assert json.loads((tmp_path / "results.json").read_text())["plot"].endswith("training.png")

    dense = recipelib.plots.plot_data(
        {**results, "optim": "adamw_torch", "communication": recipelib.results.communication([], 1000, 6)}
    )
    assert dense["demo_mb"] is None and dense["saving"] is None and dense["comm_steps"] == [1, 2, 3, 4, 5, 6]


def test_log_line_is_short(recipelib):
    row = {"loss": 2.3114, "grad_norm": 1.25, "learning_rate": 9.5e-05, "epoch": 0.05, "demo/total_bytes_sent": 9e6}
    row.update({"demo/bytes_sent_per_step": 4.27e6, "demo/ratio_to_dense": 1 / 126})
    assert recipelib.training.log_line(3, 20, row) == (
        "step 3/20  loss 2.311  grad_norm 1.25  learning_rate 9.5e-05  sent 4.27 MB/step (126x less than dense)"
    )
    evaluation = {"eval_loss": 2.4, "eval_perplexity": 11.0873, "eval_runtime": 3.2, "eval_samples_per_second": 5.0}
    assert recipelib.training.log_line(0, 20, evaluation) == "step 0/20  eval_loss 2.4  eval_perplexity 11.09"


def test_end_tears_the_process_group_down(recipelib):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    recipelib.training.end()
    assert not dist.is_initialized()


def test_the_comm_hook_of_the_baselines_is_the_recipes_not_the_librarys(recipelib, tmp_path):
    """--ddp_comm_hook is parsed by the recipes compare.py runs and set on their trainer's DDP kwargs; DeMo refuses
    it (there is no gradient all-reduce to compress)."""
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    baselines = recipelib.baselines
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    data = Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 8, "labels": [[1, 2, 3, 4]] * 8})

    def trainer(optim):
        args = hf_demo.DeMoTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", optim=optim)
        return hf_demo.DeMoTrainer(model=LlamaForCausalLM(config), args=args, train_dataset=data)

    power_sgd = baselines.BaselineArguments(ddp_comm_hook="power_sgd", powersgd_rank=4)
    with pytest.raises(ValueError, match=r"--ddp_comm_hook power_sgd .* with DeMo as the optimizer .* drop it"):
        baselines.use_ddp_comm_hook(trainer("demo"), power_sgd)
    adamw = trainer("adamw_torch")
    baselines.use_ddp_comm_hook(adamw, power_sgd)
    handler = adamw.accelerator.ddp_handler
    assert handler.comm_hook.value == "power_sgd" and handler.comm_state_option["matrix_approximation_rank"] == 4
    assert any(isinstance(cb, baselines.PowerSGDOwnGroup) for cb in adamw.callback_handler.callbacks)
    assert baselines.powersgd_bytes_per_step([(100, 100), (100,)], rank=4) == 4 * (800 + 100)
    assert not hasattr(hf_demo.DeMoTrainingArguments, "ddp_comm_hook")  # the library has no baseline fields
