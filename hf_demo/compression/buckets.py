"""Buckets: a step's parameters grouped by block shape, so that the math runs once per bucket, not per tensor.

Parameters whose blocks have the same shape and the same top-k (``b0 x b1``, ``k``) share a bucket: their blocks
are rows of one ``(rows, b0*b1)`` tensor, and the transform, the momentum update, top-k, error feedback, the
payload's coding and the update rule each run once on it (batched matmuls, ``torch._foreach_*``). Inside a
bucket the parameters of one layout (the same shape) form a *run*: they are stacked in one op on the way in
and unbound in one op on the way out, so the number of ops of a step grows with the number of distinct
shapes, not with the number of tensors. A bucket holds at most :data:`MAX_BUCKET_ELEMENTS` coefficients
(a larger group is cut into several buckets, whole parameters each), which bounds the transient memory of
the batched math.

:func:`plan` gives the :class:`Bucketing` of a list of layouts (cached: the same object every step);
:class:`Bucketed` is a list of per-parameter tensors that are views of its buckets' rows, so a part that
works per bucket and one that works per parameter see the same numbers (an in-place write to either is seen
by both).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from hf_demo.compression.blocks import BlockLayout

MAX_BUCKET_ELEMENTS = 1 << 24  # 64 MiB of fp32 coefficients per bucket


@dataclass(frozen=True)
class Run:
    """Parameters of one layout inside a bucket, its rows ``start .. start + len(members) * nblocks``."""

    layout: BlockLayout
    members: tuple[int, ...]  # positions in the step's list of parameters
    start: int

    @property
    def rows(self) -> int:
        return len(self.members) * self.layout.nblocks


@dataclass(frozen=True)
class Bucket:
    """Rows of the same block shape and top-k: what one batched op works on. It has the ``bsize`` and ``k`` of
    a :class:`~hf_demo.compression.blocks.BlockLayout`, so the per-block functions take it as one."""

    b0: int
    b1: int
    k: int
    runs: tuple[Run, ...]

    @property
    def bsize(self) -> int:
        return self.b0 * self.b1

    @property
    def rows(self) -> int:
        return sum(run.rows for run in self.runs)

    @property
    def members(self) -> tuple[int, ...]:
        """The parameters of the bucket in the order of its rows."""
        return tuple(i for run in self.runs for i in run.members)

    @property
    def member_blocks(self) -> tuple[int, ...]:
        """Each member's number of rows (blocks), in the order of :attr:`members`."""
        return tuple(run.layout.nblocks for run in self.runs for _ in run.members)


@dataclass(frozen=True)
class Bucketing:
    """Every parameter's bucket: ``buckets``, and for parameter ``i`` ``where[i] = (bucket, first row)``."""

    layouts: tuple[BlockLayout, ...]
    buckets: tuple[Bucket, ...]
    where: tuple[tuple[int, int], ...]

    def with_k(self, k_of) -> Bucketing:
        """The same buckets with top-k ``k_of(k)`` (``exchange="all_reduce"``'s nominations: k // world)."""

        def run(r: Run) -> Run:
            return Run(_with_k(r.layout, k_of(r.layout.k)), r.members, r.start)

        buckets = tuple(Bucket(b.b0, b.b1, k_of(b.k), tuple(run(r) for r in b.runs)) for b in self.buckets)
        layouts = tuple(_with_k(layout, k_of(layout.k)) for layout in self.layouts)
        return Bucketing(layouts, buckets, self.where)


def _with_k(layout: BlockLayout, k: int) -> BlockLayout:
    return BlockLayout(layout.shape, layout.rows, layout.cols, layout.b0, layout.b1, k)


