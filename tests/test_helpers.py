"""The helpers the tests and the benchmarks share: the gloo launcher (benchlib.ranks) in both start methods, the
stdlib corpus, and the guard that keeps forked ranks out of unmarked tests."""

import sysconfig
from pathlib import Path

import pytest
import torch.distributed as dist

from dist_utils import RANKS_ALLOWED, RankError, run_ranks
from hf_demo.stdlib_corpus import stdlib_bytes, stdlib_files


def _where(rank, world, fail_on):
    if rank == fail_on:
        raise ValueError(f"rank {rank} fails on purpose")
    return rank, world, dist.get_world_size()


def test_spawned_ranks_report_results_and_errors(gloo):  # the benchmarks' way: fresh interpreters
    ok, failed = gloo(_where, 2, 1, start_method="spawn")
    assert ok == (0, 2, 2)
    assert isinstance(failed, RankError) and failed.type == "ValueError" and "on purpose" in failed.message


def test_stdlib_corpus_is_the_library_without_tests():
    files = stdlib_files()
    assert len(files) > 500 and files == sorted(files)
    root = Path(sysconfig.get_paths()["stdlib"])
    assert not any({"site-packages", "test", "tests"} & set(f.relative_to(root).parts) for f in files)
    data = stdlib_bytes()
    assert data.numel() == sum(f.stat().st_size + 1 for f in files) > 5_000_000


def test_forking_ranks_needs_the_ranks_marker(monkeypatch):
    """A test that forks gloo ranks without the marker would grow the fast tier unseen: run_ranks refuses."""
    monkeypatch.setenv(RANKS_ALLOWED, "0")  # what conftest.py sets for a test without the marker
    with pytest.raises(AssertionError, match="take the gloo fixture or mark it ranks"):
        run_ranks(_where, 2, 1)


def test_one_powersgd_byte_model_for_the_benchmarks_and_compare_py():
    """The benchmarks and recipes/compare.py count PowerSGD's bytes by the same rule (each tree self-contained)."""
    import importlib

    from benchlib.baselines import powersgd_bytes
    from launch_utils import ROOT

    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT / "recipes"))
        recipes = importlib.import_module("recipelib.baselines")
    shapes = [(49152, 576), (576,), (1536, 576), (576, 1536), (8, 4, 3, 3), (3, 2), ()]
    for rank in (1, 4, 32):
        assert powersgd_bytes(shapes, rank) == recipes.powersgd_bytes_per_step(shapes, rank)
    assert powersgd_bytes([(1000, 1000)], 4) == 4 * 2000 * 4 and powersgd_bytes([(3, 2)], 4) == 4 * 6


def test_the_commit_sync_patch_hands_the_changed_arguments_to_the_function_it_wraps(monkeypatch):
    """benchlib.patches.wrap_commit_sync, the benchmarks' prototypes' one way to change a synchronisation (outer
    momentum, inner mix, orthogonal outer step): what the transform returns is what the wrapped function gets;
    two patches stack, the later one first."""
    import torch

    from benchlib import patches
    from hf_demo.optim import local_steps

    seen = []
    monkeypatch.setattr(local_steps, "commit_sync", lambda *args: seen.append(args))  # restored after the test
    param, state, update = torch.zeros(2, 2), {}, torch.full((2, 2), 2.0)
    patches.wrap_commit_sync(lambda p, s, u, lr, m, r: (p, s, u * 3, lr, m, r))
    local_steps.commit_sync(param, state, update, 0.5, None, {})
    (args,) = seen
    assert args[0] is param and args[1] is state and torch.equal(args[2], update * 3) and args[3:] == (0.5, None, {})
    patches.wrap_commit_sync(lambda p, s, u, lr, m, r: (p, s, u + 1, lr * 2, m, r))
    local_steps.commit_sync(param, state, update, 0.5, None, {})
    assert torch.equal(seen[1][2], (update + 1) * 3) and seen[1][3] == 1.0
