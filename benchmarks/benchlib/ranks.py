"""Run a function on N real gloo ranks (local processes) and collect what every rank returned or raised.

The one launcher of gloo worlds for the benchmarks and the tests (through ``tests/dist_utils.py``). It needs
torch only, not hf_demo.
"""

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


def _worker(fn, rank, world, port, results, args, collective_timeout, backend="gloo"):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=collective_timeout)
        )
        assert dist.get_world_size() == world
        # every rank connected before any runs: a rank that finishes fast and tears its group down while a slow
        # one (spawned, on a loaded machine) is still connecting would fail that one's connectFullMesh
        dist.barrier()
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


def run_ranks(
    fn,
    world: int,
    *args,
    timeout: float = 120.0,
    collective_timeout: float = 60.0,
    start_method: str = "fork",
    backend: str = "gloo",
) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the per-rank results in rank order.

    Each rank is a new process with one torch thread and an initialised default process group (127.0.0.1,
    a free port); ``fn`` may change the thread count. A rank that raised returns a :class:`RankError`. A
    collective that waits longer than ``collective_timeout`` raises on its rank; results that do not all
    arrive within ``timeout`` fail the caller (nothing may hang). ``start_method="spawn"`` gives every rank a
    fresh interpreter (clean memory figures; ``fn`` and ``args`` must then pickle); "fork" starts faster.
    ``backend="nccl"`` (with ``start_method="spawn"``: CUDA does not survive a fork) gives rank ``r`` GPU ``r``.
    """
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world, port, results, args, collective_timeout, backend), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(world):
            rank, value = results.get(timeout=timeout)
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    except queue.Empty:
        raise AssertionError(
            f"ranks {sorted(set(range(world)) - set(out))} did not finish within {timeout}s (hang?)"
        ) from None
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
