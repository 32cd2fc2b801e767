"""A custom Accelerate loop as users write it (accelerate's ``by_feature/checkpointing.py`` shape), 2 processes:
what ``hf_demo.prepare`` returns is DeMo, ``demo/*`` metrics reach ``accelerator.log``, ``save_state`` keeps every
rank's DeMo state with a manifest, ``load_state`` resumes bit for bit and refuses a broken checkpoint with one
message on every rank (issue 44, items 1, 2 and 8)."""

import json
import os
import shutil

import pytest

from hf_demo.hf.checkpoint import MANIFEST
from launch_utils import ROOT, accelerate_launch, load_records

pytestmark = pytest.mark.launch

SCRIPT = ROOT / "tests" / "scripts" / "accelerate_checkpoint_loop.py"


@pytest.mark.timeout(900)
def test_save_state_load_state_resume_bitwise_and_metrics(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    accelerate_launch(SCRIPT, "--out", full)
    ckpt = full / "step_5"
    files = set(os.listdir(ckpt))
    assert {"optimizer.bin", "optimizer.rank1.bin", MANIFEST} <= files, files
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert manifest["world_size"] == 2 and manifest["global_step"] == 5
    assert {"optimizer.rank1.bin", "random_states_1.pkl", "model.safetensors"} <= set(manifest["files"])

    missing = tmp_path / "missing_rank1"  # a checkpoint with a file lost
    shutil.copytree(ckpt, missing)
    (missing / "optimizer.rank1.bin").unlink()
    partial = tmp_path / "partial"  # a save that did not finish (or one Accelerate wrote without hf_demo)
    shutil.copytree(ckpt, partial)
    (partial / MANIFEST).unlink()
    accelerate_launch(SCRIPT, "--out", resumed, "--resume", ckpt, "--broken", missing, partial)

    f0, f1 = load_records(full, 2)
    r0, r1 = load_records(resumed, 2)
    assert f0["params"] == f1["params"] == r0["params"] == r1["params"]  # bit for bit, replicas identical
    assert (f0["momentum"], f1["momentum"]) == (r0["momentum"], r1["momentum"])  # every rank's own state
    assert f0["momentum"] != f1["momentum"] and f0["grad0"] != f1["grad0"]  # local gradients (DeMo, not DDP's)
    assert f0["data_loss"][1] < f0["data_loss"][0]  # it learns (the whole data set's loss, on rank 0)
    assert f0["losses"][5:] == r0["losses"] and f1["losses"][5:] == r1["losses"] and f0["lr"] == r0["lr"]
    assert f0["averaged"] == f0["params"] and f0["counters"] == (0, 0, 0) and f0["bytes_sent"] > 0

    assert r0["errors"] == r1["errors"]  # one message, the same on every rank
    lost, incomplete = r0["errors"]
    assert lost.startswith("CheckpointError") and "optimizer.rank1.bin is missing" in lost
    assert incomplete.startswith("CheckpointError") and "is incomplete" in incomplete

    rows = json.loads((full / "logged.json").read_text())  # rank 0's tracker
    assert [row["step"] for row in rows] == list(range(10))
    assert all(row["demo/bytes_sent_per_step"] > 0 for row in rows)
    # (the final flush() reads the last step's verdict: three settling rows of a steady step's size more, the
    # verdicts, every rank's finding on them, and those findings passed on)
    settled = rows[-1]["demo/total_bytes_sent"] + 3 * rows[-1]["demo/bytes_sent_per_step"]
    assert settled == f0["bytes_sent"] and rows[-1]["demo/skipped_steps"] == 0
    assert not (resumed / "logged.json").exists() or json.loads((resumed / "logged.json").read_text())[0]["step"] == 5
