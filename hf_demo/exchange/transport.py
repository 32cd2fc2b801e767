"""Moving bytes between ranks: DeMo's own collectives, with a timeout, counters and named failures.

All of DeMo's traffic goes through one :class:`Transport`, so the counters in :class:`CommStats` are
counted from the very buffers handed to ``torch.distributed``, every collective honours ``comm_timeout``,
and a raw backend error ("Connection closed by peer", a gloo timeout) becomes a :class:`DeMoSyncError`
that names the step and, where the rendezvous store can tell, the ranks that did not answer.

:func:`register_collective_hook` is the public hook for tools (the WAN benchmarks delay collectives with
it): ``fn(name, nbytes)`` runs on every rank just before each of DeMo's collectives.

Devices: callers hand :class:`Transport` buffers on the parameters' device and get results back on that
device; the transport moves a buffer to where the backend needs it (:func:`wire_device`: NCCL takes CUDA
tensors only, gloo is given host tensors) and back. CUDA collectives return before they are done, so the
transport waits for the device around each one: the seconds it counts (and ``comm_budget`` decides on) are
the collective's, not the time to queue it.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from hf_demo.errors import DeMoSyncError


@dataclass
class Traffic:
    """What one step's collectives moved, kept apart until the step commits (:meth:`CommStats.commit_step`);
    ``intra`` what the same step moved over the shard group (HSDP: inside a replica, the fast link), apart."""

    sent: int = 0
    received: int = 0
    collectives: int = 0
    seconds: float = 0.0
    intra: Traffic | None = None

    def record(self, sent: int, received: int, seconds: float) -> None:
        self.sent += sent
        self.received += received
        self.collectives += 1
        self.seconds += seconds

    def within(self) -> Traffic:
        """Where the shard group's collectives of this step count (:attr:`intra`, made on first use)."""
        if self.intra is None:
            self.intra = Traffic()
        return self.intra


KINDS = ("step", "settle", "averaging")  # what CommStats.add counts: a step's, confirm()'s, a dense averaging's


@dataclass
class CommStats:
    """Traffic of this rank across the replicas: the last step and the running totals (``total_*``).

    ``bytes_sent`` is what this rank handed to the collectives; ``bytes_received`` what it got from the
    other ranks (for an all-reduce, what a ring all-reduce moves: ``2 (W-1)/W`` of the buffer each way).
    ``dense_bytes`` is what an fp32 all-reduce of the same parameters moves per step (4 bytes per
    parameter), the figure DeMo saves against.

    The totals count everything this rank sent across the replicas; of them, ``total_settle_*`` is what
    ``confirm()`` sent outside a step (the settling row a checkpoint or ``flush()`` reads the last step's verdict
    with: a steady step's row, payload included) and ``total_averaging_*`` the dense averaging of the
    parameters that ends a local phase or shows its mean (``flush()``, ``averaged_parameters()``: a checkpoint
    inside a local phase). Neither counts in the last step's figures. ``intra_*``: HSDP's collectives over the
    shard group (inside a replica: the node header and vote, the whole-matrix gathers of ``orthogonal``), apart
    from every figure above.
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
    total_settle_bytes_sent: int = 0
    total_settle_bytes_received: int = 0
    total_averaging_bytes_sent: int = 0
    total_averaging_bytes_received: int = 0
    intra_bytes_sent: int = 0
    intra_bytes_received: int = 0
    total_intra_bytes_sent: int = 0
    total_intra_bytes_received: int = 0

    def start_step(self, dense_bytes: int) -> None:
        self.bytes_sent = self.bytes_received = self.collectives = 0
        self.intra_bytes_sent = self.intra_bytes_received = 0
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
        d = asdict(self)
        d["ratio_to_dense"] = self.ratio_to_dense
        return d

    def commit_step(self, dense_bytes: int, traffic: Traffic) -> None:
        """A committed step: its own figures become the last step's, and count in the totals."""
        self.start_step(dense_bytes)
        self.add(traffic)

    def add(self, traffic: Traffic, kind: str = "step") -> None:
        """``traffic`` counted as ``kind`` (:data:`KINDS`): a step's (the last step's figures too), or what
        ``confirm()`` (``"settle"``) or a dense averaging (``"averaging"``) sent outside a step."""
        if kind not in KINDS:
            raise ValueError(f"traffic of kind {kind!r}: one of {KINDS}")
        if traffic.intra is not None:
            self.intra_bytes_sent += traffic.intra.sent
            self.intra_bytes_received += traffic.intra.received
            self.total_intra_bytes_sent += traffic.intra.sent
            self.total_intra_bytes_received += traffic.intra.received
        if kind == "step":
            self.bytes_sent += traffic.sent
            self.bytes_received += traffic.received
            self.collectives += traffic.collectives
            self.seconds += traffic.seconds
        else:
            setattr(self, f"total_{kind}_bytes_sent", getattr(self, f"total_{kind}_bytes_sent") + traffic.sent)
            name = f"total_{kind}_bytes_received"
            setattr(self, name, getattr(self, name) + traffic.received)
        self.total_bytes_sent += traffic.sent
        self.total_bytes_received += traffic.received
        self.total_collectives += traffic.collectives
        self.total_seconds += traffic.seconds

    def load(self, d: dict) -> None:
        for k, v in d.items():
            if hasattr(self, k) and k != "ratio_to_dense":
                setattr(self, k, type(getattr(self, k))(v))


