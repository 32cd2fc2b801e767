"""The wire protocol: what one rank sends in one step, byte for byte, and every check made on receipt.

Every step a rank sends two buffers (in steady state in one all-gather: the payload rides after the header, and
the verdict on the step before rides as the row's kind: a step's header, or a ``FLAG_SETTLES`` row):

1. a fixed header (:data:`HEADER_BYTES`): fourteen int64 words (magic, format version, step, layout
   checksum, settings checksum, flags, world size, payload length, payload CRC32, parameter fingerprint,
   the sender's last exchange time and its time between communicating steps, in milliseconds, and at a
   process's first exchange a fingerprint of its local gradients, then the CRC32 of those 13 words) and a
   32-byte tag (zero unless a shared secret is set: 16 bytes of HMAC-SHA256 over the header, 16 over header
   and payload).
   Every rank checks every header's CRC32 (and HMAC) before acting on it (:func:`receive_headers`: a header
   it cannot trust is refused through the commit vote, on every rank alike) and compares them
   (:func:`check_headers`) before the payload moves, so ranks with a different model, settings or step stop
   with a clear error on every rank, and a non-finite gradient on one rank makes every rank skip the step.
2. one payload holding every parameter, in parameter order (:class:`PayloadCodec`). A parameter's segment
   is its indices (positions inside the block: 16 bit little endian, or with ``index_coding="elias_fano"``
   each block's sorted positions in the Elias-Fano code, ~9 bits for top-32 of 4096) followed by its
   values. Segments are 4-byte aligned. Every received row is checked against its sender's CRC32 (and HMAC
   tag) before it is decoded, and decoded indices and values are range- and finiteness-checked before
   anything is applied.

Value formats (:data:`FORMATS`): ``fp32`` (4 bytes), ``bf16`` (2 bytes), ``sign`` (1 bit per coefficient
plus one bf16 scale per block: the mean magnitude of the block's selected coefficients), ``2bit`` (a sign
and a magnitude class per coefficient plus two bf16 magnitudes per block: :class:`TwoBitFormat`). ``encode``
returns the values exactly as receivers decode them, so the sender's error feedback subtracts what was
seen. gloo has no int16 collectives: every buffer travels as uint8.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import math
import zlib
from dataclasses import dataclass, field, fields, replace

import torch

from hf_demo import compression
from hf_demo.compression import BlockLayout
from hf_demo.errors import DeMoPayloadError, DeMoSyncError, lookup

MAGIC = 0x44654D6F  # "DeMo"
FORMAT_VERSION = 6  # 4: the header's own CRC32 (the 14th word); 5: the payload rides in the header's all-gather;
# 6: a step's verdict settles in the next exchange's all-gather (FLAG_SETTLES rows, hf_demo.optim.settle)
HEADER_WORDS = 14
BODY_WORDS = 13  # the words the header CRC32 and the header HMAC cover (all but the CRC32 itself)
TAG_BYTES = 32
HEADER_BYTES = HEADER_WORDS * 8 + TAG_BYTES

FLAG_NONFINITE = 1  # NaN/Inf in this rank's gradients
FLAG_NONFINITE_PARAMS = 2  # NaN/Inf in this rank's parameters
FLAG_FINGERPRINT = 4  # the fingerprint word holds this rank's parameter fingerprint
FLAG_AUTH = 8  # the tag is an HMAC over header and payload
FLAG_GRAD_FINGERPRINT = 16  # the grad_fingerprint word holds this rank's local-gradient fingerprint
FLAG_DDP_SUSPECT = 32  # a DDP wrapper that all-reduces holds some of DeMo's parameters here: grad_fingerprint is
# the fingerprint of those parameters' gradients, which tells whether the wrapper really averaged them
FLAG_REFUSED = 64  # this rank refused the exchange the last step started (overlap): no rank applies it
FLAG_SETTLES = 128  # not a step's header: the sender's verdict on the step its ``step`` word names, in the flags'
# bits from VERDICT_SHIFT up (0: it received that step whole), sent in the all-gather after that step's headers
FLAG_SETTINGS_APART = 256  # the ranks of this rank's shard group (HSDP: the shards of its replica) hold different
# settings: every rank of every replica then names them (hf_demo.wire.agreement.gather_headers)
FLAG_CONFIRM = 512  # a settling row sent by confirm(): its sender runs the later rounds after it (hf_demo.optim.settle)
FLAG_FINAL = 1024  # a settling row of confirm()'s later rounds (with FLAG_CONFIRM the second, alone the third): its
# verdict is its sender's finding on the rounds before
VERDICT_SHIFT = 16


def settles(h) -> int | None:
    """The verdict a settling row carries (0: whole), or None for a step's header."""
    return h.flags >> VERDICT_SHIFT if h.flags & FLAG_SETTLES else None


def _align(n: int) -> int:
    return (n + 3) // 4 * 4


