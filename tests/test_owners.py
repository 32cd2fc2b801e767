"""Which rank of a shard group orthogonalises which whole matrix (hf_demo.topology.owners): balanced, the same on
every call, and the bytes the planner sizes from it."""

from __future__ import annotations

import math

from hf_demo.topology import owners
from hf_demo.topology.dtensor import shard_rows

LLAMA_LAYER = [(640, 640)] * 4 + [(1792, 640), (1792, 640), (640, 1792)]  # q k v o, gate up down


def test_newton_schulz_cost_is_the_small_side_squared_times_the_large():
    assert owners.ns_cost((640, 1792)) == owners.ns_cost((1792, 640)) == 640 * 640 * 1792
    assert owners.ns_cost((8, 3, 3)) == 8 * 9 * 8  # a conv kernel: first dimension x the others


def test_owners_balance_the_newton_schulz_work_within_the_largest_matrix():
    """Greedy largest-first: no rank's work exceeds another's by more than one matrix's cost, on a model of many
    layers and on mixed shapes, for every shard group size."""
    models = {
        "llama_4_layers": LLAMA_LAYER * 4,
        "mixed": [(20, 13), (5, 20), (1, 5), (4096, 4096), (11008, 4096), (3, 3, 3, 3), (7, 1), (1, 1)],
    }
    for shapes in models.values():
        for shards in (1, 2, 3, 4, 8):
            load = owners.loads(shapes, shards)
            assert sum(load) == sum(owners.ns_cost(s) for s in shapes)
            assert max(load) - min(load) <= max(owners.ns_cost(s) for s in shapes), (shards, load)
    # 4 identical layers over 2 ranks split evenly; 28 matrices over 4 ranks within 15% of the ideal
    assert len(set(owners.loads(LLAMA_LAYER * 4, 2))) == 1
    load = owners.loads(LLAMA_LAYER * 4, 4)
    assert max(load) <= 1.15 * sum(load) / 4


def test_owners_are_the_same_on_every_call_and_name_a_rank_of_the_group():
    shapes = LLAMA_LAYER * 3 + [(5, 20), (1, 5)]
    first = owners.owners(shapes, 4)
    assert first == owners.owners(list(shapes), 4) and all(0 <= r < 4 for r in first)
    assert owners.owners(shapes, 1) == [0] * len(shapes)
    assert owners.owners([(2, 2)] * 3, 8) == [0, 1, 2]  # more ranks than matrices: one each, the rest none


def test_owner_bytes_are_the_rows_each_rank_holds_of_the_matrices_others_own():
    shapes = [(20, 13), (5, 20), (1, 5)]  # owners 0, 1, 1 over 2 ranks: rows 10/10, 3/2, 1/0
    assert owners.owners(shapes, 2) == [0, 1, 1]
    sent = (10 * 13 + 3 * 20 + 1 * 5) * 4  # rank 1's rows of matrix 0, rank 0's of matrices 1 and 2
    assert owners.owner_bytes(shapes, 2) == sent / 2
    everywhere = sum(shard_rows(s[0], 2)[0] * math.prod(s[1:]) * 4 for s in shapes)  # each rank's padded rows
    assert 2 * owners.owner_bytes(shapes, 2) <= everywhere * 1.01  # 2 ranks: no more bytes than the all-gather's
