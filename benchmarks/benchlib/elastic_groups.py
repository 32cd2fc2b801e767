"""HSDP replica groups of ``examples/elastic.py`` on loopback around one in-process torchft Lighthouse: each replica
group is ``shards`` processes (one gloo process group of their own, FSDP2 over it, as ``torchrun --nproc_per_node``
would start them), started as one Unix process group so that a node's failure (every process at once) can be
SIGKILLed and the group restarted (tests/test_elastic.py).

A process is keyed ``"<group>-<shard>"``; its final record is ``<out>/replica<group>-<shard>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchlib.elastic import EXAMPLE, ROOT, Replica


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class ShardProcess(Replica):
    """One process of an HSDP replica group (``rid``: ``"<group>-<shard>"``)."""

    def __init__(self, group: str, shard: int, args: list[str], out: Path, env: dict, leader: int | None):
        self.rid, self.lines, self.started = f"{group}-{shard}", [], time.monotonic()
        log = open(out / f"replica{self.rid}.{int(time.time() * 1000)}.log", "w")  # noqa: SIM115 - closed with it
        popen = {"process_group": 0 if leader is None else leader}  # the leader's pid names the group
        self.proc = subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--replica-id", group, *args],
            stdout=subprocess.PIPE, stderr=log, text=True, env={**env, "RANK": str(shard), "LOCAL_RANK": str(shard)},
            cwd=ROOT, **popen,
        )  # fmt: skip
        self._log = log
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()


class ReplicaGroups:
    """``n`` HSDP replica groups of ``shards`` processes each around an in-process Lighthouse."""

    def __init__(self, n: int, shards: int, out: Path, args: list[str], extra: dict[str, list[str]] | None = None,
                 join_timeout_ms: int = 2000, heartbeat_timeout_ms: int = 2000):  # fmt: skip
        from hf_demo.elastic import lighthouse

        self.out, self.args, self.shards = Path(out), list(args), shards
        self.out.mkdir(parents=True, exist_ok=True)
        self.lighthouse = lighthouse(min_replicas=1, join_timeout_ms=join_timeout_ms,
                                     heartbeat_timeout_ms=heartbeat_timeout_ms)  # fmt: skip
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
        self.live: dict[str, ShardProcess] = {}
        self.dead: list[ShardProcess] = []
        self.go = self.out / "go"
        self.go.unlink(missing_ok=True)
        for gid in range(n):
            self.start(str(gid), (extra or {}).get(str(gid), []))
        deadline = time.monotonic() + 300
        while not all(any("ready" in x for x in r.lines) for r in self.live.values()):  # imports take a while
            if time.monotonic() > deadline or any(r.proc.poll() is not None for r in self.live.values()):
                raise RuntimeError(f"the replica groups did not all start: {[self.logs(k) for k in self.live]}")
            time.sleep(0.05)
        self.go.write_text("go")  # every replica group's first quorum at once

    def start(self, group: str, extra: list[str] = ()) -> list[ShardProcess]:
        """Start (or restart) replica group ``group``: its ``shards`` processes, ``extra`` given to its shard 0."""
        env = {**self.env, "MASTER_ADDR": "localhost", "MASTER_PORT": str(free_port()),
               "WORLD_SIZE": str(self.shards), "LOCAL_WORLD_SIZE": str(self.shards)}  # fmt: skip
        args = ["--lighthouse", self.lighthouse.address(), "--out", str(self.out), "--start-file", str(self.go),
                *self.args]  # fmt: skip
        leader = None
        started = []
        for shard in range(self.shards):
            process = ShardProcess(group, shard, [*args, *(extra if shard == 0 else [])], self.out, env, leader)
            leader = process.proc.pid if leader is None else leader
            self.live[process.rid] = process
            started.append(process)
        return started

    def members(self, group: str) -> list[str]:
        return [f"{group}-{shard}" for shard in range(self.shards)]

    def wait_exit(self, group: str, timeout: float) -> None:
        """Until every process of replica group ``group`` has exited (its ``--die-at ... --die-group``)."""
        for key in self.members(group):
            self.live[key].proc.wait(timeout)
        for key in self.members(group):
            process = self.live.pop(key)
            process.kill()
            self.dead.append(process)

    def finish(self, timeout: float) -> dict[str, dict]:
        """Wait for every live process to exit; {"<group>-<shard>": its final record}."""
        deadline = time.monotonic() + timeout
        for key, process in self.live.items():
            try:
                process.proc.wait(max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{key} did not finish in {timeout:.0f}s: {self.logs(key)}") from None
            process._log.close()
            if process.proc.returncode != 0:
                raise RuntimeError(f"{key} exited with {process.proc.returncode}: {self.logs(key)}")
        return {key: json.loads((self.out / f"replica{key}.json").read_text()) for key in self.live}

    def logs(self, key: str, tail: int = 3000) -> str:
        logs = sorted(self.out.glob(f"replica{key}.*.log"))
        return logs[-1].read_text()[-tail:] if logs else ""

    def close(self) -> None:
        for key in list(self.live):
            process = self.live.pop(key)
            if process.proc.poll() is None:
                os.kill(process.proc.pid, signal.SIGKILL)
            process.kill()
            self.dead.append(process)
        self.lighthouse.shutdown()
