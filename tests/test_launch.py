"""Real launches as users make them: clean exits, CPU launches without the switch, TRL, lost-rank recovery."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import free_port
from launch_utils import ROOT, accelerate_launch, load_records

pytestmark = pytest.mark.launch

SCRIPT = ROOT / "tests" / "scripts" / "train_tiny_llama.py"
NO_SWITCH = (
    "--optim demo --max_steps 3 --per_device_train_batch_size 4 --samples 32 --report_to none --save_strategy no "
    "--disable_tqdm true"
).split()
SHORT = [*NO_SWITCH, "--use_cpu", "true"]
COMMON = (
    "--per_device_train_batch_size 8 --learning_rate 3e-3 --max_steps 20 --save_steps 10 --seed 1 --disable_tqdm true "
    "--report_to none --use_cpu true --optim demo"
).split()


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_twenty_launches_under_load_exit_cleanly(tmp_path):
    """The script never tears down the process group itself: hf_demo's exit handler must (issue 9, item 1)."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a loaded machine
    failures = []
    try:
        for i in range(20):
            proc = accelerate_launch(SCRIPT, "--output_dir", tmp_path / "out", *SHORT, check=False)
            if proc.returncode != 0 or "terminate called" in proc.stdout:
                failures.append((i, proc.returncode, proc.stdout[-3000:]))
    finally:
        burner.kill()
        burner.wait()
    assert not failures, f"{len(failures)} of 20 launches failed at exit; first:\n{failures[0]}"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_exit_handler_stops_the_gloo_teardown_abort():
    """20 torchrun launches under load of a gloo script that never tears down, with hf_demo's exit handler: no
    abort. The same script without the handler aborts in about 1 of 5 launches here (6/30 measured), so this test
    fails without a working handler (probability of 20 clean launches ~1%)."""
    script = ROOT / "tests" / "scripts" / "exit_without_teardown.py"
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    failures = []
    try:
        for i in range(20):
            rc, out = _torchrun_script(script, "--handler", timeout=300)
            if rc != 0 or "terminate called" in out:
                failures.append((i, rc, out[-3000:]))
    finally:
        burner.kill()
        burner.wait()
    assert not failures, f"{len(failures)} of 20 launches failed at exit; first:\n{failures[0]}"


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif((os.cpu_count() or 1) < 2 or not hasattr(os, "sched_setaffinity"), reason="needs 2 CPUs")
def test_shutdown_waits_for_starved_gloo_workers():
    """12 torchrun launches whose gloo worker threads are starved of CPU (pinned at nice 19 beside a busy
    process), the default group still held as DDP holds it: ``hf_demo.shutdown()`` right after the last
    collective exits cleanly. Measured here: 2 of 8 launches abort without a teardown, 1 of 8 with the
    teardown before ``quiesce`` (destroying a held group does not join its threads), 0 of 12 with it."""
    script = ROOT / "tests" / "scripts" / "exit_with_starved_workers.py"
    burner = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", "while True: pass"])
    failures = []
    try:
        for i in range(12):
            rc, out = _torchrun_script(script, timeout=300)
            if rc != 0 or "terminate called" in out or out.count("done") != 2:
                failures.append((i, rc, out[-3000:]))
    finally:
        burner.kill()
        burner.wait()
    assert not failures, f"{len(failures)} of 12 launches failed at exit; first:\n{failures[0]}"


@pytest.mark.slow  # the same launch, resuming: test_trainer.py::test_resume_with_other_settings_warns_and_uses_...
def test_cpu_launch_without_the_switch_trains_with_world_size_2(tmp_path):
    """No ACCELERATE_USE_CPU, no --use_cpu: DeMoTrainingArguments sees the CPU-only machine (issue 9, item 2)."""
    args = NO_SWITCH
    proc = accelerate_launch(
        SCRIPT, "--output_dir", tmp_path / "out", "--record_dir", tmp_path / "rec", *args, cpu_switch=False
    )
    r0, r1 = load_records(tmp_path / "rec", 2)  # world size 2 on both ranks
    assert r0["params"] == r1["params"] and r0["first_grad"] != r1["first_grad"]
    assert "setting use_cpu=True" in proc.stdout


def test_cpu_launch_without_the_switch_stops_with_plain_arguments(tmp_path):
    """Plain TrainingArguments cannot be fixed afterwards: DeMoTrainer stops at start-up naming the fix, whatever the
    optimizer (plain TrainingArguments do not know ``demo``: hf_demo leaves transformers' OptimizerNames as it is)."""
    args = [a if a != "demo" else "adamw_torch" for a in NO_SWITCH]
    proc = accelerate_launch(
        SCRIPT, "--output_dir", tmp_path / "out", "--arguments", "plain", *args, cpu_switch=False, check=False
    )
    assert proc.returncode != 0
    assert proc.stdout.count("torch.distributed has 2 processes but Trainer sees world size 1") == 2
    assert "ACCELERATE_USE_CPU=1 or pass --use_cpu true" in proc.stdout


