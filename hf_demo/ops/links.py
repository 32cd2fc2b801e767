"""Links and the time a collective takes on them (ring algorithms, the ones gloo and NCCL use for these sizes).

A link is its bandwidth (bytes per second, each direction) and its one-way latency. Over ``W`` ranks:

- all-gather of ``s`` bytes per rank: ``W - 1`` ring hops, each edge carries ``(W - 1) s`` bytes;
- all-reduce of ``n`` bytes: a reduce-scatter then an all-gather, ``2 (W - 1)`` hops, each edge carries
  ``2 (W - 1) / W * n`` bytes (what :class:`hf_demo.exchange.transport.Transport` counts for an all-reduce);
- reduce-scatter of ``n`` bytes per rank (each keeps ``n / W`` of the sum): ``W - 1`` hops, each edge carries
  ``(W - 1) / W * n`` bytes (FSDP2's gradient reduction);
- broadcast of ``n`` bytes: pipelined along the ring, ``n`` bytes per edge and ``W - 1`` hops (NCCL; gloo's is a
  binomial tree, below).

Ranks spread over several nodes are limited by the link between nodes (a ring ordered by node crosses each
node's link once each way); ranks of one node by the link inside it.

Latency is paid per hop on the link that hop crosses, along the path of the chunk that arrives last (every
rank waits for it in its next collective). A ring over ``W`` ranks of which ``L`` share each of ``N`` nodes,
ordered by node, has ``N`` edges between nodes and ``W - N`` inside them; a chunk travels ``K`` consecutive
edges (``K = W - 1`` for an all-gather, a reduce-scatter or a broadcast, ``2 (W - 1)`` for an all-reduce),
and the slowest crosses the most edges between nodes: ``N`` per full turn of the ring plus
``ceil(r / L)`` (at most ``N``) in the last ``r`` edges (:func:`ring_hops`). For an all-gather on ``N >= 2``
nodes of ``L >= 2`` ranks that is ``N`` hops between nodes and ``W - N - 1`` inside (the chunk of a node's
last rank leaves its node and comes back), for an all-reduce up to ``2 N`` and ``2 (W - N - 1)``; with one
rank per node all ``K`` hops are between nodes. Not ``K`` hops at the latency between nodes.

Bytes and latency together: each round moves a chunk (``s`` for an all-gather, ``n / W`` for an all-reduce or
a reduce-scatter) across each edge, so the slowest chunk's path takes ``sum over its hops (latency + chunk /
bandwidth)``, and the busiest link needs its bytes' time plus at least one latency; a collective takes the
larger of the two. With one rank per node (every edge alike) that is exactly ``bytes / bandwidth + K
latencies``; with fast links inside the nodes, the link between nodes moves one chunk while another is in
flight elsewhere, and the sum of the two terms would overstate the time by up to half. A hierarchical
all-reduce (NCCL's tree across nodes) pays fewer hops between nodes than this flat ring: the figure here is
the ring's, the algorithm gloo runs and NCCL runs for all-gathers.

What a hop's latency costs depends on the transport. NCCL's ring writes into buffers the receiver posted in
advance: a hop costs one latency. gloo over TCP (torch's CPU backend) sends a ring step's data only once the
receiver's ready notice for it has arrived, and the receiver posts it as the step begins: a hop costs a round
trip, two latencies (``Link(..., round_trip=True)``). Measured on namespaces whose every byte between nodes a
relay holds for the latency (``benchmarks/delay_check.py``), a gloo all-gather over ``W`` ranks takes
``2 (W - 1)`` latencies, not ``W - 1``. gloo keeps two segments of a collective in flight, so a hop's round
trip and its chunk's bytes overlap: such a hop takes the longer of the two, not their sum (DDP's 1 MB buckets
at 20 Mbit/s took their bytes' time). gloo's broadcast is a binomial tree, not a ring: ``ceil(log2 W)`` rounds, each
sending the whole buffer, ``ceil(log2 W) + 1`` latencies in all (every receiver's ready notice is posted at the
start, so only the first hop waits for one).

Each collective also pays a fixed cost whatever its bytes and hops, once (``overhead``): the software's, to
launch it and to learn that it is done (the framework's dispatch, the backend's queue and threads, a kernel
launch and a device synchronisation). A latency is paid per hop and a rate per byte; this is paid per
collective, so it weighs most where the collectives are small and the links short: DeMo's step is two small
all-gathers. :data:`COLLECTIVE_OVERHEAD`, NCCL on GPUs, is the planner's default; gloo over TCP on a host pays
milliseconds. ``benchmarks/plan_check.py --measure`` measures it on its machine (a small all-gather after some
computation, as inside a step) and checks the whole model against real gloo collectives on an emulated link
with latency.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_RATE_UNITS = {"": 1.0, "bit": 1.0, "k": 1e3, "kbit": 1e3, "m": 1e6, "mbit": 1e6, "g": 1e9, "gbit": 1e9, "t": 1e12}
_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def parse_rate(text: str) -> float:
    """``"100mbit"``, ``"10gbit"``, ``"400g"`` -> bytes per second (the units of tc: bits per second)."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower().removesuffix("ps").removesuffix("/s") if m else None
    if not m or unit not in _RATE_UNITS:
        raise ValueError(f"cannot read the rate {text!r}: write it like 100mbit, 10gbit or 400g (bits per second)")
    return _finite(float(m.group(1)) * _RATE_UNITS[unit] / 8, text)


