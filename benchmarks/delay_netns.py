"""An emulated cluster whose links have a real delay: network namespaces routed through a delay relay.

Topology (a star, the centre a router instead of :mod:`netns`'s bridge)::

    <prefix>-n0 [eth0 198.18.1.1/24] --veth-- [p0 198.18.1.254] \
    <prefix>-n1 [eth0 198.18.2.1/24] --veth-- [p1 198.18.2.254]  +- namespace <prefix>-rt: routes, nft, relay
    ...                                                         /

Each node's only interface is ``eth0``, its default route the router. In the router an ``nft`` NAT rule
redirects every TCP connection a node opens to another node to :mod:`delay_relay` (``--transparent``), which
connects on to the real destination and holds every chunk of bytes for the one-way delay each way. gloo, the
TCPStore and torchrun connect to each other's real addresses and see a network whose every message between
nodes takes the delay: nothing in the application emulates it. A node's traffic to itself stays on its ``lo``.

Rates as in :mod:`netns`: a token bucket (tbf or htb) on egress of each node's ``eth0`` (its upload) and of the
router's port to it (its download). The delay can change while the cluster runs (:meth:`set_delay`).

Needs root, ``ip``, ``tc`` and ``nft`` (Debian: ``apt-get install nftables``; the kernel's NAT redirect is
used, not netem). Cleanup as :class:`netns.Cluster`: the relay is one of the processes it kills, and deleting the
namespaces takes the veths, the routes and the nft table with them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import netns
from netns import _ns, _run

HERE = Path(__file__).resolve().parent
RELAY_PORT = 7999


def check_available() -> None:
    """:func:`netns.check_available`, and ``nft`` for the redirect rule."""
    netns.check_available()
    if shutil.which("nft") is None:
        raise netns.NetnsUnavailable("missing tool: nft (Debian: apt-get install nftables)")


def nft_rules(port: int) -> str:
    """The router's ruleset: every TCP connection arriving from a node's port goes to the relay on ``port``."""
    return (
        "table ip delay {\n"
        "  chain pre {\n"
        "    type nat hook prerouting priority dstnat; policy accept;\n"
        f'    iifname "p*" ip protocol tcp redirect to :{port}\n'
        "  }\n"
        "}\n"
    )


class DelayedCluster(netns.Cluster):
    """``n`` namespaces routed through a router namespace whose relay delays every byte between nodes by
    ``delay_ms`` (one way), each link limited to ``rate`` (None: the plain veth)."""

    def __init__(self, n: int, rate: str | None, delay_ms: float, shaper: str = "tbf", prefix: str | None = None):
        super().__init__(n, rate, shaper, prefix)
        if not 1 <= n <= 250:
            raise ValueError("1..250 nodes")
        self.router = self.hub = f"{self.prefix}-rt"
        self.addrs = [f"198.18.{i + 1}.1" for i in range(n)]
        self.delay_ms = delay_ms
        self.delay_file = Path(tempfile.mkdtemp(prefix="delay-")) / "delay_ms"
        self.relay: subprocess.Popen | None = None

    def setup(self) -> None:
        for ns in [self.router, *self.nodes]:
            _run(["ip", "netns", "add", ns])
            self._created.append(ns)
            _ns(ns, "ip", "link", "set", "lo", "up")
        _ns(self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for i, (ns, addr) in enumerate(zip(self.nodes, self.addrs)):
            port, gateway = f"p{i}", f"198.18.{i + 1}.254"
            _ns(self.router, "ip", "link", "add", port, "type", "veth", "peer", "name", self.ifname, "netns", ns)
            _ns(self.router, "ip", "addr", "add", f"{gateway}/24", "dev", port)
            _ns(self.router, "ip", "link", "set", port, "up")
            _ns(ns, "ip", "addr", "add", f"{addr}/24", "dev", self.ifname)
            _ns(ns, "ip", "link", "set", self.ifname, "up")
            _ns(ns, "ip", "route", "add", "default", "via", gateway)
            if self.rate:
                for where, dev in ((ns, self.ifname), (self.router, port)):
                    self._shape(where, dev)
        subprocess.run(["ip", "netns", "exec", self.router, "nft", "-f", "-"], input=nft_rules(RELAY_PORT),
                       text=True, check=True, capture_output=True)  # fmt: skip
        self.set_delay(self.delay_ms)
        self._start_relay()
        self._wait_reachable()

    def _start_relay(self) -> None:
        cmd = [sys.executable, str(HERE / "delay_relay.py"), "--listen", f"0.0.0.0:{RELAY_PORT}", "--transparent"]
        cmd += ["--delay-ms", str(self.delay_ms), "--delay-file", str(self.delay_file)]
        self.relay = subprocess.Popen(
            ["ip", "netns", "exec", self.router, *cmd],
            start_new_session=True,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._procs.append(self.relay)
        line = self.relay.stdout.readline()
        if "listening" not in line:
            raise RuntimeError(f"the delay relay did not start: {line!r} (exit {self.relay.poll()})")

    def _close(self) -> None:
        super()._close()
        shutil.rmtree(self.delay_file.parent, ignore_errors=True)

    def set_delay(self, delay_ms: float) -> None:
        """The one-way delay between nodes from now on (the relay re-reads the file when it changes)."""
        tmp = self.delay_file.with_suffix(".tmp")
        tmp.write_text(f"{delay_ms}\n")
        os.replace(tmp, self.delay_file)
        self.delay_ms = delay_ms
        time.sleep(0.05)

    def _port_ready(self, i: int) -> tuple[bool, str]:
        """Whether the router's port to node ``i`` is up, and its state in words."""
        state = _ns(self.router, "cat", f"/sys/class/net/p{i}/operstate", check=False).stdout.strip()
        return state == "up", f"router port p{i} is {state!r}"
