"""An emulated cluster on one Linux machine: network namespaces, a switch, and rate-limited links.

Topology (a star, as nodes in a rack behind one switch)::

    <prefix>-n0 [eth0 198.18.0.1/24] --veth-- [p0] \
    <prefix>-n1 [eth0 198.18.0.2/24] --veth-- [p1]  +- br0  in namespace <prefix>-sw
    ...                                            /

Every node is its own network namespace; its only interface is ``eth0``, one end of a veth pair whose other
end ``p<i>`` is a port of the bridge ``br0`` in a separate "switch" namespace. Nothing is created in the
host's namespace, and no address outside 198.18.0.0/24 (RFC 2544 benchmarking range) is ever used.

The link of every node is limited in both directions with a token bucket (``tc qdisc ... tbf`` by default,
or ``htb``): egress of ``eth0`` (the node's upload) and egress of ``p<i>`` (its download). So a node has an
R-bit/s NIC, as a machine with an R-bit/s port on a switch.

This kernel has no ``netem``: ``tc`` cannot add delay or loss. :mod:`delay_netns` puts a real delay in the path
(a router namespace whose TCP relay holds every byte between nodes, :mod:`delay_relay`); ``wan_worker.py
--delay-ms`` adds latency in the application instead.

Cleanup: :class:`Cluster` is a context manager; ``close()`` kills the processes it started (by their pid /
process group, nothing else), deletes the qdiscs and then the namespaces (which takes the veths and the
bridge with them). :func:`install_signal_handlers` turns SIGINT/SIGTERM/SIGHUP into exceptions so the
``finally`` runs on interruption too.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

SUBNET = "198.18.0"  # /24 inside 198.18.0.0/15, the benchmarking range
DEFAULT_PREFIX = "demowan"


class NetnsUnavailable(RuntimeError):
    """Raised when the machine cannot run the emulation (not root, no ``ip``/``tc``, no netns)."""


def check_available() -> None:
    """Raise :class:`NetnsUnavailable` with the reason when namespaces and qdiscs cannot be used here."""
    if not sys.platform.startswith("linux"):
        raise NetnsUnavailable(f"network namespaces need Linux (this is {sys.platform})")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise NetnsUnavailable(f"missing tool(s): {', '.join(missing)} (install iproute2)")
    if os.geteuid() != 0:
        raise NetnsUnavailable("creating network namespaces and qdiscs needs root (run as root or with sudo)")
    name = f"{DEFAULT_PREFIX}-probe{os.getpid()}"
    try:
        _run(["ip", "netns", "add", name])
    except subprocess.CalledProcessError as e:
        raise NetnsUnavailable(f"'ip netns add' failed: {e.stderr.strip() if e.stderr else e}") from None
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def _ns(ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", "netns", "exec", ns, *cmd], check=check)


def parse_rate(rate: str) -> float:
    """'100mbit' -> 1e8 bit/s (tc's units: kbit, mbit, gbit; 'k'/'m'/'g' alone too)."""
    r = rate.strip().lower()
    for suffix, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0), ("g", 1e9), ("m", 1e6), ("k", 1e3)):
        if r.endswith(suffix):
            return float(r[: -len(suffix)]) * mult
    return float(r)


