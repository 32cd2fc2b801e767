"""DeMoTrainer for real: 2 processes through `accelerate launch --config_file accelerate_configs/...`."""

import json
import math
import shutil

import pytest
import torch

from dist_utils import process_alive
from hf_demo.hf.checkpoint import MANIFEST
from launch_utils import ROOT, accelerate_launch, load_records

pytestmark = pytest.mark.launch

SCRIPT = ROOT / "tests" / "scripts" / "train_tiny_llama.py"
COMMON = [
    "--per_device_train_batch_size",
    "8",
    "--learning_rate",
    "3e-3",
    "--max_steps",
    "20",
    "--logging_steps",
    "5",
    "--save_steps",
    "10",
    "--seed",
    "1",
    "--disable_tqdm",
    "true",
    "--report_to",
    "none",
    "--use_cpu",
    "true",
]


def _train(tmp, name, *extra, num_processes=2, check=True, cpu_switch=True):
    """``cpu_switch=False``: launched as a user who gave neither ACCELERATE_USE_CPU=1 nor --use_cpu would."""
    common = COMMON if cpu_switch else COMMON[: COMMON.index("--use_cpu")]
    return accelerate_launch(
        SCRIPT,
        "--output_dir",
        tmp / name / "out",
        "--record_dir",
        tmp / name / "rec",
        *common,
        *extra,
        num_processes=num_processes,
        check=check,
        cpu_switch=cpu_switch,
    )


