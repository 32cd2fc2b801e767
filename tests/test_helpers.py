"""The helpers the tests and the benchmarks share: the gloo launcher in both start methods, the stdlib corpus."""

import sysconfig
from pathlib import Path

import torch.distributed as dist

from dist_utils import RankError, run_ranks
from models import stdlib_bytes, stdlib_files


def _where(rank, world, fail_on):
    if rank == fail_on:
        raise ValueError(f"rank {rank} fails on purpose")
    return rank, world, dist.get_world_size()


def test_spawned_ranks_report_results_and_errors():  # the benchmarks' way: fresh interpreters
    ok, failed = run_ranks(_where, 2, 1, start_method="spawn")
    assert ok == (0, 2, 2)
    assert isinstance(failed, RankError) and failed.type == "ValueError" and "on purpose" in failed.message


def test_stdlib_corpus_is_the_library_without_tests():
    files = stdlib_files()
    assert len(files) > 500 and files == sorted(files)
    root = Path(sysconfig.get_paths()["stdlib"])
    assert not any({"site-packages", "test", "tests"} & set(f.relative_to(root).parts) for f in files)
    data = stdlib_bytes()
    assert data.numel() == sum(f.stat().st_size + 1 for f in files) > 5_000_000
