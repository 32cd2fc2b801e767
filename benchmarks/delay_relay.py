"""A delay line for TCP: a userspace relay that holds every chunk of bytes for a latency before forwarding it.

This machine's kernel has no netem, so a real network delay cannot be added with ``tc``. This relay is the
delay instead, outside the application and apart from the planner's model: it accepts a TCP connection, opens
one to the destination, and in each direction forwards every chunk it reads no earlier than ``delay`` seconds
after it read it, in order, intact. A message and its reply each take at least the delay, so a protocol's
round trips (gloo's ready notices, TCP's request and reply) cost what they cost on a long link; bytes take the
rate of the links around the relay (``tc`` limits them), then the delay.

What it is not: TCP's own acknowledgements run between each end and the relay, so a sender's congestion window
grows as on a short link (no slow start over the long round trip, no bandwidth-delay limit on the window).

Where the destination comes from:

- ``--target HOST:PORT``: every connection goes there (a plain port forward, as the tests use it on loopback);
- ``--transparent``: the destination the connection was made to before a NAT ``redirect`` rule sent it to the
  relay (``SO_ORIGINAL_DST``). :mod:`delay_netns` routes every node's traffic through a namespace whose
  ``nft`` rule redirects each TCP connection between nodes to this relay: gloo, the TCPStore and torchrun
  connect to each other's real addresses and never know.

``--delay-file PATH`` lets another process change the delay while it runs: the file holds the delay in
milliseconds, read when it changes; a chunk keeps the delay it was read with.

    python benchmarks/delay_relay.py --listen 127.0.0.1:9000 --target 127.0.0.1:9001 --delay-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import struct
import sys
import threading
from collections import deque
from pathlib import Path

CHUNK = 1 << 20  # the most bytes read at once
MAX_HELD = 64 << 20  # bytes held per direction before the relay stops reading (the sender then waits)
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where a connection redirected by NAT was going (IPv4)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port = struct.unpack_from("!H", raw, 2)[0]
    return socket.inet_ntoa(raw[4:8]), port


class DelayLine:
    """One direction of one connection: chunks in, the same chunks out ``delay`` seconds later."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_of) -> None:
        self.reader, self.writer, self.delay_of = reader, writer, delay_of
        self.held: deque[tuple[float, bytes]] = deque()
        self.held_bytes = 0
        self.arrived = asyncio.Event()
        self.drained = asyncio.Event()

    async def read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await self.reader.read(CHUNK)
            self.held.append((loop.time() + self.delay_of(), data))
            self.held_bytes += len(data)
            self.arrived.set()
            if not data:
                return
            while self.held_bytes > MAX_HELD:
                self.drained.clear()
                await self.drained.wait()

    async def write(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.held:
                self.arrived.clear()
                await self.arrived.wait()
            due, data = self.held[0]
            while (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            self.held.popleft()
            self.held_bytes -= len(data)
            self.drained.set()
            if not data:
                if self.writer.can_write_eof():
                    self.writer.write_eof()
                return
            self.writer.write(data)
            await self.writer.drain()


class Relay:
    """Accepts on ``listen``; forwards each connection to ``target`` (or, ``target=None``, to its NAT original
    destination) with every chunk held ``delay`` seconds each way."""

    def __init__(self, delay: float, target: tuple[str, int] | None = None, delay_file: str | None = None) -> None:
        if delay < 0:
            raise ValueError(f"the delay must be 0 or more seconds, not {delay}")
        self.delay, self.target, self.delay_file = delay, target, delay_file
        self._file_stamp = None
        self.connections = 0

    def delay_of(self) -> float:
        """The delay for a chunk read now (``--delay-file`` re-read when its modification time changes)."""
        if self.delay_file:
            try:
                stamp = Path(self.delay_file).stat().st_mtime_ns
                if stamp != self._file_stamp:
                    self._file_stamp = stamp
                    self.delay = float(Path(self.delay_file).read_text().strip()) / 1000
            except (OSError, ValueError):
                pass  # a file being rewritten: keep the last delay
        return self.delay

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        sock = writer.get_extra_info("socket")
        try:
            host, port = self.target or original_destination(sock)
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        for w in (writer, up_writer):
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            w.transport.set_write_buffer_limits(high=4 << 20)
        lines = (DelayLine(reader, up_writer, self.delay_of), DelayLine(up_reader, writer, self.delay_of))
        tasks = [asyncio.ensure_future(t) for line in lines for t in (line.read(), line.write())]
        try:
            await asyncio.gather(*tasks)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for t in tasks:
                t.cancel()
            for w in (writer, up_writer):
                w.close()

    async def serve(self, host: str, port: int, started=None) -> None:
        server = await asyncio.start_server(self.handle, host, port, reuse_address=True, backlog=512)
        if started is not None:
            started(server.sockets[0].getsockname()[1])
        async with server:
            await server.serve_forever()


def start_thread(delay: float, target: tuple[str, int], host: str = "127.0.0.1") -> tuple[int, callable]:
    """A :class:`Relay` in a daemon thread on ``host`` (a free port): (its port, a function that stops it)."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    port: list[int] = []
    relay = Relay(delay, target)

    def started(p: int) -> None:
        port.append(p)
        ready.set()

    task: list[asyncio.Task] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        task.append(loop.create_task(relay.serve(host, 0, started)))
        try:
            loop.run_until_complete(task[0])
        except asyncio.CancelledError:
            pass
        finally:  # the connections still open: cancelled, and their closing run, before the loop closes
            rest = asyncio.all_tasks(loop)
            for t in rest:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
            loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the relay did not start within 10 s")

    def stop() -> None:
        loop.call_soon_threadsafe(task[0].cancel)
        thread.join(5)

    return port[0], stop


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: write HOST:PORT, e.g. 127.0.0.1:9000")
    return host, int(port)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", type=parse_address, required=True, help="HOST:PORT to accept on")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", type=parse_address, help="HOST:PORT every connection goes to")
    where.add_argument("--transparent", action="store_true", help="each connection to its NAT original destination")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added to every chunk, ms")
    p.add_argument("--delay-file", default=None, help="a file holding the delay in ms, re-read when it changes")
    args = p.parse_args(argv)
    if args.delay_ms < 0:
        p.error(f"--delay-ms must be 0 or more, not {args.delay_ms}")
    relay = Relay(args.delay_ms / 1000, None if args.transparent else args.target, args.delay_file)

    def started(port: int) -> None:
        print(f"delay_relay: listening on {args.listen[0]}:{port}", flush=True)

    try:
        asyncio.run(relay.serve(args.listen[0], args.listen[1], started))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
