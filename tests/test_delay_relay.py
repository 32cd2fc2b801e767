"""The TCP delay relay of benchmarks/delay_relay.py on loopback (no root): every chunk held for the delay, each
direction, and forwarded intact and in order."""

import hashlib
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import delay_relay  # noqa: E402

DELAY = 0.05


def _echo_server():
    """A loopback server echoing every byte; records when its first byte arrived."""
    srv = socket.create_server(("127.0.0.1", 0))
    first: list[float] = []

    def serve():
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(1 << 16):
                if not first:
                    first.append(time.monotonic())
                conn.sendall(data)
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], first


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        data = sock.recv(min(1 << 16, n - got))
        if not data:
            break
        parts.append(data)
        got += len(data)
    return b"".join(parts)


@pytest.fixture
def relayed():
    port, first = _echo_server()
    relay_port, stop = delay_relay.start_thread(DELAY, ("127.0.0.1", port))
    try:
        yield relay_port, first
    finally:
        stop()


def test_each_direction_is_held_for_the_delay(relayed):
    relay_port, first = relayed
    with socket.create_connection(("127.0.0.1", relay_port)) as c:
        sent = time.monotonic()
        c.sendall(b"ping")
        assert _recv_exactly(c, 4) == b"ping"
        back = time.monotonic()
    assert first[0] - sent >= DELAY  # one way: at least the delay
    assert back - sent >= 2 * DELAY  # a round trip: at least twice


def test_bytes_arrive_intact_and_in_order(relayed):
    relay_port, _ = relayed
    payload = os.urandom(3 << 20)
    with socket.create_connection(("127.0.0.1", relay_port)) as c:
        sender = threading.Thread(target=lambda: (c.sendall(payload), c.shutdown(socket.SHUT_WR)))
        sender.start()
        echoed = _recv_exactly(c, len(payload) + 1)  # +1: the relay passes the end of the stream on too
        sender.join()
    assert len(echoed) == len(payload)
    assert hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest()


def test_a_later_chunk_is_not_sent_before_its_own_delay(relayed):
    """Two writes 0.1 s apart: the second arrives at least the delay after it was written, not with the first."""
    relay_port, _ = relayed
    with socket.create_connection(("127.0.0.1", relay_port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.sendall(b"a")
        assert _recv_exactly(c, 1) == b"a"
        time.sleep(0.1)
        second = time.monotonic()
        c.sendall(b"b")
        assert _recv_exactly(c, 1) == b"b"
        assert time.monotonic() - second >= 2 * DELAY


def test_delay_file_changes_the_delay(tmp_path):
    path = tmp_path / "delay_ms"
    path.write_text("30\n")
    relay = delay_relay.Relay(0.0, ("127.0.0.1", 1), str(path))
    assert relay.delay_of() == pytest.approx(0.030)
    path.write_text("not a number")  # being rewritten: the last delay holds
    assert relay.delay_of() == pytest.approx(0.030)


def test_refuses_a_negative_delay():
    with pytest.raises(ValueError, match="0 or more"):
        delay_relay.Relay(-0.01, ("127.0.0.1", 1))


def test_the_check_plans_each_run_and_the_router_redirects_tcp():
    """benchmarks/delay_check.py's tables from recorded runs (no namespaces): DeMo's bytes checked against the
    planner's, a round trip per hop planned beside one latency per hop; delay_netns's nft rule."""
    import delay_check
    import delay_netns
    from hf_demo.ops.methods import Workload

    rule = delay_netns.nft_rules(7999)
    assert 'iifname "p*" ip protocol tcp redirect to :7999' in rule and "type nat hook prerouting" in rule
    cluster = delay_check.delayed_cluster(2, "1gbit", 20.0, round_trip=True)
    from plan_check import llama_shapes

    work = Workload(llama_shapes(delay_check.MODEL), 0.1, 0.5, 0.4)
    sent = delay_check.estimate("demo-bf16", cluster, work).rank_bytes()

    def rank(step, comm, sent_bytes):
        return dict(step_s=step, fwd_bwd_s=0.1, opt_s=0.05 + comm, comm_s=comm, sent=sent_bytes)

    records = [
        dict(nodes=2, delay_ms=20.0, rate="1gbit", method=m, repeat=i, load=["3.0", "2", "1"], ranks=[r, r])
        for i in range(3)
        for m, r in (("demo-bf16", rank(0.2, 0.05, sent)), ("adamw", rank(0.3, 0.0, 0.0)))
    ]
    records.append(dict(nodes=2, delay_ms=20.0, rate="1gbit", method="probe", load=["3.0"],
                        probes=[dict(kind="all_gather", nbytes=8, seconds=0.045)]))  # fmt: skip
    rows = delay_check.plan(delay_check.summarize(records), 0.4)
    demo = next(r for r in rows if r["method"] == "demo-bf16")
    assert demo["note"] == "bytes exact" and demo["runs"] == 3
    assert demo["planned_wait_s"] == pytest.approx(2 * demo["planned_wait_one_s"], rel=0.01)  # 2 x 20 ms, 1 x 20 ms
    assert demo["wait_s"] == pytest.approx(0.05)
    text = "\n".join(delay_check.table(rows))
    assert "| 2 | 20 ms | 1gbit | DeMo defaults |" in text and "| 2 | 20 ms | 1gbit | DDP-AdamW |" in text
    [probe] = delay_check.probe_rows(records)
    assert probe["round_trip"] == pytest.approx(0.040, rel=0.01) and probe["one"] == pytest.approx(0.020, rel=0.01)
    one = delay_check.planned_probe("all_reduce", 1 << 20, cluster)  # two at once on gloo: the time of one
    assert delay_check.planned_probe("all_reduce_pair", 1 << 20, cluster) == pytest.approx(one)
    nccl = delay_check.delayed_cluster(2, "1gbit", 20.0, round_trip=False)  # in turn: twice
    assert delay_check.planned_probe("all_reduce_pair", 1 << 20, nccl) == pytest.approx(
        2 * delay_check.planned_probe("all_reduce", 1 << 20, nccl)
    )
