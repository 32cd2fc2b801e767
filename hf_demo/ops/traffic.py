"""What one training step sends, collective by collective, for DDP, PowerSGD and DeMo in every layout.

DeMo's bytes are the library's own: the block layouts of :func:`hf_demo.compression.plan`, the
payload sizes of the exchange classes of :mod:`hf_demo.exchange.transport` (which size their buffers with
:mod:`hf_demo.wire.codec`), and :data:`hf_demo.wire.codec.HEADER_BYTES` for each header, exactly as the
optimizer builds them. DDP all-reduces every gradient (fp32 by default) in buckets; PowerSGD (torch's
``powerSGD_hook``) all-reduces the factors ``P`` (n x r) and ``Q`` (m x r) of each matrix it compresses and
every other tensor whole. HSDP-DeMo (:func:`hsdp_collectives`) adds FSDP2's all-gathers and reduce-scatter
inside a node and exchanges each rank's shard between nodes. Which collectives DeMo runs, on which group and
when, is what the parts that run them describe (:mod:`hf_demo.exchange.collectives`); this module sizes them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from hf_demo import compression
from hf_demo.compression import plan
from hf_demo.exchange import collectives
from hf_demo.exchange import transport as exchanges
from hf_demo.ops.shapes import Shape
from hf_demo.settings import DeMoSettings
from hf_demo.topology import owners
from hf_demo.topology.dtensor import shard_rows
from hf_demo.topology.sharded import ShardedTopology
from hf_demo.wire import agreement, codec

DDP_BUCKET_BYTES = 25 * 1024 * 1024  # DistributedDataParallel's bucket_cap_mb default
DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # and its first, smaller bucket
GROUPS = ("replicas", "shard", "fsdp")  # whose collectives a plan counts apart (Collective.group)


@dataclass(frozen=True)
class Collective:
    """One collective of a step. ``nbytes``: what each rank hands to it (an all-gather's own row); ``scope``:
    the link it runs on (``inter`` between nodes, ``intra`` inside a node); ``every``: once per that many
    steps; ``hideable``: it may run under computation (DDP's early buckets, DeMo's overlapped payload, FSDP2's
    prefetched collectives); ``parallel``: that many ranks of each node run it side by side (HSDP's local ranks,
    each exchanging its own shard), sharing the node's link; ``group``: whose collective it is, as the optimizer's
    ``comm_stats`` splits them: ``"replicas"`` (DeMo across the replicas, or a data-parallel method's own:
    ``bytes_sent``), ``"shard"`` (HSDP: DeMo over a replica's shard group, inside the node: ``intra_bytes_sent``),
    ``"fsdp"`` (FSDP2's own gathers and reduce-scatters, which DeMo does not count)."""

    name: str
    kind: str
    nbytes: float
    world: int
    scope: str
    every: float = 1
    hideable: bool = False
    parallel: int = 1  # ranks of one node running this collective at once, each in its own group, on one link
    # issued without waiting for the one before (DDP's buckets): where the backend runs collectives side by side
    # (Cluster.concurrent: gloo's two worker threads) their times overlap instead of adding up
    overlaps: bool = False
    group: str = "replicas"  # "replicas", "shard" (HSDP's shard group) or "fsdp": GROUPS


def demo_layouts(shapes: list[Shape], settings: DeMoSettings, topk_divisor: int = 1):
    topk = max(1, settings.compression_topk // topk_divisor)
    return [plan(tuple(s), settings.compression_chunk, topk) for s in shapes]


@dataclass(frozen=True)
class PayloadSize:
    """What the exchange the optimizer builds for these layouts sends (its attributes of the same names), sized
    as :func:`hf_demo.wire.codec.wire_map` lays a payload out, without building its index tensors (a 7B model's
    would take gigabytes). tests/test_ops.py checks it against the built exchange in every combination."""

    layouts: list
    payload_nbytes: int
    index_nbytes: int
    dtype: torch.dtype | None
    union: bool
    nominated: list
    collectives: tuple = ()  # what the exchange says it runs (its ``collectives``)


def _map_nbytes(layouts, fmt: str | None, coding: str) -> int:
    """``wire_map(plan(layouts), fmt, coding).nbytes``: every parameter's padded index and value slots."""
    indices, values = codec.index_coding(coding), None if fmt is None else codec.value_format(fmt)
    total = 0
    for layout in layouts:
        total += indices.nbytes(layout)
        if values is not None:
            total += sum(padded for _, padded in values.segments(layout.nblocks, layout.k))
    return total


def demo_payload(shapes, settings: DeMoSettings, world: int, value_format: str | None = None, topk_divisor=1):
    """The sizes of the exchange the optimizer builds for these shapes (:class:`PayloadSize`). The settings are
    checked by building that exchange on one small block first, so a refused combination raises the library's
    own ValueError."""
    average = "world" if settings.sync_every > 1 else None
    layouts = demo_layouts(shapes, settings, topk_divisor)
    spec = exchanges.ExchangeSpec(
        layouts,
        value_format or settings.value_format,
        settings.index_coding,
        average=average,
        world=max(world, 1),
        positions=settings.reduce_positions,
    )
    chunk = settings.compression_chunk
    probe = [plan((chunk, chunk), chunk, max(1, settings.compression_topk // topk_divisor))]
    built = exchanges.build(settings.exchange, dataclasses.replace(spec, layouts=probe))
    if settings.exchange == "all_gather":
        nbytes = _map_nbytes(layouts, spec.value_format, spec.index_coding)
        return PayloadSize(layouts, nbytes, 0, None, False, [], built.collectives)
    union = built.union
    picked = compression.plan_buckets(tuple(layouts))
    if union:
        picked = picked.with_k(lambda k: max(1, k // spec.world))
    index_nbytes = _map_nbytes(picked.layouts, None, spec.index_coding)
    nominated = list(picked.layouts)
    return PayloadSize(
        layouts, index_nbytes if union else 0, index_nbytes, built.dtype, union, nominated, built.collectives
    )


def _exchange_collectives(shapes, settings, world, scope, every, value_format, topk_divisor, parallel=1):
    """The collectives of one DeMo exchange among ``world`` ranks: what the step's agreement
    (:data:`hf_demo.wire.agreement.COLLECTIVES`) and the exchange (its ``collectives``) say they run, sized for
    these shapes."""
    ex = demo_payload(shapes, settings, world, value_format, topk_divisor)
    sizes = {"payload": ex.payload_nbytes, "positions": ex.index_nbytes, "parameters": 4 * _numel(shapes)}
    if settings.exchange == "all_reduce":  # each rank's values at every position of the union (or the leader's)
        per_block = [world * n.k if ex.union else layout.k for layout, n in zip(ex.layouts, ex.nominated)]
        sizes["values"] = sum(layout.nblocks * k for layout, k in zip(ex.layouts, per_block)) * ex.dtype.itemsize
    specs = (*agreement.COLLECTIVES, *ex.collectives)
    out = described(specs, sizes, settings, every, world, scope, parallel)
    if settings.overlap or not (settings.exchange == "all_gather" or ex.union):
        return out
    # in steady state the header rides in the exchange's first all-gather (hf_demo.wire.agreement.gather_headers)
    header = next(c for c in out if c.name == "header")
    rides = lambda c: c.kind == "all_gather" and c.name in ("payload", "positions")  # noqa: E731
    return [dataclasses.replace(c, nbytes=c.nbytes + header.nbytes) if rides(c) else c for c in out if c is not header]


def described(specs, sizes: dict, settings: DeMoSettings, every: int, world: int, scope: str, parallel: int = 1):
    """:class:`Collective` of each description in ``specs`` (:mod:`hf_demo.exchange.collectives`) that runs
    with these settings: its bytes per call (the description's, or ``sizes[its size name]``), on ``world``
    ranks over ``scope``, once per the steps its ``when`` says."""
    out = []
    for spec in specs:
        often = _often(spec.when, settings, every, world, sharded=parallel > 1)
        if often is None:
            continue
        nbytes = spec.nbytes if isinstance(spec.nbytes, int) else sizes[spec.nbytes]
        hideable = spec.overlaps and settings.overlap
        out.append(Collective(spec.name, spec.kind, nbytes, world, scope, often, hideable, parallel))
    return out


def _often(when: str, settings: DeMoSettings, every: int, world: int, sharded: bool = False) -> float | None:
    """Once per how many steps a collective described as running ``when`` runs (None: never, here). The vote is
    not counted where a steady step's verdict settles in the next exchange (hf_demo.optim.phases.vote)."""
    from hf_demo.optim import update_rules

    rules = update_rules.RULES
    whole = (rules[settings.update_rule].whole_matrix and every == 1) or (
        rules[settings.inner_rule].whole_matrix and every > 1
    )
    settles = settings.commit_vote == "on" and settings.exchange == "all_gather" and every == 1 and not sharded
    voting = not settings.overlap and settings.commit_vote != "off" and world > 1 and not settles
    return {
        collectives.EXCHANGE: every,
        collectives.COMMIT_VOTE: every if voting else None,
        collectives.FULL_SYNC: settings.full_sync_every if settings.full_sync_every and world > 1 else None,
        collectives.CHECK: settings.check_every or None,
        collectives.LOCAL_STEP: every / (every - 1) if every > 1 else None,
        collectives.WHOLE_MATRIX_STEP: 1 if whole else None,
        collectives.BUDGET: every if settings.comm_budget > 0 else None,
    }[when]


def _numel(shapes) -> int:
    return sum(math.prod(s) for s in shapes)


def demo_collectives(
    shapes: list[Shape],
    settings: DeMoSettings,
    nodes: int,
    devices_per_node: int,
    value_format: str | None = None,
    topk_divisor: int = 1,
    sync_every: int | None = None,
    layout: str = "flat",
    param_bytes: int = 4,
) -> list[Collective]:
    """Every collective of DeMo's step with these settings (a policy tier: its value format, top-k divisor and
    sync_every) on ``nodes`` x ``devices_per_node`` ranks. ``layout``: ``flat`` (DeMo between every rank) or
    ``hsdp`` (:func:`hsdp_collectives`: FSDP2 inside a node, DeMo between nodes)."""
    every = sync_every or settings.sync_every
    world = nodes * devices_per_node
    tier = (value_format, topk_divisor)
    if layout == "hsdp" and devices_per_node > 1:
        return hsdp_collectives(shapes, settings, nodes, devices_per_node, every, tier, param_bytes)
    return _exchange_collectives(shapes, settings, world, "inter" if nodes > 1 else "intra", every, *tier)


def shard_shapes(shapes: list[Shape], shards: int, index: int) -> list[Shape]:
    """The local shapes shard ``index`` of ``shards`` holds under FSDP2 (``torch.chunk`` along dim 0); a tensor
    with no rows there is left out, as DeMo leaves it out."""
    rows = {n: shard_rows(n, shards)[index] for n in {s[0] for s in shapes}}  # once per length: O(tensors + shards)
    return [(rows[s[0]], *s[1:]) for s in shapes if rows[s[0]]]


def hsdp_collectives(shapes, settings, nodes, devices_per_node, every, tier=(None, 1), param_bytes=4):
    """HSDP-DeMo on ``nodes`` x ``devices_per_node`` ranks (:mod:`hf_demo.fsdp`): the model sharded by FSDP2
    over the ``L = devices_per_node`` ranks of a node, DeMo across the nodes.

    - inside a node, every step: FSDP2 all-gathers each layer's parameters for the forward and again for the
      backward (each rank hands its shard, ``2 (L-1)/L`` of the parameters' bytes cross each edge) and
      reduce-scatters the fp32 gradients (``(L-1)/L`` of them); FSDP2 prefetches and overlaps them with the
      computation (``hideable``);
    - inside a node: what the sharded topology runs over the shard group, as ``ShardedTopology.COLLECTIVES``
      describes it (its agreement at each exchange, drift check and local step; the whole matrices of the
      rules that need them; the budget policy's figures);
    - between nodes: each of the ``L`` local ranks exchanges its shard's DeMo payload with its replicas
      (``parallel``: the ``L`` exchanges share the node's link); ``nbytes`` is the mean over the local ranks.
    """
    L = devices_per_node
    shard_bytes = param_bytes * _numel(shapes) / L
    out = [
        Collective("fsdp_all_gather_forward", "all_gather", shard_bytes, L, "intra", hideable=True, group="fsdp"),
        Collective("fsdp_all_gather_backward", "all_gather", shard_bytes, L, "intra", hideable=True, group="fsdp"),
        Collective(
            "fsdp_reduce_scatter", "reduce_scatter", 4 * _numel(shapes), L, "intra", hideable=True, group="fsdp"
        ),  # fmt: skip
    ]
    node = described(ShardedTopology.COLLECTIVES, _shard_sizes(shapes, settings, L), settings, every, L, "intra")
    out += [dataclasses.replace(c, group="shard") for c in node]
    if nodes < 2:
        return out
    lengths = sorted({s[0] for s in shapes})
    rows = {n: shard_rows(n, L) for n in lengths}
    sized: dict[tuple, list[Collective]] = {}  # ranks holding the same rows of every tensor send the same: sized once
    per_rank = []
    for r in range(L):
        key = tuple(rows[n][r] for n in lengths)
        if key not in sized:
            sized[key] = _exchange_collectives(shard_shapes(shapes, L, r), settings, nodes, "inter", every, *tier, L)
        per_rank.append(sized[key])
    for mine in zip(*per_rank):  # the same collectives on every local rank, each for its own shard
        out.append(dataclasses.replace(mine[0], nbytes=sum(m.nbytes for m in mine) / L))
    return out


def _shard_sizes(shapes, settings, shards: int) -> dict:
    """The sizes of the sharded topology's collectives over the shard group: ``matrices``
    (:class:`hf_demo.topology.sharded.ShardedMatrices`), the owner scheme's bytes each way (each rank's fp32 rows
    of the matrices others own, and back: :func:`hf_demo.topology.owners.owner_bytes`), counted for every tensor
    of 2 or more dimensions (an upper bound where Muon-style groups leave the embeddings and head out);
    ``figures`` (``agree_figures``), the budget policy's figures."""
    from hf_demo.optim import policy as policies

    rows = owners.owner_bytes([tuple(s) for s in shapes if len(s) >= 2], shards)
    figures = 0
    if settings.comm_budget > 0:
        tiers = policies.tiers(
            settings.value_format, settings.exchange, settings.sync_every, settings.policy_sync_every
        )
        figures = 8 * (2 + len(tiers))
    return {"matrices": rows, "figures": figures}


def ddp_collectives(
    shapes: list[Shape], world: int, scope: str, grad_bytes: int = 4, buffers: bool = True
) -> list[Collective]:
    """DDP's step: the broadcast of the model's buffers before the forward (:func:`ddp_buffer_broadcast`; none
    without ``buffers``), then its gradient all-reduces, one per bucket, each issued as its bucket fills without
    waiting for the one before (``overlaps``); every bucket but the last may run during the backward pass."""
    total = grad_bytes * sum(math.prod(s) for s in shapes)
    sizes, rest = [], total
    cap = DDP_FIRST_BUCKET_BYTES
    while rest > 0:
        sizes.append(min(cap, rest))
        rest -= sizes[-1]
        cap = DDP_BUCKET_BYTES
    return ([ddp_buffer_broadcast(world, scope)] if buffers else []) + [
        Collective(f"bucket{i}", "all_reduce", b, world, scope, hideable=i < len(sizes) - 1, overlaps=True)
        for i, b in enumerate(sizes)
    ]


def ddp_buffer_broadcast(world: int, scope: str) -> Collective:
    """DistributedDataParallel broadcasts the module's buffers from rank 0 before every forward
    (``broadcast_buffers=True``, torch's and Trainer's default) and waits for it. Every transformers language model
    has buffers (rotary frequencies, position ids): a few hundred bytes, so its bytes are left out (0) and its
    latency is not. A model without buffers skips it (``Workload.ddp_buffers=False``)."""
    return Collective("buffers", "broadcast", 0, world, scope)


def powersgd_collectives(
    shapes: list[Shape], world: int, scope: str, rank: int = 4, buffers: bool = True
) -> list[Collective]:
    """DDP's broadcast of the buffers (:func:`ddp_buffer_broadcast`, with ``buffers``), then torch's
    ``powerSGD_hook`` on one bucket: the uncompressed tensors, then ``P``, then ``Q`` all-reduced (a matrix is
    compressed where ``(n + m) r`` is less than half of ``n m``, its ``min_compression_rate``)."""
    plain = p_bytes = q_bytes = 0
    for s in shapes:
        n, m = (s[0], math.prod(s[1:])) if len(s) >= 2 else (1, math.prod(s))
        if len(s) >= 2 and (n + m) * rank * 2 < n * m:
            p_bytes, q_bytes = p_bytes + 4 * n * rank, q_bytes + 4 * m * rank
        else:
            plain += 4 * n * m
    out = [ddp_buffer_broadcast(world, scope)] if buffers else []
    out += [Collective("uncompressed", "all_reduce", plain, world, scope)] if plain else []
    return out + [
        Collective("P", "all_reduce", p_bytes, world, scope),
        Collective("Q", "all_reduce", q_bytes, world, scope),
    ]
