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

The exchanges (below the transport) are what a step sends over it:

How selected coefficients move between ranks and become one averaged update (identical on every rank).

An exchange works on the step's *working* momenta (copies: the optimizer commits them only when the whole
step succeeded) in two phases:

- ``prepare(working)``: local work before the headers travel; subtracts what will be sent from the working
  momenta (error feedback) where the choice is local, and returns the payload whose CRC32/HMAC the header
  carries (empty when nothing is known yet);
- ``start(transport, headers, payload, working, arrived=None)``: the collectives (the last one may still be
  running when it returns: overlap), as an :class:`InFlight`; ``arrived``: every rank's payload, where it rode
  in the headers' all-gather (an exchange whose first collective is that all-gather says so: ``rides``), so
  that collective is not run again; ``finish(in_flight, traffic)``: waits for it, validates
  everything received (raising :class:`~hf_demo.errors.DeMoPayloadError` on this rank) and returns the averaged
  coefficients per parameter, dense ``(nblocks, bsize)``. ``communicate`` is both at once.

An :class:`InFlight` is what a checkpoint keeps of an exchange still running: :meth:`InFlight.to_state`.

Exchanges (:data:`EXCHANGES`):

- ``all_gather`` (default): each rank sends its own top-k positions and values; each coefficient is the
  mean over the ranks that picked it (``average="pickers"``, every-step DeMo's rule), or at a
  synchronisation of ``sync_every > 1`` the mean over all ranks (``average="world"``: a rank that did not
  pick it counts zero, the average of the ranks' pseudo-gradients). Each rank receives ``W - 1`` payloads.
- ``all_reduce``: every rank sends its values at the same agreed positions and an all-reduce sums them, so
  each coefficient is the mean over all ranks. Only values travel in the reduction: the bytes per rank stay
  flat in ``W`` (a ring all-reduce moves ``2 (W-1)/W`` of the buffer, the least any all-reduce can). How the
  positions are agreed (``reduce_positions``, :data:`REDUCE_POSITIONS`):

  - ``union`` (default): each rank nominates the top ``k // W`` (at least 1) positions of its own momentum
    per block and the nominations are all-gathered (under the header's CRC32/HMAC, like any payload); the
    union (``W * (k // W)`` slots, a position nominated twice counted once) is where every rank's values are
    summed. Every rank's energetic coefficients get in, and positions cost ``(W-1)/W`` of one top-k index
    set per rank.
  - ``leader``: one rank per step (rotating: ``step % W``) picks all ``k`` positions and broadcasts them;
    the other ranks' energetic coefficients wait in their residuals until their turn.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from hf_demo import compression
from hf_demo import compression as F
from hf_demo.compression import BlockLayout
from hf_demo.errors import DeMoPayloadError, DeMoStateError, DeMoSyncError
from hf_demo.exchange.collectives import REPLICAS, CollectiveSpec
from hf_demo.refusals import refuse
from hf_demo.wire import codec
from hf_demo.wire.sealing import Envelope


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
        self.bytes_sent = self.bytes_received = self.collectives = 0
        self.intra_bytes_sent = self.intra_bytes_received = 0
        self.seconds = 0.0
        self.dense_bytes = dense_bytes
        self.steps += 1
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
        self._wire_devices: dict[torch.device, torch.device] = {}  # a buffer's device -> where the backend needs it

    @classmethod
    def alone(cls) -> Transport:
        """A world of one, without collectives, also where torch.distributed is initialised (pure FSDP: no
        replica to exchange with)."""
        return Transport(None, 0, _Alone())

    def at(self, step: int, traffic: Traffic | None = None) -> StepTransport:
        """This transport for the collectives of optimizer step ``step``, counting into ``traffic`` (None: a new
        :class:`Traffic`)."""
        traffic = Traffic() if traffic is None else traffic
        return StepTransport(self, step, traffic, self.world, self.rank, self.backend)

    def global_rank(self, group_rank: int) -> int:
        return self.collectives.global_rank(group_rank)

    def _to_wire(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf`` on the device the backend needs (itself when it is there already; :func:`wire_device`, once per
        device)."""
        device = self._wire_devices.get(buf.device)
        if device is None:
            device = self._wire_devices[buf.device] = wire_device(self.backend, buf.device)
        return buf if device == buf.device else buf.to(device)

    # ------------------------------------------------------------ collectives
    def all_gather(self, buf: torch.Tensor, name: str, step: int, traffic: Traffic | None) -> torch.Tensor:
        """Gather a uint8 buffer of equal length from every rank: returns (world, len) (:meth:`StepTransport.all_gather`
        for step ``step``, counted into ``traffic`` unless None)."""
        return self.at(step, traffic).all_gather(buf, name, count=traffic is not None)

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
        cuda = device is not None and device.type == "cuda"  # its queued work waited for (_synchronize), in place
        if cuda:
            torch.cuda.synchronize(device)  # work queued before the collective is not counted as communication
        t0 = time.perf_counter()
        try:
            op()
            if cuda:
                torch.cuda.synchronize(device)  # a CUDA collective returns once queued: count it until it is done
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


@dataclass(eq=False)
class StepTransport:
    """A :class:`Transport` bound to one optimizer step (made by :meth:`Transport.at`): its collectives name that
    step (in messages, for the all-reduce leader's rotation and the liveness probe) and count into that step's
    :class:`Traffic`, which the optimizer commits with the step (or drops with it); ``world``, ``rank`` and
    ``backend`` are the transport's."""

    transport: Transport
    step: int
    traffic: Traffic
    world: int
    rank: int
    backend: str | None

    def global_rank(self, group_rank: int) -> int:
        return self.transport.global_rank(group_rank)

    def all_gather(self, buf: torch.Tensor, name: str, count: bool = True) -> torch.Tensor:
        """Gather a uint8 buffer of equal length from every rank: returns (world, len); counted unless ``count`` is
        False (a set-up check)."""
        t = self.transport
        if t.world == 1:
            return buf.view(1, -1)
        wire = t._to_wire(buf)
        out = torch.empty(t.world * buf.numel(), dtype=torch.uint8, device=wire.device)
        sent, received = buf.numel(), buf.numel() * (t.world - 1)
        op = functools.partial(t.collectives.gather, out, wire)
        t._run(name, sent, received, op, wire.device, self.step, self.traffic if count else None)
        return out.view(t.world, -1).to(buf.device)

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


# ---------------------------------------------------------------- the exchanges
REDUCE_POSITIONS = ("union", "leader")  # how exchange="all_reduce" agrees on positions (see above)


@dataclasses.dataclass(frozen=True)
class ExchangeSpec:
    """What one step's exchange needs to know, whichever exchange it is (the optimizer makes one per step; the
    exchange of a spec equal to an earlier one is the one :func:`build` made then). ``layouts`` is compared, not
    hashed (a step's list, never changed once made: hashing the other fields costs the same for any model)."""

    layouts: list[BlockLayout] = dataclasses.field(hash=False)
    value_format: str
    index_coding: str
    secret: bytes | None = None
    average: str | None = None  # "pickers" or "world" (functional.WEIGHTS); None: the exchange's own rule
    world: int = 1
    positions: str = REDUCE_POSITIONS[0]  # exchange="all_reduce"; the optimizer passes the setting
    sealer: object = None  # HF_DEMO_ENCRYPT=1: the payloads travel sealed (hf_demo.wire.sealing), not HMAC-tagged


@dataclasses.dataclass
class InFlight:
    """An exchange whose collectives have started: ``data`` is the last collective (a running :class:`Pending`
    or its result); ``positions`` the agreed positions' rows (all_reduce). Validated by ``finish``."""

    step: int
    rank: int
    world: int
    headers: list
    data: Pending | torch.Tensor
    positions: torch.Tensor | None = None
    refused: DeMoPayloadError | None = None  # what this rank found wrong while starting it (raised by finish)
    agreed: list | None = dataclasses.field(default=None, repr=False)  # the decoded positions (not saved)

    collective: Pending | None = dataclasses.field(default=None, repr=False)  # what data was, once waited for
    envelopes: list | None = None  # sealed rows (HF_DEMO_ENCRYPT=1): each sender's, from this step's headers

    def wait(self, traffic: Traffic) -> torch.Tensor:
        if isinstance(self.data, Pending):
            self.collective = self.data
            self.data = self.data.wait(traffic)  # done: a failure after this does not wait twice
        return self.data

    @property
    def arrived(self) -> Pending | None:
        """The background collective, once it has been waited for (its traffic then happened)."""
        return self.collective

    def to_state(self, traffic: Traffic) -> dict:
        rows = self.wait(traffic)
        state = {"rows": rows.clone(), "headers": torch.stack([h.to_bytes() for h in self.headers])}
        if self.positions is not None:
            state["positions"] = self.positions.clone()
        if self.envelopes is not None:  # what opens the rows after a restart: no secret, no plaintext
            state["envelopes"] = [  # None: a header this rank refused (the exchange is refused when finished)
                None if e is None else [e.sender, e.session.hex(), e.tries, e.aad.hex()] for e in self.envelopes
            ]
        return state

    @classmethod
    def from_state(cls, state: dict, step: int, rank: int, world: int, device) -> InFlight:
        positions = state.get("positions")
        envelopes = state.get("envelopes")
        if envelopes is not None:
            envelopes = [
                None if e is None else Envelope(int(e[0]), bytes.fromhex(e[1]), int(e[2]), bytes.fromhex(e[3]))
                for e in envelopes
            ]
        return cls(
            step,
            rank,
            world,
            [codec.Header.from_bytes(row) for row in state["headers"]],
            state["rows"].to(device, copy=True),
            None if positions is None else positions.to(device, copy=True),
            envelopes=envelopes,
        )


class AllGatherExchange:
    name = "all_gather"
    rides = True  # its one collective is an all-gather of the payload: it can ride with the headers
    riding_name = "payload"
    collectives = (CollectiveSpec("payload", "all_gather", REPLICAS, "payload", overlaps=True),)  # what start runs

    def __init__(self, spec: ExchangeSpec):
        self.layouts = tuple(spec.layouts)
        self.weights = F.WEIGHTS[spec.average or "pickers"]
        self.codec = codec.payload_codec(self.layouts, spec.value_format, spec.index_coding)
        self.payload_nbytes = self.codec.nbytes
        self.secret = spec.secret
        self.sealer = spec.sealer

    def prepare(self, working: list[torch.Tensor], workspace: compression.Workspace | None = None) -> torch.Tensor:
        """Top-k, the payload and error feedback, once per bucket (``working``: the per-parameter momenta, best
        :class:`~hf_demo.compression.Bucketed` over this exchange's buckets: the feedback then lands in
        their rows directly; ``workspace``: the optimizer's, where top-k's magnitudes are written)."""
        bucketing = self.codec.bucketing
        rows = compression.bucket_rows(working, bucketing)
        selections = [
            F.select(m, bucket.k, F.take(workspace, "a", [m.shape], m.device)[0])
            for m, bucket in zip(rows, bucketing.buckets)
        ]
        device = working[0].device if working else torch.device("cpu")
        payload, sent = self.codec.encode_buckets(selections, device)
        for m, (idx, _), values in zip(rows, selections, sent):
            F.feedback(m, idx, values)
        compression.write_back(working, rows, bucketing)
        return payload

    def start(
        self, transport, headers, payload, working, background: bool = False, arrived=None, skipped: bool = False
    ) -> InFlight:
        """Every rank's payload row (``skipped``: a step every rank skips, whose payload is zeros already)."""
        # the senders' envelopes of this step: overlap opens the rows after the next step's headers
        envelopes = None if self.sealer is None else list(self.sealer.envelopes)
        if arrived is not None:  # every rank's payload rode with the headers (sealed there, where sealing)
            return InFlight(transport.step, transport.rank, transport.world, headers, arrived, envelopes=envelopes)
        if self.sealer is not None:
            payload = self.sealer.seal(payload, transport.step, "payload")
        if background:
            rows = transport.start_all_gather(payload, "payload")
        else:
            rows = transport.all_gather(payload, "payload")
        return InFlight(transport.step, transport.rank, transport.world, headers, rows, envelopes=envelopes)

    def finish(
        self, in_flight: InFlight, traffic: Traffic, workspace: compression.Workspace | None = None
    ) -> list[torch.Tensor]:
        """Every rank's payload row -> the averaged coefficients (validated first; ``workspace``: written to its
        ``"dense"`` buffer, :class:`~hf_demo.compression.Workspace`, read before the step ends)."""
        received = in_flight.wait(traffic)
        if in_flight.refused is not None:  # a header refused when it started (overlap)
            raise in_flight.refused
        if in_flight.envelopes is not None:
            if self.sealer is None:
                raise DeMoStateError(
                    f"the exchange in flight (optimizer step {in_flight.step}) was sent encrypted, and this optimizer "
                    f"has no key to open it: resume with HF_DEMO_ENCRYPT=1 and the same HF_DEMO_SECRET"
                )
            received = self.sealer.open_rows(
                received, in_flight.step, "payload", in_flight.rank, envelopes=in_flight.envelopes
            )
        codec.verify_rows(in_flight.headers, received, self.secret, in_flight.rank, in_flight.step)
        bucketing = self.codec.bucketing
        shapes = [(bucket.rows, bucket.bsize) for bucket in bucketing.buckets]
        outs = F.take(workspace, "dense", shapes, received.device)
        dense = [
            F.densify(*self.weights(idx, values, bucket), bucket, out)
            for (idx, values), bucket, out in zip(self.codec.decode_buckets(received), bucketing.buckets, outs)
        ]
        return compression.Bucketed.of(dense, bucketing)


class AllReduceExchange:
    name = "all_reduce"
    VALUE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

    def __init__(self, spec: ExchangeSpec):
        if spec.average not in (None, "world"):  # every rank sends values at the same positions: mean over all
            raise ValueError(f"exchange='all_reduce' averages over every rank, not {spec.average!r}")
        if spec.value_format not in self.VALUE_DTYPES:
            refuse("all_reduce_scaled_values", allowed=", ".join(self.VALUE_DTYPES), value_format=spec.value_format)
        self.layouts = tuple(spec.layouts)
        self.dtype = self.VALUE_DTYPES[spec.value_format]
        self.secret = spec.secret
        self.union = spec.positions == "union"
        self.bucketing = compression.plan_buckets(self.layouts)
        # union: each rank nominates k // W positions per block; leader: one rank picks all k
        world = spec.world
        self.picked = self.bucketing.with_k(lambda k: max(1, k // world)) if self.union else self.bucketing
        self.nominated = list(self.picked.layouts)
        self.indices = codec.index_coding(spec.index_coding)
        self.map = codec.wire_map(self.picked, None, spec.index_coding)
        self.index_offsets, self.index_nbytes = self.map.offsets, self.map.nbytes
        # union: the nominations are the payload the headers vouch for; leader: positions follow the headers
        self.payload_nbytes = self.index_nbytes if self.union else 0
        self.rides = self.union  # the nominations' all-gather can ride with the headers; the leader's broadcast not
        self.riding_name = "positions"

    def _positions(
        self, working: list[torch.Tensor], device, workspace: compression.Workspace | None = None
    ) -> torch.Tensor:
        """This rank's nominated positions, index-coded: one buffer for every parameter (``workspace``: where
        top-k's magnitudes are written, :meth:`AllGatherExchange.prepare`)."""
        streams = [
            self.indices.pack_rows(
                F.select(m, b.k, F.take(workspace, "a", [m.shape], m.device)[0])[0], b.bsize, b.k
            ).reshape(-1)
            for m, b in zip(compression.bucket_rows(working, self.bucketing), self.picked.buckets)
        ]
        return self.map.assemble(streams, device)

    @property
    def collectives(self) -> tuple[CollectiveSpec, ...]:
        """What :meth:`start` runs: the positions (every rank's nominations all-gathered, or the leader's
        broadcast), then the sum of the values at them."""
        positions = CollectiveSpec("positions", "all_gather" if self.union else "broadcast", REPLICAS, "positions")
        return positions, CollectiveSpec("values", "all_reduce", REPLICAS, "values", overlaps=True)

    def prepare(self, working: list[torch.Tensor], workspace: compression.Workspace | None = None) -> torch.Tensor:
        device = working[0].device if working else torch.device("cpu")
        if self.union:
            return self._positions(working, device, workspace)
        return torch.empty(0, dtype=torch.uint8, device=device)

    def _agreed_rows(self, transport, headers, payload, working, arrived=None, skipped=False) -> torch.Tensor:
        """Every rank's nominations (union, under the headers' CRC32/HMAC; ``arrived`` where they rode with the
        headers) or the leader's positions (zeros on a skipped step, whose momenta were not made)."""
        device = payload.device
        if arrived is not None:
            return arrived
        if self.union:
            return transport.all_gather(payload, "positions")  # checked by start against the headers
        leader = transport.step % transport.world
        if transport.rank == leader and not skipped:
            buf = self._positions(working, device)
        else:
            buf = torch.zeros(self.index_nbytes, dtype=torch.uint8, device=device)
        return transport.broadcast(buf, leader, "positions")[None]  # after the headers: not under their CRC

    def _chosen(self, rows: torch.Tensor, rank: int, step: int, world: int) -> list[tuple]:
        """Per bucket (positions (rows, W*k_nominated), first-occurrence mask or None), validated: every bucket's
        range check is made on the device and read back at once; the culprit is named only then."""
        idxs = self._unpack(rows)
        if idxs:  # (2, senders, rows): out-of-range positions, a position named twice by one sender
            flags = [
                torch.stack([(i >= b.bsize).any(-1), self.indices.repeated(i)])
                for b, i in zip(self.picked.buckets, idxs)
            ]
            bad = torch.cat(flags, dim=2)
            if bool(bad.any()):
                raise self._refusal(self._by_parameter(bad), rank, step, world)
        chosen = []
        for bucket, idx in zip(self.picked.buckets, idxs):
            # every rank's nominations one after the other: (rows, W * k_nominated)
            positions = idx.permute(1, 0, 2).reshape(bucket.rows, -1)
            chosen.append((positions, F.first_occurrences(idx, bucket) if self.union else None))
        return chosen

    def _by_parameter(self, bad: torch.Tensor) -> list:
        """Row flags (2, senders, rows of every bucket) -> per parameter [[out-of-range per sender], [repeated
        per sender]] (on the host)."""
        bad, firsts, base = bad.cpu(), [], 0
        for bucket in self.picked.buckets:
            firsts.append(base)
            base += bucket.rows
        return [
            bad[:, :, firsts[b] + row : firsts[b] + row + layout.nblocks].any(-1).tolist()
            for (b, row), layout in zip(self.picked.where, self.layouts)
        ]

    def _refusal(self, bad: list, rank: int, step: int, world: int) -> DeMoPayloadError:
        """The error naming the first parameter with out-of-range or repeated positions (``bad``: per parameter
        [[out-of-range per sender], [repeated per sender]])."""
        i, kind = next((i, kind) for i, flags in enumerate(bad) for kind in (0, 1) if any(flags[kind]))
        layout = self.layouts[i]
        senders = [r for r, flag in enumerate(bad[i][kind]) if flag]
        source = f"nominated by rank(s) {senders}" if self.union else f"broadcast by rank {step % world}"
        what = "out-of-range positions" if kind == 0 else "repeated positions (a block naming one position twice)"
        return DeMoPayloadError(
            f"rank {rank}: {what} for parameter {i} (shape {layout.shape}, "
            f"block of {layout.bsize}) {source} at optimizer step {step}: corrupted payload"
        )

    def _sum_order(self, senders: int, device) -> torch.Tensor:
        """Where each value of the summed buffer (parameter after parameter, as it travels) is in the buckets'
        contributions (bucket after bucket); ``senders`` runs of positions per block (W union, 1 leader)."""
        return _sum_order(self.picked, senders, torch.device(device))

    def start(
        self, transport, headers, payload, working, background: bool = False, arrived=None, skipped: bool = False
    ) -> InFlight:
        """The agreed positions, then the sum of every rank's values at them. ``skipped``: a step every rank
        skips (the headers say non-finite): the same collectives of the same sizes, with zeros, and the
        momenta left alone, so a rank that could not read that (a refused header) still meets every other."""
        rows = self._agreed_rows(transport, headers, payload, working, arrived, skipped)
        if skipped:
            return self._sum_zeros(transport, headers, rows, background, payload.device)
        try:
            if self.union:
                codec.verify_rows(headers, rows, self.secret, transport.rank, transport.step)
            chosen = self._chosen(rows, transport.rank, transport.step, transport.world)
        except DeMoPayloadError as exc:  # still take part in the sum (zeros), so no rank waits: finish raises
            in_flight = self._sum_zeros(transport, headers, rows, background, payload.device)
            in_flight.refused = exc
            return in_flight
        # every rank contributes its own values at the agreed positions (once each), exactly as they travel
        device = working[0].device if working else torch.device("cpu")
        momenta = compression.bucket_rows(working, self.bucketing)
        contributions = []
        for m, (idx, first) in zip(momenta, chosen):
            mine = m.gather(1, idx)
            mine = (mine if first is None else mine * first).to(self.dtype)
            F.feedback(m, idx, mine.float())
            contributions.append(mine.reshape(-1))
        compression.write_back(working, momenta, self.bucketing)
        # nothing to send (every parameter frozen, or a hierarchy shard without one): the same on every rank of
        # the group, whose layouts the headers proved equal
        if not contributions:
            sums = torch.empty(0, dtype=self.dtype, device=device)
        else:
            flat = torch.cat(contributions).index_select(0, self._sum_order(rows.shape[0], device))
            sums = transport.start_all_reduce(flat, "values") if background else transport.all_reduce(flat, "values")
        return InFlight(transport.step, transport.rank, transport.world, headers, sums, rows, None, chosen)

    def _sum_zeros(self, transport, headers, rows, background: bool, device) -> InFlight:
        """The values' all-reduce with zeros of the size every rank sends (set by the layouts and the senders of
        positions alone): a rank that cannot or must not send its values still takes part."""
        size = sum(bucket.rows * bucket.k for bucket in self.picked.buckets) * rows.shape[0]
        flat = torch.zeros(size, dtype=self.dtype, device=device)
        if size:
            sums = transport.start_all_reduce(flat, "values") if background else transport.all_reduce(flat, "values")
        else:
            sums = flat
        return InFlight(transport.step, transport.rank, transport.world, headers, sums, rows)

    def finish(
        self, in_flight: InFlight, traffic: Traffic, workspace: compression.Workspace | None = None
    ) -> list[torch.Tensor]:
        """The summed values -> the averaged coefficients (validated first; ``workspace``: as
        :meth:`AllGatherExchange.finish`)."""
        sums = in_flight.wait(traffic)
        if in_flight.refused is not None:
            raise in_flight.refused
        limit = in_flight.world * min((codec.coefficient_bound(b.bsize) for b in self.bucketing.buckets), default=0)
        if not bool((sums.abs() <= limit).all()):  # NaN, Inf, or finite sums too large to average and transform
            if not bool(sums.isfinite().all()):
                raise DeMoPayloadError(
                    f"rank {in_flight.rank}: the summed values of optimizer step {in_flight.step} hold NaN/Inf"
                )
            raise DeMoPayloadError(
                f"rank {in_flight.rank}: the summed values of optimizer step {in_flight.step} hold coefficients too "
                f"large: finite, but their mean is beyond {limit / in_flight.world:.3g}, past which the inverse "
                "transform could overflow fp32 (a corrupted or forged payload, or a rank whose momentum diverged)"
            )
        chosen = in_flight.agreed or self._chosen(in_flight.positions, in_flight.rank, in_flight.step, in_flight.world)
        out = []
        if chosen:
            order = self._sum_order(in_flight.positions.shape[0], sums.device)
            by_bucket = torch.empty_like(sums).index_copy_(0, order, sums)
            parts = by_bucket.split([idx.numel() for idx, _ in chosen])
            shapes = [(bucket.rows, bucket.bsize) for bucket in self.picked.buckets]
            outs = F.take(workspace, "dense", shapes, sums.device)
            for (idx, _), bucket, part, dense in zip(chosen, self.picked.buckets, parts, outs):
                mean = part.float().view_as(idx) / in_flight.world
                out.append(F.densify(idx, mean, bucket, dense))  # runs of one rank's nominations: no repeats within
        return compression.Bucketed.of(out, self.bucketing)

    def _unpack(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """(senders, index_nbytes) -> per bucket (senders, rows, k_nominated) positions."""
        codec.check_rows(rows, self.index_nbytes, "position")
        streams = self.map.extract(rows) if self.picked.buckets else []
        return [self.indices.unpack_rows(w, b.rows, b.bsize, b.k) for w, b in zip(streams, self.picked.buckets)]


@functools.lru_cache(maxsize=64)
def _sum_order_cpu(picked: compression.Bucketing, world: int) -> torch.Tensor:
    firsts, base = [], 0
    for bucket in picked.buckets:
        firsts.append(base)
        base += bucket.rows * bucket.k * world
    parts = []
    for (b, row), layout in zip(picked.where, picked.layouts):
        start = firsts[b] + row * layout.k * world
        parts.append(torch.arange(start, start + layout.nblocks * layout.k * world))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


_SUM_ORDERS: dict = {}


def _sum_order(picked: compression.Bucketing, world: int, device: torch.device) -> torch.Tensor:
    key = (picked, world, device)
    if key not in _SUM_ORDERS:
        _SUM_ORDERS[key] = _sum_order_cpu(picked, world).to(device)
    return _SUM_ORDERS[key]


EXCHANGES_BY_NAME = {cls.name: cls for cls in (AllGatherExchange, AllReduceExchange)}
EXCHANGES = tuple(EXCHANGES_BY_NAME)


@functools.lru_cache(maxsize=64)
def build(name: str, spec: ExchangeSpec):
    """The exchange ``name`` for one step (raises ValueError, naming the fix, on settings it refuses; ``name`` is
    the ``exchange`` setting, checked against :data:`EXCHANGES` when the settings were made). Cached per (name,
    spec): an exchange keeps nothing of a step (what a step's exchange carries is in its :class:`InFlight`), so
    the steps of one plan share the one made at the first (a refusal is raised again each time: not cached)."""
    return EXCHANGES_BY_NAME[name](spec)
