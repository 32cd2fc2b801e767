"""The benchmark scripts still run end to end (a tiny model, two steps): their figures come from long runs,
but a refactor must not leave them broken."""

import json
import sys

import pytest

from launch_utils import ROOT

pytestmark = pytest.mark.ranks


def test_convergence_benchmark_runs_every_method_on_a_tiny_model(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import convergence

    tiny = "--hidden 32 --intermediate 64 --layers 1 --heads 2 --seq-len 32 --batch-size 2 --eval-batches 1".split()
    convergence.main(
        ["--tag", "smoke", "--results-dir", str(tmp_path), "--steps", "3", "--eval-every", "3", "--warmup", "1",
         "--methods", "adamw", "powersgd", "demo", "--demo-configs", "update_rule=sign;update_rule=adam",
         "--topk", "4", "--chunk", "8", *tiny]
    )  # fmt: skip
    runs = json.loads((tmp_path / "convergence_smoke.json").read_text())
    assert len(runs) == 4 and all(r["ok"] for r in runs), [r.get("error") for r in runs]
    assert (tmp_path / "convergence_smoke.md").exists()
