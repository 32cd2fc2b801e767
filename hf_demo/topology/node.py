"""Hierarchical mode (``hierarchy="node"``): dense averaging inside a node, DeMo only between nodes.

The topology is the one the launcher already knows: ``LOCAL_WORLD_SIZE`` processes per node (torchrun and
``accelerate launch`` set it), ranks ``node * L .. node * L + L - 1`` on node ``node``. Per step:

1. gradients are averaged densely inside the node over the fast local link (one all-reduce): every local
   rank of a node then holds the node's mean gradient;
2. parameters are sharded over the local ranks (parameter ``i``, counted among all of the optimizer's
   parameters, trainable or not, belongs to local rank ``i % L``: freezing one moves no other): local rank
   ``j`` keeps the momentum of its shard only and runs DeMo for it with local rank ``j`` of every other node
   (its *inter-node group*), so each node sends one DeMo payload per step over the slow link, not ``L``;
3. each owner broadcasts its shard's new values inside the node (dense, fast link), and every rank commits.

Momentum memory per rank is divided by ``L``. Not combined with ``sync_every > 1`` or ``comm_budget``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Topology:
    world: int
    rank: int
    local_size: int

    @property
    def node(self) -> int:
        return self.rank // self.local_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_size

    @property
    def nodes(self) -> int:
        return self.world // self.local_size

    def node_ranks(self) -> list[int]:
        return [self.node * self.local_size + j for j in range(self.local_size)]

    def peer_ranks(self) -> list[int]:
        """The same local rank on every node: this rank's inter-node group."""
        return [n * self.local_size + self.local_rank for n in range(self.nodes)]


def topology(world: int, rank: int) -> Topology:
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None or not raw.isdigit() or int(raw) < 1 or world % int(raw):
        raise ValueError(
            f"hierarchy='node' needs LOCAL_WORLD_SIZE (processes per node, set by torchrun and accelerate launch) "
            f"dividing the world size {world}; got {raw!r}. Launch with torchrun/accelerate, or use hierarchy='flat'"
        )
    return Topology(world, rank, int(raw))


AGREEMENT_MAGIC = b"HDN1"  # opens check_agreement's 16 bytes: a rank in another collective sends something else


