"""Per-parameter views of the wire codec for tests, built on the one path the step takes.

The step encodes and decodes per bucket (``encode_rows``/``decode_rows`` of a value format, ``pack_rows``/
``unpack_rows`` of an index coding, ``PayloadCodec.encode_buckets``/``decode_buckets``); a test that looks at one
parameter's values, or at a payload parameter by parameter, goes through these helpers instead of a second copy
of the codec.
"""

import torch
import torch.nn.functional as F

from hf_demo import compression
from hf_demo.compression import BlockLayout
from hf_demo.wire import codec


def one_bucket(nblocks: int, k: int) -> compression.Bucket:
    """The bucket of one parameter of ``nblocks`` blocks of ``k`` positions (a vector in blocks of ``k``)."""
    layout = BlockLayout((nblocks * k,), 1, nblocks * k, 1, k, k)
    return compression.plan_buckets((layout,)).buckets[0]


def encode_values(fmt: str, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One parameter's values (nblocks, k) -> (values as receivers decode them, its bytes on the wire: each stream
    padded to its 4-aligned segment, as the payload carries them)."""
    nblocks, k = values.shape
    f = codec.value_format(fmt)
    sent, streams = f.encode_rows(values, one_bucket(nblocks, k))
    wire = [F.pad(s.reshape(-1), (0, padded - s.numel())) for s, (_, padded) in zip(streams, f.segments(nblocks, k))]
    return sent, torch.cat(wire)


def decode_values(fmt: str, wire: torch.Tensor, nblocks: int, k: int) -> torch.Tensor:
    """Every sender's bytes (world, nbytes) of one parameter's values -> values (world, nblocks, k)."""
    f = codec.value_format(fmt)
    streams, start = [], 0
    for size, padded in f.segments(nblocks, k):
        streams.append(wire[:, start : start + size].contiguous())
        start += padded
    return f.decode_rows(streams, one_bucket(nblocks, k))


def encode_params(pc: codec.PayloadCodec, selections: list, device) -> tuple[torch.Tensor, list]:
    """[(positions, values)] per parameter -> (payload uint8, [values as receivers decode them] per parameter)."""
    idxs = compression.bucket_rows([idx for idx, _ in selections], pc.bucketing)
    values = compression.bucket_rows([v for _, v in selections], pc.bucketing)
    payload, sent = pc.encode_buckets(list(zip(idxs, values)), device)
    return payload, list(compression.Bucketed.of(sent, pc.bucketing))


def decode_params(pc: codec.PayloadCodec, received: torch.Tensor) -> list:
    """Rows of every rank (world, nbytes) -> [(positions, values) each (world, nblocks, k)] per parameter,
    validated as the step validates them (``decode_buckets``)."""
    out: list = [None] * len(pc.layouts)
    for bucket, (idx, values) in zip(pc.bucketing.buckets, pc.decode_buckets(received)):
        parts = zip(idx.split(bucket.member_blocks, dim=1), values.split(bucket.member_blocks, dim=1))
        for i, part in zip(bucket.members, parts):
            out[i] = part
    return out
