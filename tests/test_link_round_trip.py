"""A hop that waits for the receiver's ready notice (gloo over TCP) costs a round trip in the planner's links
(hf_demo.ops.links.Link.round_trip), measured on a delayed network by benchmarks/delay_check.py."""

import pytest

from hf_demo.ops.links import Link, collective_seconds
from hf_demo.ops.methods import Cluster, Estimate, Workload, ddp_adamw
from hf_demo.ops.traffic import ddp_collectives, powersgd_collectives


def test_a_round_trip_per_hop_doubles_the_latency_terms():
    one = Link.parse("1gbit", "20ms")
    trips = Link.parse("1gbit", "20ms", round_trip=True)
    assert trips.hop_latency == pytest.approx(0.040)
    assert one.hop_latency == pytest.approx(0.020)
    # 8 bytes over 4 nodes: an all-gather's 3 hops, an all-reduce's 6, bytes negligible
    assert collective_seconds("all_gather", 8, 4, trips) == pytest.approx(3 * 0.040, rel=1e-3)
    assert collective_seconds("all_gather", 8, 4, one) == pytest.approx(3 * 0.020, rel=1e-3)
    assert collective_seconds("all_reduce", 8, 4, trips) == pytest.approx(6 * 0.040, rel=1e-3)
    # a broadcast is gloo's binomial tree, not a ring: 2 rounds, 3 latencies (test_gloo_broadcasts_along_...)
    assert collective_seconds("broadcast", 8, 4, trips) == pytest.approx(3 * 0.020, rel=1e-3)


def test_round_trips_inside_and_between_nodes():
    inter = Link.parse("10gbit", "10ms", round_trip=True)
    intra = Link.parse("400gbit", "5us", round_trip=True)
    # 2 nodes of 4 ranks: an all-gather's slowest chunk crosses 2 hops between nodes and 5 inside
    got = collective_seconds("all_gather", 1, 8, inter, intra, per_node=4)
    assert got == pytest.approx(2 * 0.020 + 5 * 10e-6, rel=1e-3)


def test_bytes_bound_collectives_pay_the_round_trip_once():
    trips = Link.parse("20mbit", "50ms", round_trip=True)
    nbytes = 10e6  # 10 MB all-gathered over 2 nodes: 4 s of bytes
    assert collective_seconds("all_gather", nbytes, 2, trips) == pytest.approx(nbytes / 2.5e6 + 0.1, rel=1e-6)


def test_default_is_one_latency_per_hop():
    assert Link(1e9, 0.02).round_trip is False
    assert Link(1e9, 0.02).seconds(0, 3) == pytest.approx(0.06)
    assert Link(1e9, 0.02, round_trip=True).seconds(0, 3) == pytest.approx(0.12)


def test_gloo_hops_overlap_the_round_trip_with_the_bytes():
    """gloo keeps two segments in flight: a hop takes the longer of its round trip and its chunk's bytes (DDP's
    1 MB bucket at 20 Mbit/s and 50 ms over 4 nodes: its bytes' time plus one round trip, not the sum of every
    hop's round trip and bytes)."""
    gloo = Link.parse("20mbit", "50ms", round_trip=True)
    nccl = Link.parse("20mbit", "50ms")
    nbytes = 1 << 20
    transfer = 2 * 3 / 4 * nbytes / gloo.bandwidth
    assert collective_seconds("all_reduce", nbytes, 4, gloo) == pytest.approx(transfer + 0.1, rel=1e-6)
    assert collective_seconds("all_reduce", nbytes, 4, nccl) == pytest.approx(transfer + 6 * 0.05, rel=1e-6)


def test_gloo_broadcasts_along_a_binomial_tree():
    """gloo's broadcast (gloo/broadcast.cc) is a binomial tree: ceil(log2 W) rounds, each moving the whole buffer;
    the first hop of the deepest chain waits for a ready notice (a round trip), the later ones do not (every
    receiver posted its receive at the start). Not the ring's W - 1 hops at a round trip each (6 latencies on 4
    nodes, 14 on 8); NCCL's ring broadcast is unchanged."""
    gloo = Link.parse("1gbit", "50ms", round_trip=True)
    assert collective_seconds("broadcast", 0, 2, gloo) == pytest.approx(2 * 0.05)
    assert collective_seconds("broadcast", 0, 4, gloo) == pytest.approx(3 * 0.05)
    assert collective_seconds("broadcast", 0, 8, gloo) == pytest.approx(4 * 0.05)
    assert collective_seconds("broadcast", 0, 5, gloo) == pytest.approx(4 * 0.05)  # ceil(log2 5) = 3 rounds
    slow = Link.parse("20mbit", "0", round_trip=True)
    assert collective_seconds("broadcast", 1e6, 4, slow) == pytest.approx(2 * 1e6 / 2.5e6)  # the whole buffer twice
    assert collective_seconds("broadcast", 0, 4, Link.parse("1gbit", "50ms")) == pytest.approx(3 * 0.05)  # NCCL


