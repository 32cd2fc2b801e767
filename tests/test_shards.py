"""How the benchmarks' corpus is split between ranks (``benchlib.toy``, ``convergence.py --shards``): every mode
gives each rank a disjoint part of the training bytes and leaves the held-out bytes alone; ``by_directory`` gives
each package to one rank, ``interleaved`` mixes them, and the default ``contiguous`` is what it always was."""

import pytest
import torch

from benchlib import toy

# a synthetic corpus: 3 packages of 4 files and 6 top-level modules, file sizes 10..
FILES = [(f"pkg{p}", 10 + 3 * p + f) for p in range(3) for f in range(4)] + [(f"mod{m}.py", 40 + m) for m in range(6)]


def _spans(files=FILES):
    spans, offset = [], 0
    for pkg, size in files:
        spans.append((pkg, offset, offset + size))
        offset += size
    return spans


def _covered(ranges):
    return sorted(i for s, e in ranges for i in range(s, e))


@pytest.mark.parametrize("shards", toy.SHARDS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_mode_gives_each_rank_disjoint_bytes_below_the_held_out_cut(shards, world):
    spans = _spans()
    cut = spans[-1][2] - 30  # the cut falls inside the last file
    parts = [toy.shard_ranges(shards, r, world, cut, spans) for r in range(world)]
    every = [i for p in parts for i in _covered(p)]
    assert len(every) == len(set(every))  # no byte read by two ranks
    assert max(every) < cut
    assert all(parts)  # no rank without data
    if shards != "contiguous":  # whole files: together exactly the training bytes
        assert sorted(every) == list(range(cut))


def _packages_of(ranges, spans):
    starts = {s for s, _ in ranges}
    return {pkg for pkg, s, _ in spans if s in starts}


def test_by_directory_gives_each_package_to_one_rank_and_interleaved_mixes_them():
    spans = _spans()
    cut = spans[-1][2]
    by_dir = [_packages_of(toy.shard_ranges("by_directory", r, 3, cut, spans), spans) for r in range(3)]
    for a in range(3):
        for b in range(a + 1, 3):
            assert not by_dir[a] & by_dir[b], (a, b, by_dir)
    assert set().union(*by_dir) == {pkg for pkg, _, _ in spans}
    # the three packages, the largest units, go to three different ranks
    assert [sum(p.startswith("pkg") for p in pkgs) for pkgs in by_dir] == [1, 1, 1]
    mixed = [_packages_of(toy.shard_ranges("interleaved", r, 3, cut, spans), spans) for r in range(3)]
    assert all({"pkg0", "pkg1", "pkg2"} <= pkgs for pkgs in mixed)  # every rank reads every package


def test_the_standard_library_split_by_directory_shares_no_package_between_ranks():
    spans = toy.stdlib_spans()
    cut = int(spans[-1][2] * 0.98)
    seen = {}
    for r in range(8):
        for pkg in _packages_of(toy.shard_ranges("by_directory", r, 8, cut, spans), spans):
            assert seen.setdefault(pkg, r) == r, f"{pkg} on ranks {seen[pkg]} and {r}"
    assert {"encodings", "asyncio", "email"} <= set(seen)


def test_contiguous_is_the_default_and_reads_what_it_always_read():
    corpus = torch.arange(1000, dtype=torch.int64) % 251
    for rank in range(4):
        new = toy.Data(corpus, rank, 4, 16, 3, seed=7, heldout=0.02, eval_batches=2)
        shard = 980 // 4  # the training bytes (98%) in 4
        assert torch.equal(new.train, corpus[rank * shard : (rank + 1) * shard])
        gen = torch.Generator().manual_seed(7 * 1000003 + rank)  # the old code's windows, drawn alike
        starts = torch.randint(0, shard - 16, (3,), generator=gen)
        old = torch.stack([corpus[rank * shard + s : rank * shard + s + 16] for s in starts.tolist()])
        assert torch.equal(new.next_batch(), old)


def test_the_held_out_windows_are_the_same_whatever_the_shards():
    corpus = torch.arange(1000, dtype=torch.int64) % 251
    spans = _spans([("a", 300), ("b", 200), ("c.py", 500)])
    evals = [torch.cat(toy.Data(corpus, 1, 2, 16, 3, 0, 0.02, 2, mode, spans).eval) for mode in toy.SHARDS]
    assert all(torch.equal(e, evals[0]) for e in evals)
    assert torch.equal(evals[0][0], corpus[980:996])


def test_a_file_mode_with_other_files_or_an_unknown_mode_is_refused():
    corpus = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not the same files"):
        toy.Data(corpus, 0, 2, 8, 2, 0, 0.02, 1, "by_directory", _spans())
    with pytest.raises(ValueError, match="expected one of"):
        toy.shard_ranges("random", 0, 2, 90, _spans())
