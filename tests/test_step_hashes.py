"""Nothing a user can see changed with the step's code: parameter and momentum hashes after 30 steps, for every
mode x value format x 1/2/4 ranks, equal the ones recorded before the step became a pipeline of parts
(tests/data/step_hashes*.json, written by scripts/step_hashes.py, one file per CPU kind: AVX512 and AVX2).
Bitwise results depend on the CPU's kernels, so each CPU compares with the record made on its own kind."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import step_hashes  # noqa: E402

RECORDS = [json.loads(path.read_text()) for path in sorted((ROOT / "tests" / "data").glob("step_hashes*.json"))]
KERNELS = (torch.backends.cpu.get_cpu_capability(), torch.__version__)
MATCHING = [r for r in RECORDS if (r["cpu"], r["torch"]) == KERNELS]
RECORDED = MATCHING[0] if MATCHING else RECORDS[0]
SAME_KERNELS = bool(MATCHING)
pytestmark = [
    pytest.mark.ranks,
    pytest.mark.skipif(
        not SAME_KERNELS,
        reason=f"recorded on {', '.join(r['cpu'] + ' CPUs with torch ' + r['torch'] for r in RECORDS)}: bitwise "
        "results differ elsewhere",
    ),
]
CASES = {name: (kw, world) for name, kw, world in step_hashes.cases()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_rank_ends_with_the_recorded_hashes(name):
    kw, world = CASES[name]
    assert step_hashes.run_case(kw, world) == RECORDED["cases"][name]


def test_every_recorded_case_is_still_run():
    assert set(CASES) == set(RECORDED["cases"])
