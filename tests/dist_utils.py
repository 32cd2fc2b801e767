"""Gloo worlds in the tests: the benchmarks' launcher (``benchmarks/benchlib/ranks.py``), refused in a test that
is not marked ``ranks``, and the faults the tests inject into a rank.

A test that forks gloo ranks takes the ``gloo`` fixture (tests/conftest.py), which marks it ``ranks``, or carries
``pytestmark = pytest.mark.ranks``; :func:`run_ranks` refuses to start ranks in a test that is neither, so the
fast tier (``-m "not launch and not ranks"``) does not silently grow.
"""

from __future__ import annotations

import os

import torch

from benchlib import ranks
from benchlib.ranks import RankError, expect_ok, free_port

__all__ = ["RankError", "corrupt_indices", "expect_ok", "free_port", "run_ranks"]

RANKS_ALLOWED = "HF_DEMO_TEST_MAY_FORK_RANKS"  # "0" inside a test not marked ranks (set by conftest.py)


def run_ranks(fn, world: int, *args, **kwargs) -> list:
    """:func:`benchlib.ranks.run_ranks`, inside a test marked ``ranks`` only."""
    if os.environ.get(RANKS_ALLOWED) == "0":
        raise AssertionError(
            "this test forks gloo ranks: take the gloo fixture or mark it ranks (see tests/dist_utils.py)"
        )
    return ranks.run_ranks(fn, world, *args, **kwargs)


def corrupt_indices(coding) -> None:
    """From now on, this process's index code sends all-ones bytes: out-of-range 16-bit positions (65535),
    Elias-Fano records with too many ones (both decode to out-of-range positions)."""
    real = coding.pack_rows
    coding.pack_rows = lambda idx, bsize, k: torch.full_like(real(idx, bsize, k), 0xFF)


def carries_header(row: torch.Tensor) -> bool:
    """Whether a received row begins with a DeMo header (clear or sealed): a header all-gather's, or one where
    the payload rides after the header."""
    from hf_demo.wire import codec, sealing

    if row.numel() < codec.HEADER_BYTES:
        return False
    first = int.from_bytes(row[:8].cpu().numpy().tobytes(), "little")
    return first == codec.MAGIC or sealing.is_sealed(row[: codec.HEADER_BYTES])


class _FlipAfter:
    """An asynchronous all-gather's work whose rows are corrupted once they have arrived."""

    def __init__(self, work, flip):
        self.work, self.flip = work, flip

    def wait(self, *args, **kwargs):
        done = self.work.wait(*args, **kwargs)
        self.flip()
        return done


def _flipping(real, flip):
    """``real`` (an all-gather), with ``flip(out, buf)`` applied to what arrives (also where it runs in the
    background: a settling row)."""

    def gather(out, buf, group=None, async_op=False):
        if async_op:
            return _FlipAfter(real(out, buf, group=group, async_op=True), lambda: flip(out, buf))
        real(out, buf, group=group)
        flip(out, buf)

    return gather


def flip_received_header_bit(byte: int, once: bool = False):
    """From now on, this rank's all-gathers that carry headers arrive with the lowest bit of ``byte`` of rank 0's
    header flipped (``once``: the next one only). Returns what makes the link whole again."""
    from hf_demo.exchange import transport as comm

    real = comm._all_gather

    def flip(out, buf):
        if carries_header(out[: buf.numel()]):
            out[byte] ^= 0x01
            if once:
                comm._all_gather = real

    comm._all_gather = _flipping(real, flip)
    return lambda: setattr(comm, "_all_gather", real)


def flip_received_payload_bit():
    """From now on, this rank's all-gathers arrive with a bit of rank 0's payload flipped: the middle byte of what
    follows its header where the payload rides with the header, of its row in the others (a header alone is
    left intact). Returns what makes the link whole again."""
    from hf_demo.exchange import transport as comm
    from hf_demo.wire import codec

    real = comm._all_gather

    def flip(out, buf):
        n = buf.numel()
        if not carries_header(out[:n]):
            out[n // 2] ^= 0x01
        elif n > codec.HEADER_BYTES:
            out[codec.HEADER_BYTES + (n - codec.HEADER_BYTES) // 2] ^= 0x01

    comm._all_gather = _flipping(real, flip)
    return lambda: setattr(comm, "_all_gather", real)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False