@lru_cache(maxsize=64)
def plan(layouts: tuple[BlockLayout, ...]) -> Bucketing:
    """The buckets of ``layouts`` (in order of first appearance; runs in order of first appearance inside a
    bucket, each run's members in parameter order)."""
    groups: dict[tuple[int, int, int], dict[BlockLayout, list[int]]] = {}
    for i, layout in enumerate(layouts):
        groups.setdefault((layout.b0, layout.b1, layout.k), {}).setdefault(layout, []).append(i)
    buckets, where = [], [None] * len(layouts)
    for (b0, b1, k), runs in groups.items():
        cap = max(1, MAX_BUCKET_ELEMENTS // (b0 * b1))
        current: list[list] = []  # [layout, members, first row] of each run of the bucket being filled
        rows = 0
        for layout, members in runs.items():
            for i in members:
                if rows and rows + layout.nblocks > cap:  # full: close the bucket, open the next one
                    buckets.append(_bucket(b0, b1, k, current))
                    current, rows = [], 0
                if not current or current[-1][0] != layout:
                    current.append([layout, [], rows])
                where[i] = (len(buckets), rows)
                current[-1][1].append(i)
                rows += layout.nblocks
        buckets.append(_bucket(b0, b1, k, current))
    return Bucketing(tuple(layouts), tuple(buckets), tuple(where))


def _bucket(b0: int, b1: int, k: int, runs: list[list]) -> Bucket:
    return Bucket(b0, b1, k, tuple(Run(layout, tuple(members), start) for layout, members, start in runs))


class Bucketed(list):
    """Per-parameter tensors (the list) that are row views of ``buckets`` (one tensor per bucket)."""

    def __init__(self, items, buckets: list[torch.Tensor], bucketing: Bucketing):
        super().__init__(items)
        self.buckets = buckets
        self.bucketing = bucketing

    @classmethod
    def of(cls, buckets: list[torch.Tensor], bucketing: Bucketing) -> Bucketed:
        """The per-parameter row views of ``buckets`` (one ``split`` per bucket)."""
        items: list = [None] * len(bucketing.layouts)
        for bucket, rows in zip(bucketing.buckets, buckets):
            for i, part in zip(bucket.members, rows.split(bucket.member_blocks)):
                items[i] = part
        return cls(items, buckets, bucketing)


def rows(tensors: list[torch.Tensor], bucketing: Bucketing) -> list[torch.Tensor]:
    """Per-parameter ``(nblocks, ...)`` tensors -> one tensor per bucket: the bucket's own tensors when
    ``tensors`` is :class:`Bucketed` over the same buckets, else a new one (``torch.cat``)."""
    if isinstance(tensors, Bucketed) and (tensors.bucketing is bucketing or tensors.bucketing == bucketing):
        return tensors.buckets
    return [torch.cat([tensors[i] for i in bucket.members]) for bucket in bucketing.buckets]


def stacked_blocks(tensors: list, run: Run) -> torch.Tensor:
    """The run's parameter-shaped tensors (None: zeros) -> ``(n, block_rows, block_cols, b0, b1)`` fp32,
    zero-padded: the blocks of every member, as :func:`hf_demo.compression.blocks.to_blocks` lays out one's."""
    layout = run.layout
    first = next((tensors[i] for i in run.members if tensors[i] is not None), None)
    if first is None:
        raise ValueError("stacked_blocks needs at least one tensor of the run")
    xs = [tensors[i] if tensors[i] is not None else torch.zeros_like(first) for i in run.members]
    m = torch.stack(xs).reshape(len(xs), layout.rows, layout.cols).float()
    pad_r = layout.block_rows * layout.b0 - layout.rows
    pad_c = layout.block_cols * layout.b1 - layout.cols
    if pad_r or pad_c:
        m = torch.nn.functional.pad(m, (0, pad_c, 0, pad_r))
    m = m.view(len(xs), layout.block_rows, layout.b0, layout.block_cols, layout.b1)
    return m.permute(0, 1, 3, 2, 4)


def unstacked(blocks: torch.Tensor, run: Run) -> list[torch.Tensor]:
    """A run's rows ``(rows, bsize)`` -> its members' parameter-shaped tensors (padding cropped), in member
    order: the inverse of :func:`stacked_blocks`, one ``unbind`` for the run."""
    layout, n = run.layout, len(run.members)
    m = blocks.reshape(n, layout.block_rows, layout.block_cols, layout.b0, layout.b1).permute(0, 1, 3, 2, 4)
    m = m.reshape(n, layout.block_rows * layout.b0, layout.block_cols * layout.b1)
    if layout.padded:
        m = m[:, : layout.rows, : layout.cols]
    return list(m.reshape(n, *layout.shape).unbind(0))


def run_rows(bucket_tensor: torch.Tensor, bucket: Bucket) -> list[torch.Tensor]:
    """A bucket's tensor split into its runs' rows (one op)."""
    if len(bucket.runs) == 1:
        return [bucket_tensor]
    return list(bucket_tensor.split([run.rows for run in bucket.runs]))


def write_back(tensors: list[torch.Tensor], bucket_tensors: list[torch.Tensor], bucketing: Bucketing) -> None:
    """After an in-place change of ``bucket_tensors`` made by :func:`rows`: the same change in ``tensors``
    (nothing to do when they are the buckets' own views)."""
    if isinstance(tensors, Bucketed) and tensors.bucketing == bucketing:
        return
    for i, part in enumerate(Bucketed.of(bucket_tensors, bucketing)):
        tensors[i].copy_(part)