def parse_time(text: str) -> float:
    """``"20ms"``, ``"5us"``, ``"0.1"`` -> seconds."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _TIME_UNITS:
        raise ValueError(f"cannot read the time {text!r}: write it like 20ms, 5us or 0.1 (seconds)")
    return _finite(float(m.group(1)) * _TIME_UNITS[m.group(2).lower()], text)


def _finite(value: float, text: str) -> float:
    """``value``, refused (ValueError) where the number written overflows or is not one (1e999, nan, inf)."""
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


def format_rate(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    for unit, mult in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= mult:
            return f"{bits / mult:.3g} {unit}"
    return f"{bits:.3g} bit/s"


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes per second, each direction
    latency: float = 0.0  # seconds, one way
    # True where a hop's data leaves only once the receiver's ready notice has arrived (gloo over TCP): a hop
    # then costs a round trip, two latencies (module docstring); False for pre-posted buffers (NCCL): one
    round_trip: bool = False

    @classmethod
    def parse(cls, rate: str, latency: str = "0", round_trip: bool = False) -> Link:
        return cls(parse_rate(rate), parse_time(latency), round_trip)

    @property
    def hop_latency(self) -> float:
        """Seconds of latency one ring hop pays on this link: one latency, or two with ``round_trip``."""
        return self.latency * (2 if self.round_trip else 1)

    def seconds(self, edge_bytes: float, hops: int) -> float:
        return edge_bytes / self.bandwidth + hops * self.hop_latency


def all_gather_edge_bytes(nbytes: float, world: int) -> float:
    return (world - 1) * nbytes


def all_reduce_edge_bytes(nbytes: float, world: int) -> float:
    return 2 * (world - 1) / world * nbytes if world > 1 else 0.0


def reduce_scatter_edge_bytes(nbytes: float, world: int) -> float:
    return (world - 1) / world * nbytes


HOPS = {"all_gather": 1, "all_reduce": 2, "reduce_scatter": 1, "broadcast": 1, "all_to_all": 1}  # times W - 1

# NCCL on GPUs: ~10 us to launch a collective from PyTorch (dispatch, the kernel launch) and ~10 us of the
# collective's own start-up (NCCL's tuning model, src/graph/tuning.cc: a base latency of 4 to 17 us per
# collective, by version, algorithm and protocol, on top of each hop's).
COLLECTIVE_OVERHEAD = 20e-6  # seconds per collective


def collective_seconds(
    kind: str,
    nbytes: float,
    world: int,
    link: Link,
    inner: Link | None = None,
    per_node: int = 1,
    overhead: float = 0.0,
) -> float:
    """Seconds of one collective of ``kind`` (all_gather, all_reduce, reduce_scatter, broadcast, all_to_all) handing
    ``nbytes`` per rank, its bytes limited by ``link``; with ``inner`` and ``per_node`` ranks on each node, the
    hops inside a node pay ``inner``'s latency and only those between nodes ``link``'s; plus ``overhead``
    seconds, the fixed cost of one collective (module docstring)."""
    if kind not in HOPS:
        raise ValueError(f"unknown collective {kind!r}")
    if world <= 1:
        return 0.0
    return overhead + _ring_seconds(kind, nbytes, world, link, inner, per_node)


def _ring_seconds(kind: str, nbytes: float, world: int, link: Link, inner: Link | None, per_node: int) -> float:
    """What :func:`collective_seconds` gives without the fixed cost: the links' time."""
    if inner is None or per_node <= 1:
        between, within = HOPS[kind] * (world - 1), 0
    else:
        between, within = ring_hops(kind, world, per_node)
    inner = inner or link
    if kind == "broadcast" and link.round_trip:
        return _tree_broadcast_seconds(nbytes, world, link, inner, per_node)
    transfer = edge_bytes(kind, nbytes, world) / link.bandwidth
    if kind == "broadcast":
        return transfer + between * link.hop_latency + within * inner.hop_latency
    chunk = nbytes if kind == "all_gather" else nbytes / world  # what one ring round moves on an edge
    path = between * _hop_seconds(link, chunk) + within * _hop_seconds(inner, chunk)
    return max(transfer + link.hop_latency, path)


