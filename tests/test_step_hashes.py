"""Nothing a user can see changed with the step's code: parameter and momentum hashes after 30 steps, for every
mode x value format x 1/2/4 ranks, equal the ones recorded before the step became a pipeline of parts
(tests/data/step_hashes*.json, written by scripts/step_hashes.py, one file per kind of CPU). Bitwise results depend
on the CPU's kernels, its vector width and its maker alike (AMD's and Intel's AVX512 CPUs give other bits), so each
CPU compares with the record made on its own kind; a record without a maker was made on an AVX512 CPU not AMD's."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import step_hashes  # noqa: E402


def _kind(record: dict) -> str:
    return f"{record.get('vendor', 'non-AMD')} {record['cpu']}"


RECORDS = [json.loads(path.read_text()) for path in sorted((ROOT / "tests" / "data").glob("step_hashes*.json"))]
MATCHING = [r for r in RECORDS if step_hashes.made_here(r)]
RECORDED = MATCHING[0] if MATCHING else RECORDS[0]
SAME_KERNELS = bool(MATCHING)
pytestmark = [
    pytest.mark.ranks,
    pytest.mark.skipif(
        not SAME_KERNELS,
        reason=f"recorded on {', '.join(_kind(r) + ' CPUs with torch ' + r['torch'] for r in RECORDS)}, this is "
        f"{step_hashes.cpu_vendor()} {torch.backends.cpu.get_cpu_capability()}: bitwise results differ elsewhere "
        "(record this kind with scripts/step_hashes.py)",
    ),
]
CASES = {name: (kw, world) for name, kw, world in step_hashes.cases()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_rank_ends_with_the_recorded_hashes(name):
    kw, world = CASES[name]
    assert step_hashes.run_case(kw, world) == RECORDED["cases"][name]


def test_every_recorded_case_is_still_run():
    assert set(CASES) == set(RECORDED["cases"])
