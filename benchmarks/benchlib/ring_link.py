"""An emulated link under real gloo collectives: the time a ring collective takes on a topology with latency.

This kernel has no netem, so the latency and the rate of a link are emulated in the application: before each
collective every rank sleeps :func:`ring_seconds`, the time the collective's ring takes on the emulated
topology, then the real gloo collective runs on loopback (its own time counts on top, as the base latency of
the loopback "link"). :func:`ring_seconds` is an event simulation of the ring written from what the messages
do, independent of the planner's formulas (:mod:`hf_demo.ops.links`), so a measurement checks them:

- ranks ``0 .. W-1`` in a ring ordered by node (``node_of[r]``: rank ``r``'s node), rank ``r`` sending to
  ``r + 1``; a message of ``s`` bytes on the edge ``r -> r + 1`` takes ``s / bandwidth + latency`` of that
  edge (between nodes or inside one), and an edge carries one message at a time;
- all-gather: ``W - 1`` rounds, each rank forwarding the chunk it received in the round before (``s`` =
  the bytes each rank hands over); all-reduce: a reduce-scatter then an all-gather, ``2 (W - 1)`` rounds of
  chunks of ``n / W``; broadcast: the message forwarded along the ring from rank 0;
- the collective ends when the last message arrives (every rank waits for the slowest in the next one).

What it departs from on a real link: a message is sent as soon as it is ready (an eager link, as NCCL's
pre-posted ring buffers behave). gloo's TCP pairs send an unbound buffer only once the receiver's "ready"
notice has arrived (gloo/transport/tcp/pair.cc, ``handleRemotePendingRecv``), so over a truly delayed link
gloo pays up to a round trip per ring round, which this emulation (and the planner) does not; nor TCP's
slow start after idle, nor jitter.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Edge:
    bandwidth: float  # bytes per second; float("inf") for no limit
    latency: float  # seconds, one way


@dataclass(frozen=True)
class Topology:
    """``nodes`` x ``per_node`` ranks, rank ``r`` on node ``r // per_node``."""

    nodes: int
    per_node: int
    inter: Edge
    intra: Edge

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def edge(self, rank: int) -> Edge:
        """The edge from ``rank`` to the next rank of the ring."""
        nxt = (rank + 1) % self.world
        return self.intra if rank // self.per_node == nxt // self.per_node else self.inter


def _rounds(topo: Topology, chunk: float, rounds: int) -> float:
    """Every rank sends ``rounds`` chunks of ``chunk`` bytes to the next, each (after the first) once it has
    received the one before; the time the last one arrives."""
    w = topo.world
    arrived = [0.0] * w  # when rank r received its chunk of the previous round
    edge_free = [0.0] * w  # when the edge r -> r+1 is free again
    for _ in range(rounds):
        nxt = [0.0] * w
        for r in range(w):
            e = topo.edge(r)
            start = max(arrived[r], edge_free[r])
            edge_free[r] = start + chunk / e.bandwidth
            nxt[(r + 1) % w] = edge_free[r] + e.latency
        arrived = nxt
    return max(arrived)


def ring_seconds(kind: str, nbytes: float, topo: Topology) -> float:
    """Seconds one collective of ``kind`` takes on ``topo``, ``nbytes`` handed over by each rank (module doc)."""
    w = topo.world
    if w <= 1:
        return 0.0
    if kind == "all_gather":
        return _rounds(topo, nbytes, w - 1)
    if kind == "all_reduce":
        return _rounds(topo, nbytes / w, 2 * (w - 1))
    if kind == "broadcast":  # along the ring from rank 0, the message cut into pieces that follow each other
        path = [topo.edge(r) for r in range(w - 1)]
        return sum(e.latency for e in path) + nbytes / min(e.bandwidth for e in path)
    raise ValueError(f"unknown collective {kind!r}")
