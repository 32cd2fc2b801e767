"""Where DeMo meets ``DTensor``: what a rank computes on (its local shard) and how FSDP2 cuts a dimension.

Every other part of DeMo computes on plain tensors; these are the only functions that look inside a DTensor or
build one (the sharded topology, :mod:`hf_demo.topology.sharded`, and the checkpoints of sharded states,
:mod:`hf_demo.optim.sharded_checkpoint`, go through them; ``tests/test_structure.py`` keeps it so). It imports
nothing of hf-demo, so any part may use it without an import cycle.
"""

from __future__ import annotations

import torch


def is_sharded(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor this rank computes on: a DTensor's local shard (a view: writes reach the parameter), else itself."""
    return t.to_local() if t is not None and is_sharded(t) else t


def local_shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(local(p).shape)


def shard_rows(rows: int, shards: int) -> list[int]:
    """The rows each shard holds of a dimension of ``rows`` cut by FSDP2's ``Shard(0)``: torch.chunk's pieces, then
    empty shards (5 rows over 4 shards: 2, 2, 1, 0)."""
    size = -(-rows // shards)
    return [max(0, min(size, rows - r * size)) for r in range(shards)]


def mesh_of(p):
    """The device mesh a DTensor is placed on."""
    return p.device_mesh


def placements_of(p) -> tuple:
    """A DTensor's placements, one per dimension of its mesh."""
    return tuple(p.placements)


def is_shard(placement) -> bool:
    """Whether ``placement`` cuts a dimension (``Shard``), as FSDP2 places its parameters."""
    from torch.distributed.tensor import Shard

    return isinstance(placement, Shard)


def shard_shapes(p, shards: int) -> list[tuple[int, ...]]:
    """The local shape of the DTensor ``p`` on each rank of its shard group (FSDP2 cuts the sharded dimension as
    torch.chunk)."""
    dim = p.placements[0].dim
    return [(*p.shape[:dim], rows, *p.shape[dim + 1 :]) for rows in shard_rows(p.shape[dim], shards)]


def placed_like(p, value: torch.Tensor):
    """``value`` (this rank's piece, shaped like ``p``'s local shard) as a DTensor placed like the DTensor ``p``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def pieces_over(mesh, piece: torch.Tensor):
    """A 1-D DTensor over the 1-D ``mesh`` whose rank ``r`` holds ``piece`` (flat, the same length on every rank)."""
    from torch.distributed.tensor import DTensor, Shard

    width = piece.numel()
    return DTensor.from_local(piece, mesh, [Shard(0)], run_check=False, shape=(mesh.size() * width,), stride=(1,))