def shaping_args(rate: str, kind: str = "tbf") -> list[list[str]]:
    """The tc commands (without 'tc qdisc add dev X') for a rate limit."""
    bps = parse_rate(rate)
    # veth carries GSO super-packets up to 64 KiB, so the bucket must hold at least that; beyond it, about
    # 4 ms worth of traffic (HZ=250), as tc's documentation asks for at high rates.
    burst = max(256 * 1024, int(bps / 8 / 250))
    if kind == "tbf":
        return [["root", "handle", "1:", "tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]]
    if kind == "htb":
        return [
            ["root", "handle", "1:", "htb", "default", "10"],
            [
                "parent",
                "1:",
                "classid",
                "1:10",
                "htb",
                "rate",
                rate,
                "ceil",
                rate,
                "burst",
                str(burst),
                "cburst",
                str(burst),
            ],
        ]
    raise ValueError(f"unknown shaper {kind!r} (tbf or htb)")


class Cluster:
    """``n`` namespaces on a bridge, each link limited to ``rate`` (None: unlimited veth)."""

    def __init__(self, n: int, rate: str | None, shaper: str = "tbf", prefix: str | None = None):
        if not 1 <= n <= 250:
            raise ValueError("1..250 nodes")
        self.n, self.rate, self.shaper = n, rate, shaper
        self.prefix = prefix or f"{DEFAULT_PREFIX}{os.getpid()}"
        self.switch = f"{self.prefix}-sw"
        self.hub = self.switch  # the namespace holding every node's port p<i> (delay_netns: its router)
        self.nodes = [f"{self.prefix}-n{i}" for i in range(n)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.ifname = "eth0"
        self._created: list[str] = []
        self._qdiscs: list[tuple[str, str]] = []  # (namespace, device)
        self._procs: list[subprocess.Popen] = []

    # ------------------------------------------------------------------ setup / teardown
    def __enter__(self) -> Cluster:
        try:
            self.setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def setup(self) -> None:
        for ns in [self.switch, *self.nodes]:
            _run(["ip", "netns", "add", ns])
            self._created.append(ns)
            _ns(ns, "ip", "link", "set", "lo", "up")
        _ns(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        _ns(self.switch, "ip", "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.nodes, self.addrs)):
            port = f"p{i}"
            _ns(self.switch, "ip", "link", "add", port, "type", "veth", "peer", "name", self.ifname, "netns", ns)
            _ns(self.switch, "ip", "link", "set", port, "master", "br0")
            _ns(self.switch, "ip", "link", "set", port, "up")
            _ns(ns, "ip", "addr", "add", f"{addr}/24", "dev", self.ifname)
            _ns(ns, "ip", "link", "set", self.ifname, "up")
            if self.rate:
                for where, dev in ((ns, self.ifname), (self.switch, port)):
                    self._shape(where, dev)
        self._wait_reachable()

    def _shape(self, where: str, dev: str) -> None:
        """Limit ``dev`` in namespace ``where`` to the cluster's rate (its egress), remembered for :meth:`set_rate`."""
        self._qdiscs.append((where, dev))
        for args in shaping_args(self.rate, self.shaper):
            _ns(where, "tc", "qdisc" if args[0] == "root" else "class", "add", "dev", dev, *args)

    def set_rate(self, rate: str) -> None:
        """Change every link's rate in place (``tc qdisc/class change``), e.g. mid-run. Needs a shaped cluster."""
        if not self._qdiscs:
            raise RuntimeError("set_rate needs a cluster created with a rate (an unlimited one has no qdisc)")
        for ns, dev in self._qdiscs:
            for args in shaping_args(rate, self.shaper):
                if self.shaper == "tbf":
                    _ns(ns, "tc", "qdisc", "change", "dev", dev, *args)
                elif args[0] != "root":  # htb: the class holds the rate
                    _ns(ns, "tc", "class", "change", "dev", dev, *args)
        self.rate = rate

    def set_link(self, i: int, up: bool) -> None:
        """Take node ``i``'s port at the hub down (the cable pulled: nothing passes either way) or back up."""
        _ns(self.hub, "ip", "link", "set", f"p{i}", "up" if up else "down")
        if up:
            self._wait_reachable()

    def _port_ready(self, i: int) -> tuple[bool, str]:
        """Whether node ``i``'s bridge port is forwarding (brport state 3), and its state in words."""
        state = _ns(self.switch, "cat", f"/sys/class/net/p{i}/brport/state", check=False).stdout.strip()
        return state == "3", f"bridge port p{i} state {state!r}"

    def _wait_reachable(self, timeout: float = 15.0) -> None:
        """Wait until every node's eth0 is up and its port at the hub passes traffic (:meth:`_port_ready`)."""
        deadline = time.time() + timeout
        for i, ns in enumerate(self.nodes):
            while True:
                link = _ns(ns, "cat", f"/sys/class/net/{self.ifname}/operstate", check=False).stdout.strip()
                ready, port = self._port_ready(i)
                if link == "up" and ready:
                    break
                if time.time() > deadline:
                    raise RuntimeError(f"{ns}: {self.ifname} is {link!r}, {port}")
                time.sleep(0.1)

    def close(self) -> None:
        with _signals_deferred():
            self._close()

    def _close(self) -> None:
        for p in self._procs:
            kill_tree(p)
        self._procs.clear()
        for ns, dev in reversed(self._qdiscs):
            _ns(ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        self._qdiscs.clear()
        for ns in reversed(self._created):
            _run(["ip", "netns", "del", ns], check=False)
        self._created.clear()

    # ------------------------------------------------------------------ running things in a node
    def popen(self, i: int, cmd: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        """Start ``cmd`` in node ``i`` (own process group, so it can be killed with its children)."""
        full_env = dict(os.environ if env is None else env)
        full_env["GLOO_SOCKET_IFNAME"] = self.ifname
        p = subprocess.Popen(["ip", "netns", "exec", self.nodes[i], *cmd], env=full_env, start_new_session=True, **kw)
        self._procs.append(p)
        return p

    def forget(self, p: subprocess.Popen) -> None:
        if p in self._procs:
            self._procs.remove(p)

    def counters(self, i: int) -> tuple[int, int]:
        """(tx_bytes, rx_bytes) of node i's eth0."""
        out = _ns(
            self.nodes[i],
            "cat",
            f"/sys/class/net/{self.ifname}/statistics/tx_bytes",
            f"/sys/class/net/{self.ifname}/statistics/rx_bytes",
        ).stdout.split()
        return int(out[0]), int(out[1])

    def qdisc_report(self) -> str:
        lines = []
        for ns, dev in self._qdiscs:
            lines.append(f"{ns} {dev}: " + _ns(ns, "tc", "qdisc", "show", "dev", dev, check=False).stdout.strip())
        return "\n".join(lines)


def kill_tree(p: subprocess.Popen, grace: float = 3.0) -> None:
    """Terminate the process group this module started for ``p`` (and only that one)."""
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        p.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def list_namespaces(prefix: str = DEFAULT_PREFIX) -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout.split("\n")
    return [line.split()[0] for line in out if line.strip() and line.split()[0].startswith(prefix)]


def remove_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete namespaces left behind by a killed (SIGKILL) run of this script; returns their names."""
    names = list_namespaces(prefix)
    for ns in names:
        _run(["ip", "netns", "del", ns], check=False)
    return names


class Interrupted(BaseException):
    pass


class _signals_deferred:
    """Hold SIGINT/SIGTERM/SIGHUP while cleaning up (a second Ctrl-C must not leave half a cluster)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __enter__(self):
        try:
            self.old = signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)
        except (AttributeError, ValueError):
            self.old = None
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.old)


def install_signal_handlers() -> None:
    """SIGINT/SIGTERM/SIGHUP raise :class:`Interrupted`, so every ``finally`` (the cleanup) runs."""

    def handler(signum, frame):
        raise Interrupted(f"interrupted by signal {signum}")

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, handler)
