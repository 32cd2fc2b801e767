"""Run a function on N real gloo ranks (forked processes) and collect what every rank returned or raised."""
from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankError:
    """What a rank raised: its type name, message and traceback (exceptions don't all pickle)."""

    def __init__(self, exc: BaseException):
        self.type = type(exc).__name__
        self.message = str(exc)
        self.traceback = traceback.format_exc()

    def __repr__(self):
        return f"RankError({self.type}: {self.message})"


def _worker(fn, rank, world, port, results, args):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        assert dist.get_world_size() == world
        out = fn(rank, world, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out = RankError(exc)
    buf = io.BytesIO()
    torch.save(out, buf)  # plain bytes: tensors must not travel as shared-memory handles of a dead process
    results.put((rank, buf.getvalue()))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(fn, world: int, *args, timeout: float = 120.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the per-rank results in rank order.

    A rank that raised returns a :class:`RankError`. A rank that does not answer within ``timeout`` fails
    the test (nothing may hang).
    """
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, results, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(world):
            rank, value = results.get(timeout=timeout)
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    except queue.Empty:
        raise AssertionError(f"ranks {sorted(set(range(world)) - set(out))} did not finish within {timeout}s "
                             f"(hang?)") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]


def expect_ok(results: list) -> list:
    errors = [r for r in results if isinstance(r, RankError)]
    if errors:
        raise AssertionError("a rank failed:\n" + "\n".join(e.traceback for e in errors))
    return results