@pytest.mark.slow  # TRL's SFT on 2 processes stays in the default tier: tests/test_recipe_sft.py (full and LoRA)
@pytest.mark.timeout(900)
def test_trl_sft_trainer(tmp_path, tiny_llama_dir):
    """DeMoSFTTrainer trains with local gradients and resumes exactly; plain SFTTrainer with
    optimizers=(DeMo, None) stops loudly."""
    script = ROOT / "tests" / "scripts" / "train_sft.py"
    sft = (
        "--max_steps 4 --per_device_train_batch_size 4 --max_length 32 --logging_steps 2 --report_to none "
        "--use_cpu true --save_strategy no --disable_tqdm true --learning_rate 1e-3 --eos_token [SEP]"
    ).split()
    sft += ["--model_dir", tiny_llama_dir]
    demo = ["--trainer", "demo", "--optim", "demo"]
    save = ["--save_strategy", "steps", "--save_steps", "2"]
    accelerate_launch(script, *demo, "--record_dir", tmp_path / "demo", "--output_dir", tmp_path / "o1", *sft, *save)
    r0, r1 = load_records(tmp_path / "demo", 2)
    assert r0["optimizer"] == "DeMo" and r0["global_step"] == 4
    assert r0["params"] == r1["params"] and r0["first_grad"] != r1["first_grad"]
    assert any("demo/total_bytes_sent" in row for row in r0["log_history"])
    # resume from step 2 on both ranks (each loads its own optimizer state): bitwise the uninterrupted run
    resume = ["--resume_from_checkpoint", tmp_path / "o1" / "checkpoint-2"]
    accelerate_launch(
        script, *demo, "--record_dir", tmp_path / "resumed", "--output_dir", tmp_path / "o3", *sft, *resume
    )
    q0, q1 = load_records(tmp_path / "resumed", 2)
    assert q0["params"] == q1["params"] == r0["params"] and q0["global_step"] == 4
    proc = accelerate_launch(script, "--trainer", "plain", "--output_dir", tmp_path / "o2", *sft, check=False)
    assert proc.returncode != 0
    assert proc.stdout.count("DeMoSetupError: DeMo's parameters are inside a DistributedDataParallel model") == 2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trl_sft_trainer_with_the_many_nodes_preset(tmp_path, tiny_llama_dir):
    """DeMoSFTTrainer with ``--demo_preset many_nodes``: the preset reaches the optimizer, replicas stay identical."""
    script = ROOT / "tests" / "scripts" / "train_sft.py"
    sft = (
        "--max_steps 4 --per_device_train_batch_size 4 --max_length 32 --logging_steps 2 --report_to none "
        "--use_cpu true --save_strategy no --disable_tqdm true --learning_rate 1e-3 --eos_token [SEP]"
    ).split()
    demo = ["--trainer", "demo", "--optim", "demo", "--demo_preset", "many_nodes", "--model_dir", tiny_llama_dir]
    accelerate_launch(script, *demo, "--record_dir", tmp_path / "rec", "--output_dir", tmp_path / "o", *sft)
    r0, r1 = load_records(tmp_path / "rec", 2)
    assert r0["settings"].exchange == "all_reduce" and r0["settings"].compression_topk == 128
    assert r0["params"] == r1["params"] and r0["first_grad"] != r1["first_grad"] and r0["global_step"] == 4


def _torchrun_script(script, *args, restarts=0, env_extra=None, timeout=600):
    """``torchrun --nproc_per_node 2`` (c10d rendezvous on a free port) of ``script``: (returncode, output)."""
    launcher = (
        f"--nproc_per_node 2 --max-restarts {restarts} --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{free_port()}"
    ).split()
    cmd = [str(Path(sys.executable).parent / "torchrun"), *launcher, str(script), *map(str, args)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        **(env_extra or {}),
    }
    env.pop("ACCELERATE_USE_CPU", None)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:  # torchrun's workers outlive torchrun: end the whole session
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out


def _torchrun(tmp, name, *extra, **kwargs):
    rec = ["--output_dir", tmp / name / "out", "--record_dir", tmp / name / "rec"]
    return _torchrun_script(SCRIPT, *rec, *COMMON, *extra, **kwargs)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torchrun")
    rc, out = _torchrun(tmp, "straight")
    assert rc == 0, out[-4000:]
    return load_records(tmp / "straight" / "rec", 2)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("store", ["shared", "per_attempt"])
def test_torchrun_recovers_a_killed_rank_bitwise(tmp_path, uninterrupted, store):
    """Rank 1 dies after the step-10 checkpoint; torchrun restarts both ranks, they resume from the last complete
    checkpoint, and the result is bitwise the uninterrupted run's (issue 9, item 9).

    shared: torchrun's default, the agent's store outlives the workers; hf_demo.hf.launch_env initialises the restarted
    group on a per-attempt prefix (without it, restarts read dead workers' gloo addresses: "connectFullMesh
    failed ... Connection refused"). per_attempt: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, the launcher setting that
    works for any script: worker rank 0 hosts a fresh store each attempt.
    """
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if store == "per_attempt" else {}
    kill = ["--kill_rank", "1", "--kill_at_step", "10", "--resume_last", "true"]
    rc, out = _torchrun(tmp_path, "killed", *kill, restarts=1, env_extra=env)
    assert rc == 0, out[-4000:]
    assert "killing myself after the step-10 checkpoint" in out
    assert out.count("resuming from " + str(tmp_path / "killed" / "out" / "checkpoint-10")) == 2
    recovered = load_records(tmp_path / "killed" / "rec", 2)
    assert recovered[0]["global_step"] == 20
    assert recovered[0]["params"] == recovered[1]["params"] == uninterrupted[0]["params"]
