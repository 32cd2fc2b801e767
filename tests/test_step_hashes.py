"""Nothing a user can see changed with the step's code: parameter and momentum hashes after 30 steps, for every
mode x value format x 1/2/4 ranks, equal the ones recorded before the step became a pipeline of parts
(tests/data/step_hashes.json, written by scripts/step_hashes.py). Bitwise results depend on the CPU's kernels,
so the comparison runs on a CPU of the kind that recorded them."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import step_hashes  # noqa: E402

RECORDED = json.loads((ROOT / "tests" / "data" / "step_hashes.json").read_text())
SAME_KERNELS = RECORDED["cpu"] == torch.backends.cpu.get_cpu_capability() and RECORDED["torch"] == torch.__version__
pytestmark = [
    pytest.mark.ranks,
    pytest.mark.skipif(
        not SAME_KERNELS,
        reason=f"recorded on a {RECORDED['cpu']} CPU with torch {RECORDED['torch']}: bitwise results differ elsewhere",
    ),
]
CASES = {name: (kw, world) for name, kw, world in step_hashes.cases()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_rank_ends_with_the_recorded_hashes(name):
    kw, world = CASES[name]
    assert step_hashes.run_case(kw, world) == RECORDED["cases"][name]


def test_every_recorded_case_is_still_run():
    assert set(CASES) == set(RECORDED["cases"])