def _hop_seconds(link: Link, chunk: float) -> float:
    """One ring hop of ``chunk`` bytes: its latency then its bytes; on a ``round_trip`` link (gloo) the next
    segment's ready notice travels while this one's bytes move, so the longer of the two."""
    if link.round_trip:
        return max(link.hop_latency, chunk / link.bandwidth)
    return link.latency + chunk / link.bandwidth


def _tree_broadcast_seconds(nbytes: float, world: int, link: Link, inner: Link, per_node: int) -> float:
    """gloo's broadcast (``gloo/broadcast.cc``): a binomial tree of ``ceil(log2 W)`` rounds; in round ``i`` each
    rank holding the data sends it whole to the rank ``2^i`` away. Every receiver posts its receive at the start,
    so its ready notice has arrived before its sender gets the data: the first hop costs a round trip, each later
    hop one latency. The deepest rank waits for ``ceil(log2 W)`` whole copies in turn, ``(ceil(log2 W) + 1)``
    latencies in all. With ``per_node`` ranks on each node (ranks ordered by node), the first ``log2 per_node``
    rounds stay inside the nodes (``inner``), the rest cross between them (``link``)."""
    rounds = math.ceil(math.log2(world))
    within = min(rounds, math.ceil(math.log2(per_node))) if per_node > 1 else 0
    between = rounds - within
    first = inner if within else link
    return (
        within * (nbytes / inner.bandwidth + inner.latency)
        + between * (nbytes / link.bandwidth + link.latency)
        + first.latency
    )


def ring_hops(kind: str, world: int, per_node: int) -> tuple[int, int]:
    """(hops between nodes, hops inside a node) on the path of the slowest chunk of a ring collective over
    ``world`` ranks ordered by node, ``per_node`` on each (module docstring)."""
    hops = HOPS[kind] * (world - 1)
    nodes = world // per_node
    if nodes < 2:
        return 0, hops
    turns, rest = divmod(hops, world)
    between = turns * nodes + min(nodes, -(-rest // per_node))
    return between, hops - between


def edge_bytes(kind: str, nbytes: float, world: int) -> float:
    """Bytes one ring edge carries (each direction) for a collective of ``kind``."""
    if world <= 1:
        return 0.0
    per_edge = {
        "all_gather": all_gather_edge_bytes,
        "all_reduce": all_reduce_edge_bytes,
        "reduce_scatter": reduce_scatter_edge_bytes,
    }
    return per_edge.get(kind, lambda n, w: n)(nbytes, world)


def sent_bytes(kind: str, nbytes: float, world: int) -> float:
    """What a rank's ``CommStats.bytes_sent`` counts for a collective (mean over the ranks): an all-gather its
    own row, an all-reduce or a reduce-scatter what a ring moves, a broadcast ``(W - 1) n`` on its source."""
    if world <= 1:
        return 0.0
    if kind in ("all_reduce", "reduce_scatter"):
        return edge_bytes(kind, nbytes, world)
    if kind == "broadcast":
        return nbytes * (world - 1) / world
    return nbytes