def _pad_to(buf: torch.Tensor, n: int) -> torch.Tensor:
    if buf.numel() == n:
        return buf
    return torch.cat([buf, buf.new_zeros(n - buf.numel())])


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """A flat bool/0-1 tensor -> bytes, bit j of byte i holding bit 8i+j (zero-padded to whole bytes)."""
    bits = _pad_to(bits.reshape(-1).to(torch.uint8), (bits.numel() + 7) // 8 * 8)
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (bits.view(-1, 8) << shifts).sum(dim=1, dtype=torch.uint8)


@functools.cache
def _byte_bits_table(device: torch.device) -> torch.Tensor:
    """byte -> its 8 bits, (256, 8) uint8, built once per device (a copy to a GPU per call would make the host wait)."""
    return ((torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1).to(torch.uint8)


def byte_bits(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (..., nbytes) -> (..., 8 * nbytes) uint8 bits, least significant first (one table lookup)."""
    bits = _byte_bits_table(packed.device).index_select(0, packed.reshape(-1).int())
    return bits.view(*packed.shape[:-1], 8 * packed.shape[-1])


def checksum(obj) -> int:
    """A stable 32-bit checksum of a value's repr (tuples of ints, floats and strings)."""
    return zlib.crc32(repr(obj).encode())


def crc32(buf: torch.Tensor) -> int:
    """CRC32 of a uint8 tensor's bytes."""
    return zlib.crc32(buf.detach().cpu().contiguous().numpy().tobytes()) if buf.numel() else 0


# ---------------------------------------------------------------- value formats
class Fp32Format:
    name = "fp32"

    def nbytes(self, nblocks: int, k: int) -> int:
        return nblocks * k * 4

    def segments(self, nblocks: int, k: int) -> list[tuple[int, int]]:
        """(bytes, bytes with padding) of each stream of one parameter's values, in payload order."""
        return [(nblocks * k * 4, nblocks * k * 4)]

    def encode_rows(self, values: torch.Tensor, bucket) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A bucket's values (rows, k) -> (values as receivers decode them, [each stream's bytes, members one
        after the other])."""
        q = values.float().contiguous()
        return q, [q.view(torch.uint8).reshape(-1)]

    def decode_rows(self, streams: list[torch.Tensor], bucket) -> torch.Tensor:
        """Every sender's streams of a bucket, (world, bytes) each -> values (world, rows, k)."""
        return streams[0].view(torch.float32).view(streams[0].shape[0], bucket.rows, bucket.k)


class Bf16Format:
    name = "bf16"

    def nbytes(self, nblocks: int, k: int) -> int:
        return _align(nblocks * k * 2)

    def segments(self, nblocks: int, k: int) -> list[tuple[int, int]]:
        return [(nblocks * k * 2, _align(nblocks * k * 2))]

    def encode_rows(self, values: torch.Tensor, bucket) -> tuple[torch.Tensor, list[torch.Tensor]]:
        wire = values.to(torch.bfloat16).contiguous()
        return wire.float(), [wire.view(torch.uint8).reshape(-1)]

    def decode_rows(self, streams: list[torch.Tensor], bucket) -> torch.Tensor:
        world = streams[0].shape[0]
        return streams[0].view(torch.bfloat16).float().view(world, bucket.rows, bucket.k)


class SignFormat:
    """1 bit per coefficient and one bf16 scale per block (the mean magnitude of its selected values)."""

    name = "sign"

    def nbytes(self, nblocks: int, k: int) -> int:
        return _align(nblocks * 2) + _align((nblocks * k + 7) // 8)

    def segments(self, nblocks: int, k: int) -> list[tuple[int, int]]:
        bits = (nblocks * k + 7) // 8
        return [(nblocks * 2, _align(nblocks * 2)), (bits, _align(bits))]

    def encode_rows(self, values: torch.Tensor, bucket) -> tuple[torch.Tensor, list[torch.Tensor]]:
        scale = values.abs().mean(dim=1).to(torch.bfloat16)
        negative = values < 0
        q = scale.float()[:, None] * torch.where(negative, -1.0, 1.0)
        bits = negative.reshape(-1)
        spread = _member_bits(bucket, bits.device)  # each member's bits from a byte boundary
        if spread is not None:
            bits = torch.cat([bits, bits.new_zeros(1)]).index_select(0, spread)
        return q, [scale.view(torch.uint8), pack_bits(bits)]

    def decode_rows(self, streams: list[torch.Tensor], bucket) -> torch.Tensor:
        world = streams[0].shape[0]
        scale = streams[0].view(torch.bfloat16).float().view(world, bucket.rows)
        bits = byte_bits(streams[1])
        gather = _member_bits_back(bucket, bits.device)
        bits = bits[:, : bucket.rows * bucket.k] if gather is None else bits.index_select(1, gather)
        negative = bits.bool().view(world, bucket.rows, bucket.k)
        return scale[:, :, None] * torch.where(negative, -1.0, 1.0)


class TwoBitFormat:
    """2 bits per coefficient (a sign and a magnitude class) and two bf16 magnitudes per block: a 4-level
    symmetric quantiser, as SparseLoCo/MuLoCo send their values.

    In each block, a selected coefficient is *large* when its magnitude is at least the mean magnitude of
    the block's selected coefficients, else *small*; each class is sent as the mean magnitude of its members
    (the conditional means: the least squared error for that split), ``small <= large``, 0 for an empty class.
    A coefficient decodes to its sign times its class's magnitude. Per parameter, three streams: the
    magnitudes (each block's small then large, bf16), the sign bits, the class bits (bit set: large), each
    member's bits from a byte boundary as in ``sign``. What the quantiser loses stays in the momentum: the
    sender subtracts the decoded values (error feedback). Magnitudes that cannot come from an encoder
    (negative, out of order, NaN) decode to NaN, so the payload check refuses the row.
    """

    name = "2bit"

    def nbytes(self, nblocks: int, k: int) -> int:
        return sum(padded for _, padded in self.segments(nblocks, k))

    def segments(self, nblocks: int, k: int) -> list[tuple[int, int]]:
        bits = (nblocks * k + 7) // 8
        return [(nblocks * 4, _align(nblocks * 4)), (bits, _align(bits)), (bits, _align(bits))]

    @staticmethod
    def quantise(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Values (rows, k) -> (decoded values, magnitudes (rows, 2) bf16, negative, large (rows, k) bool)."""
        mag = values.float().abs()
        large = mag >= mag.mean(dim=1, keepdim=True)
        classes = torch.stack([~large, large], dim=1).float()  # (rows, 2, k)
        counts = classes.sum(dim=2)
        sums = (classes * mag[:, None, :]).sum(dim=2)
        scales = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0).to(torch.bfloat16)
        negative = values < 0
        q = scales.float().gather(1, large.long()) * torch.where(negative, -1.0, 1.0)
        return q, scales, negative, large

    def encode_rows(self, values: torch.Tensor, bucket) -> tuple[torch.Tensor, list[torch.Tensor]]:
        q, scales, negative, large = self.quantise(values)
        streams = [_spread_bits(bits.reshape(-1), bucket) for bits in (negative, large)]
        return q, [scales.contiguous().view(torch.uint8).reshape(-1), *streams]

    def decode_rows(self, streams: list[torch.Tensor], bucket) -> torch.Tensor:
        world, shape = streams[0].shape[0], (streams[0].shape[0], bucket.rows, bucket.k)
        scales = streams[0].view(torch.bfloat16).float().view(world, bucket.rows, 2)
        negative, large = (_gather_bits(s, bucket).view(shape) for s in streams[1:])
        return _two_bit_values(scales, negative, large)


def _two_bit_values(scales: torch.Tensor, negative: torch.Tensor, large: torch.Tensor) -> torch.Tensor:
    """Magnitudes (world, rows, 2), sign and class bits (world, rows, k) -> values; a row whose magnitudes are
    not ``0 <= small <= large`` decodes to NaN (refused by the payload check)."""
    valid = (scales[..., 0] >= 0) & (scales[..., 0] <= scales[..., 1])  # False for NaN
    values = scales.gather(2, large.long()) * torch.where(negative, -1.0, 1.0)
    return torch.where(valid[..., None], values, float("nan"))


def _spread_bits(bits: torch.Tensor, bucket) -> torch.Tensor:
    """A bucket's bits (rows * k) -> the packed stream, each member's bits from a byte boundary."""
    spread = _member_bits(bucket, bits.device)
    if spread is not None:
        bits = torch.cat([bits, bits.new_zeros(1)]).index_select(0, spread)
    return pack_bits(bits)


def _gather_bits(stream: torch.Tensor, bucket) -> torch.Tensor:
    """Every sender's packed stream (world, bytes) -> its bits (world, rows * k) bool (see :func:`_spread_bits`)."""
    bits = byte_bits(stream)
    gather = _member_bits_back(bucket, bits.device)
    return (bits[:, : bucket.rows * bucket.k] if gather is None else bits.index_select(1, gather)).bool()


def _cached_on(cache: dict, key, device, build):
    """``build()`` (a CPU tensor or None), copied once to ``device`` and kept."""
    full = (key, torch.device(device))
    if full not in cache:
        if key not in cache:
            cache[key] = build()
        cache[full] = None if cache[key] is None else cache[key].to(device)
    return cache[full]


_BIT_MAPS: dict = {}


def _member_bits(bucket, device) -> torch.Tensor | None:
    """Where each bit of the packed bit stream comes from: member after member, each member's ``nblocks * k``
    sign bits starting at a byte boundary (the padding points at index ``rows * k``, a zero); None when every
    member's bits fill whole bytes (the stream is then the bits as they are)."""

    def build():
        sizes = [n * bucket.k for n in bucket.member_blocks]
        if all(n % 8 == 0 for n in sizes):
            return None
        pad, parts, start = bucket.rows * bucket.k, [], 0
        for n in sizes:
            parts += [torch.arange(start, start + n), torch.full(((-n) % 8,), pad)]
            start += n
        return torch.cat(parts)

    return _cached_on(_BIT_MAPS, ("spread", bucket), device, build)


def _member_bits_back(bucket, device) -> torch.Tensor | None:
    """The inverse of :func:`_member_bits`: where each member's bits are in the unpacked stream."""

    def build():
        spread = _member_bits(bucket, "cpu")
        if spread is None:
            return None
        return torch.nonzero(spread < bucket.rows * bucket.k).flatten()

    return _cached_on(_BIT_MAPS, ("back", bucket), device, build)


FORMATS = {fmt.name: fmt for fmt in (Fp32Format(), Bf16Format(), SignFormat(), TwoBitFormat())}

UPDATE_BOUND = torch.finfo(torch.float32).max / 2  # the most a decoded update element may reach (half fp32's range)


def coefficient_bound(bsize: int) -> float:
    """The largest coefficient magnitude a receiver accepts in a block of ``bsize``. The average of coefficients
    (over the senders or the pickers) is no larger; the orthonormal inverse DCT of a block (every basis value at
    most ``2 / sqrt(bsize)``, ``bsize`` coefficients) is then at most :data:`UPDATE_BOUND`, so neither can
    overflow fp32, and a parameter stepped by it (``lr <= 1``) stays finite. Finite values beyond it are refused
    like NaN/Inf: in every value format, since the check is on what the receiver decodes."""
    return UPDATE_BOUND / (2 * math.sqrt(bsize))


VALUE_FORMATS = tuple(FORMATS)


def value_format(name: str):
    return lookup(FORMATS, "value format", name)


# ---------------------------------------------------------------- indices
class Uint16Indices:
    """16 bits per position (Psyche's wire; the DeMo reference sends 64-bit ones)."""

    name = "uint16"

    def nbytes(self, layout: BlockLayout) -> int:
        return _align(layout.nblocks * layout.k * 2)

    def record_bytes(self, bsize: int, k: int) -> int:
        return 2 * k

    def pack_rows(self, idx: torch.Tensor, bsize: int, k: int) -> torch.Tensor:
        """Positions (rows, k) -> (rows, 2k) bytes."""
        return idx.to(torch.int32).to(torch.int16).contiguous().view(torch.uint8).view(idx.shape[0], 2 * k)

    def unpack_rows(self, stream: torch.Tensor, rows: int, bsize: int, k: int) -> torch.Tensor:
        """Every sender's bytes (world, rows * 2k) -> positions (world, rows, k) int64."""
        return (stream.view(torch.int16).to(torch.int64) & 0xFFFF).view(stream.shape[0], rows, k)

    def repeated(self, idx: torch.Tensor) -> torch.Tensor:
        """Positions (..., k) -> (...) bool: a block that names one position twice (a top-k never does; a
        repeat would count one sender as several pickers). Sorted on the device, no host read."""
        ordered = idx.sort(dim=-1).values
        return (ordered[..., 1:] == ordered[..., :-1]).any(-1)


class EliasFanoIndices:
    """Each block's k positions, sorted, in the Elias-Fano code: ~log2(bsize/k) + 2 bits per position.

    With ``L = floor(log2(bsize/k))`` a position ``x`` splits into its low ``L`` bits, stored as they are,
    and its high part ``x >> L``; the i-th smallest position sets bit ``(x >> L) + i`` of an upper bit
    vector of ``k + ((bsize-1) >> L)`` bits. A block's record is the k low parts back to back (bit
    ``i*L + j`` is bit j of the i-th position), then the upper vector, rounded up to whole bytes: the same
    size for every block of a layout. Top-32 of a 64x64 block is 7*32 + 63 = 287 bits, 36 bytes (9.0 bits
    per position instead of 16), top-4 is 10*4 + 7 = 47 bits, 6 bytes (12). Blocks of the same (size,
    k) in all parameters are coded at once, with integer arithmetic on (blocks, k) arrays (a handful of
    tensor operations per step, not per parameter, and no array of single bits for the low parts).
    Lossless: receivers get the same positions (sorted, as :func:`hf_demo.compression.select` returns them),
    so training is bitwise what the 16-bit code gives. A corrupted record (an upper vector without exactly
    k ones, or positions not strictly increasing) decodes to an out-of-range position, which the payload
    check reports.
    """

    name = "elias_fano"

    @staticmethod
    @functools.cache
    def split(bsize: int, k: int) -> tuple[int, int]:
        """(low bits per position, upper-vector bits per block) (cached: a handful of block shapes)."""
        low = max(0, (bsize // k).bit_length() - 1)
        return low, k + ((bsize - 1) >> low)

    def repeated(self, idx: torch.Tensor) -> torch.Tensor:
        """Never: :meth:`unpack_rows` turns a record whose positions are not strictly increasing into out-of-range
        positions (flagged by the range check)."""
        return torch.zeros(idx.shape[:-1], dtype=torch.bool, device=idx.device)

    @staticmethod
    @functools.cache
    def record_bytes(bsize: int, k: int) -> int:
        low, upper = EliasFanoIndices.split(bsize, k)
        return (k * low + upper + 7) // 8

    def nbytes(self, layout: BlockLayout) -> int:
        return _align(layout.nblocks * self.record_bytes(layout.bsize, layout.k))

    def pack(self, idx: torch.Tensor, bsize: int, k: int) -> torch.Tensor:
        """Sorted positions (nblocks, k) -> records (nblocks, record_bytes) uint8."""
        low, upper = self.split(bsize, k)
        nblocks, r, device = idx.shape[0], self.record_bytes(bsize, k), idx.device
        record = torch.zeros(nblocks, r + 2, dtype=torch.int64, device=device)
        # the bits of different positions never overlap, so adding a value shifted into place is OR-ing it
        if low:  # position i's L bits start at bit i*L and touch at most 3 bytes (L <= 16)
            start = torch.arange(k, device=device) * low
            shifted = (idx & ((1 << low) - 1)) << (start % 8)
            for byte in range(3):
                record.scatter_add_(1, (start // 8 + byte).expand(nblocks, k), (shifted >> (8 * byte)) & 0xFF)
        ones = k * low + (idx >> low) + torch.arange(k, device=device)  # the upper vector's bits
        record.scatter_add_(1, ones // 8, 1 << (ones % 8))
        return record[:, :r].to(torch.uint8)

    pack_rows = pack  # sorted positions (rows, k) -> records (rows, record_bytes): the blocks are the rows

    def unpack_rows(self, stream: torch.Tensor, rows: int, bsize: int, k: int) -> torch.Tensor:
        """Every sender's records (world, rows * record_bytes) -> positions (world, rows, k) int64; ``bsize`` (out
        of range) for every position of a corrupted record."""
        low, upper = self.split(bsize, k)
        world, nblocks, device = stream.shape[0], rows, stream.device
        records = stream.view(world, nblocks, self.record_bytes(bsize, k))
        low_part = 0
        if low:  # int32 throughout: a low part and its shift fit in 23 bits
            padded = torch.nn.functional.pad(records[:, :, : (k * low + 7) // 8], (0, 2)).int()
            start = torch.arange(k, device=device, dtype=torch.int32) * low
            byte = (start // 8).long()
            gathered = padded.index_select(2, byte)
            gathered |= padded.index_select(2, byte + 1) << 8
            gathered |= padded.index_select(2, byte + 2) << 16
            low_part = (gathered >> (start % 8)) & ((1 << low) - 1)
        first = k * low // 8  # the byte holding the upper vector's first bit
        offset = k * low - 8 * first
        upper_bits = byte_bits(records[:, :, first:])[:, :, offset : offset + upper]
        # the i-th one's position is the first bit where the running count of ones reaches i + 1: no host read,
        # no shape that depends on the data; a record without exactly k ones is flagged and decodes out of range
        seen = upper_bits.cumsum(-1, dtype=torch.int32)
        bad = seen[..., -1] != k
        wanted = torch.arange(1, k + 1, device=device, dtype=torch.int32).expand(world, nblocks, k).contiguous()
        ones = torch.searchsorted(seen, wanted).int().clamp_(max=upper - 1)
        idx = ((ones - torch.arange(k, device=device, dtype=torch.int32)) << low) | low_part
        if k > 1:
            bad |= (idx[..., 1:] <= idx[..., :-1]).any(-1)
        return torch.where(bad[..., None], bsize, idx).long()


INDEX_CODINGS_BY_NAME = {c.name: c for c in (Uint16Indices(), EliasFanoIndices())}
INDEX_CODINGS = tuple(INDEX_CODINGS_BY_NAME)


def index_coding(name: str):
    return lookup(INDEX_CODINGS_BY_NAME, "index coding", name)


def index_bytes(layout: BlockLayout, coding: str) -> int:
    return index_coding(coding).nbytes(layout)


def segment_bytes(layout: BlockLayout, fmt: str, coding: str) -> int:
    """Bytes of one parameter's segment (indices + values) in the payload."""
    return index_bytes(layout, coding) + value_format(fmt).nbytes(layout.nblocks, layout.k)


# ---------------------------------------------------------------- payload
class WireMap:
    """Where the streams of every bucket go in a payload of per-parameter segments, and back.

    A bucket's *stream* is one kind of bytes (positions, values, sign scales, sign bits) of all its members one
    after the other; in the payload each member's part lies in that member's segment (in parameter order, each
    part 4-byte aligned). Building a payload is one ``index_select`` of every stream (and a zero byte for the
    padding); reading one, one ``index_select`` per stream. The index tensors are built once per layout and
    device (:func:`wire_map`)."""

    def __init__(self, bucketing, slots):
        """``slots(layout)``: [(bytes, bytes with padding)] of each stream of one parameter, in payload order
        (the same number of streams for every parameter of a bucket)."""
        self.offsets, off = [], 0
        for layout in bucketing.layouts:
            self.offsets.append(off)
            off += sum(padded for _, padded in slots(layout))
        self.nbytes = off
        source = torch.full((off,), -1, dtype=torch.int64)  # -1: padding (the zero byte)
        self.positions, base = [], 0  # per stream: where its bytes are in the payload
        for bucket in bucketing.buckets:
            members = bucket.members
            parts = [slots(bucketing.layouts[i]) for i in members]
            for s in range(len(parts[0])):
                where = []
                for i, member_slots in zip(members, parts):
                    start = self.offsets[i] + sum(padded for _, padded in member_slots[:s])
                    where.append(torch.arange(start, start + member_slots[s][0]))
                where = torch.cat(where)
                source[where] = torch.arange(base, base + where.numel())
                base += where.numel()
                self.positions.append(where)
        self.source = torch.where(source < 0, base, source)
        self._on: dict = {}

    def _device(self, device) -> tuple[torch.Tensor, list[torch.Tensor]]:
        device = torch.device(device)
        if device not in self._on:
            self._on[device] = (self.source.to(device), [p.to(device) for p in self.positions])
        return self._on[device]

    def assemble(self, streams: list[torch.Tensor], device) -> torch.Tensor:
        """Every bucket's streams (flat uint8, in order) -> the payload."""
        if not streams:
            return torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        source, _ = self._on.get(device) or self._device(device)
        flat = torch.cat([*streams, streams[0].new_zeros(1)])
        return flat.index_select(0, source)

    def extract(self, received: torch.Tensor) -> list[torch.Tensor]:
        """Rows of every sender (world, nbytes) -> every bucket's streams, (world, bytes) each."""
        _, positions = self._on.get(received.device) or self._device(received.device)
        return [received.index_select(1, where) for where in positions]


@functools.lru_cache(maxsize=64)
def wire_map(bucketing, fmt: str, coding: str) -> WireMap:
    """The :class:`WireMap` of a payload (``fmt`` None: the positions alone, ``exchange="all_reduce"``'s)."""
    indices = index_coding(coding)

    def slots(layout):
        positions = layout.nblocks * indices.record_bytes(layout.bsize, layout.k)
        index_slot = [(positions, indices.nbytes(layout))]
        return index_slot if fmt is None else index_slot + value_format(fmt).segments(layout.nblocks, layout.k)

    return WireMap(bucketing, slots)


class PayloadCodec:
    """Packs every parameter's selected coefficients into one payload, and unpacks and validates it; the work
    is done per bucket (:mod:`hf_demo.compression`): ``encode_buckets``/``decode_buckets``."""

    def __init__(self, layouts: list[BlockLayout], fmt: str, coding: str):
        self.layouts = layouts
        self.format = value_format(fmt)
        self.indices = index_coding(coding)
        self.bucketing = compression.plan_buckets(tuple(layouts))
        self.map = wire_map(self.bucketing, fmt, coding)
        self.offsets, self.nbytes = self.map.offsets, self.map.nbytes
        self.value_streams = len(self.format.segments(1, 1))  # streams of values per bucket
        self.bounds = [coefficient_bound(bucket.bsize) for bucket in self.bucketing.buckets]

    def encode_buckets(self, selections: list[tuple[torch.Tensor, torch.Tensor]], device) -> tuple[torch.Tensor, list]:
        """[(positions, values)] per bucket, (rows, k) each -> (payload, [values as receivers decode them])."""
        streams, sent = [], []
        for bucket, (idx, values) in zip(self.bucketing.buckets, selections):
            streams.append(self.indices.pack_rows(idx, bucket.bsize, bucket.k).reshape(-1))
            decoded, wires = self.format.encode_rows(values, bucket)
            streams += wires
            sent.append(decoded)
        return self.map.assemble(streams, device), sent

    def decode_buckets(self, received: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rows of every rank (world, nbytes) -> [(positions, values) each (world, rows, k)] per bucket, validated.

        Raises :class:`DeMoPayloadError` naming the parameter and the sending ranks on out-of-range or repeated
        positions (a block naming a position twice) or NaN/Inf values; nothing is returned half-decoded. Every
        bucket's checks are made on the device and read back at once (one host read per payload, whatever the
        number of parameters); the culprit is looked for only when that read says something is wrong.
        """
        check_rows(received, self.nbytes, "payload")
        streams = iter(self.map.extract(received))
        out, flags = [], []
        for bucket, bound in zip(self.bucketing.buckets, self.bounds):
            idx = self.indices.unpack_rows(next(streams), bucket.rows, bucket.bsize, bucket.k)
            values = self.format.decode_rows([next(streams) for _ in range(self.value_streams)], bucket)
            in_range = (idx >= bucket.bsize).any(-1)
            finite = values.isfinite()
            too_large = (finite & (values.abs() > bound)).any(-1)
            flags.append(torch.stack([in_range, self.indices.repeated(idx), (~finite).any(-1), too_large]))
            out.append((idx, values))
        if flags:
            bad = torch.cat(flags, dim=2)  # (4, senders, rows): bad positions, bad values (NaN/Inf, too large)
            if bool(bad.any()):
                raise self.refusal(self.by_parameter(bad))
        return out

    def by_parameter(self, bad: torch.Tensor) -> list:
        """Row flags (4, senders, rows of every bucket) -> per parameter [[out-of-range per sender], [repeated
        per sender], [NaN/Inf per sender], [too large per sender]] (on the host: only when a flag is set)."""
        bad = bad.cpu()
        firsts, base = [], 0
        for bucket in self.bucketing.buckets:
            firsts.append(base)
            base += bucket.rows
        out = []
        for (b, row), layout in zip(self.bucketing.where, self.layouts):
            rows = bad[:, :, firsts[b] + row : firsts[b] + row + layout.nblocks]
            out.append(rows.any(-1).tolist())
        return out

    def refusal(self, bad: list) -> DeMoPayloadError:
        """The error for the first parameter whose flags (``[[out-of-range per sender], [repeated per sender],
        [NaN/Inf per sender], [too large per sender]]`` per parameter) say its positions or values are wrong."""
        for i, (layout, (bad_idx, repeated, bad_val, *too_large)) in enumerate(zip(self.layouts, bad)):
            if any(bad_idx):
                return DeMoPayloadError(
                    f"received out-of-range indices for parameter {i} (shape {layout.shape}, block of "
                    f"{layout.bsize}) from rank(s) {_senders(bad_idx)}: corrupted payload"
                )
            if any(repeated):
                return DeMoPayloadError(
                    f"received repeated positions (a block naming one position twice) for parameter {i} (shape "
                    f"{layout.shape}) from rank(s) {_senders(repeated)}: corrupted payload"
                )
            if any(bad_val):
                return DeMoPayloadError(
                    f"received NaN/Inf coefficients for parameter {i} (shape {layout.shape}) from rank(s) "
                    f"{_senders(bad_val)}"
                )
            if too_large and any(too_large[0]):
                return DeMoPayloadError(too_large_refusal(i, layout, f"from rank(s) {_senders(too_large[0])}"))
        raise AssertionError("refusal() called with no flag set")


@functools.lru_cache(maxsize=64)
def payload_codec(layouts: tuple[BlockLayout, ...], fmt: str, coding: str) -> PayloadCodec:
    """The :class:`PayloadCodec` of ``layouts`` (cached: built once, the same object every step; it holds no state
    a step changes)."""
    return PayloadCodec(list(layouts), fmt, coding)


def too_large_refusal(i: int, layout: BlockLayout, source: str) -> str:
    """The message for finite coefficients beyond :func:`coefficient_bound` for parameter ``i``."""
    return (
        f"received coefficients too large for parameter {i} (shape {layout.shape}, block of {layout.bsize}) "
        f"{source}: finite, but beyond {coefficient_bound(layout.bsize):.3g}, past which their average or the "
        "inverse transform could overflow fp32 (a corrupted or forged payload, or a sender whose momentum diverged)"
    )


def _senders(flags: list[bool]) -> list[int]:
    return [r for r, flag in enumerate(flags) if flag]


# ---------------------------------------------------------------- header
@dataclass(frozen=True)
class Header:
    step: int
    layout_checksum: int
    settings_checksum: int
    flags: int
    world_size: int
    payload_bytes: int
    payload_crc: int = 0
    fingerprint: int = 0
    exchange_ms: int = 0
    elapsed_ms: int = 0
    grad_fingerprint: int = 0
    magic: int = MAGIC
    version: int = FORMAT_VERSION
    tag: bytes = bytes(TAG_BYTES)
    header_crc: int = 0  # CRC32 of the 13 words before it (set by :func:`sign`, checked by :func:`receive_headers`)
    intact: bool = field(default=False, compare=False, repr=False)  # not a word: read (:meth:`from_bytes`) from
    # bytes whose CRC32 word matches the 13 words before it (False: corrupted on the way, or not read from bytes)

    _WORDS = (
        "magic", "version", "step", "layout_checksum", "settings_checksum", "flags", "world_size",
        "payload_bytes", "payload_crc", "fingerprint", "exchange_ms", "elapsed_ms", "grad_fingerprint",
        "header_crc",
    )  # fmt: skip
    OLD_WORDS = (12, 13)  # format versions 2 and 3 (the headers of an overlapped exchange in a checkpoint)

    def body_bytes(self) -> bytes:
        """The words the header's CRC32 and HMAC cover."""
        words = [getattr(self, w) for w in self._WORDS[:BODY_WORDS]]
        return torch.tensor(words, dtype=torch.int64, device="cpu").numpy().tobytes()

    def words_bytes(self) -> bytes:
        return self.body_bytes() + torch.tensor([self.header_crc], dtype=torch.int64, device="cpu").numpy().tobytes()

    def to_bytes(self) -> torch.Tensor:
        crc = torch.tensor([self.header_crc], dtype=torch.int64, device="cpu").numpy().tobytes()
        return torch.frombuffer(bytearray(self.body_bytes() + crc + self.tag), dtype=torch.uint8)

    @classmethod
    def from_bytes(cls, buf: torch.Tensor) -> Header:
        """A header from its bytes (this format's, or format 2's or 3's in an older checkpoint); raises
        :class:`DeMoSyncError` on any other size."""
        if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
            raise DeMoSyncError(f"a DeMo header is a flat uint8 tensor, got {_describe(buf)}")
        words = (buf.numel() - TAG_BYTES) // 8
        if buf.numel() - TAG_BYTES != words * 8 or words not in (HEADER_WORDS, *cls.OLD_WORDS):
            raise DeMoSyncError(
                f"a DeMo header of {buf.numel()} bytes: expected {HEADER_BYTES} (format {FORMAT_VERSION}) or the "
                f"{', '.join(str(w * 8 + TAG_BYTES) for w in cls.OLD_WORDS)} of formats 2 and 3 (a truncated or "
                "foreign buffer, or a checkpoint of another hf_demo version)"
            )
        raw = buf.detach().cpu().contiguous().numpy().tobytes()
        w = torch.frombuffer(bytearray(raw[: words * 8]), dtype=torch.int64).tolist()
        intact = words == HEADER_WORDS and zlib.crc32(raw[: BODY_WORDS * 8]) == w[BODY_WORDS]
        return cls(**dict(zip(cls._WORDS, w)), tag=raw[words * 8 : words * 8 + TAG_BYTES], intact=intact)


def _describe(buf) -> str:
    if isinstance(buf, torch.Tensor):
        return f"a {buf.dtype} tensor of shape {tuple(buf.shape)}"
    return f"a {type(buf).__name__}"


assert len(Header._WORDS) == HEADER_WORDS and {f.name for f in fields(Header)} >= set(Header._WORDS)


def sign(header: Header, payload: torch.Tensor, secret: bytes | None) -> Header:
    """The header with its payload CRC32 and, with a secret, its tag: 16 bytes of HMAC-SHA256 over the header
    (checked before any header field is acted on) and 16 over header and payload (checked on receipt)."""
    header = replace(header, payload_crc=crc32(payload))
    if secret is not None:
        header = replace(header, flags=header.flags | FLAG_AUTH)
        header = replace(header, tag=_tag(header, None, secret) + _tag(header, payload, secret))
    return replace(header, header_crc=zlib.crc32(header.body_bytes()))


def _tag(header: Header, payload: torch.Tensor | None, secret: bytes) -> bytes:
    body = b"" if payload is None else b"payload" + payload.detach().cpu().contiguous().numpy().tobytes()
    return hmac.new(secret, header.body_bytes() + body, hashlib.sha256).digest()[: TAG_BYTES // 2]


UNSIGNED = (
    "is not signed while this rank holds HF_DEMO_SECRET: rank {sender} does not sign its payloads and rank {rank} "
    "does (set the same HF_DEMO_SECRET on every rank), or a writer on the way without the secret rewrote it"
)
SIGNED = (
    "is signed while this rank holds no HF_DEMO_SECRET: rank {rank} does not sign its payloads and rank {sender} "
    "does (set the same HF_DEMO_SECRET on every rank), or a writer on the way rewrote it"
)
BAD_TAG = "carries no valid HMAC-SHA256 tag for this HF_DEMO_SECRET (a different secret, or injected traffic)"


GARBLED = "fails its CRC32 check (corrupted on the way: a faulty link, NIC or memory)"


def receive_headers(rows: torch.Tensor, own: Header | None, secret: bytes | None, rank: int, step: int) -> tuple:
    """Every rank's header row (world, HEADER_BYTES) -> (headers, refusal or None), checking each header's CRC32
    (and HMAC) before any of its fields is acted on. This rank (``rank``) cannot trust a header received from
    another: its CRC32 fails (corrupted on the way); it claims to be signed where this rank does not sign, or not
    where this rank does (a writer on the way, or a rank with another HF_DEMO_SECRET setting: refused, and so voted
    on, on the rank that sees it, so that every rank decides alike, also where only one rank received it
    rewritten); its HMAC fails. Its own row is always read.

    A refused header is not raised here: the other ranks received it intact and go on into the step's
    collectives, so this rank must too (raising alone would leave them waiting, and a retry on this rank alone
    would meet them in another collective). It stands in for the refused one a copy of this rank's own header
    (``own``) that changes no decision (same step, layout, settings and fingerprint; no flags of its own), and the
    refusal (a :class:`DeMoPayloadError` naming the sender) travels in the commit vote: every rank then raises,
    nothing is applied anywhere, and the step can be run again. With ``own`` None (the rows that settle a step:
    :func:`hf_demo.wire.agreement.read_rows`), None stands in for a refused header."""
    headers, refused = [], []
    for r, row in enumerate(rows):
        h = Header.from_bytes(row)
        signs = bool(h.flags & FLAG_AUTH)
        if r == rank:
            why = None
        elif not h.intact:
            why = GARBLED
        elif signs != (secret is not None):
            why = (SIGNED if signs else UNSIGNED).format(rank=rank, sender=r)
        elif secret is not None and not hmac.compare_digest(_tag(h, None, secret), h.tag[: TAG_BYTES // 2]):
            why = BAD_TAG
        else:
            why = None
        if why is not None:
            refused.append((r, why))
            h = stand_in(own) if own is not None else None
        headers.append(h)
    if not refused:
        return headers, None
    r, why = refused[0]
    return headers, header_refused(rank, r, step, why)


def stand_in(own: Header) -> Header:
    """What stands in for a header this rank refused: its own, deciding nothing the others would not (same step,
    layout, settings and fingerprint; no flags of its own), its payload CRC32 never matching."""
    neutral = own.flags & ~(FLAG_GRAD_FINGERPRINT | FLAG_DDP_SUSPECT)
    return replace(own, flags=neutral, payload_crc=~own.payload_crc & 0xFFFFFFFF)


def header_refused(rank: int, sender: int, step: int, why: str, unauthentic: bool | None = None) -> DeMoPayloadError:
    """The refusal of ``sender``'s header, voted on (its sender in ``header_sender``; ``unauthentic``: it failed
    its HMAC, did not open, or claims another signing than this rank's, which corruption and another secret
    explain alike; by default every refusal but a failed CRC32)."""
    error = DeMoPayloadError(
        f"rank {rank}: the header from rank {sender} at optimizer step {step} {why}; nothing was applied"
    )
    error.header_sender = sender
    error.unauthentic = why != GARBLED if unauthentic is None else unauthentic
    return error


def check_rows(received, nbytes: int, what: str) -> None:
    """Raise :class:`DeMoPayloadError` unless ``received`` is (senders, ``nbytes``) uint8: what every parser of
    received rows reads, so nothing is read past a row or allocated beyond what the layout sets."""
    if not isinstance(received, torch.Tensor) or received.dtype != torch.uint8 or received.dim() != 2:
        raise DeMoPayloadError(
            f"received {what} rows must be a (senders, bytes) uint8 tensor, got {_describe(received)}"
        )
    if received.shape[1] != nbytes:
        raise DeMoPayloadError(
            f"received {what} rows of {received.shape[1]} bytes where this rank's layout makes {nbytes}: truncated "
            "or oversized (a different model or settings, or corrupted traffic)"
        )


def verify_rows(headers: list[Header], received: torch.Tensor, secret: bytes | None, rank: int, step: int) -> None:
    """Every received payload row against its sender's CRC32 and (with a secret) HMAC tag (on a host copy)."""
    if not isinstance(received, torch.Tensor) or received.dim() != 2 or received.shape[0] != len(headers):
        raise DeMoPayloadError(f"rank {rank}: {len(headers)} headers for received rows {_describe(received)}")
    received = received.detach().cpu()  # one copy from the device for every row's CRC32 and HMAC
    for r, (h, row) in enumerate(zip(headers, received)):
        if crc32(row) != h.payload_crc:
            raise DeMoPayloadError(
                f"rank {rank}: the payload from rank {r} at optimizer step {step} fails its CRC32 check "
                "(corrupted on the way: a faulty link, NIC or memory); nothing was applied"
            )
        if secret is not None and not hmac.compare_digest(_tag(h, row, secret), h.tag[TAG_BYTES // 2 :]):
            raise DeMoPayloadError(
                f"rank {rank}: the payload from rank {r} at optimizer step {step} carries no valid "
                "HMAC-SHA256 tag for this HF_DEMO_SECRET: refused (a different secret, or injected traffic)"
            )


def check_headers(headers: list[Header], rank: int) -> None:
    """Raise :class:`DeMoSyncError` (on every rank alike) when any two ranks' headers disagree."""
    problems = []
    ref = headers[0]
    for r, h in enumerate(headers):
        if h.magic != MAGIC or h.version != FORMAT_VERSION:
            problems.append(
                f"rank {r} speaks wire format {h.magic:#x}/v{h.version}, expected {MAGIC:#x}/v{FORMAT_VERSION} "
                "(different hf_demo versions?)"
            )
            continue
        if h.world_size != ref.world_size:
            problems.append(f"rank {r} thinks the world has {h.world_size} ranks, rank 0 {ref.world_size}")
        if h.step != ref.step:
            problems.append(
                f"rank {r} is at optimizer step {h.step}, rank 0 at step {ref.step} (a rank skipped or "
                "repeated optimizer.step(), or resumed from another checkpoint)"
            )
        if h.layout_checksum != ref.layout_checksum:
            problems.append(
                f"rank {r} has a different parameter layout than rank 0 (layout checksum "
                f"{h.layout_checksum:#010x} vs {ref.layout_checksum:#010x}, payload {h.payload_bytes} vs "
                f"{ref.payload_bytes} bytes): different model, frozen parameters, parameter order, chunk or top-k"
            )
        elif h.payload_bytes != ref.payload_bytes:  # same parameters and blocks, another way of sending them
            problems.append(
                f"rank {r} sends a payload of {h.payload_bytes} bytes, rank 0 of {ref.payload_bytes}, for the same "
                "parameter layout: a different exchange, reduce_positions, value format or index coding"
            )
        if (h.flags & FLAG_AUTH) != (ref.flags & FLAG_AUTH):
            problems.append(
                f"rank {r} {'signs' if h.flags & FLAG_AUTH else 'does not sign'} its payloads and rank 0 "
                f"{'does' if ref.flags & FLAG_AUTH else 'does not'}: set the same HF_DEMO_SECRET on every rank"
            )
        elif h.settings_checksum != ref.settings_checksum:
            problems.append(
                f"rank {r} has different optimizer settings than rank 0 (lr, weight decay, momentum decay, "
                "value format, index coding, exchange, update rule, non-finite policy, checks or timeouts differ)"
            )
    if problems:
        raise DeMoSyncError(f"DeMo ranks disagree (seen by rank {rank}):\n  " + "\n  ".join(problems))


def settings_only(headers: list[Header]) -> bool:
    """Whether the settings checksums are all that differs between ``headers`` (a settings mismatch to name, not
    another fault)."""
    ref = headers[0]
    try:
        check_headers([replace(h, settings_checksum=ref.settings_checksum) for h in headers], 0)
    except DeMoSyncError:
        return False
    return settings_differ(headers)


def settings_differ(headers: list[Header]) -> bool:
    """Whether the ranks' settings checksums differ (same wire format, both signing or both not)."""
    ref = headers[0]
    return any(
        h.magic == ref.magic
        and h.version == ref.version
        and (h.flags & FLAG_AUTH) == (ref.flags & FLAG_AUTH)
        and h.settings_checksum != ref.settings_checksum
        for h in headers
    )


def flagged(headers: list[Header], flag: int) -> list[int]:
    return [r for r, h in enumerate(headers) if h.flags & flag]
