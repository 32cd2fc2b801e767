"""A hop that waits for the receiver's ready notice (gloo over TCP) costs a round trip in the planner's links
(hf_demo.ops.links.Link.round_trip), measured on a delayed network by benchmarks/delay_check.py."""

import pytest

from hf_demo.ops.links import Link, collective_seconds


def test_a_round_trip_per_hop_doubles_the_latency_terms():
    one = Link.parse("1gbit", "20ms")
    trips = Link.parse("1gbit", "20ms", round_trip=True)
    assert trips.hop_latency == pytest.approx(0.040)
    assert one.hop_latency == pytest.approx(0.020)
    # 8 bytes over 4 nodes: an all-gather's 3 hops, an all-reduce's 6, bytes negligible
    assert collective_seconds("all_gather", 8, 4, trips) == pytest.approx(3 * 0.040, rel=1e-3)
    assert collective_seconds("all_gather", 8, 4, one) == pytest.approx(3 * 0.020, rel=1e-3)
    assert collective_seconds("all_reduce", 8, 4, trips) == pytest.approx(6 * 0.040, rel=1e-3)
    assert collective_seconds("broadcast", 8, 4, trips) == pytest.approx(3 * 0.040, rel=1e-3)


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
