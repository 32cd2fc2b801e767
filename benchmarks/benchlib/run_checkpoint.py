"""Checkpoints inside one benchmark run (``convergence.py --checkpoint-every``), so a run of hours survives the end
of the session that started it: a later ``--resume`` goes on from the last checkpoint, bit for bit where every
state is saved.

Each rank saves its own state (the model, whose parameters differ between ranks inside a local phase, the
optimizer, its data generator, torch's RNG and what it has measured) to ``step<S>.rank<R>.pt`` under one folder per
run (named by the run's key); once every rank has saved, rank 0 writes ``latest.json`` (the step, the key, a
signature of the corpus) and ``progress.json`` (the held-out losses so far, bytes sent, wall time and load: what a
report of a run still going reads), then each rank removes its older files. Every write goes to a temporary file
first, so a run killed at any moment leaves the previous checkpoint whole. A checkpoint of another corpus (a
package installed since) is refused, naming the folder to delete.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from benchlib.atomic import write_atomic

STOP_FILE = "STOP"  # a file of this name in the checkpoints' folder stops every run at its next checkpoint


def default_root() -> Path:
    return Path(os.environ.get("HF_DEMO_BENCH_CACHE", Path.home() / ".cache" / "hf-demo-bench")) / "checkpoints"


def corpus_signature(corpus: torch.Tensor) -> list[int]:
    """The corpus's length and a sum over every 997th token: enough to tell two corpora apart."""
    return [int(corpus.numel()), int(corpus[::997].long().sum())]


class RunCheckpoint:
    """The checkpoints of the run with key ``key`` under ``root``, as rank ``rank`` sees them."""

    def __init__(self, root: Path, key: str, rank: int, corpus: torch.Tensor):
        self.root = Path(root)
        self.dir = self.root / hashlib.sha1(key.encode()).hexdigest()[:16]
        self.key, self.rank, self.signature = key, rank, corpus_signature(corpus)

    def latest(self) -> int | None:
        """The step of the last complete checkpoint of this run, or None."""
        marker = self.dir / "latest.json"
        if not marker.exists():
            return None
        saved = json.loads(marker.read_text())
        if saved["key"] != self.key:
            raise ValueError(f"{self.dir} holds another run's checkpoints ({saved['key']}): delete the folder")
        if saved["corpus"] != self.signature:
            raise ValueError(
                f"the corpus changed since the checkpoint in {self.dir} (tokens/signature {saved['corpus']} then, "
                f"{self.signature} now: a package installed or removed?): delete that folder to start this run over"
            )
        return int(saved["step"])

    def load(self, step: int) -> dict:
        return torch.load(self.dir / f"step{step}.rank{self.rank}.pt", weights_only=False)

    def save(self, step: int, state: dict, progress: dict | None) -> None:
        """Every rank's ``state`` at ``step`` (a collective: every rank calls it); rank 0 also ``progress``."""
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.dir / f"step{step}.rank{self.rank}.pt", lambda p: torch.save(state, p))
        dist.barrier()
        if self.rank == 0:
            marker = dict(step=step, key=self.key, corpus=self.signature)
            write_atomic(self.dir / "progress.json", lambda p: p.write_text(json.dumps({**progress, "key": self.key})))
            write_atomic(self.dir / "latest.json", lambda p: p.write_text(json.dumps(marker)))
        dist.barrier()
        for old in self.dir.glob(f"step*.rank{self.rank}.pt"):
            if old.name != f"step{step}.rank{self.rank}.pt":
                old.unlink()

    def should_stop(self, deadline: float | None, now: float) -> bool:
        """Whether every rank stops here (rank 0 decides: past ``deadline``, or a STOP file in the root)."""
        flag = torch.tensor(
            [int(self.rank == 0 and ((deadline is not None and now > deadline) or (self.root / STOP_FILE).exists()))]
        )
        dist.broadcast(flag, 0)
        return bool(flag.item())


def read_progress(root: Path, keys: list[str]) -> dict[str, dict]:
    """``progress.json`` of each run among ``keys`` that has one (what a report of runs still going reads)."""
    out = {}
    for key in keys:
        path = Path(root) / hashlib.sha1(key.encode()).hexdigest()[:16] / "progress.json"
        if path.exists():
            out[key] = json.loads(path.read_text())
    return out
