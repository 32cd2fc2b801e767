"""What one training step sends, collective by collective, for DDP, PowerSGD and DeMo in every layout.

DeMo's bytes are the library's own: the block layouts of :func:`hf_demo.compression.blocks.plan`, the
payload sizes of the exchange classes of :mod:`hf_demo.exchange.exchanges` (which size their buffers with
:mod:`hf_demo.wire.codec`), and :data:`hf_demo.wire.codec.HEADER_BYTES` for each header, exactly as the
optimizer builds them. DDP all-reduces every gradient (fp32 by default) in buckets; PowerSGD (torch's
``powerSGD_hook``) all-reduces the factors ``P`` (n x r) and ``Q`` (m x r) of each matrix it compresses and
every other tensor whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hf_demo.compression.blocks import plan
from hf_demo.exchange import exchanges
from hf_demo.ops.shapes import Shape
from hf_demo.settings import DeMoSettings
from hf_demo.wire import agreement, codec

DDP_BUCKET_BYTES = 25 * 1024 * 1024  # DistributedDataParallel's bucket_cap_mb default
DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # and its first, smaller bucket


@dataclass(frozen=True)
class Collective:
    """One collective of a step. ``nbytes``: what each rank hands to it (an all-gather's own row); ``scope``:
    the link it runs on (``inter`` between nodes, ``intra`` inside a node); ``every``: once per that many
    steps; ``hideable``: it may run under computation (DDP's early buckets, DeMo's overlapped payload)."""

    name: str
    kind: str
    nbytes: float
    world: int
    scope: str
    every: int = 1
    hideable: bool = False


def demo_layouts(shapes: list[Shape], settings: DeMoSettings, topk_divisor: int = 1):
    topk = max(1, settings.compression_topk // topk_divisor)
    return [plan(tuple(s), settings.compression_chunk, topk) for s in shapes]


def demo_payload(shapes, settings: DeMoSettings, world: int, value_format: str | None = None, topk_divisor=1):
    """The exchange object the optimizer builds for these shapes (its buffers sized by the codec)."""
    average = "world" if settings.sync_every > 1 else None
    spec = exchanges.ExchangeSpec(
        demo_layouts(shapes, settings, topk_divisor),
        value_format or settings.value_format,
        settings.index_coding,
        average=average,
        world=max(world, 1),
        positions=settings.reduce_positions,
    )
    return exchanges.build(settings.exchange, spec)


def _exchange_collectives(shapes, settings, world, scope, every, value_format, topk_divisor, overlap):
    """The collectives of one DeMo exchange among ``world`` ranks (header first, as the optimizer does)."""
    ex = demo_payload(shapes, settings, world, value_format, topk_divisor)
    out = [Collective("header", "all_gather", codec.HEADER_BYTES, world, scope, every)]
    # the commit vote after the exchange (overlap's verdict rides in the next header instead)
    vote = (
        []
        if overlap or settings.commit_vote == "off" or world <= 1
        else [Collective("vote", "all_gather", agreement.VOTE_BYTES, world, scope, every)]
    )
    if settings.exchange == "all_gather":
        payload = Collective("payload", "all_gather", ex.payload_nbytes, world, scope, every, hideable=overlap)
        return out + [payload] + vote
    value_bytes = ex.dtype.itemsize
    if ex.union:  # every rank's nominations all-gathered, then the values at their union all-reduced
        slots = sum(layout.nblocks * world * nominated.k for layout, nominated in zip(ex.layouts, ex.nominated))
        out.append(Collective("positions", "all_gather", ex.index_nbytes, world, scope, every))
    else:  # the step's leader broadcasts its positions
        slots = sum(layout.nblocks * layout.k for layout in ex.layouts)
        out.append(Collective("positions", "broadcast", ex.index_nbytes, world, scope, every))
    values = Collective("values", "all_reduce", slots * value_bytes, world, scope, every, hideable=overlap)
    return out + [values] + vote


def demo_collectives(
    shapes: list[Shape],
    settings: DeMoSettings,
    nodes: int,
    devices_per_node: int,
    value_format: str | None = None,
    topk_divisor: int = 1,
    sync_every: int | None = None,
) -> list[Collective]:
    """Every collective of DeMo's step with these settings (a policy tier: its value format, top-k divisor and
    sync_every) on ``nodes`` x ``devices_per_node`` ranks."""
    every = sync_every or settings.sync_every
    world = nodes * devices_per_node
    n_params = sum(math.prod(s) for s in shapes)
    if settings.hierarchy == "node" and devices_per_node > 1:
        d = devices_per_node
        out = [
            Collective("node_header", "all_gather", codec.HEADER_BYTES, d, "intra"),
            Collective("node_gradients", "all_reduce", 4 * n_params, d, "intra"),
            Collective("node_parameters", "broadcast", 4 * n_params, d, "intra"),
        ]
        if nodes > 1:  # every local rank exchanges its shard with its peers; together they carry every parameter
            inter = _exchange_collectives(shapes, settings, nodes, "inter", every, value_format, topk_divisor, False)
            out += [
                Collective(c.name, c.kind, c.nbytes * (d if c.name == "header" else 1), c.world, c.scope, c.every)
                for c in inter
            ]
        return out
    scope = "inter" if nodes > 1 else "intra"
    out = _exchange_collectives(shapes, settings, world, scope, every, value_format, topk_divisor, settings.overlap)
    if settings.full_sync_every and world > 1:
        out.append(Collective("resync", "broadcast", 4 * n_params, world, scope, settings.full_sync_every))
    return out


def ddp_collectives(shapes: list[Shape], world: int, scope: str, grad_bytes: int = 4) -> list[Collective]:
    """DDP's gradient all-reduces, one per bucket; every bucket but the last may run during the backward pass."""
    total = grad_bytes * sum(math.prod(s) for s in shapes)
    sizes, rest = [], total
    cap = DDP_FIRST_BUCKET_BYTES
    while rest > 0:
        sizes.append(min(cap, rest))
        rest -= sizes[-1]
        cap = DDP_BUCKET_BYTES
    return [
        Collective(f"bucket{i}", "all_reduce", b, world, scope, hideable=i < len(sizes) - 1)
        for i, b in enumerate(sizes)
    ]


def powersgd_collectives(shapes: list[Shape], world: int, scope: str, rank: int = 4) -> list[Collective]:
    """torch's ``powerSGD_hook`` on one bucket: the uncompressed tensors, then ``P``, then ``Q`` all-reduced
    (a matrix is compressed where ``(n + m) r`` is less than half of ``n m``, its ``min_compression_rate``)."""
    plain = p_bytes = q_bytes = 0
    for s in shapes:
        n, m = (s[0], math.prod(s[1:])) if len(s) >= 2 else (1, math.prod(s))
        if len(s) >= 2 and (n + m) * rank * 2 < n * m:
            p_bytes, q_bytes = p_bytes + 4 * n * rank, q_bytes + 4 * m * rank
        else:
            plain += 4 * n * m
    out = [Collective("uncompressed", "all_reduce", plain, world, scope)] if plain else []
    return out + [
        Collective("P", "all_reduce", p_bytes, world, scope),
        Collective("Q", "all_reduce", q_bytes, world, scope),
    ]
