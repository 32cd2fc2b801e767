"""Launch scripts for real with `accelerate launch --config_file accelerate_configs/cpu_multiprocess.yaml`."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from dist_utils import free_port

ROOT = Path(__file__).resolve().parent.parent
CPU_CONFIG = ROOT / "accelerate_configs" / "cpu_multiprocess.yaml"
LAUNCH_ALLOWED = "HF_DEMO_TEST_MAY_LAUNCH"  # "0" inside a test not marked launch (set by conftest.py)


def accelerate_launch(script, *args, num_processes=2, timeout=300, check=True, cpu_switch=True):
    """Run ``script`` on ``num_processes`` CPU processes; returns the CompletedProcess (output in .stdout).

    ``cpu_switch=False`` launches as a user who forgot ``ACCELERATE_USE_CPU=1`` would.
    """
    if os.environ.get(LAUNCH_ALLOWED) == "0":
        raise AssertionError("this test starts processes: mark it @pytest.mark.launch (see tests/conftest.py)")
    accelerate = Path(sys.executable).parent / "accelerate"
    cmd = [
        str(accelerate),
        "launch",
        "--config_file",
        str(CPU_CONFIG),
        "--num_processes",
        str(num_processes),
        "--main_process_port",
        str(free_port()),
        str(script),
        *map(str, args),
    ]
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    if not cpu_switch:
        env.pop("ACCELERATE_USE_CPU")
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}")
    return proc


def load_records(folder, world):
    records = [torch.load(Path(folder) / f"rank{r}.pt", weights_only=False) for r in range(world)]
    assert all(r["world_size"] == world for r in records), "did not get the world size asked for"
    return records