def check_agreement(transport) -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks read the same ``LOCAL_WORLD_SIZE`` (nodes
    with different numbers of processes would build different groups and wait on each other until a timeout).
    Runs before :func:`topology` validates the value, so a rank with a missing or invalid one does not leave
    the others waiting: they all raise here, naming every rank's value. One 16-byte all-gather over the whole
    world (``transport``, under ``comm_timeout``; a set-up check, not counted)."""
    import torch

    from hf_demo.errors import DeMoSyncError

    raw = os.environ.get("LOCAL_WORLD_SIZE")
    mine = AGREEMENT_MAGIC + bytes([raw is not None]) + (raw or "").encode()[:11].ljust(11, b"\0")
    try:
        rows = transport.all_gather(torch.frombuffer(bytearray(mine), dtype=torch.uint8), "hierarchy", count=False)
    except DeMoSyncError as exc:
        raise DeMoSyncError(
            f"{exc}. hierarchy='node' checks the topology first: a rank with another hierarchy setting (every rank "
            "needs the same one) fails here too"
        ) from None
    foreign = [r for r, row in enumerate(rows) if bytes(row[:4].tolist()) != AGREEMENT_MAGIC]
    if foreign:  # what a rank in another collective sent (hierarchy='flat': its exchange header)
        raise DeMoSyncError(
            f"rank {transport.rank}: hierarchy='node' checks the topology at the first step, but rank(s) {foreign} "
            "sent something else: they run with another hierarchy setting (every rank needs the same one), or "
            "called optimizer.step() a different number of times"
        )
    values = [bytes(row[5:].tolist()).rstrip(b"\0").decode(errors="replace") if row[4] else None for row in rows]
    if len(set(values)) > 1:
        raise ValueError(
            f"hierarchy='node' needs the same number of processes on every node, but the ranks read "
            f"LOCAL_WORLD_SIZE {values} (rank by rank): launch the same --nproc_per_node on every node, or use "
            "hierarchy='flat'"
        )


def check_node(transport, header, device, node: int, secret: bytes | None = None) -> None:
    """The local ranks of a node agree on the step, the parameter layout and the settings (one small all-gather
    on the node's link, before any dense collective): the headers between nodes compare only one local rank of
    each node, and a single node has no other. Raises :class:`~hf_demo.errors.DeMoSyncError` on every local
    rank alike."""
    from hf_demo.errors import DeMoSyncError
    from hf_demo.wire import codec

    header = codec.sign(header, torch.empty(0, dtype=torch.uint8), secret)  # with HF_DEMO_SECRET: its tag
    rows = transport.all_gather(header.to_bytes().to(device), "node_header")
    try:
        headers = [codec.Header.from_bytes(row) for row in rows]
        codec.verify_headers(headers, secret, transport.rank, header.step)  # another secret stops here
        codec.check_headers(headers, transport.rank)
    except DeMoSyncError as exc:
        raise DeMoSyncError(f"{exc}\n(ranks are local ranks of node {node}, hierarchy='node')") from None


def wide_dtype(params: list[torch.Tensor]) -> torch.dtype:
    """fp32, or the widest parameter dtype where wider (fp64): what the node's dense collectives carry. The same
    on every rank of the node (it depends on the parameters only)."""
    wide = torch.float32
    for p in params:
        wide = torch.promote_types(wide, p.dtype)
    return wide


def node_mean(tensors: list[torch.Tensor | None], like: list[torch.Tensor], transport) -> list[torch.Tensor]:
    """The mean over the node of each tensor (a missing one counts as zeros), one all-reduce, in fp32 or the
    parameters' wider dtype (:func:`wide_dtype`)."""
    wide = wide_dtype(like)
    flat = torch.cat(
        [(t if t is not None else torch.zeros_like(p)).reshape(-1).to(wide) for t, p in zip(tensors, like)]
    )
    transport.all_reduce(flat, "node_gradients")
    flat /= transport.world
    out, start = [], 0
    for p in like:
        out.append(flat[start : start + p.numel()].view(p.shape))
        start += p.numel()
    return out


def owners(indices: list[int], topo: Topology) -> list[int]:
    """The local rank that owns each parameter, from its position among all of the optimizer's parameters."""
    return [i % topo.local_size for i in indices]


def share(
    values: dict[int, torch.Tensor], params: list[torch.Tensor], owner_of: list[int], topo: Topology, transport
) -> list[torch.Tensor]:
    """Every owner's new values (``values``: index -> tensor, this rank's shard; ``owner_of``: each parameter's
    owner, :func:`owners`) to every rank of the node."""
    out: list[torch.Tensor | None] = [None] * len(params)
    for owner in range(topo.local_size):
        mine = [i for i in range(len(params)) if owner_of[i] == owner]
        if not mine:
            continue
        wide = wide_dtype([params[i] for i in mine])  # fp64 parameters travel as fp64
        if owner == topo.local_rank:
            buf = torch.cat([values[i].reshape(-1).to(wide) for i in mine])
        else:
            buf = torch.empty(sum(params[i].numel() for i in mine), dtype=wide, device=params[0].device)
        transport.broadcast(buf, owner, "node_parameters")
        start = 0
        for i in mine:
            out[i] = buf[start : start + params[i].numel()].view(params[i].shape).to(params[i].dtype)
            start += params[i].numel()
    return out


def groups(topo: Topology, timeout: float, backend: str | None = None):
    """(node group, inter-node group) of this rank. Every rank creates every group, in the same order."""
    from hf_demo.exchange.transport import timed_group

    node_groups = [
        timed_group([n * topo.local_size + j for j in range(topo.local_size)], timeout, backend)
        for n in range(topo.nodes)
    ]
    peer_groups = [
        timed_group([n * topo.local_size + j for n in range(topo.nodes)], timeout, backend)
        for j in range(topo.local_size)
    ]
    return node_groups[topo.node], peer_groups[topo.local_rank]
