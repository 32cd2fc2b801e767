"""What a parameter's gradient becomes before top-k: the blockwise transform, chosen by the ``transform`` setting.

A transform maps a parameter-shaped tensor to ``(nblocks, bsize)`` coefficients of its
:class:`~hf_demo.compression.blocks.BlockLayout` and back (``encode``/``decode``), and blocks ``(..., b0, b1)``
to coefficients of the same shape and back (``encode_blocks``/``decode_blocks``: a bucket's blocks at once);
it must be linear (the momentum lives in its
domain: ``T(decay*m + lr*g) == decay*T(m) + lr*T(g)``) and its inverse exact enough that error feedback
subtracts what receivers decode. Add one by writing a class with ``name``, ``encode``, ``decode``, ``encode_blocks`` and
``decode_blocks`` and listing it in :data:`TRANSFORMS`; nothing else changes.

- ``dct`` (default): the orthonormal DCT-II along both axes of every block (DeMo's: energy gathers in few
  coefficients, so top-k keeps most of it).
- ``identity``: the blocks as they are (top-k of the raw momentum: the ablation that shows what the DCT buys).
"""

from __future__ import annotations

import torch

from hf_demo.compression import blocks
from hf_demo.errors import lookup


class DCT:
    name = "dct"

    @staticmethod
    def encode_blocks(x: torch.Tensor) -> torch.Tensor:
        """Blocks (..., b0, b1) -> coefficients of the same shape (a bucket's blocks at once)."""
        return blocks.transform_blocks(x)

    @staticmethod
    def decode_blocks(coeffs: torch.Tensor) -> torch.Tensor:
        return blocks.inverse_blocks(coeffs)

    @staticmethod
    def encode(x: torch.Tensor, layout: blocks.BlockLayout) -> torch.Tensor:
        return blocks.encode(x, layout)

    @staticmethod
    def decode(coeffs: torch.Tensor, layout: blocks.BlockLayout) -> torch.Tensor:
        return blocks.decode(coeffs, layout)


class Identity:
    name = "identity"

    @staticmethod
    def encode_blocks(x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def decode_blocks(coeffs: torch.Tensor) -> torch.Tensor:
        return coeffs

    @staticmethod
    def encode(x: torch.Tensor, layout: blocks.BlockLayout) -> torch.Tensor:
        return blocks.to_blocks(x, layout).reshape(layout.nblocks, layout.bsize)

    @staticmethod
    def decode(coeffs: torch.Tensor, layout: blocks.BlockLayout) -> torch.Tensor:
        return blocks.from_blocks(coeffs.reshape(layout.block_rows, layout.block_cols, layout.b0, layout.b1), layout)


TRANSFORMS = {t.name: t for t in (DCT, Identity)}
TRANSFORM_NAMES = tuple(TRANSFORMS)


def get(name: str):
    return lookup(TRANSFORMS, "transform", name)
