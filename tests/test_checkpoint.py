"""Checkpoint manifests (in-process): complete, incomplete, corrupted, other world size, last complete one."""

import json
import os
from pathlib import Path

import pytest

from hf_demo.hf import checkpoint as ckpt


def _fake_checkpoint(folder, world=2, step=10, manifest=True):
    os.makedirs(folder)
    for name, size in [
        ("model.safetensors", 4000),
        ("optimizer.pt", 3000),
        ("optimizer.rank1.pt", 3000),
        ("rng_state_0.pth", 100),
        ("rng_state_1.pth", 100),
        ("trainer_state.json", 50),
    ]:
        with open(os.path.join(folder, name), "wb") as f:
            f.write(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    if manifest:
        ckpt.write_manifest(str(folder), world, step)
    return str(folder)


def test_manifest_lists_every_file_with_a_checksum(tmp_path):
    folder = _fake_checkpoint(tmp_path / "checkpoint-10")
    manifest = json.loads((tmp_path / "checkpoint-10" / ckpt.MANIFEST).read_text())
    assert manifest["world_size"] == 2 and manifest["global_step"] == 10
    assert set(manifest["files"]) == {
        "model.safetensors",
        "optimizer.pt",
        "optimizer.rank1.pt",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "trainer_state.json",
    }
    assert all(len(m["sha256"]) == 64 for m in manifest["files"].values())
    assert ckpt.verify_checkpoint(folder, 2) == manifest


def test_missing_rank_file_is_named(tmp_path):
    folder = _fake_checkpoint(tmp_path / "checkpoint-10")
    os.remove(os.path.join(folder, "optimizer.rank1.pt"))
    with pytest.raises(ckpt.CheckpointError, match=r"cannot be trusted: optimizer.rank1.pt is missing"):
        ckpt.verify_checkpoint(folder, 2)


def test_flipped_bytes_are_caught(tmp_path):
    folder = _fake_checkpoint(tmp_path / "checkpoint-10")
    path = os.path.join(folder, "optimizer.pt")
    data = bytearray(Path(path).read_bytes())
    for i in range(50):
        data[1000 + 7 * i] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"optimizer.pt is corrupted \(its SHA-256 differs"):
        ckpt.verify_checkpoint(folder, 2)


def test_other_world_size_and_missing_manifest(tmp_path):
    folder = _fake_checkpoint(tmp_path / "checkpoint-10")
    with pytest.raises(ckpt.CheckpointError, match="saved with 2 process\\(es\\) but this run has 1"):
        ckpt.verify_checkpoint(folder, 1)
    ckpt.verify_checkpoint(folder)  # world size not checked (e.g. AdamW under DeMoTrainer)
    bare = _fake_checkpoint(tmp_path / "checkpoint-20", manifest=False)
    with pytest.raises(ckpt.CheckpointError, match="is incomplete: it has no hf_demo_manifest.json"):
        ckpt.verify_checkpoint(bare, 2)


def test_last_complete_checkpoint_skips_unfinished_saves(tmp_path):
    assert ckpt.last_complete_checkpoint(str(tmp_path / "nothing")) is None
    _fake_checkpoint(tmp_path / "checkpoint-5")
    _fake_checkpoint(tmp_path / "checkpoint-10")
    _fake_checkpoint(tmp_path / "checkpoint-15", manifest=False)  # the run died while saving this one
    os.makedirs(tmp_path / "checkpoint-x")
    with pytest.warns(UserWarning, match="skipping incomplete checkpoint\\(s\\) checkpoint-15"):
        assert ckpt.last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")
    assert [os.path.basename(c) for c in ckpt.checkpoints(str(tmp_path))] == [
        "checkpoint-5",
        "checkpoint-10",
        "checkpoint-15",
    ]
