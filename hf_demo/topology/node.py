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

Momentum memory per rank is divided by ``L``. With ``sync_every > 1`` the local steps run on the node's mean
gradient for each rank's shard, shared inside the node at every step, and DeMo moves the shard's change between
nodes at each synchronisation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


class NodeTopology:
    """The pipeline's part for ``hierarchy="node"``: :meth:`select` averages the gradients inside the node and
    keeps this rank's shard; :meth:`share` gives every rank of the node the shard owners' new values."""

    name = "node"
    needs_values = True  # the new values travel inside the node before anything is committed

    def __init__(self, topo: Topology, node, transport):
        self.topo, self.node, self.transport = topo, node, transport  # node: the node's group; transport: peers

    @classmethod
    def build(cls, opt, initialised: bool, timeout: float):
        from hf_demo.exchange.transport import Transport
        from hf_demo.topology.flat import FlatTopology

        if not initialised:  # one process: the node is the world
            return FlatTopology(Transport(None, 0))
        if opt.process_group is not None:
            raise ValueError("hierarchy='node' builds its groups from the whole world: pass no process_group")
        check_agreement(Transport(None, timeout).at(0))  # the same LOCAL_WORLD_SIZE everywhere, first
        topo = topology(dist.get_world_size(), dist.get_rank())
        node_group, peer_group = groups(topo, timeout, dist.get_backend())
        return cls(topo, Transport(node_group, timeout), Transport(peer_group, timeout))

    def _node_at(self, ctx):
        return self.node.at(ctx.transport.step, ctx.transport.traffic)

    def select(self, ctx) -> None:
        from hf_demo.wire import codec

        node = self._node_at(ctx)
        here = codec.Header(ctx.transport.step, ctx.layout_ck, ctx.settings_ck, 0, node.world, 0)
        device = ctx.all_items[0][0].device if ctx.all_items else torch.device("cpu")
        check_node(node, here, device, self.topo.node, ctx.opt.secret)
        params = [p for p, _, _ in ctx.all_items]
        every = node_mean([p.grad for p in params], params, node)
        ctx.owner_of = owners(ctx.opt.positions(params), self.topo)
        mine = [j for j, owner in enumerate(ctx.owner_of) if owner == self.topo.local_rank]
        ctx.items = [ctx.all_items[j] for j in mine]
        ctx.grads = [every[j] for j in mine]
        # every node-mean gradient is checked, not only this rank's shard: they are the same on every local rank of
        # a node (one all-reduce), so all local ranks raise the same flag and every inter-node group skips alike
        ctx.checked_grads = every

    def share(self, ctx) -> None:
        params = [p for p, _, _ in ctx.all_items]
        shared = share(ctx.values, params, ctx.owner_of, self.topo, self._node_at(ctx))
        for p, value in zip(params, shared):
            ctx.tx.copy(p, value)

    def owners_of(self, opt, params) -> list[int]:
        return owners(opt.positions(params), self.topo)

    def identity(self) -> tuple[int, int, str]:
        """(rank, world size, scope): the rank in the whole world (two local ranks share their peer-group rank)."""
        return dist.get_rank(), dist.get_world_size(), "world"

    def mean_over_ranks(self, params, transport, name: str, every, owner_of) -> dict:
        """The mean over every rank of the anchored ``params`` this rank owns (over the peers), shared inside the
        node: {param: mean} for ``every`` trainable parameter (``owner_of`` each)."""
        from hf_demo.topology.flat import dense_mean

        means = dense_mean(params, transport, name)
        values = {j: means[p] for j, p in enumerate(every) if p in means}
        shared = share(values, every, owner_of, self.topo, self.node.at(transport.step, transport.traffic))
        return dict(zip(every, shared))