# ---------------------------------------------------------------- the public hook
_HOOKS: dict[int, Callable[[str, int], None]] = {}


class HookHandle:
    def __init__(self, key: int):
        self.key = key

    def remove(self) -> None:
        _HOOKS.pop(self.key, None)


def register_collective_hook(fn: Callable[[str, int], None]) -> HookHandle:
    """Call ``fn(name, nbytes)`` before each of DeMo's collectives (e.g. to emulate network delay)."""
    key = id(fn) ^ time.monotonic_ns()
    _HOOKS[key] = fn
    return HookHandle(key)


def wire_device(backend: str | None, device: torch.device) -> torch.device:
    """Where a buffer on ``device`` must be for a collective of ``backend``.

    ``nccl``: CUDA only (a host buffer goes to the current CUDA device); ``gloo``: the host (gloo's CUDA support
    is partial and stages through the host anyway); a device map such as ``"cpu:gloo,cuda:nccl"``: the
    tensor's own device when the map has a backend for it; any other backend: the tensor's device.
    """
    name = str(backend or "").lower()
    if ":" in name:
        mapped = {part.split(":", 1)[0].strip() for part in name.split(",")}
        if device.type in mapped:
            return device
        name = "gloo" if "cpu" in mapped else "nccl" if "cuda" in mapped else ""
    if name == "nccl":
        return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    if name == "gloo":
        return torch.device("cpu")
    return device


def _synchronize(device: torch.device | None) -> None:
    """Wait for the work queued on a CUDA device (collectives included); nothing for the host."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


# torch >= 2.11 renamed all_gather_into_tensor to all_gather_single (same arguments)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Pending:
    """A collective running in the background; :meth:`wait` counts only the time spent waiting for it."""

    def __init__(self, transport, name, work, rows, sent, received, step, device=None):
        self.transport, self.name, self.work, self.rows = transport, name, work, rows
        self.sent, self.received, self.step = sent, received, step
        self.waited = 0.0  # seconds wait() spent, once it has
        self.device = rows.device if device is None else device  # where the caller wants the rows

    def wait(self, traffic: Traffic) -> torch.Tensor:
        """The rows, once every rank's have arrived; the wait counts into ``traffic`` (the waiting step's)."""
        if self.work is not None:
            t0 = time.perf_counter()
            try:
                self.work.wait()
                _synchronize(self.rows.device)
            except (RuntimeError, dist.DistError) as exc:
                raise self.transport._failure(self.name, time.perf_counter() - t0, exc, self.step) from exc
            self.waited = time.perf_counter() - t0
            traffic.record(self.sent, self.received, self.waited)
            self.work = None
            self.rows = self.rows.to(self.device)
        return self.rows


_TIMED_GROUPS: dict[tuple, object] = {}


def timed_group(ranks: list[int], timeout: float, backend: str | None = None):
    """A process group over ``ranks`` whose collectives give up after ``timeout`` seconds (cached: every DeMo
    in the process that needs the same one shares it). Called by every rank of the world in the same order
    when ``ranks`` is the whole world; otherwise by the members only."""
    key = (tuple(ranks), float(timeout), backend)
    if key not in _TIMED_GROUPS:
        _TIMED_GROUPS[key] = dist.new_group(
            ranks=list(ranks),
            timeout=datetime.timedelta(seconds=timeout) if timeout > 0 else None,
            backend=backend,
            use_local_synchronization=len(ranks) != dist.get_world_size(),
        )
    return _TIMED_GROUPS[key]


class DistBackend:
    """The collectives of a :class:`Transport` on ``torch.distributed``, over one process group (``None``: the world
    where it is initialised, else a world of one). With ``timeout`` > 0 they run in a group of DeMo's own created
    with that timeout (same ranks, same backend, :func:`timed_group`). Another backend object with the same
    attributes and calls plugs into a :class:`Transport` in its place (hf_demo.elastic: torchft's managed group)."""

    probes_liveness = True  # a failed collective asks the rendezvous store which ranks answered

    def __init__(self, group, timeout: float):
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        self.base_group = self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.name = dist.get_backend(group) if group is not None else None  # gloo, nccl: where buffers must be
        if group is not None and self.world > 1 and timeout > 0:
            try:
                self.group = timed_group(dist.get_process_group_ranks(group), timeout, dist.get_backend(group))
            except (RuntimeError, dist.DistError) as exc:
                raise DeMoSyncError(
                    f"rank {self.rank}: could not set up DeMo's process group within comm_timeout={timeout:g}s: "
                    f"a peer is missing (not started, crashed, or already finished). Backend said: {exc}"
                ) from exc

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.base_group, group_rank) if self.base_group is not None else group_rank

    def gather(self, out: torch.Tensor, wire: torch.Tensor, async_op: bool = False):
        if async_op:
            return _all_gather(out, wire, group=self.group, async_op=True)
        return _all_gather(out, wire, group=self.group)  # the call tests wrap (tests/dist_utils.py)

    def reduce(self, wire: torch.Tensor, async_op: bool = False):
        return dist.all_reduce(wire, group=self.group, async_op=async_op)

    def broadcast(self, wire: torch.Tensor, src: int):
        return dist.broadcast(wire, src=self.global_rank(src), group=self.group)

    def all_to_all(self, out: torch.Tensor, wire: torch.Tensor, receive: list[int], send: list[int]):
        return dist.all_to_all_single(out, wire, list(receive), list(send), group=self.group)


