"""How a parameter becomes blocks of DCT coefficients, and back.

Every tensor is seen as a 2-D matrix: a 0-d tensor as (1, 1), a 1-D tensor of length n as (1, n), an N-D
tensor as (shape[0], prod(shape[1:])). Blocks are ``b0 x b1`` (:func:`block_side`): a dimension shorter
than the chunk is one block (a tensor smaller than a block is sent whole: its block keeps
``min(topk, b0*b1)`` coefficients); a longer one is cut into blocks of the largest divisor in
``[chunk/2, chunk]`` (688 -> 16 blocks of 43, as the DeMo reference does), and only a dimension without
such a divisor is zero-padded up to a multiple of the chunk (a 50257 vocabulary: 786 blocks of 64, not
29-long ones). Cutting 688 into 43s instead of padding to 704 sends 45% more coefficients at the same top-k,
which is what the reference sends.

Each block is transformed with the orthonormal DCT-II along both axes: ``C = D0 @ X @ D1.T``. Being
orthonormal, the transform preserves energy and its inverse is the transpose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

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

    @property
    def block_rows(self) -> int:
        return -(-self.rows // self.b0)

    @property
    def block_cols(self) -> int:
        return -(-self.cols // self.b1)

    @property
    def nblocks(self) -> int:
        return self.block_rows * self.block_cols

    @property
    def bsize(self) -> int:
        return self.b0 * self.b1

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
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


_DEVICE_CACHE: dict[tuple[int, torch.device], torch.Tensor] = {}


def dct_matrix(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The n x n orthonormal DCT-II matrix D (rows are basis vectors): ``coeffs = D @ x``, fp32, on ``device``.

    Cached per (n, device): the same bits on every device (computed once on the CPU in float64, then copied),
    so a CUDA rank and a CPU rank transform with the same matrix. Everything DeMo transforms is fp32."""
    device = torch.device(device)
    key = (n, device)
    if key not in _DEVICE_CACHE:
        _DEVICE_CACHE[key] = _dct_matrix_cpu(n).to(device)
    return _DEVICE_CACHE[key]


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


def transform_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks (..., b0, b1) -> their DCT coefficients ``D0 @ X @ D1.T``, fp32 (any number of leading dims:
    one block, a parameter's, a bucket's)."""
    b0, b1 = blocks.shape[-2:]
    if b0 > 1:
        blocks = torch.matmul(dct_matrix(b0, blocks.device), blocks)
    if b1 > 1:
        blocks = torch.matmul(blocks, dct_matrix(b1, blocks.device).T)
    return blocks


def inverse_blocks(coeffs: torch.Tensor) -> torch.Tensor:
    """DCT coefficients (..., b0, b1) -> blocks (the inverse of :func:`transform_blocks`)."""
    b0, b1 = coeffs.shape[-2:]
    if b0 > 1:
        coeffs = torch.matmul(dct_matrix(b0, coeffs.device).T, coeffs)
    if b1 > 1:
        coeffs = torch.matmul(coeffs, dct_matrix(b1, coeffs.device))
    return coeffs


def encode(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Parameter-shaped tensor -> DCT coefficients, shape (nblocks, bsize), fp32."""
    return transform_blocks(to_blocks(x, layout)).reshape(layout.nblocks, layout.bsize)


def decode(coeffs: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """DCT coefficients (nblocks, bsize) -> parameter-shaped fp32 tensor (the inverse of :func:`encode`)."""
    blocks = coeffs.reshape(layout.block_rows, layout.block_cols, layout.b0, layout.b1)
    return from_blocks(inverse_blocks(blocks), layout)
