"""The wire format: what one rank sends in one step, byte for byte.

Every step a rank sends two buffers (two collectives):

1. a fixed 64-byte header, eight int64 words: magic, format version, step, layout checksum, settings
   checksum, flags, world size, payload length. Every rank checks every header before the payload moves,
   so ranks with a different model, different settings or a different step stop with a clear error,
   and a non-finite gradient on one rank makes every rank skip the step.
2. one payload holding every parameter, in parameter order. A parameter's segment is its indices (16 bit,
   position inside the block, little endian) followed by its values. Segments are 4-byte aligned.

Value formats: ``fp32`` (4 bytes), ``bf16`` (2 bytes), ``sign`` (1 bit per coefficient plus one bf16
scale per block: the mean magnitude of the block's selected coefficients). :func:`quantize` returns the
values exactly as receivers will decode them, so the sender's error feedback subtracts what was seen.
gloo has no int16 collectives: every buffer travels as uint8.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from .blocks import BlockLayout

MAGIC = 0x44654D6F  # "DeMo"
FORMAT_VERSION = 1
HEADER_WORDS = 8
HEADER_BYTES = HEADER_WORDS * 8
VALUE_FORMATS = ("fp32", "bf16", "sign")

FLAG_NONFINITE = 1

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _align(n: int) -> int:
    return (n + 3) // 4 * 4


# ---------------------------------------------------------------- header
@dataclass(frozen=True)
class Header:
    step: int
    layout_checksum: int
    settings_checksum: int
    flags: int
    world_size: int
    payload_bytes: int
    magic: int = MAGIC
    version: int = FORMAT_VERSION

    def to_bytes(self) -> torch.Tensor:
        words = torch.tensor(
            [self.magic, self.version, self.step, self.layout_checksum, self.settings_checksum,
             self.flags, self.world_size, self.payload_bytes],
            dtype=torch.int64,
        )
        return words.view(torch.uint8)

    @classmethod
    def from_bytes(cls, buf: torch.Tensor) -> "Header":
        w = buf.contiguous().view(torch.int64).tolist()
        return cls(magic=w[0], version=w[1], step=w[2], layout_checksum=w[3], settings_checksum=w[4],
                   flags=w[5], world_size=w[6], payload_bytes=w[7])


def checksum(obj) -> int:
    """A stable 32-bit checksum of a value's repr (tuples of ints, floats and strings)."""
    return zlib.crc32(repr(obj).encode())


# ---------------------------------------------------------------- segment sizes
def index_bytes(layout: BlockLayout) -> int:
    return _align(layout.nblocks * layout.k * 2)


def value_bytes(layout: BlockLayout, fmt: str) -> int:
    n = layout.nblocks * layout.k
    if fmt == "fp32":
        return n * 4
    if fmt == "bf16":
        return _align(n * 2)
    if fmt == "sign":
        return _align(layout.nblocks * 2) + _align((n + 7) // 8)
    raise ValueError(f"unknown value format {fmt!r}; expected one of {VALUE_FORMATS}")


def segment_bytes(layout: BlockLayout, fmt: str) -> int:
    return index_bytes(layout) + value_bytes(layout, fmt)


# ---------------------------------------------------------------- values
def quantize(values: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected coefficients (nblocks, k) fp32 -> (what receivers decode, fp32; the wire bytes, uint8)."""
    if fmt == "fp32":
        q = values.contiguous()
        return q, q.view(torch.uint8).reshape(-1)
    if fmt == "bf16":
        wire = values.to(torch.bfloat16).contiguous()
        return wire.float(), _pad_to(wire.view(torch.uint8).reshape(-1), _align(wire.numel() * 2))
    if fmt == "sign":
        nblocks, k = values.shape
        scale = values.abs().mean(dim=1).to(torch.bfloat16)
        negative = values < 0
        q = scale.float()[:, None] * torch.where(negative, -1.0, 1.0)
        bits = _pad_to(negative.reshape(-1).to(torch.uint8), (nblocks * k + 7) // 8 * 8)
        packed = (bits.view(-1, 8) * _BIT_WEIGHTS.to(bits.device)).sum(dim=1, dtype=torch.uint8)
        wire = torch.cat([_pad_to(scale.view(torch.uint8), _align(nblocks * 2)),
                          _pad_to(packed, _align(packed.numel()))])
        return q, wire
    raise ValueError(f"unknown value format {fmt!r}; expected one of {VALUE_FORMATS}")


def dequantize(wire: torch.Tensor, fmt: str, nblocks: int, k: int) -> torch.Tensor:
    """Wire bytes (world, value_bytes) uint8 -> values (world, nblocks, k) fp32."""
    world = wire.shape[0]
    n = nblocks * k
    if fmt == "fp32":
        return wire[:, : n * 4].contiguous().view(torch.float32).view(world, nblocks, k)
    if fmt == "bf16":
        return wire[:, : n * 2].contiguous().view(torch.bfloat16).float().view(world, nblocks, k)
    if fmt == "sign":
        s = _align(nblocks * 2)
        scale = wire[:, : nblocks * 2].contiguous().view(torch.bfloat16).float()
        packed = wire[:, s: s + (n + 7) // 8]
        shifts = torch.arange(8, dtype=torch.uint8, device=wire.device)
        bits = (packed[:, :, None] >> shifts) & 1
        negative = bits.reshape(world, -1)[:, :n].view(world, nblocks, k).bool()
        return scale[:, :, None] * torch.where(negative, -1.0, 1.0)
    raise ValueError(f"unknown value format {fmt!r}; expected one of {VALUE_FORMATS}")


# ---------------------------------------------------------------- indices
def pack_indices(idx: torch.Tensor) -> torch.Tensor:
    """Block positions (nblocks, k) int64 in [0, 65536) -> 16-bit little-endian bytes (4-aligned)."""
    wire = idx.to(torch.int32).to(torch.int16).contiguous().view(torch.uint8).reshape(-1)
    return _pad_to(wire, _align(wire.numel()))


def unpack_indices(wire: torch.Tensor, nblocks: int, k: int) -> torch.Tensor:
    """Bytes (world, index_bytes) uint8 -> positions (world, nblocks, k) int64."""
    world = wire.shape[0]
    n = nblocks * k
    return (wire[:, : n * 2].contiguous().view(torch.int16).to(torch.int64) & 0xFFFF).view(world, nblocks, k)


def _pad_to(buf: torch.Tensor, n: int) -> torch.Tensor:
    if buf.numel() == n:
        return buf
    return torch.cat([buf, buf.new_zeros(n - buf.numel())])
