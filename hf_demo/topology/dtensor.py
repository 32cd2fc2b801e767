"""Where DeMo meets ``DTensor``: what a rank computes on (its local shard) and how FSDP2 cuts a dimension.

Every other part of DeMo computes on plain tensors; these are the only functions that look inside a DTensor
(the sharded topology, :mod:`hf_demo.topology.sharded`, and the checkpoints of sharded states build them). It
imports nothing of hf-demo, so any part may use it without an import cycle.
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