# the straight run also calls trainer.evaluate() before trainer.train() on replicas initialised apart, and ends
# with hf_demo.shutdown() (test_evaluate_before_train_still_wraps_and_synchronises reads it): one launch less
EVALUATE_FIRST = ["--evaluate_first", "true", "--init_seed_by_rank", "true", "--end_with_shutdown", "true"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    proc = _train(tmp, "straight", "--optim", "demo", *EVALUATE_FIRST)
    return tmp, load_records(tmp / "straight" / "rec", 2), proc.stdout


@pytest.fixture(scope="module")
def resumed(straight):
    """The straight run resumed from its step-10 checkpoint, logging to TensorBoard (Trainer's TensorBoard
    callback writes to the working directory when trainer.evaluate() comes before train(), so not the straight run)."""
    tmp, _, _ = straight
    ckpt = tmp / "straight" / "out" / "checkpoint-10"
    _train(tmp, "resumed", "--optim", "demo", "--report_to", "tensorboard", "--resume_from_checkpoint", ckpt)
    return load_records(tmp / "resumed" / "rec", 2)


def test_demo_trains_keeps_ranks_identical_and_local_gradients(straight):
    _, (r0, r1), _ = straight
    assert r0["optimizer"] == "DeMo" and r0["global_step"] == 20
    assert r0["params"] == r1["params"]  # bitwise identical parameters on every rank
    assert r0["first_grad"] != r1["first_grad"]  # DDP did not average the gradients
    losses = [row["loss"] for row in r0["log_history"] if "loss" in row]
    assert losses[-1] < losses[0] - 0.5


def test_communication_metrics_reach_tensorboard(straight, resumed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, _, _ = straight
    events = list((tmp / "resumed" / "out" / "runs").rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for name in [
        "bytes_sent_per_step",
        "bytes_received_per_step",
        "total_bytes_sent",
        "total_bytes_received",
        "ratio_to_dense",
        "comm_seconds_per_step",
        "total_comm_seconds",
    ]:
        assert f"train/demo/{name}" in tags, sorted(tags)
    ratio = acc.Scalars("train/demo/ratio_to_dense")[-1].value
    sent = acc.Scalars("train/demo/bytes_sent_per_step")[-1].value
    assert 0 < ratio < 0.05 and sent > 0


def test_resume_is_bitwise_exact(straight, resumed):
    _, (r0, _), _ = straight
    assert resumed[0]["global_step"] == 20
    assert resumed[0]["params"] == resumed[1]["params"] == r0["params"]


def test_a_local_phase_is_evaluated_and_checkpointed_as_the_ranks_mean(tmp_path):
    """sync_every=4, evaluation and checkpoints every 3 steps, 6 steps: both fall inside local phases. The
    evaluation at step 6 saw each rank's own model on its shard (not the model train() returns after averaging),
    and a checkpoint's model file held rank 0's own parameters (what load_best_model_at_end takes)."""
    phase = ["--optim", "demo", "--demo_sync_every", "4", "--max_steps", "6", "--save_steps", "3"]
    phase += ["--eval_strategy", "steps", "--eval_steps", "3", "--per_device_eval_batch_size", "4"]
    _train(tmp_path, "phase", *phase, "--evaluate_after", "true")
    r0, r1 = load_records(tmp_path / "phase" / "rec", 2)
    evals = [(row["step"], row["eval_loss"]) for row in r0["log_history"] if "eval_loss" in row]
    assert [step for step, _ in evals] == [3, 6, 6]  # in training at 3 and 6, then trainer.evaluate()
    assert r0["params"] == r1["params"]  # the phase ended, averaged, at the end
    assert evals[1][1] == evals[2][1] == r0["eval_after"] == r1["eval_after"]  # the mean model, in training too
    checkpoint = tmp_path / "phase" / "out" / "checkpoint-3"
    _train(tmp_path, "resumed", *phase, "--resume_from_checkpoint", checkpoint, "--evaluate_after", "true")
    resumed = load_records(tmp_path / "resumed" / "rec", 2)
    assert resumed[0]["params"] == resumed[1]["params"] == r0["params"]  # exact, from the mean model file
    assert resumed[0]["eval_after"] == r0["eval_after"]


def test_rank_0_alone_saves_after_training_that_ended_inside_a_local_phase_left_apart(tmp_path):
    """end_local_phase='warn' leaves the phase open after train(); `if is_world_process_zero(): save_model()`
    then waited on rank 0 alone in the ranks' mean (a collective) until comm_timeout."""
    phase = ["--optim", "demo", "--demo_sync_every", "4", "--max_steps", "6", "--save_steps", "100"]
    _train(
        tmp_path,
        "warn",
        *phase,
        "--demo_end_local_phase",
        "warn",
        "--demo_comm_timeout",
        "20",
        "--save_on_rank0",
        "true",
    )
    assert (tmp_path / "warn" / "out" / "final" / "model.safetensors").is_file()


def test_resume_with_another_number_of_processes_fails_clearly(straight):
    tmp, _, _ = straight
    ckpt = tmp / "straight" / "out" / "checkpoint-10"
    proc = _train(tmp, "one", "--optim", "demo", "--resume_from_checkpoint", ckpt, num_processes=1, check=False)
    assert proc.returncode != 0
    assert "CheckpointError" in proc.stdout and "saved with 2 process(es) but this run has 1" in proc.stdout


def test_checkpoints_carry_a_manifest_of_every_rank_file(straight):
    tmp, _, _ = straight
    manifest = json.loads((tmp / "straight" / "out" / "checkpoint-10" / MANIFEST).read_text())
    assert manifest["world_size"] == 2 and manifest["global_step"] == 10
    assert {
        "optimizer.pt",
        "optimizer.rank1.pt",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "model.safetensors",
        "scheduler.pt",
        "trainer_state.json",
    } <= set(manifest["files"])


@pytest.mark.parametrize(
    "damage",
    # flipped bytes are also caught in tests/test_checkpoint.py, in one process
    ["missing_rank1", pytest.param("flipped_bytes", marks=pytest.mark.slow)],
)
def test_damaged_checkpoint_gives_every_rank_the_same_error(straight, damage):
    tmp, _, _ = straight
    ckpt = tmp / f"damaged_{damage}"
    shutil.copytree(tmp / "straight" / "out" / "checkpoint-10", ckpt)
    if damage == "missing_rank1":
        (ckpt / "optimizer.rank1.pt").unlink()
        expected = "optimizer.rank1.pt is missing"
    else:
        data = bytearray((ckpt / "optimizer.pt").read_bytes())
        for i in range(50):  # 50 bytes inside the momentum tensors
            data[len(data) // 2 + 13 * i] ^= 0x5A
        (ckpt / "optimizer.pt").write_bytes(bytes(data))
        expected = "optimizer.pt is corrupted"
    proc = _train(tmp, f"from_{damage}", "--optim", "demo", "--resume_from_checkpoint", ckpt, check=False)
    assert proc.returncode != 0
    messages = [line for line in proc.stdout.splitlines() if "CheckpointError:" in line]
    assert len(messages) == 2 and len({m.split("CheckpointError:", 1)[1] for m in messages}) == 1, messages
    assert expected in messages[0]
    assert "resume with 1 process" not in proc.stdout  # no contradicting advice


def test_resume_with_other_settings_warns_and_uses_the_requested_ones(straight):
    """Launched without the CPU switch too (no ACCELERATE_USE_CPU, no --use_cpu): DeMoTrainingArguments sees the
    CPU-only machine and trains with world size 2 (issue 9, item 2)."""
    tmp, (r0, _), _ = straight
    proc = _train(
        tmp,
        "resettled",
        "--optim",
        "demo",
        "--demo_compression_topk",
        "16",
        "--demo_compression_chunk",
        "32",
        "--resume_from_checkpoint",
        tmp / "straight" / "out" / "checkpoint-10",
        cpu_switch=False,
    )
    assert proc.stdout.count("resuming with settings that differ from the checkpoint's") == 2
    assert "compression_topk: saved 32, requested 16" in proc.stdout
    a, b = load_records(tmp / "resettled" / "rec", 2)  # world size 2 on both ranks
    assert a["params"] == b["params"] != r0["params"] and a["global_step"] == 20
    assert a["first_grad"] != b["first_grad"] and "setting use_cpu=True" in proc.stdout


@pytest.mark.slow  # DeMoTrainer's non-DeMo path; the fast run keeps evaluate-before-train with adamw_torch
def test_adamw_under_demo_trainer_is_plain_trainer(tmp_path):
    _train(tmp_path, "adamw_demo", "--optim", "adamw_torch", "--trainer", "demo")
    _train(tmp_path, "adamw_plain", "--optim", "adamw_torch", "--trainer", "plain")
    a = load_records(tmp_path / "adamw_demo" / "rec", 2)
    b = load_records(tmp_path / "adamw_plain" / "rec", 2)
    assert a[0]["optimizer"] == b[0]["optimizer"] == "AdamW"
    assert a[0]["first_grad"] == a[1]["first_grad"]  # DDP averaged the gradients as usual
    assert a[0]["params"] == b[0]["params"] == a[1]["params"]


def test_gradient_accumulation_bf16_checkpointing_and_clipping(tmp_path):
    _train(
        tmp_path,
        "mix",
        "--optim",
        "demo",
        "--gradient_accumulation_steps",
        "2",
        "--bf16",
        "true",
        "--gradient_checkpointing_on",
        "true",
        "--max_grad_norm",
        "0.5",
        "--max_steps",
        "12",
    )
    r0, r1 = load_records(tmp_path / "mix" / "rec", 2)
    assert r0["params"] == r1["params"] and r0["first_grad"] != r1["first_grad"]
    losses = [row["loss"] for row in r0["log_history"] if "loss" in row]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


@pytest.mark.slow  # the same checks on a loop that also saves and resumes: test_accelerate_loop.py
def test_custom_accelerate_loop_with_prepare(tmp_path):
    accelerate_launch(ROOT / "tests" / "scripts" / "accelerate_loop.py", tmp_path / "rankRANK.pt")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert r0["world"] == r1["world"] == 2
    assert r0["params"] == r1["params"] and r0["grad0"] != r1["grad0"]
    assert sum(r0["losses"][-5:]) < sum(r0["losses"][:5])


def _check_evaluate_first(r0, r1, stdout, optim):
    assert r0["ddp"] and r1["ddp"] and r0["find_unused_parameters"] is False
    assert r0["params"] == r1["params"]  # one model on every rank
    if optim == "demo":
        assert r0["first_grad"] != r1["first_grad"] and r0["resyncs"] == 0  # local gradients; DDP broadcast
    else:
        assert r0["first_grad"] == r1["first_grad"]  # DDP averaged the gradients
    assert "find_unused_parameters=True" not in stdout


def test_evaluate_before_train_still_wraps_and_synchronises(straight):
    """evaluate() before train() used to leave the model unwrapped: replicas initialised apart stayed apart
    (PEFT adapters), and the DDP baselines never averaged. Now train() wraps it in DDP, which broadcasts
    rank 0's weights; DDP's find_unused_parameters warning is gone too. (The straight run: EVALUATE_FIRST.)"""
    _, (r0, r1), stdout = straight
    _check_evaluate_first(r0, r1, stdout, "demo")


@pytest.mark.slow  # the DDP control of the test above
def test_evaluate_before_train_still_wraps_and_synchronises_adamw(tmp_path):
    proc = _train(tmp_path, "evalfirst", "--optim", "adamw_torch", *EVALUATE_FIRST, "--max_steps", "6")
    r0, r1 = load_records(tmp_path / "evalfirst" / "rec", 2)
    _check_evaluate_first(r0, r1, proc.stdout, "adamw_torch")


@pytest.mark.slow  # the same refusal in one process: test_args.py::test_fsdp_asked_for_in_the_arguments_on_cpu_stops
def test_fsdp_asked_for_on_cpu_stops_saying_it_would_train_ddp(tmp_path):
    """Trainer's --fsdp on CPU: Accelerate turns FSDP off, and the run trained as plain DDP + DeMo without a word."""
    proc = _train(tmp_path, "fsdp", "--optim", "demo", "--fsdp", "full_shard", "--max_steps", "2", check=False)
    assert proc.returncode != 0
    assert "Accelerate does not run it here: it runs FSDP only on GPUs" in proc.stdout and "hf_demo.fsdp" in proc.stdout
    assert not (tmp_path / "fsdp" / "rec").exists() or not list((tmp_path / "fsdp" / "rec").iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("where", ["log", "data"])
def test_a_stopped_rank_under_demotrainer_ends_the_job_within_comm_timeout(tmp_path, where):
    """Rank 1 stops (SIGSTOP) at step 5: before Trainer's logging gather (not DeMo's collective), or before its
    batch (rank 0 then waits in DDP's buffer broadcast of the next forward, or in DeMo's exchange). transformers'
    CPU path gives the group gloo's 30 minutes; with DeMoTrainer the survivor raises within comm_timeout, the
    launcher ends the job, and no rank outlives it."""
    import re
    import time

    started = time.monotonic()
    proc = _train(
        tmp_path, where, "--optim", "demo", "--demo_comm_timeout", "10", "--stop_rank", "1", "--stop_at", where,
        check=False,
    )  # fmt: skip
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert time.monotonic() - started < 280, proc.stdout[-3000:]  # the launch's own limit is 300 s; gloo's is 1800
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\): stopping myself", proc.stdout)]
    assert pids, proc.stdout[-3000:]
    deadline = time.monotonic() + 30
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(process_alive(p) for p in pids), "the stopped rank outlived its launcher"
    # what rank 0 waited in: DeMo's exchange (DeMoSyncError), or a collective of the default group (DDP's buffer
    # broadcast in the forward, Trainer's nested_gather), now bounded by comm_timeout: gloo's timeout error
    assert "DeMoSyncError" in proc.stdout or "Timed out waiting 10000ms" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.slow
def test_a_vouched_checkpoint_holding_another_runs_rank_file_gives_every_rank_the_same_error(straight):
    """rank 1's optimizer file taken from another run with the same settings, and the checkpoint vouched for
    with write_manifest (what the incomplete-checkpoint error suggests): it resumed silently on other parameters.
    Every rank now raises the same DeMoStateError naming rank 1's file, not rank 0 a raw gloo error."""
    from hf_demo.hf.checkpoint import write_manifest

    tmp, _, _ = straight
    _train(tmp, "other", "--optim", "demo", "--seed", "2", "--max_steps", "10")
    ckpt = tmp / "mixed"
    shutil.copytree(tmp / "straight" / "out" / "checkpoint-10", ckpt)
    shutil.copy(tmp / "other" / "out" / "checkpoint-10" / "optimizer.rank1.pt", ckpt / "optimizer.rank1.pt")
    (ckpt / MANIFEST).unlink()
    write_manifest(str(ckpt), 2, 10)
    proc = _train(tmp, "from_mixed", "--optim", "demo", "--resume_from_checkpoint", ckpt, check=False)
    assert proc.returncode != 0
    messages = [line.split("DeMoStateError:", 1)[1] for line in proc.stdout.splitlines() if "DeMoStateError:" in line]
    assert len(messages) == 2 and len(set(messages)) == 1, proc.stdout[-3000:]
    assert "rank 1's state is another run's" in messages[0], messages[0]
