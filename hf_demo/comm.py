"""Moving bytes between ranks, counting them, and checking that every rank is in the same step.

All traffic goes through :func:`all_gather_bytes`, so the counters in :class:`CommStats` are counted from
the very buffers handed to ``torch.distributed``.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .codec import FLAG_NONFINITE, FORMAT_VERSION, MAGIC, Header
from .errors import DeMoSyncError


@dataclass
class CommStats:
    """Traffic of this rank: the last step and the running totals (``total_*``).

    ``bytes_sent`` is what this rank handed to the collectives; ``bytes_received`` what it got from the
    other ranks. ``dense_bytes`` is what an fp32 all-reduce of the same parameters moves per step
    (4 bytes per parameter), the figure DeMo saves against.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    collectives: int = 0
    seconds: float = 0.0
    total_bytes_sent: int = 0
    total_bytes_received: int = 0
    total_collectives: int = 0
    total_seconds: float = 0.0
    steps: int = 0
    dense_bytes: int = 0

    def start_step(self, dense_bytes: int) -> None:
        self.bytes_sent = self.bytes_received = self.collectives = 0
        self.seconds = 0.0
        self.dense_bytes = dense_bytes
        self.steps += 1

    def record(self, sent: int, received: int, seconds: float) -> None:
        self.bytes_sent += sent
        self.bytes_received += received
        self.collectives += 1
        self.seconds += seconds
        self.total_bytes_sent += sent
        self.total_bytes_received += received
        self.total_collectives += 1
        self.total_seconds += seconds

    @property
    def ratio_to_dense(self) -> float:
        """Bytes sent in the last step over a dense fp32 all-reduce's (0 when nothing was sent)."""
        return self.bytes_sent / self.dense_bytes if self.dense_bytes else 0.0

    def as_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        d["ratio_to_dense"] = self.ratio_to_dense
        return d

    def load(self, d: dict) -> None:
        for k, v in d.items():
            if hasattr(self, k) and not k.startswith("_") and k != "ratio_to_dense":
                setattr(self, k, type(getattr(self, k))(v))


# torch >= 2.11 renamed all_gather_into_tensor to all_gather_single (same arguments)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_bytes(buf: torch.Tensor, group, world: int, stats: CommStats) -> torch.Tensor:
    """Gather a uint8 buffer of equal length from every rank: returns (world, len)."""
    if world == 1:
        return buf.view(1, -1)
    out = torch.empty(world * buf.numel(), dtype=torch.uint8, device=buf.device)
    t0 = time.perf_counter()
    _ALL_GATHER(out, buf, group=group)
    stats.record(buf.numel(), buf.numel() * (world - 1), time.perf_counter() - t0)
    return out.view(world, -1)


def check_headers(headers: list[Header], rank: int) -> None:
    """Raise :class:`DeMoSyncError` (on every rank alike) when any two ranks' headers disagree."""
    problems = []
    for r, h in enumerate(headers):
        if h.magic != MAGIC or h.version != FORMAT_VERSION:
            problems.append(f"rank {r} speaks wire format {h.magic:#x}/v{h.version}, "
                            f"expected {MAGIC:#x}/v{FORMAT_VERSION} (different hf_demo versions?)")
            continue
        ref = headers[0]
        if h.world_size != ref.world_size:
            problems.append(f"rank {r} thinks the world has {h.world_size} ranks, rank 0 {ref.world_size}")
        if h.step != ref.step:
            problems.append(f"rank {r} is at optimizer step {h.step}, rank 0 at step {ref.step} "
                            "(a rank skipped or repeated optimizer.step(), or resumed from another checkpoint)")
        if h.layout_checksum != ref.layout_checksum or h.payload_bytes != ref.payload_bytes:
            problems.append(f"rank {r} has a different parameter layout than rank 0 (layout checksum "
                            f"{h.layout_checksum:#010x} vs {ref.layout_checksum:#010x}, payload "
                            f"{h.payload_bytes} vs {ref.payload_bytes} bytes): different model, parameter "
                            "order, chunk or top-k")
        if h.settings_checksum != ref.settings_checksum:
            problems.append(f"rank {r} has different optimizer settings than rank 0 (lr, weight decay, "
                            "momentum decay, value format or sign update differ)")
    if problems:
        raise DeMoSyncError(f"DeMo ranks disagree (seen by rank {rank}):\n  " + "\n  ".join(problems))


def nonfinite_ranks(headers: list[Header]) -> list[int]:
    return [r for r, h in enumerate(headers) if h.flags & FLAG_NONFINITE]