def test_gloo_broadcast_rounds_inside_nodes_then_between():
    """Ranks ordered by node, 4 on each of 2 nodes: the tree's first two rounds stay inside the nodes, the third
    crosses between them; the chain's first hop (inside) pays the round trip."""
    inter = Link.parse("1gbit", "20ms", round_trip=True)
    intra = Link.parse("100gbit", "5us", round_trip=True)
    got = collective_seconds("broadcast", 1e6, 8, inter, intra, per_node=4)
    assert got == pytest.approx(2 * (1e6 / intra.bandwidth + 5e-6) + (1e6 / inter.bandwidth + 0.02) + 5e-6)


def _ddp(cluster: Cluster, shapes=((1 << 18,), (1 << 18,))) -> Estimate:
    """DDP-AdamW on 1 MiB and 1 MiB of fp32 gradients (two buckets) with 30 ms of forward+backward."""
    return ddp_adamw(cluster, Workload(list(shapes), 0.03))


def test_ddp_broadcasts_its_buffers_before_every_forward():
    """DistributedDataParallel broadcasts the module's buffers from rank 0 before each forward and waits for it
    (broadcast_buffers=True, the default): a latency-bound collective in every DDP step, PowerSGD's too."""
    world = 4
    for collectives in (
        ddp_collectives([(1 << 18,), (1 << 18,)], world, "inter"),
        powersgd_collectives([(64, 64)], world, "inter"),
    ):
        first = collectives[0]
        assert (first.kind, first.nbytes, first.hideable, first.world) == ("broadcast", 0, False, world)
    buckets = ddp_collectives([(1 << 18,), (1 << 18,)], world, "inter")[1:]
    assert [(b.nbytes, b.hideable, b.overlaps) for b in buckets] == [(1 << 20, True, True), (1 << 20, False, True)]
    assert ddp_collectives([(1 << 18,), (1 << 18,)], world, "inter", buffers=False) == buckets  # a model without
    link = Link.parse("1gbit", "50ms")
    bare = Workload([(1 << 18,)], 0.03, ddp_buffers=False)
    assert [c.kind for c in ddp_adamw(Cluster(world, 1, link, link), bare).collectives] == ["all_reduce"]


def test_gloo_runs_ddp_buckets_side_by_side_where_nccl_runs_them_in_turn():
    """ProcessGroupGloo's two worker threads run DDP's bucket all-reduces at once (measured: two 1 MiB all-reduces
    issued together took 1.03x one on 4 nodes at 50 ms): on a latency-bound link the step waits for the buffers'
    broadcast and one bucket's round trips, not for both buckets'. NCCL (one stream) runs them in turn."""
    link = Link.parse("1gbit", "50ms", round_trip=True)
    gloo, in_turn = Cluster(4, 1, link, link, 0.0, concurrent=2), Cluster(4, 1, link, link, 0.0)
    bucket = collective_seconds("all_reduce", 1 << 20, 4, link)
    broadcast = collective_seconds("broadcast", 0, 4, link)
    assert bucket == pytest.approx(6 * 0.1) and broadcast == pytest.approx(3 * 0.05)
    assert _ddp(gloo).exchange_s(gloo) == pytest.approx(broadcast + bucket)
    window = 2 / 3 * 0.03  # the backward pass after the first bucket is issued hides that much of it
    assert _ddp(in_turn).exchange_s(in_turn) == pytest.approx(broadcast + bucket + bucket - window)


def test_side_by_side_buckets_share_the_link_bytes():
    """Bytes-bound (20 Mbit/s), the buckets side by side still share the one link: the step waits for all their
    bytes (less the backward pass left after the first is issued), not for the longest bucket alone."""
    link = Link.parse("20mbit", "20ms", round_trip=True)
    gloo = Cluster(2, 1, link, link, 0.0, concurrent=2)
    both = collective_seconds("all_reduce", 2 << 20, 2, link)
    broadcast = collective_seconds("broadcast", 0, 2, link)
    assert _ddp(gloo).exchange_s(gloo) == pytest.approx(broadcast + both - 2 / 3 * 0.03)
    assert _ddp(gloo).exchange_s(gloo) > broadcast + 1.5 * collective_seconds("all_reduce", 1 << 20, 2, link)
