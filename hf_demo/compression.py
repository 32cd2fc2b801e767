"""The per-parameter math of DeMo: how a parameter becomes blocks of transform coefficients, the buckets that
batch them, and the pure functions a gradient meets, in this order:

momentum (kept in the transform's domain) -> select top-k -> error feedback -> [pack, gather, unpack: codec and
exchange] -> mean over the ranks that selected each coefficient -> inverse transform -> the update rule's
direction (:mod:`hf_demo.optim.update_rules`) -> decoupled weight decay and the step.

The sections below: blocks (the layout of a parameter and the DCT), transforms (the ``transform`` setting),
buckets (the math once per block shape) and the functions of a step. The records (:class:`BlockLayout`,
:class:`Bucket`, :class:`Run`) are built once (``plan``/``plan_buckets`` are cached) and cache what they derive,
so a steady step re-derives nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, cached_property, lru_cache, partial

import torch
import torch.nn.functional as F

from hf_demo.errors import lookup

# ---- blocks --------------------------------------------------------------------------------------

# How a parameter becomes blocks of DCT coefficients, and back.
#
# Every tensor is seen as a 2-D matrix: a 0-d tensor as (1, 1), a 1-D tensor of length n as (1, n), an N-D
# tensor as (shape[0], prod(shape[1:])). Blocks are ``b0 x b1`` (:func:`block_side`): a dimension shorter
# than the chunk is one block (a tensor smaller than a block is sent whole: its block keeps
# ``min(topk, b0*b1)`` coefficients); a longer one is cut into blocks of the largest divisor in
# ``[chunk/2, chunk]`` (688 -> 16 blocks of 43, as the DeMo reference does), and only a dimension without
# such a divisor is zero-padded up to a multiple of the chunk (a 50257 vocabulary: 786 blocks of 64, not
# 29-long ones). Cutting 688 into 43s instead of padding to 704 sends 45% more coefficients at the same top-k,
# which is what the reference sends.
#
# Each block is transformed with the orthonormal DCT-II along both axes: ``C = D0 @ X @ D1.T``. Being
# orthonormal, the transform preserves energy and its inverse is the transpose.

MAX_BLOCK_SIZE = 65536  # positions inside a block must fit 16 bits (index_coding="uint16")


@dataclass(frozen=True)
class BlockLayout:
    """The blocking of one parameter: all a receiver needs to place coefficients."""

    shape: tuple[int, ...]
    rows: int
    cols: int
    b0: int
    b1: int
    k: int

    @cached_property
    def block_rows(self) -> int:
        return -(-self.rows // self.b0)

    @cached_property
    def block_cols(self) -> int:
        return -(-self.cols // self.b1)

    @cached_property
    def nblocks(self) -> int:
        return self.block_rows * self.block_cols

    @cached_property
    def bsize(self) -> int:
        return self.b0 * self.b1

    @cached_property
    def numel(self) -> int:
        return self.rows * self.cols

    @cached_property
    def padded(self) -> bool:
        return self.rows % self.b0 != 0 or self.cols % self.b1 != 0


@cache
def plan(shape: tuple[int, ...], chunk: int, topk: int) -> BlockLayout:
    """The block layout of a parameter of ``shape`` for the given chunk and top-k."""
    if len(shape) == 0:
        rows, cols = 1, 1
    elif len(shape) == 1:
        rows, cols = 1, shape[0]
    else:
        rows, cols = shape[0], math.prod(shape[1:])
    if rows * cols == 0:
        raise ValueError(f"cannot optimise an empty parameter of shape {tuple(shape)}")
    b0, b1 = block_side(rows, chunk), block_side(cols, chunk)
    return BlockLayout(tuple(shape), rows, cols, b0, b1, min(topk, b0 * b1))


def block_side(n: int, chunk: int) -> int:
    """A block's side along a dimension of ``n``: ``n`` when it fits in a chunk; else the largest divisor of
    ``n`` in ``[ceil(chunk/2), chunk]`` (the DeMo reference's blocking: no padding, e.g. 688 -> 43);
    else ``chunk``, the dimension zero-padded to a multiple of it (e.g. a 50257 vocabulary)."""
    if n <= chunk:
        return n
    for side in range(chunk, (chunk + 1) // 2 - 1, -1):
        if n % side == 0:
            return side
    return chunk


@cache
def _dct_matrix_cpu(n: int) -> torch.Tensor:
    # built on the CPU in float64 whatever the default device (a cached tensor must not land on a
    # torch.set_default_device device), then cast once and copied to each device that asks for it
    k = torch.arange(n, dtype=torch.float64, device="cpu")[:, None]
    i = torch.arange(n, dtype=torch.float64, device="cpu")[None, :]
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(torch.float32)


@cache
def _dct_matrix_on(n: int, device: torch.device) -> torch.Tensor:
    # the CPU's matrix copied to ``device`` once; a steady step's transforms find it here (a cache hit)
    return _dct_matrix_cpu(n).to(device)


def dct_matrix(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The n x n orthonormal DCT-II matrix D (rows are basis vectors): ``coeffs = D @ x``, fp32, on ``device``.

    Cached per (n, device): the same bits on every device (computed once on the CPU in float64, then copied),
    so a CUDA rank and a CPU rank transform with the same matrix. Everything DeMo transforms is fp32."""
    return _dct_matrix_on(n, torch.device(device))


def to_blocks(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """``x`` (any shape matching the layout) -> (block_rows, block_cols, b0, b1), zero-padded, fp32."""
    m = x.reshape(layout.rows, layout.cols).float()
    pad_r = layout.block_rows * layout.b0 - layout.rows
    pad_c = layout.block_cols * layout.b1 - layout.cols
    if pad_r or pad_c:
        m = F.pad(m, (0, pad_c, 0, pad_r))
    m = m.view(layout.block_rows, layout.b0, layout.block_cols, layout.b1)
    return m.permute(0, 2, 1, 3)


def from_blocks(blocks: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """(block_rows, block_cols, b0, b1) -> a tensor of the parameter's shape (padding cropped)."""
    m = blocks.permute(0, 2, 1, 3).reshape(layout.block_rows * layout.b0, layout.block_cols * layout.b1)
    return m[: layout.rows, : layout.cols].reshape(layout.shape)


def transform_blocks(blocks: torch.Tensor, into: tuple | None = None, inverse: bool = False) -> torch.Tensor:
    """Blocks (..., b0, b1) -> their DCT coefficients ``D0 @ X @ D1.T``, fp32 (any number of leading dims: one
    block, a parameter's, a bucket's); ``inverse``: coefficients -> blocks, ``D0.T @ C @ D1``
    (:func:`inverse_blocks`).

    ``into``: two contiguous fp32 buffers ``(a, b)`` of ``blocks``' shape (a :class:`Workspace`'s), ``blocks``
    contiguous and either one of them or apart from both: each product is written to the buffer it does not read
    (``out=``: the same kernels, the same bits, no new tensor), and the result is ``a``, ``b`` or ``blocks`` (no
    product: a 1 x 1 block)."""
    b0, b1 = blocks.shape[-2:]
    d0 = _dct_matrix_on(b0, blocks.device) if b0 > 1 else None
    d1 = _dct_matrix_on(b1, blocks.device) if b1 > 1 else None
    left = d0 if d0 is None or not inverse else d0.T
    right = d1 if d1 is None or inverse else d1.T
    for factor, on_left in ((left, True), (right, False)):
        if factor is not None:
            out = None if into is None else into[1] if blocks.data_ptr() == into[0].data_ptr() else into[0]
            blocks = torch.matmul(factor, blocks, out=out) if on_left else torch.matmul(blocks, factor, out=out)
    return blocks


# DCT coefficients (..., b0, b1) -> blocks, the inverse of transform_blocks (``into`` as there)
inverse_blocks = partial(transform_blocks, inverse=True)


def encode(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Parameter-shaped tensor -> DCT coefficients, shape (nblocks, bsize), fp32."""
    return transform_blocks(to_blocks(x, layout)).reshape(layout.nblocks, layout.bsize)


def decode(coeffs: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """DCT coefficients (nblocks, bsize) -> parameter-shaped fp32 tensor (the inverse of :func:`encode`)."""
    blocks = coeffs.reshape(layout.block_rows, layout.block_cols, layout.b0, layout.b1)
    return from_blocks(inverse_blocks(blocks), layout)


# ---- transforms ----------------------------------------------------------------------------------

# What a parameter's gradient becomes before top-k: the blockwise transform, chosen by the ``transform`` setting.
#
# A transform maps a parameter-shaped tensor to ``(nblocks, bsize)`` coefficients of its
# :class:`~hf_demo.compression.BlockLayout` and back (``encode``/``decode``), and blocks ``(..., b0, b1)``
# to coefficients of the same shape and back (``encode_blocks``/``decode_blocks``: a bucket's blocks at once);
# it must be linear (the momentum lives in its domain: ``T(decay*m + lr*g) == decay*T(m) + lr*T(g)``) and its
# inverse exact enough that error feedback subtracts what receivers decode. Add one by writing a class with
# ``name``, ``encode``, ``decode``, ``encode_blocks`` and ``decode_blocks`` and listing it in :data:`TRANSFORMS`;
# nothing else changes.
#
# - ``dct`` (default): the orthonormal DCT-II along both axes of every block (DeMo's: energy gathers in few
#   coefficients, so top-k keeps most of it).
# - ``identity``: the blocks as they are (top-k of the raw momentum: the ablation that shows what the DCT buys).


class DCT:
    name = "dct"

    encode_blocks = staticmethod(transform_blocks)  # blocks (..., b0, b1) -> coefficients of the same shape

    decode_blocks = staticmethod(inverse_blocks)

    encode = staticmethod(encode)

    decode = staticmethod(decode)


class Identity:
    name = "identity"

    @staticmethod
    def encode_blocks(x: torch.Tensor, into: tuple | None = None) -> torch.Tensor:
        return x

    @staticmethod
    def decode_blocks(coeffs: torch.Tensor, into: tuple | None = None) -> torch.Tensor:
        return coeffs

    @staticmethod
    def encode(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
        return to_blocks(x, layout).reshape(layout.nblocks, layout.bsize)

    @staticmethod
    def decode(coeffs: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
        return from_blocks(coeffs.reshape(layout.block_rows, layout.block_cols, layout.b0, layout.b1), layout)


TRANSFORMS = {t.name: t for t in (DCT, Identity)}
TRANSFORM_NAMES = tuple(TRANSFORMS)


def get_transform(name: str):
    """The transform called ``name`` (:data:`TRANSFORMS`)."""
    return lookup(TRANSFORMS, "transform", name)


# ---- buckets -------------------------------------------------------------------------------------

# Buckets: a step's parameters grouped by block shape, so that the math runs once per bucket, not per tensor.
#
# Parameters whose blocks have the same shape and the same top-k (``b0 x b1``, ``k``) share a bucket: their blocks
# are rows of one ``(rows, b0*b1)`` tensor, and the transform, the momentum update, top-k, error feedback, the
# payload's coding and the update rule each run once on it (batched matmuls, ``torch._foreach_*``). Inside a
# bucket the parameters of one layout (the same shape) form a *run*: they are stacked in one op on the way in
# and unbound in one op on the way out, so the number of ops of a step grows with the number of distinct
# shapes, not with the number of tensors. A bucket holds at most :data:`MAX_BUCKET_ELEMENTS` coefficients
# (a larger group is cut into several buckets, whole parameters each), which bounds the transient memory of
# the batched math.
#
# :func:`plan_buckets` gives the :class:`Bucketing` of a list of layouts (cached: the same object every step);
# :class:`Bucketed` is a list of per-parameter tensors that are views of its buckets' rows, so a part that
# works per bucket and one that works per parameter see the same numbers (an in-place write to either is seen
# by both).

MAX_BUCKET_ELEMENTS = 1 << 24  # 64 MiB of fp32 coefficients per bucket
ALIGNMENT = 128  # fp32 elements, 512 bytes (the CUDA caching allocator's; the CPU's 64 divides it): where a new tensor
# starts, and with it a GEMM's bits (the kernel chosen depends on where its operands start)


@dataclass(frozen=True)
class Run:
    """Parameters of one layout inside a bucket, its rows ``start .. start + len(members) * nblocks``."""

    layout: BlockLayout
    members: tuple[int, ...]  # positions in the step's list of parameters
    start: int

    @cached_property
    def rows(self) -> int:
        return len(self.members) * self.layout.nblocks


@dataclass(frozen=True)
class Bucket:
    """Rows of the same block shape and top-k: what one batched op works on. It has the ``bsize`` and ``k`` of
    a :class:`BlockLayout`, so the per-block functions take it as one."""

    b0: int
    b1: int
    k: int
    runs: tuple[Run, ...]

    @cached_property
    def bsize(self) -> int:
        return self.b0 * self.b1

    @cached_property
    def rows(self) -> int:
        return sum(run.rows for run in self.runs)

    @cached_property
    def members(self) -> tuple[int, ...]:
        """The parameters of the bucket in the order of its rows."""
        return tuple(i for run in self.runs for i in run.members)

    @cached_property
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
def plan_buckets(layouts: tuple[BlockLayout, ...]) -> Bucketing:
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

    buckets: list[torch.Tensor]
    bucketing: Bucketing

    @classmethod
    def of(cls, buckets: list[torch.Tensor], bucketing: Bucketing) -> Bucketed:
        """The per-parameter row views of ``buckets`` (one ``split`` per bucket)."""
        out = cls([None] * len(bucketing.layouts))
        for bucket, rows in zip(bucketing.buckets, buckets):
            for i, part in zip(bucket.members, rows.split(bucket.member_blocks)):
                out[i] = part
        out.buckets, out.bucketing = buckets, bucketing
        return out


def bucket_rows(tensors: list[torch.Tensor], bucketing: Bucketing) -> list[torch.Tensor]:
    """Per-parameter ``(nblocks, ...)`` tensors -> one tensor per bucket: the bucket's own tensors when
    ``tensors`` is :class:`Bucketed` over the same buckets, else a new one (``torch.cat``)."""
    if isinstance(tensors, Bucketed) and (tensors.bucketing is bucketing or tensors.bucketing == bucketing):
        return tensors.buckets
    return [torch.cat([tensors[i] for i in bucket.members]) for bucket in bucketing.buckets]


class Workspace:
    """The buffers a step's per-bucket math writes into (``out=``), kept from step to step; :func:`take` hands them out.

    Without them every step allocates a bucket's stacked blocks, its transform's products, the magnitudes that
    top-k ranks and the averaged coefficients afresh: up to :data:`MAX_BUCKET_ELEMENTS` fp32 each (a larger
    parameter alone: more), and on a CPU glibc's malloc maps every such block anew and page-faults it in,
    gigabytes a step. Each role is one buffer per device, of the largest size asked for:

    - ``"a"``, ``"b"`` (:data:`ROLES`, taken together as ``"pair"``): scratch, dead before the function that took it
      returns (the next bucket takes it again): each the size of the largest bucket (the largest of
      ``MAX_BUCKET_ELEMENTS`` and the largest parameter's padded blocks);
    - ``"dense"``: the step's own exchange's averaged coefficients, every bucket's (the exchange's ``finish``),
      read by the inverse transform in the same step: the size of every coefficient (the momenta's).

    Only a CPU's buffers are kept: on an accelerator :func:`take` hands out new tensors (the same code and kernels),
    as its caching allocator reuses the blocks already, and kept buffers would hold that memory through the forward
    and backward passes. Not state: never saved, made again (once) after a restart. One per optimizer (its
    :class:`~hf_demo.optim.state.RunState`): two optimizers never share one, and nothing reads a buffer after the
    step that wrote it, so an optimizer's steps may run in any thread."""

    ROLES = ("a", "b")  # a pair: stacked blocks and the products written in turn (transform_blocks' ``into``)

    def __init__(self):
        self.buffers: dict[tuple[str, torch.device], torch.Tensor] = {}


def take(workspace: Workspace | None, role: str, shapes: list[tuple[int, ...]], device: torch.device):
    """A contiguous fp32 tensor of each of ``shapes``, apart from each other, in ``workspace``'s ``role`` buffer on
    ``device`` (grown, made anew, where it is smaller), each starting :data:`ALIGNMENT`-aligned, as a new tensor
    does. Their content is whatever was written last: write before reading. Off the CPU: new tensors.
    ``role="pair"`` (``shapes`` one shape): the tuple ``(a, b)``, a tensor of that shape in each of the
    :data:`~Workspace.ROLES`' buffers (:func:`transform_blocks`' ``into``).

    Without a workspace (None): what the functions that write into them take for "a new tensor":
    ``[None] * len(shapes)`` (an ``out=`` each), and None for the pair. Every caller takes its buffers here."""
    if role == "pair":
        return None if workspace is None else tuple(take(workspace, r, shapes, device)[0] for r in Workspace.ROLES)
    if workspace is None:
        return [None] * len(shapes)
    if device.type != "cpu":  # the accelerator's caching allocator reuses the blocks (see Workspace)
        return [torch.empty(shape, dtype=torch.float32, device=device) for shape in shapes]
    sizes = [math.prod(shape) for shape in shapes]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-size // ALIGNMENT) * ALIGNMENT)
    key, buffers = (role, device), workspace.buffers
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < starts[-1]:
        buffers[key] = buffer = None  # the smaller one goes first: never both at once
        buffers[key] = buffer = torch.empty(starts[-1], dtype=torch.float32, device=device)
    return [buffer[start : start + size].view(shape) for start, size, shape in zip(starts, sizes, shapes)]


def stacked_blocks(tensors: list, run: Run, into: tuple | None = None) -> torch.Tensor:
    """The run's parameter-shaped tensors (None: zeros) -> ``(n, block_rows, block_cols, b0, b1)`` fp32,
    zero-padded: the blocks of every member, as :func:`to_blocks` lays out one's. ``into``: two contiguous fp32
    buffers of the run's ``(rows, b0*b1)`` (a :class:`Workspace`'s): the blocks are stacked in the first and come
    back contiguous in the second (no new tensor); blocks of one row (``b0 == 1``) come back as a view of the
    first, as they come without ``into`` (strides and all: a product's kernel, and so its bits, depends on them)."""
    layout = run.layout
    first = next((tensors[i] for i in run.members if tensors[i] is not None), None)
    if first is None:
        raise ValueError("stacked_blocks needs at least one tensor of the run")
    xs = [tensors[i] if tensors[i] is not None else torch.zeros_like(first) for i in run.members]
    n, grid = len(xs), (len(xs), layout.block_rows * layout.b0, layout.block_cols * layout.b1)
    if into is not None:  # stacked in a (padded: in b, then placed zero-padded in a), laid out block by block in b
        a, b = into
        m = torch.stack(xs, out=(b if layout.padded else a).view(-1)[: n * layout.numel].view((n, *layout.shape)))
        if layout.padded:
            a.view(grid).zero_()[:, : layout.rows, : layout.cols].copy_(m.view(n, layout.rows, layout.cols))
        m = a.view(n, layout.block_rows, layout.b0, layout.block_cols, layout.b1).permute(0, 1, 3, 2, 4)
        # a block of one row is transformed on this view itself (its product's kernel depends on the strides)
        return m if layout.b0 == 1 else b.view(m.shape).copy_(m)
    m = torch.stack(xs).reshape(n, layout.rows, layout.cols).float()
    pad_r = layout.block_rows * layout.b0 - layout.rows
    pad_c = layout.block_cols * layout.b1 - layout.cols
    if pad_r or pad_c:
        m = torch.nn.functional.pad(m, (0, pad_c, 0, pad_r))
    m = m.view(n, layout.block_rows, layout.b0, layout.block_cols, layout.b1)
    return m.permute(0, 1, 3, 2, 4)


def write_back(tensors: list[torch.Tensor], bucket_tensors: list[torch.Tensor], bucketing: Bucketing) -> None:
    """After an in-place change of ``bucket_tensors`` made by :func:`bucket_rows`: the same change in ``tensors``
    (nothing to do when they are the buckets' own views)."""
    if isinstance(tensors, Bucketed) and tensors.bucketing == bucketing:
        return
    for i, part in enumerate(Bucketed.of(bucket_tensors, bucketing)):
        tensors[i].copy_(part)


# ---- functions of a step -------------------------------------------------------------------------

# The per-parameter math of DeMo as pure functions, in the order a gradient meets them.
#
# momentum (kept in the DCT domain) -> select top-k -> error feedback -> [pack, gather, unpack: codec/comm]
# -> mean over the ranks that selected each coefficient -> inverse DCT -> the update rule's direction
# (:mod:`hf_demo.optim.update_rules`) -> decoupled weight decay and the step.
#
# Momentum lives in the DCT domain: the transform is linear and orthonormal, so
# ``DCT(decay*m + lr*g) == decay*DCT(m) + lr*DCT(g)``, and each step needs one forward transform (of the
# gradient) and one inverse (of the averaged update) instead of the reference's three.


def accumulate(
    momentum: torch.Tensor, grad: torch.Tensor | None, layout: BlockLayout, decay: float, lr: float, transform=None
) -> torch.Tensor:
    """``decay*momentum + lr*T(grad)`` as a new tensor (fp32; ``momentum`` is left as it is, so a step
    that fails commits nothing), ``T`` the transform (:data:`TRANSFORMS`, default the DCT).
    A missing grad counts as zero."""
    out = momentum.mul(decay)
    if grad is not None:
        out.add_((transform.encode if transform is not None else encode)(grad, layout), alpha=lr)
    return out


def accumulate_many(
    momenta: list, signals: list, layouts: list, factors: list, transform, workspace: Workspace | None = None
) -> Bucketed:
    """:func:`accumulate` of every parameter, once per bucket: ``decay * momentum + scale * T(signal)`` with
    ``factors[i] = (decay, scale)``; the per-parameter results are row views of the buckets' new tensors (the
    momenta are left as they are). Bitwise what :func:`accumulate` gives each parameter. ``workspace``: the
    signals' blocks and their transform are written to its buffers (:class:`Workspace`), not to new tensors."""
    bucketing = plan_buckets(tuple(layouts))
    out = []
    for bucket in bucketing.buckets:
        m = torch.cat([momenta[i] for i in bucket.members])
        coeffs = None  # T of the members' signals, (rows, bsize), run by run: a missing signal is zero (None: all)
        if not all(signals[i] is None for i in bucket.members):
            parts, shape = [], (bucket.rows, bucket.bsize)
            into = take(workspace, "pair", [shape], m.device)
            for run in bucket.runs:  # with a workspace, each run's coefficients land in its rows of the b buffer
                rows = slice(run.start, run.start + run.rows)  # computed there where they start aligned as a new
                aligned = into is not None and run.start * bucket.bsize % ALIGNMENT == 0  # tensor: the GEMMs' bits
                mine = tuple(t[rows] for t in into) if aligned else None  # depend on where their operands start
                if all(signals[i] is None for i in run.members):
                    device = next(s for s in signals if s is not None).device
                    part = torch.zeros(run.rows, bucket.bsize, device=device) if mine is None else mine[1].zero_()
                else:
                    blocks = stacked_blocks(signals, run, mine)
                    part = transform.encode_blocks(blocks, mine and tuple(t.view(blocks.shape) for t in mine))
                    part = part.reshape(run.rows, bucket.bsize)
                if into is not None and part.data_ptr() != into[1][rows].data_ptr():  # elsewhere, or one product: a
                    into[1][rows].copy_(part)
                parts.append(part)
            coeffs = into[1] if into is not None else parts[0] if len(parts) == 1 else torch.cat(parts)
        own = [factors[i] for i in bucket.members]
        if len(set(own)) == 1:  # one decay and scale for the bucket (one parameter group): one op each
            decay, scale = own[0]
            m.mul_(decay)
            if coeffs is not None:
                m.add_(coeffs, alpha=scale)
        else:  # parameter groups of other decays or learning rates share the bucket: row by row
            start = 0
            for (decay, scale), n in zip(own, bucket.member_blocks):
                m[start : start + n].mul_(decay)
                if coeffs is not None:
                    m[start : start + n].add_(coeffs[start : start + n], alpha=scale)
                start += n
        out.append(m)
    return Bucketed.of(out, bucketing)


def decode_many(coeffs: list, layouts: list, transform, workspace: Workspace | None = None) -> list[torch.Tensor]:
    """Coefficients (nblocks, bsize) of every parameter -> parameter-shaped fp32 tensors, the inverse transform
    once per bucket (``coeffs`` best :class:`~hf_demo.compression.Bucketed`, as the exchanges return
    them). Bitwise what ``transform.decode`` gives each parameter. ``workspace``: the transform's products are
    written to its buffers (:class:`Workspace`); the tensors returned are new (they outlive the call)."""
    bucketing = plan_buckets(tuple(layouts))
    out: list = [None] * len(layouts)
    for bucket, rows in zip(bucketing.buckets, bucket_rows(coeffs, bucketing)):
        shape = (bucket.rows, bucket.b0, bucket.b1)
        into = take(workspace, "pair", [shape], rows.device)
        blocks = transform.decode_blocks(rows.view(shape), into)
        runs = blocks.reshape(bucket.rows, bucket.bsize)
        parts = [runs] if len(bucket.runs) == 1 else runs.split([run.rows for run in bucket.runs])
        for run, part in zip(bucket.runs, parts):  # each run's blocks -> its members' tensors (padding cropped),
            layout, n = run.layout, len(run.members)  # the inverse of stacked_blocks: one unbind for the run
            m = part.reshape(n, layout.block_rows, layout.block_cols, layout.b0, layout.b1).permute(0, 1, 3, 2, 4)
            m = m.reshape(n, layout.block_rows * layout.b0, layout.block_cols * layout.b1)
            if layout.padded:
                m = m[:, : layout.rows, : layout.cols]
            m = m.reshape(n, *layout.shape)  # a copy, but where the blocks' order is the tensor's: not a view of
            if into is not None and m.untyped_storage().data_ptr() == blocks.untyped_storage().data_ptr():
                m = m.clone()  # the workspace, which the next bucket writes
            for i, value in zip(run.members, m.unbind(0)):
                out[i] = value
    return out


def select(momentum: torch.Tensor, k: int, scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest-magnitude coefficients of each block: (positions (nblocks, k) int64, values), the
    positions of a block in increasing order (what the Elias-Fano index code needs; the 16-bit code sends
    the same order, so both codes lead to the same bits everywhere). ``scratch``: an fp32 tensor of the
    momentum's shape the magnitudes are written to (a :class:`Workspace`'s buffer) instead of a new one."""
    magnitudes = momentum.abs() if scratch is None else torch.abs(momentum, out=scratch)
    idx = magnitudes.topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    return idx, momentum.gather(1, idx)


def feedback(momentum: torch.Tensor, idx: torch.Tensor, sent: torch.Tensor) -> None:
    """Error feedback: subtract exactly what receivers will decode; the rest stays as the residual."""
    momentum.scatter_add_(1, idx, -sent)


def mean_weights(idx: torch.Tensor, values: torch.Tensor, layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Coefficients of all ranks (world, nblocks, k) -> per block (positions, values) of length world*k.

    Each value is divided by the number of ranks that selected its position, so that summing the
    duplicates gives the mean over the ranks that selected it (the reference's rule, every-step DeMo).
    """
    world, nblocks, k = idx.shape  # per block the ranks' runs one after the other, (nblocks, world*k) each:
    idx, values = idx.permute(1, 0, 2).reshape(nblocks, world * k), values.permute(1, 0, 2).reshape(nblocks, world * k)
    if world == 1:
        return idx, values
    # a count is at most the world size: the payload check refuses a run that names one position twice
    # (codec: repeated positions), so a uint8 count cannot wrap below 256 ranks
    count_dtype = torch.uint8 if world < 256 else torch.int32
    count = torch.zeros(nblocks, layout.bsize, dtype=count_dtype, device=idx.device)
    count.scatter_add_(1, idx, torch.ones(idx.shape, dtype=count_dtype, device=idx.device))
    return idx, values / count.gather(1, idx).to(values.dtype)


def world_weights(idx: torch.Tensor, values: torch.Tensor, layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`mean_weights`, but each value is divided by the world size: summed, a coefficient is the mean
    over every rank, a rank that did not select it counting zero. This is the average of the ranks' sparse
    pseudo-gradients at a synchronisation (DiLoCo's and SparseLoCo's outer step): the mean over the ranks
    that selected a coefficient would apply one rank's change at full weight where the others sent nothing."""
    world, nblocks, k = idx.shape  # per block the ranks' runs one after the other, as mean_weights lays them
    idx, values = idx.permute(1, 0, 2).reshape(nblocks, world * k), values.permute(1, 0, 2).reshape(nblocks, world * k)
    return idx, values / world


def first_occurrences(idx: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Ranks' nominated positions (world, nblocks, k) -> (nblocks, world*k): 1.0 where a position appears
    for the first time in rank order, 0.0 where an earlier rank already nominated it (the union of the
    nominations, each position counted once; every rank computes the same mask from the same rows)."""
    world, nblocks, _ = idx.shape
    seen = torch.zeros(nblocks, layout.bsize, dtype=torch.bool, device=idx.device)
    keep = []
    for run in idx:  # a run (one rank's top-k) never repeats a position
        keep.append(~seen.gather(1, run))
        seen.scatter_(1, run, True)
    return torch.cat(keep, dim=1).float()


WEIGHTS = {"pickers": mean_weights, "world": world_weights}  # how an all-gather averages (hf_demo.exchange)


def densify(
    idx: torch.Tensor, values: torch.Tensor, layout: BlockLayout, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Sparse per-block coefficients -> dense (nblocks, bsize), duplicates summed in rank order.

    ``idx`` and ``values`` hold one run of ``layout.k`` positions per rank (rank after rank, as
    :func:`mean_weights` lays them out); a run never repeats a position (a top-k). The runs are added one
    after the other, so a position picked by several ranks is summed in rank order on every device: one
    ``scatter_add_`` over all runs would sum duplicates with atomics on CUDA, in an order that changes from
    call to call, and the replicas would drift apart. On the CPU, where ``scatter_add_`` goes through the
    positions in order, the result is bitwise the same as one call. ``out``: the (nblocks, bsize) fp32 tensor to
    write (a :class:`Workspace`'s), not a new one.
    """
    out = values.new_zeros(idx.shape[0], layout.bsize) if out is None else out.zero_()
    k = layout.k
    for start in range(0, idx.shape[1], k):
        out.scatter_add_(1, idx[:, start : start + k], values[:, start : start + k])
    return out


def apply_step(
    param: torch.Tensor,
    direction: torch.Tensor,
    lr: float,
    weight_decay: float,
    generator: torch.Generator | None = None,
) -> None:
    """``param <- param * (1 - lr*weight_decay) - lr * direction`` (decoupled weight decay, then the step).

    With a ``generator`` and a bf16 parameter the result is computed in fp32 and rounded
    *stochastically* to the parameter's dtype (unbiased: small steps move weights on average instead of
    vanishing below the format's resolution). The same generator state on every rank gives the same bits.
    """
    if generator is None or param.dtype == torch.float32 or param.dtype == torch.float64:
        if weight_decay:
            param.mul_(1.0 - lr * weight_decay)
        param.add_(direction.to(param.dtype), alpha=-lr)
        return
    exact = param.float()
    if weight_decay:
        exact.mul_(1.0 - lr * weight_decay)
    exact.add_(direction.float(), alpha=-lr)
    param.copy_(stochastic_round(exact, param.dtype, generator))


def apply_steps(params: list, directions: list, lrs: list, weight_decays: list, generator=None) -> None:
    """:func:`apply_step` of every parameter: ``torch._foreach_*`` once per (learning rate, weight decay) for the
    parameters rounded to nearest (bitwise the same as one at a time), then stochastic rounding parameter by
    parameter in order (its noise is drawn in parameter order)."""
    nearest: dict[tuple[float, float], list[int]] = {}
    rounded = []
    for i, p in enumerate(params):
        if generator is None or p.dtype == torch.float32 or p.dtype == torch.float64:
            nearest.setdefault((lrs[i], weight_decays[i]), []).append(i)
        else:
            rounded.append(i)
    for (lr, wd), members in nearest.items():
        ps = [params[i] for i in members]
        if wd:
            torch._foreach_mul_(ps, 1.0 - lr * wd)
        torch._foreach_add_(ps, [directions[i].to(params[i].dtype) for i in members], alpha=-lr)
    for i in rounded:
        apply_step(params[i], directions[i], lrs[i], weight_decays[i], generator)


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """fp32 -> bf16, rounding away from zero with probability equal to the distance to the lower neighbour
    (in units of the last place): ``E[round(x)] = x``. Other dtypes round to nearest."""
    if dtype != torch.bfloat16:
        return x.to(dtype)
    bits = x.contiguous().view(torch.int32)
    generator = generator_on(x.device, generator)
    noise = torch.randint(0, 1 << 16, x.shape, generator=generator, dtype=torch.int32, device=x.device)
    return ((bits + noise) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def generator_on(device: torch.device, generator: torch.Generator) -> torch.Generator:
    """A generator on ``device`` for noise made where the tensor lives.

    ``generator`` itself when it is on ``device`` (a CPU parameter: the noise is what it always was);
    otherwise a new generator on ``device`` seeded with one draw from ``generator``. The optimizer seeds
    ``generator`` identically on every rank and every rank draws in the same order, so every rank gets the
    same seeds and, on the same kind of accelerator, the same noise (CUDA's random kernels lay the stream
    out by the GPU's number of SMs: different GPU models give different noise, which the drift check sees).
    """
    device = torch.device(device)
    if generator.device.type == device.type and (device.index is None or generator.device.index == device.index):
        return generator
    seed = int(torch.randint(0, 1 << 62, (), generator=generator, device=generator.device))
    return torch.Generator(device=device).manual_seed(seed)


PARAM_NOISE_SEED = 0x5EED0000  # stochastic rounding: the same noise on every rank, a new draw every step


def rounding_noise(param_rounding: str, step: int) -> torch.Generator | None:
    """The generator of ``param_rounding="stochastic"`` for optimizer step ``step``, seeded alike on every rank
    (None: round to nearest)."""
    if param_rounding != "stochastic":
        return None
    return torch.Generator().manual_seed(PARAM_NOISE_SEED + step)