class _Alone:
    """The backend of a world of one: no collective is ever called (each returns before, at ``world == 1``)."""

    probes_liveness, world, rank, name = False, 1, 0, None

    def global_rank(self, group_rank: int) -> int:
        return group_rank


class Transport:
    """DeMo's collectives, with a timeout, counters and named failures, over a backend object: ``torch.distributed``
    over ``group`` (:class:`DistBackend`), or the ``backend`` given (hf_demo.elastic: torchft's managed group).

    With ``timeout`` > 0, DeMo communicates in a group of its own created with that timeout (same ranks,
    same backend), so a frozen or vanished peer makes every surviving rank raise instead of blocking for
    the backend's default 30 minutes. Every collective names the optimizer step it belongs to and the
    :class:`Traffic` it counts into (``None``: a set-up check, not counted); :meth:`at` binds both for a step.
    """

    def __init__(self, group, timeout: float, backend=None):
        self.timeout = timeout
        self.failures = 0
        self.collectives = backend if backend is not None else DistBackend(group, timeout)
        self.world, self.rank = self.collectives.world, self.collectives.rank
        self.backend = self.collectives.name  # its name: where a buffer must be for it (wire_device)

    @classmethod
    def alone(cls) -> Transport:
        """A world of one, without collectives, also where torch.distributed is initialised (pure FSDP: no
        replica to exchange with)."""
        return Transport(None, 0, _Alone())

    def at(self, step: int, traffic: Traffic | None = None) -> StepTransport:
        """This transport for the collectives of optimizer step ``step``, counting into ``traffic``."""
        return StepTransport(self, step, traffic)

    def global_rank(self, group_rank: int) -> int:
        return self.collectives.global_rank(group_rank)

    def _to_wire(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf`` on the device the backend needs (itself when it is there already)."""
        device = wire_device(self.backend, buf.device)
        return buf if device == buf.device else buf.to(device)

    # ------------------------------------------------------------ collectives
    def all_gather(self, buf: torch.Tensor, name: str, step: int, traffic: Traffic | None) -> torch.Tensor:
        """Gather a uint8 buffer of equal length from every rank: returns (world, len)."""
        if self.world == 1:
            return buf.view(1, -1)
        wire = self._to_wire(buf)
        out = torch.empty(self.world * buf.numel(), dtype=torch.uint8, device=wire.device)
        sent, received = buf.numel(), buf.numel() * (self.world - 1)
        op = lambda: self._gather(out, wire)  # noqa: E731
        self._run(name, sent, received, op, wire.device, step, traffic)
        return out.view(self.world, -1).to(buf.device)

    def start_all_gather(self, buf: torch.Tensor, name: str, step: int) -> Pending:
        """:meth:`all_gather` started in the background (overlap): :meth:`Pending.wait` returns the rows."""
        out = torch.empty(self.world * buf.numel(), dtype=torch.uint8, device=buf.device)
        if self.world == 1:
            out.copy_(buf)
            return Pending(self, name, None, out.view(1, -1), 0, 0, step)
        for hook in list(_HOOKS.values()):
            hook(name, buf.numel())
        wire = self._to_wire(buf)
        out = out if wire.device == out.device else torch.empty_like(out, device=wire.device)
        try:
            work = self._gather(out, wire, async_op=True)
        except (RuntimeError, dist.DistError) as exc:
            raise self._failure(name, 0.0, exc, step) from exc
        sent, received = buf.numel(), buf.numel() * (self.world - 1)
        return Pending(self, name, work, out.view(self.world, -1), sent, received, step, buf.device)

    def start_all_reduce(self, buf: torch.Tensor, name: str, step: int) -> Pending:
        """A sum over every rank started in the background (overlap): :meth:`Pending.wait` returns the sum."""
        if self.world == 1:
            return Pending(self, name, None, buf, 0, 0, step)
        for hook in list(_HOOKS.values()):
            hook(name, buf.numel() * buf.element_size())
        ring = buf.numel() * buf.element_size() * 2 * (self.world - 1) // self.world
        wire = self._to_wire(buf)
        try:
            work = self._reduce(wire, async_op=True)
        except (RuntimeError, dist.DistError) as exc:
            raise self._failure(name, 0.0, exc, step) from exc
        return Pending(self, name, work, wire, ring, ring, step, buf.device)

    def all_reduce(self, buf: torch.Tensor, name: str, step: int, traffic: Traffic | None) -> torch.Tensor:
        """Sum a tensor over every rank, in place (every rank gets the same bits)."""
        if self.world == 1:
            return buf
        ring = buf.numel() * buf.element_size() * 2 * (self.world - 1) // self.world
        wire = self._to_wire(buf)
        op = lambda: self._reduce(wire)  # noqa: E731
        self._run(name, ring, ring, op, wire.device, step, traffic)
        if wire is not buf:
            buf.copy_(wire)
        return buf

    def broadcast(self, buf: torch.Tensor, src: int, name: str, step: int, traffic: Traffic | None) -> torch.Tensor:
        """Rank ``src``'s (group rank) tensor to every rank, in place."""
        if self.world == 1:
            return buf
        n = buf.numel() * buf.element_size()
        sent, received = (n * (self.world - 1), 0) if self.rank == src else (0, n)
        wire = self._to_wire(buf)
        op = lambda: self._broadcast(wire, src)  # noqa: E731
        self._run(name, sent, received, op, wire.device, step, traffic)
        if wire is not buf:
            buf.copy_(wire)
        return buf

    def all_to_all(
        self, buf: torch.Tensor, send: list[int], receive: list[int], name: str, step: int, traffic: Traffic | None
    ) -> torch.Tensor:
        """Uneven all-to-all of uint8 bytes: ``buf`` holds ``send[r]`` bytes for each group rank ``r`` in rank order;
        returns the ``receive[r]`` bytes each rank ``r`` sent this one, in rank order (gloo and NCCL take uneven
        splits through ``all_to_all_single``). What a rank sends to itself is not counted."""
        if self.world == 1:
            return buf
        wire = self._to_wire(buf)
        out = torch.empty(sum(receive), dtype=torch.uint8, device=wire.device)
        sent, received = sum(send) - send[self.rank], sum(receive) - receive[self.rank]
        op = lambda: self.collectives.all_to_all(out, wire, receive, send)  # noqa: E731
        self._run(name, sent, received, op, wire.device, step, traffic)
        return out.to(buf.device)

    # ------------------------------------------------------------ the backend's calls
    def _gather(self, out: torch.Tensor, wire: torch.Tensor, async_op: bool = False):
        return self.collectives.gather(out, wire, async_op)

    def _reduce(self, wire: torch.Tensor, async_op: bool = False):
        return self.collectives.reduce(wire, async_op)

    def _broadcast(self, wire: torch.Tensor, src: int):
        return self.collectives.broadcast(wire, src)

    def _run(self, name: str, sent: int, received: int, op: Callable[[], object], device, step, traffic) -> None:
        for hook in list(_HOOKS.values()):
            hook(name, sent)
        _synchronize(device)  # work queued before the collective is not counted as communication
        t0 = time.perf_counter()
        try:
            op()
            _synchronize(device)  # a CUDA collective returns once queued: count it until it is done
        except (RuntimeError, dist.DistError) as exc:
            raise self._failure(name, time.perf_counter() - t0, exc, step) from exc
        if traffic is not None:
            traffic.record(sent, received, time.perf_counter() - t0)

    def _failure(self, name: str, waited: float, exc: BaseException, step: int) -> DeMoSyncError:
        silent = [self.global_rank(r) for r in self._unanswered_ranks(step)]
        who = f"rank(s) {silent} did not answer" if silent else "a peer is missing or out of step"
        timed_out = "timed out" in str(exc).lower() or "timeout" in str(exc).lower()
        why = f"no answer within comm_timeout={self.timeout:g}s" if timed_out else "the connection failed"
        return DeMoSyncError(
            f"rank {self.global_rank(self.rank)}: DeMo's {name} exchange of optimizer step {step} failed after "
            f"{waited:.1f}s ({why}): {who} (frozen, killed, cut off, or a rank called optimizer.step() a different "
            f"number of times). No state was changed. Backend said: "
            f"{str(exc).splitlines()[0] if str(exc) else exc!r}"
        )

    def _unanswered_ranks(self, step: int) -> list[int]:
        """Ask the rendezvous store which ranks are alive: each survivor writes the wall-clock time under its rank,
        waits briefly and reads the others'. A rank counts as alive if it wrote within this probe's window and the
        ``comm_timeout`` before it: the survivors of one failure probe within about that much of each other, even
        where they fail at different steps or collectives (no step or count in the key, which they would not share).
        None where the backend cannot ask (torchft's group: who is gone is its quorum's to say, at the next step)."""
        if not self.collectives.probes_liveness:
            return []
        try:
            store = dist.distributed_c10d._get_default_store()
            self.failures += 1
            ranks = "-".join(str(self.global_rank(r)) for r in range(self.world))  # unique per group
            prefix = f"hf_demo/alive/{ranks}/"
            store.set(prefix + str(self.rank), repr(time.time()))
            window = min(5.0, max(self.timeout, 1.0))
            deadline = time.monotonic() + window
            while True:
                since = time.time() - window - max(self.timeout, 1.0)
                missing = [r for r in range(self.world) if not _wrote_since(store, prefix + str(r), since)]
                if not missing or time.monotonic() > deadline:
                    return missing
                time.sleep(0.2)
        except Exception:  # noqa: BLE001 - the store itself may be gone with the failed peer
            return []


def _wrote_since(store, key: str, since: float) -> bool:
    """Whether ``key`` holds a wall-clock time no earlier than ``since`` (a probe's answer)."""
    if not store.check([key]):
        return False
    try:
        return float(store.get(key).decode()) >= since
    except ValueError:
        return False


class StepTransport:
    """A :class:`Transport` bound to one optimizer step: its collectives name that step (in messages, for the
    all-reduce leader's rotation and the liveness probe) and count into that step's :class:`Traffic`, which the
    optimizer commits with the step (or drops with it)."""

    def __init__(self, transport: Transport, step: int, traffic: Traffic | None = None):
        self.transport, self.step = transport, step
        self.traffic = Traffic() if traffic is None else traffic
        self.world, self.rank, self.backend = transport.world, transport.rank, transport.backend

    def global_rank(self, group_rank: int) -> int:
        return self.transport.global_rank(group_rank)

    def all_gather(self, buf: torch.Tensor, name: str, count: bool = True) -> torch.Tensor:
        return self.transport.all_gather(buf, name, self.step, self.traffic if count else None)

    def start_all_gather(self, buf: torch.Tensor, name: str) -> Pending:
        return self.transport.start_all_gather(buf, name, self.step)

    def start_all_reduce(self, buf: torch.Tensor, name: str) -> Pending:
        return self.transport.start_all_reduce(buf, name, self.step)

    def all_reduce(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        return self.transport.all_reduce(buf, name, self.step, self.traffic)

    def broadcast(self, buf: torch.Tensor, src: int, name: str) -> torch.Tensor:
        return self.transport.broadcast(buf, src, name, self.step, self.traffic)

    def all_to_all(self, buf: torch.Tensor, send: list[int], receive: list[int], name: str) -> torch.Tensor:
        return self.transport.all_to_all(buf, send, receive, name, self.step, self.traffic)
