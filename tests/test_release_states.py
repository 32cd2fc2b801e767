"""Checkpoints written by the release before the staged step keep working: each state (saved after 6 steps by
that release, tests/data/release_states/make_states.py) loads into today's DeMo, and 3 more steps give what that
release's own 3 more steps gave, bit for bit on the CPU kernels they were recorded with (one process), to one
ulp elsewhere."""

import json
import sys
from pathlib import Path

import pytest
import torch

import hf_demo
from models import loss_and_backward, tiny_mlp

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
import step_hashes  # noqa: E402

STATES = Path(__file__).parent / "data" / "release_states"
# the states were recorded with the kernels tests/data/step_hashes.json names: bit for bit there; elsewhere the
# vectorised kernels (AVX2 against AVX512, AMD's against others) round a few values one ulp apart
SAME_KERNELS = step_hashes.made_here(json.loads((Path(__file__).parent / "data" / "step_hashes.json").read_text()))
DETERMINISTIC = ["default", "adam_fp32", "all_reduce", "overlap_in_flight", "sync_every_mid_phase"]


def _resumed(name):
    saved = torch.load(STATES / f"{name}.pt", weights_only=True)
    model = tiny_mlp(seed=7)
    model.load_state_dict(saved["model"])
    opt = hf_demo.DeMo(model.parameters(), **saved["kw"])
    opt.load_state_dict(saved["opt"])
    return saved, model, opt


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_a_state_of_the_last_release_resumes_bit_for_bit(name):
    saved, model, opt = _resumed(name)
    assert opt.steps == 6
    for step in range(6, 9):
        loss_and_backward(model, 0, step)
        opt.step()
    opt.flush()
    for a, b in zip(model.parameters(), saved["after"]):
        if SAME_KERNELS:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a.detach(), b, atol=1e-6, rtol=0)


def test_a_budget_tier_of_the_last_release_is_found_again():
    _, _, opt = _resumed("budget_tier")
    assert (
        opt.tier == 2
        and opt.tiers[2]
        == hf_demo.DeMo(
            [torch.nn.Parameter(torch.zeros(2))],
            **{k: v for k, v in torch.load(STATES / "budget_tier.pt", weights_only=True)["kw"].items()},
        ).tiers[2]
    )
