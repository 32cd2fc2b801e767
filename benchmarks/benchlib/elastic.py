"""Replica groups of ``examples/elastic.py`` on loopback around one in-process torchft Lighthouse: started,
SIGKILLed and restarted by the caller (tests/test_elastic.py, benchmarks/elastic_soak.py).

Each replica is one process; its per-step JSON lines are collected as they come (:meth:`Replica.lines`), its
final record is ``<out>/replica<id>.json``. Warm standbys (:meth:`Replicas.add_standby`) are processes of the same
script that have imported everything and built their model and wait (``--standby FILE``); :meth:`Replicas.replace`
hands one a dead replica's id, and it joins the quorum as that replica group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "elastic.py"


class Replica:
    """One process of ``examples/elastic.py``: replica group ``rid``, or (``standby``: the file it waits on) a warm
    standby named ``rid`` until :meth:`take` gives it a replica group's id."""

    def __init__(self, rid: str, args: list[str], out: Path, env: dict, standby: Path | None = None):
        self.rid, self.lines, self.started, self.standby = rid, [], time.monotonic(), standby
        self.took: float | None = None  # when a standby was given its replica id (monotonic)
        log = open(out / f"replica{rid}.{int(time.time() * 1000)}.log", "w")  # noqa: SIM115 - closed with the process
        who = ["--standby", str(standby)] if standby is not None else ["--replica-id", rid]
        self.proc = subprocess.Popen(
            [sys.executable, str(EXAMPLE), *who, *args],
            stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT,
        )  # fmt: skip
        self._log = log
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                try:
                    self.lines.append(json.loads(line))
                except json.JSONDecodeError:
                    pass

    @property
    def warm(self) -> bool:
        """A standby that has imported everything and waits for its replica id."""
        return self.standby is not None and self.took is None and any("standby" in x for x in self.lines)

    def take(self, rid: str) -> None:
        """This standby becomes replica group ``rid`` (the file written whole: a rename)."""
        tmp = self.standby.with_suffix(".tmp")
        tmp.write_text(rid)
        tmp.rename(self.standby)
        self.rid, self.took = rid, time.monotonic()

    def step(self) -> int:
        """The last step this replica printed (-1: none yet)."""
        steps = [x["step"] for x in self.lines if "step" in x]
        return steps[-1] if steps else -1

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()


class Replicas:
    """``n`` replica groups of ``examples/elastic.py`` around an in-process Lighthouse."""

    def __init__(self, n: int, out: Path, args: list[str], min_replicas: int = 1, join_timeout_ms: int = 2000,
                 heartbeat_timeout_ms: int = 2000, extra: dict[str, list[str]] | None = None,
                 standbys: int = 0):  # fmt: skip
        from hf_demo.elastic import lighthouse

        self.out, self.args = Path(out), list(args)
        self.out.mkdir(parents=True, exist_ok=True)
        self.lighthouse = lighthouse(min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                                     heartbeat_timeout_ms=heartbeat_timeout_ms)  # fmt: skip
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
        self.env.pop("MASTER_ADDR", None)
        self.live: dict[str, Replica] = {}
        self.dead: list[Replica] = []
        self.standbys: list[Replica] = []  # warming or warm, not yet given an id
        self._spares = 0
        self.go = self.out / "go"
        self.go.unlink(missing_ok=True)
        for rid in range(n):
            self.start(str(rid), (extra or {}).get(str(rid), []))
        for _ in range(standbys):  # warming beside the replicas' own start-up
            self.add_standby()
        deadline = time.monotonic() + 300
        while not all(any("ready" in x for x in r.lines) for r in self.live.values()):  # imports take a while
            if time.monotonic() > deadline or any(r.proc.poll() is not None for r in self.live.values()):
                raise RuntimeError(f"the replicas did not all start: {[self.logs(rid) for rid in self.live]}")
            time.sleep(0.05)
        self.go.write_text("go")  # every replica's first quorum at once

    def start(self, rid: str, extra: list[str] = (), env: dict | None = None) -> Replica:
        """Start (or restart) replica ``rid``, with ``extra`` arguments (and ``env`` variables) for this start only."""
        args = ["--lighthouse", self.lighthouse.address(), "--out", str(self.out), "--start-file", str(self.go),
                *self.args, *extra]  # fmt: skip
        self.live[rid] = Replica(rid, args, self.out, {**self.env, **(env or {})})
        return self.live[rid]

    def add_standby(self) -> Replica:
        """Start one more warm standby (it imports, builds its model, then waits for an id)."""
        self._spares += 1
        name = f"standby{self._spares}"
        args = ["--lighthouse", self.lighthouse.address(), "--out", str(self.out), *self.args]
        replica = Replica(name, args, self.out, self.env, standby=self.out / name)
        self.standbys.append(replica)
        return replica

    def replace(self, rid: str) -> Replica | None:
        """A warm standby takes replica group ``rid``'s place (now live); None when no standby is warm yet."""
        for replica in self.standbys:
            if replica.proc.poll() is not None:
                raise RuntimeError(f"standby {replica.rid} exited with {replica.proc.returncode}: {replica.proc.args}")
        warm = [r for r in self.standbys if r.warm]
        if not warm:
            return None
        self.standbys.remove(warm[0])
        warm[0].take(rid)
        self.live[rid] = warm[0]
        return warm[0]

    def kill(self, rid: str) -> Replica:
        replica = self.live.pop(rid)
        replica.kill()
        self.dead.append(replica)
        return replica

    def wait_exit(self, rid: str, timeout: float) -> Replica:
        """Until replica ``rid`` has exited (a ``--die-at``); then it is among the dead."""
        self.live[rid].proc.wait(timeout)
        return self.kill(rid)

    def wait_step(self, rid: str, step: int, timeout: float) -> None:
        """Until replica ``rid`` has printed step ``step`` (or later); raises after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.live[rid].step() < step:
            if self.live[rid].proc.poll() is not None:
                raise RuntimeError(f"replica {rid} exited with {self.live[rid].proc.returncode}: {self.logs(rid)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {rid} did not reach step {step} in {timeout:.0f}s: {self.logs(rid)}")
            time.sleep(0.05)

    def finish(self, timeout: float) -> dict[str, dict]:
        """Wait for every live replica to exit; {replica id: its final record}."""
        deadline = time.monotonic() + timeout
        for rid, replica in self.live.items():
            try:
                replica.proc.wait(max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"replica {rid} did not finish in {timeout:.0f}s: {self.logs(rid)}") from None
            replica._log.close()
            if replica.proc.returncode != 0:
                raise RuntimeError(f"replica {rid} exited with {replica.proc.returncode}: {self.logs(rid)}")
        return {rid: json.loads((self.out / f"replica{rid}.json").read_text()) for rid in self.live}

    def logs(self, rid: str, tail: int = 3000) -> str:
        logs = sorted(self.out.glob(f"replica{rid}.*.log"))
        return logs[-1].read_text()[-tail:] if logs else ""

    def close(self) -> None:
        for rid in list(self.live):
            self.kill(rid)
        for replica in self.standbys:
            replica.kill()
        self.lighthouse.shutdown()
