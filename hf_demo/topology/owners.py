"""Which rank of a shard group orthogonalises which whole matrix (:class:`hf_demo.topology.sharded.ShardedMatrices`).

Newton-Schulz of an ``m x n`` matrix costs about ``m n min(m, n)`` multiply-adds per iteration (its Gram matrices
are the small side squared). :func:`owners` hands the matrices to the ranks greedily, largest first, each to the
rank with the least work so far (the lowest rank on a tie): every rank of every replica computes the same
assignment from the shapes alone, so the replicas stay identical. The planner (:mod:`hf_demo.ops.traffic`) sizes
the gather to the owners and the rows sent back from the same assignment (:func:`owner_bytes`). Pure arithmetic:
no torch, no hf-demo imports but :func:`~hf_demo.topology.dtensor.shard_rows`.
"""

from __future__ import annotations

import math

from hf_demo.topology.dtensor import shard_rows


def ns_cost(shape: tuple[int, ...]) -> int:
    """Newton-Schulz's work on a tensor of ``shape`` seen as (first dimension) x (the others): ``m n min(m, n)``."""
    rows, cols = shape[0], math.prod(shape[1:])
    return rows * cols * min(rows, cols)


def owners(shapes: list[tuple[int, ...]], shards: int) -> list[int]:
    """The rank (``0 .. shards-1``) that orthogonalises each matrix of ``shapes``: largest cost first (the earlier
    matrix on a tie), each to the least loaded rank so far (the lowest on a tie)."""
    if shards < 1:
        raise ValueError(f"a shard group has at least one rank; got shards={shards}")
    load = [0] * shards
    out = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_cost(shapes[i]), i)):
        rank = min(range(shards), key=lambda r: (load[r], r))
        out[i] = rank
        load[rank] += ns_cost(shapes[i])
    return out


def loads(shapes: list[tuple[int, ...]], shards: int) -> list[int]:
    """Each rank's Newton-Schulz work under :func:`owners`."""
    load = [0] * shards
    for shape, rank in zip(shapes, owners(shapes, shards)):
        load[rank] += ns_cost(shape)
    return load


def owner_bytes(shapes: list[tuple[int, ...]], shards: int, item_bytes: int = 4) -> float:
    """Bytes one rank sends, on average over the shard group, to bring every matrix to its owner (its rows of the
    matrices others own); the owners send the same back (each rank's rows of the result)."""
    total = 0
    for shape, rank in zip(shapes, owners(shapes, shards)):
        rows = shard_rows(shape[0], shards)
        total += (shape[0] - rows[rank]) * math.prod(shape[1:]) * item_bytes
    return total / shards
