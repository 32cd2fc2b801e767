"""Elastic DeMo on torchft: a lost replica costs a step, not the run (``pip install 'hf-demo[ft]'``).

One replica group per DeMo replica (one process, or an HSDP node of shard ranks), a torchft Lighthouse, and per
step:

1. :meth:`Elastic.start_step`: torchft's quorum. The Manager reconfigures its process group when the quorum
   changed (a replica lost or back), and a replica behind the quorum (a restarted one, or one that failed to
   commit a step the others committed) receives the agreed state from a live peer through torchft's checkpoint
   transport (:meth:`Elastic.agreed_state` / :meth:`Elastic.load_agreed`) before its forward pass.
2. :meth:`Elastic.step`: DeMo's step prepared (:meth:`DeMo.prepare_step`), its collectives (headers, payloads, the
   vote) over the Manager's reconfigurable process group (:class:`ManagedGroup`, the backend of DeMo's transport),
   which :meth:`DeMo.reset_peers` gave DeMo at the quorum's change, among this quorum's replicas: the mean is over
   the replicas present. A plain ``opt.step()`` on a wrapped DeMo is refused, naming ``elastic.step()``.
3. One commit decision, :meth:`Elastic.decide`: an error of the step (a collective that
   failed because a peer died, a payload or header refused by DeMo's all-ranks vote) is reported to torchft
   (``Manager.report_error``), and ``Manager.should_commit()`` decides whether the step's transaction commits.
   A refused step applies nothing (parameters, momenta, counters: DeMo's transaction) and does not count as a
   torchft step either; the survivors go on at the next quorum without reloading anything. A peer that dies
   between two survivors' receives can leave one survivor committed and another not: torchft's step tells them
   apart, and at the next quorum the one behind receives the state of one ahead (its own momentum kept).
   Settings that differ between replica groups (:class:`~hf_demo.errors.DeMoSettingsError`, named by the headers on
   every replica alike) are raised after torchft is told, not retried: every retry would meet them again. A joiner
   keeps its own learning rate and weight decay (:data:`OWN_GROUP_KEYS`), so a difference is named, never adopted.

A quorum that cannot form (the Lighthouse lost: torchft's raw ``TimeoutError: status: Cancelled``) raises one
:class:`DeMoSyncError` naming the Lighthouse and the fix (:func:`quorum_failed`); a missing ``TORCHFT_LIGHTHOUSE`` is
a :class:`DeMoSetupError` from ``Elastic(...)``; a replica group that comes back to a run (under any launcher) and
finds itself alone at step 0 (the run is over, or every replica died) is refused (:func:`refuse_lost_run`).

With local steps (``sync_every > 1``, or a ``comm_budget`` policy's local-step tier) every quorum inside a local phase
may only shrink (torchft's ``shrink_only``): a joiner enters at the first quorum after a synchronisation, when the
replicas' parameters agree. The policy's tier is agreed state (a joiner receives it); the figures it decides from
are forgotten by every replica at each change of the quorum (:meth:`DeMo.reset_peers`), so every replica takes the same
decision.
With ``overlap=True`` every replica drops the exchange still in flight at each change of the quorum (one step's
update lost, alike everywhere).

HSDP (:class:`NodeShards`): a node of FSDP2 shard ranks is one replica group (one ``torchrun --nproc_per_node``
per node, FSDP2 over the node's own process group); every shard rank runs torchft's Manager with its rank in the
node, so shard rank ``i`` exchanges with shard rank ``i`` of every other replica group over torchft's managed group
(DeMo's sharded topology over it, :func:`sharded_topology`), receives its own shard's agreed state from the same
shard rank of a live peer, and the outcome of every collective across replica groups is agreed over the shard group
(:class:`LockstepTransport`): every shard rank of a replica group refuses a step alike, as torchft's
``should_commit`` (which needs every rank of a replica group) decides it. Overlap and local steps on HSDP are
refused with the reason (:func:`refuse_modes`).

A returning replica's momentum starts at zero (a live replica that only lagged keeps its own): DeMo's momentum is
each rank's own residual of what it has not yet transmitted, never averaged, so no peer holds it and none needs
it; a zero momentum is the state every rank starts a run in, and the replica's next steps send the top-k of its
fresh gradients like any rank's first steps. With ``momentum_dir`` each replica also keeps its own momentum on its
disk after committed steps, and the process that takes its replica id back resumes it (:mod:`hf_demo.own_momentum`):
what the dead replica had not yet sent is still unsent, so nothing of its residual is lost.
"""

from __future__ import annotations

import datetime
import importlib
import os
import time
from dataclasses import asdict, dataclass

import torch

from hf_demo import own_momentum, refusals
from hf_demo.errors import DeMoError, DeMoSettingsError, DeMoSetupError, DeMoSyncError
from hf_demo.exchange.transport import Transport
from hf_demo.own_momentum import own_key
from hf_demo.topology.dtensor import is_sharded, local, placed_like
from hf_demo.topology.flat import FlatTopology

EXTRA = "ft"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"  # torchrun's count of this worker's restarts
OWN_GROUP_KEYS = ("lr", "weight_decay", "initial_lr")  # a joiner's own, never replaced by a peer's (load_agreed)


def require_torchft():
    """``import torchft``, or an ImportError naming the extra that brings it."""
    try:
        return importlib.import_module("torchft")
    except ImportError as exc:
        raise ImportError(
            "elastic DeMo (hf_demo.elastic) runs on torchft, which the default install of hf-demo does not bring: "
            f"pip install 'hf-demo[{EXTRA}]' (or pip install torchft)"
        ) from exc


def lighthouse(min_replicas: int = 1, bind: str = "[::]:0", join_timeout_ms: int = 1000, quorum_tick_ms: int = 50,
               heartbeat_timeout_ms: int = 5000):  # fmt: skip
    """A torchft Lighthouse in this process (tests, one-machine runs): ``.address()`` is what every replica's
    :class:`Elastic` (or ``TORCHFT_LIGHTHOUSE``) takes. On a cluster run ``torchft_lighthouse`` instead.
    ``heartbeat_timeout_ms``: how long a silent replica still counts as alive (the detection time of a replica
    lost between steps)."""
    require_torchft()
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms)  # fmt: skip


class ManagedGroup:
    """torchft's reconfigurable process group as the backend of a :class:`~hf_demo.exchange.transport.Transport`
    (in place of :class:`~hf_demo.exchange.transport.DistBackend`): DeMo's collectives among the replicas of one
    quorum. ``rank`` and ``world`` are this replica's rank and the number of replicas in the quorum."""

    probes_liveness = False  # who is gone is torchft's quorum's to say, at the next step

    def __init__(self, pg, rank: int, world: int):
        self.group, self.rank, self.world = pg, rank, world
        self.name = "nccl" if "nccl" in pg.getBackendName() else "gloo"

    def global_rank(self, group_rank: int) -> int:
        return group_rank  # the replica's rank in this quorum

    def gather(self, out: torch.Tensor, wire: torch.Tensor, async_op: bool = False):
        from torch.distributed.distributed_c10d import AllgatherOptions

        rows = list(out.view(self.world, -1).unbind(0))
        return _issued(lambda: self.group.allgather([rows], [wire], AllgatherOptions()), async_op)

    def reduce(self, wire: torch.Tensor, async_op: bool = False):
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        return _issued(lambda: self.group.allreduce([wire], opts), async_op)

    def broadcast(self, wire: torch.Tensor, src: int):
        from torch.distributed.distributed_c10d import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        return _issued(lambda: self.group.broadcast([wire], opts), False)

    def all_to_all(self, out: torch.Tensor, wire: torch.Tensor, receive: list[int], send: list[int]):
        import torch.distributed as dist

        return dist.all_to_all_single(out, wire, list(receive), list(send), group=self.group)


class ManagedTransport(Transport):
    """DeMo's :class:`~hf_demo.exchange.transport.Transport` over torchft's managed group (:class:`ManagedGroup`,
    its backend): a collective that fails (a peer died mid-step) raises :class:`DeMoSyncError` inside the step as on
    a plain group; :meth:`Elastic.step` reports it to torchft instead of raising it to the training loop.
    ``replica_name``: this replica group's id, named in a settings error."""

    def __init__(self, pg, rank: int, world: int, timeout: float, replica_name: str | None = None):
        super().__init__(None, timeout, ManagedGroup(pg, rank, world))
        self.replica_name = replica_name


def _issued(call, async_op: bool):
    """Run a collective on torchft's group: its work (``async_op``), or None once done; any failure of the group
    (a dead peer, a group not configured) as the RuntimeError the transport names."""
    try:
        work = call()
        if async_op:
            return work
        work.wait()
    except RuntimeError:
        raise
    except Exception as exc:  # noqa: BLE001 - torchft's group may fail with an assertion or a timeout
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc
    return None


def quorum_failed(exc: BaseException, lighthouse: str | None) -> DeMoSyncError:
    """torchft's quorum that did not form (its raw error: ``TimeoutError: status: Cancelled`` once the Lighthouse is
    gone), as one error naming the likely cause and the fix."""
    raw = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    where = f" at {lighthouse}" if lighthouse else ""
    reach = lighthouse_reachable(lighthouse) if lighthouse else None
    causes = {
        False: f"the Lighthouse{where} does not answer (nothing listens there: it died or was stopped)",
        True: f"the Lighthouse{where} answers, but no quorum formed in time (too few replica groups for "
        "--min_replicas, or this replica group's own manager is gone)",
        None: "the Lighthouse (or this replica group's manager on its shard rank 0) did not answer",
    }
    cause = causes[reach]
    return DeMoSyncError(
        f"hf_demo.elastic: torchft's quorum for the next step did not form: {cause}. The replicas keep no state a "
        "new Lighthouse could hand on: restart the Lighthouse (torchft_lighthouse ...), then every replica group "
        f"from the run's last checkpoint (see 'What survives what' in docs/guides/elastic.md). torchft said: {raw}"
    )


def lighthouse_reachable(address: str) -> bool | None:
    """Whether something listens at the Lighthouse's ``address`` (``http://host:port``): True, False, or None where
    the address cannot be read."""
    import socket
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(address if "://" in address else f"http://{address}")
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not host or not port:
        return None
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False


FIRST_QUORUM_ID = 1  # the id a fresh Lighthouse gives its first quorum (it counts each change of the quorum's members)


def refuse_lost_run(manager, world: int) -> None:
    """At this process's first quorum: a replica group alone in a quorum at step 0 that comes back to a run (the
    Lighthouse formed a quorum before this one, whatever launched the process; or torchrun's
    ``TORCHELASTIC_RESTART_COUNT`` > 0) finds no replica that holds the run's state (the others finished, or every
    one died): training on alone would start the run again and end with other parameters, so it is refused. A run's
    first replica alone at step 0 (the Lighthouse's first quorum, no restart) trains."""
    if world != 1 or manager.current_step() != 0:
        return
    restarts = os.environ.get(RESTART_ENV, "0")
    quorum = getattr(manager, "_quorum_id", None)
    if restarts.isdigit() and int(restarts) > 0:
        why = f"this replica group was restarted ({RESTART_ENV}={restarts})"
    elif isinstance(quorum, int) and quorum > FIRST_QUORUM_ID:
        why = f"this replica group came back to a run whose Lighthouse formed {quorum - 1} quorum(s) before this one"
    else:
        return
    raise DeMoSyncError(
        f"hf_demo.elastic: {why} but is alone in torchft's quorum at step 0: no live replica group holds the run's "
        "state (the others finished, or every one died), so training on would start the run again from this "
        "process's own weights and end with other parameters. Resume the run from its last checkpoint (every "
        "replica group), or start a new run with a new Lighthouse"
    )


EVENT_KINDS = ("join", "loss", "recovered")


@dataclass(frozen=True)
class ElasticEvent:
    """One change of the quorum as this replica saw it (:attr:`Elastic.events`, :meth:`Elastic.add_listener`).

    ``kind``: ``"join"`` (replicas joined this quorum), ``"loss"`` (replicas were lost: on a survivor),
    ``"recovered"`` (this replica received the agreed state from a live peer). ``step``: torchft's step it
    happened at; ``quorum``: the replicas in the new quorum; ``seconds``: for a loss, the time the survivors lost
    (the refused step in flight, the detection and the new quorum), for a recovery the seconds this replica took to
    receive the state (its quorum included), for a join the seconds the quorum took; ``samples_lost``: the samples
    whose work was thrown away with the loss (every replica's batch of the refused steps); ``time``: wall clock
    (``time.time()``)."""

    kind: str
    step: int
    quorum: int
    seconds: float
    samples_lost: int
    time: float


@dataclass
class ElasticStats:
    """What the quorum did, as seen by this replica."""

    quorum_size: int = 0  # replicas in the current quorum
    quorum_changes: int = 0  # reconfigurations seen (a replica lost or joined)
    replicas_lost: int = 0  # replicas gone between two quorums (net of joins at the same change)
    replicas_joined: int = 0  # replicas added between two quorums
    recoveries: int = 0  # times this replica received the agreed state from a peer
    committed_steps: int = 0
    refused_steps: int = 0  # steps every survivor refused (nothing applied)
    batches_lost: int = 0  # the batches of the refused steps (one per replica in the quorum)
    samples_lost: int = 0  # batches_lost x batch_size: the samples whose forward and backward were thrown away
    samples_unread: int = 0  # data no replica reads (Trainer: lost replicas' shards at the steps they are away)
    momentum_restored: int = 0  # recoveries whose momentum came from this replica's snapshot (momentum_dir)
    quorum_seconds: float = 0.0  # time in torchft's quorum, a recovery included
    last_error: str = ""  # the last refused step's reason

    def as_dict(self) -> dict:
        return asdict(self)


class Elastic(torch.optim.Optimizer):
    """DeMo ``opt`` (over ``model``'s parameters) trained elastically under torchft: a wrapper around an untouched
    DeMo, as torchft's ``OptimizerWrapper`` is around any optimizer.

    Per step, on every replica: :meth:`start_step` (the quorum; a joiner's recovery), forward and backward on the
    batch :attr:`batch_index` of the run's batch stream (:attr:`rank` among :attr:`world` replicas), then
    :meth:`step` (in place of ``opt.step()``, which is refused while wrapped), which commits only where torchft says
    so (:attr:`last_committed`). It is a ``torch.optim.Optimizer`` for what takes one (a learning-rate schedule,
    Accelerate, Trainer): ``param_groups``, ``state``, ``defaults``, ``zero_grad``, ``state_dict`` and
    ``load_state_dict`` are DeMo's (torchft's wrapper's pattern: the base class's ``__init__`` is not run, DeMo
    holds the groups and the state). DeMo holds no reference to it: it is given each quorum's group
    (:meth:`DeMo.reset_peers`) and stepped through its public phases (:meth:`DeMo.prepare_step`, then
    ``commit()`` or ``discard()``).

    Data: the run reads one stream of batches; a committed step consumes ``world`` of them (replica ``rank`` reads
    ``batches_committed + rank``), a refused step none, so its batches (a dead replica's included) are the next
    step's, read by the replicas present then; a joiner reads from the ``batches_committed`` it receives with the
    agreed state. No batch is skipped or trained twice; what a loss costs is the work of the refused step, counted
    in :attr:`samples_lost`.

    Args:
        opt: a :class:`hf_demo.DeMo` over ``model``'s parameters, not stepped yet.
        model: the module whose ``state_dict`` a joiner receives with DeMo's agreed state.
        lighthouse: the Lighthouse's address (default ``TORCHFT_LIGHTHOUSE``).
        replica_id: this replica group's name (default ``REPLICA_GROUP_ID``); a restarted replica keeps it.
        min_replicas: the fewest replicas a step commits with.
        timeout: seconds for a collective, ``should_commit`` and a recovery (torchft's ``timeout``).
        quorum_timeout: seconds to wait for a quorum.
        batch_size: the samples in one replica's batch of one step (for :attr:`samples_lost`).
        manager: a torchft ``Manager`` built by the caller (then the four above are its own).
        momentum_dir: a folder on this replica's disk (one per run) where its own momentum is kept after every
            ``momentum_every``-th committed step, so that the process taking its replica id back (a restart, a
            warm standby) resumes it instead of starting at zero (:mod:`hf_demo.own_momentum`); None: not kept.
        momentum_every: committed steps between two snapshots of the momentum (each writes the momenta's bytes).
    """

    def __init__(self, opt, model: torch.nn.Module, *, lighthouse: str | None = None, replica_id: str | None = None,
                 min_replicas: int = 1, timeout: float = 30.0, quorum_timeout: float = 60.0, batch_size: int = 1,
                 manager=None, momentum_dir: str | os.PathLike | None = None, momentum_every: int = 1):  # fmt: skip
        require_torchft()
        refuse_modes(opt)
        if batch_size < 1:
            raise ValueError(f"Elastic: batch_size={batch_size}; give the samples in one replica's batch (>= 1)")
        self._snapshot = self._snapshot_path(momentum_dir, momentum_every, replica_id, opt)
        self.momentum_every = momentum_every
        self.opt, self.model, self.batch_size = opt, model, batch_size
        self.stats = ElasticStats()
        self.events: list[ElasticEvent] = []
        self._listeners: list = []
        self.timeout = timeout
        self.last_committed = False
        self._topology = None
        self._quorum_id = None
        self._armed = False
        self._step_started = 0.0  # when this step's start_step began (monotonic)
        self._refused_since: float | None = None  # when the first refused step since the last commit began
        self._unreported_lost = 0  # samples of refused steps not yet in a "loss" event
        self.node = node_shards(opt, timeout)  # HSDP: this replica group's shard group; None: one process
        if self.node is not None:  # now, on every shard rank: a state sent by one while another heals needs it
            opt.establish_run_id()
        self.lighthouse = lighthouse  # the address a quorum's failure names (_manager: the one torchft is given)
        self.replica_name = replica_id if replica_id is not None else os.environ.get("REPLICA_GROUP_ID")
        self.manager = manager or self._manager(lighthouse, replica_id, min_replicas, timeout, quorum_timeout)
        opt.reset_peers(self.topology)  # a world of one until the first quorum; DeMo's own step() refused from now

    def _manager(self, lighthouse, replica_id, min_replicas, timeout, quorum_timeout):
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        group_rank, group_world = (0, 1) if self.node is None else (self.node.rank, self.node.world)
        if self.node is None and int(os.environ.get("WORLD_SIZE", "1")) != 1:
            refusals.refuse("elastic_processes_unsharded", world=os.environ["WORLD_SIZE"])
        self._store = None
        # no launcher's store: this process hosts its replica group's (HSDP: the launcher's, shared by the node)
        if "MASTER_ADDR" not in os.environ and self.node is None:
            self._store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        seconds = datetime.timedelta(seconds=timeout)
        self.lighthouse = lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if group_rank == 0 and not self.lighthouse:  # torchft's own error would be a bare KeyError
            raise DeMoSetupError(
                f"hf_demo.elastic: no torchft Lighthouse to ask for the quorum: {LIGHTHOUSE_ENV} is not set and "
                f"Elastic(lighthouse=...) was not given. Start one (torchft_lighthouse --min_replicas 1 ...) and set "
                f"{LIGHTHOUSE_ENV}=http://<its host>:<its port> for every replica group (or pass its address)"
            )
        return Manager(
            pg=ProcessGroupGloo(timeout=seconds),
            load_state_dict=self.load_agreed,
            state_dict=self.agreed_state,
            min_replica_size=min_replicas,
            use_async_quorum=False,  # a joiner recovers before its forward pass
            timeout=seconds,
            quorum_timeout=datetime.timedelta(seconds=quorum_timeout),
            connect_timeout=seconds,
            rank=group_rank,  # HSDP: shard rank i meets shard rank i of every replica group in torchft's group
            world_size=group_world,
            store_addr="localhost" if self._store is not None else None,
            store_port=self._store.port if self._store is not None else None,
            lighthouse_addr=self.lighthouse,
            replica_id=replica_id if replica_id is not None else os.environ.get("REPLICA_GROUP_ID"),
        )

    @staticmethod
    def _snapshot_path(folder, every: int, replica_id: str | None, opt):
        """Where this replica's momentum snapshot goes (None: ``momentum_dir`` not given); bad input refused."""
        if folder is None:
            return None
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Elastic: momentum_every={every!r}; give the committed steps between snapshots (>= 1)")
        rid = replica_id if replica_id is not None else os.environ.get("REPLICA_GROUP_ID")
        if rid is None:
            raise DeMoSetupError(
                "Elastic: momentum_dir keeps each replica's momentum under its replica id: give replica_id (or set "
                "REPLICA_GROUP_ID), the same for the process that takes this replica's place"
            )
        if any(is_sharded(p) for g in opt.param_groups for p in g["params"]):
            refusals.refuse("elastic_momentum_dir_hsdp")
        return own_momentum.snapshot_path(folder, rid)

    # ------------------------------------------------------------------ events
    def add_listener(self, callback) -> None:
        """Call ``callback(event)`` with every :class:`ElasticEvent` from now on (operators' metrics)."""
        self._listeners.append(callback)

    def _emit(self, kind: str, seconds: float, samples_lost: int = 0) -> None:
        event = ElasticEvent(kind, self.manager.current_step(), self.stats.quorum_size, seconds, samples_lost,
                             time.time())  # fmt: skip
        self.events.append(event)
        for callback in self._listeners:
            callback(event)

    @property
    def samples_lost(self) -> int:
        """The samples whose forward and backward were thrown away: every replica's batch of each refused step
        (the data themselves are read again at the next step; see the class's note on data)."""
        return self.stats.samples_lost

    def unread(self, samples: int) -> None:
        """Count ``samples`` of the run's data that no replica will read (``ElasticStats.samples_unread``): under
        Trainer, where each replica group reads its own shard, the shards of the replicas missing from a committed
        step. (A custom loop reading one stream by :attr:`batch_index` leaves none.)"""
        self.stats.samples_unread += int(samples)

    # ------------------------------------------------------------------ per step
    def start_step(self) -> None:
        """torchft's quorum for the next step (a recovery from a peer included, before the forward pass);
        DeMo's exchange then runs among this quorum's replicas."""
        t0 = self._step_started = time.monotonic()
        recoveries = self.stats.recoveries
        # inside a local phase (sync_every > 1) each replica's parameters are its own: no joiner until the next
        # synchronisation has made them agree again (torchft's shrink_only quorum: replicas may leave, none join)
        try:
            self.manager.start_quorum(shrink_only=bool(self.opt.unsynced))
        except DeMoError:
            raise  # hf_demo's own (a recovered state refused by load_agreed): it names itself
        except Exception as exc:  # noqa: BLE001 - torchft's raw errors (a Cancelled RPC, a timeout) named here
            raise quorum_failed(exc, self.lighthouse) from exc
        rank, world = self.manager.participating_rank(), self.manager.num_participants()
        if rank is None:
            raise DeMoSyncError("this replica is not in torchft's quorum (a spare): nothing to step")
        if self._quorum_id is None:
            refuse_lost_run(self.manager, world)
        seconds = time.monotonic() - t0
        self.stats.quorum_seconds += seconds
        quorum = getattr(self.manager, "_quorum_id", None)
        before = self.stats.quorum_size
        self.stats.quorum_size = world
        if quorum != self._quorum_id or self._topology is None:
            changed = self._quorum_id is not None
            self._quorum_id = quorum
            self._topology = self._topology_over(rank, world)
            self.opt.reset_peers(self._topology)  # DeMo forgets the last quorum's peers, and exchanges over this one's
            if changed:
                self._count_change(before, world)
        if self.stats.recoveries > recoveries and self.manager.current_step() > 0:
            self._emit("recovered", seconds)
        self._armed = True  # one step() may now decide

    def _count_change(self, before: int, world: int) -> None:
        self.stats.quorum_changes += 1
        self.stats.replicas_lost += max(before - world, 0)
        self.stats.replicas_joined += max(world - before, 0)
        if world < before or self._refused_since is not None:
            since = self._refused_since if self._refused_since is not None else self._step_started
            self._emit("loss", time.monotonic() - since, self._unreported_lost)
            self._refused_since, self._unreported_lost = None, 0
        if world > before:
            self._emit("join", time.monotonic() - self._step_started)

    @property
    def rank(self) -> int:
        """This replica's rank in the current quorum."""
        return self._topology.transport.rank if self._topology is not None else 0

    @property
    def world(self) -> int:
        """The number of replicas in the current quorum."""
        return self._topology.transport.world if self._topology is not None else 1

    @property
    def batch_index(self) -> int:
        """The index, in the run's stream of batches, of the batch this replica reads at this step:
        ``batches_committed + rank`` (torchft's count of the batches committed steps consumed, which a joiner
        receives with the agreed state)."""
        return self.manager.batches_committed() + self.rank

    @property
    def topology(self):
        """The flat topology over this quorum's group (what DeMo exchanges over, given by :meth:`DeMo.reset_peers`;
        a world of one before the first quorum, for the state a peer's recovery asks for)."""
        if self._topology is not None:
            return self._topology
        return FlatTopology(Transport.alone()) if self.node is None else sharded_topology(Transport.alone(), self.node)

    def _topology_over(self, rank: int, world: int):
        """This quorum's topology: flat over torchft's group, or (HSDP) sharded with the replicate dimension on it."""
        pg, name = self.manager._pg, self.replica_name  # the name: what a settings error calls this replica group
        if self.node is None:
            return FlatTopology(ManagedTransport(pg, rank, world, self.timeout, name))
        return sharded_topology(LockstepTransport(pg, rank, world, self.timeout, self.node, name), self.node)

    def decide(self, error: BaseException | None) -> bool:
        """The one commit decision of a step, on every replica: DeMo's verdict (``error``: what the step raised,
        a failed collective or a refusal of the all-ranks vote) reported to torchft, and torchft's
        ``should_commit()`` says whether the step's transaction commits. An error that is not a
        :class:`DeMoSyncError` (a bug, a bad setting), or a :class:`DeMoSettingsError` (the replica groups' settings
        differ: every replica holds the same headers and raises it alike, and every retry would meet it again), is
        raised once torchft has been told (:meth:`_should_commit`: even where torchft's call then fails)."""
        self._check_armed()
        self._armed = False
        if error is not None:
            self.manager.report_error(error if isinstance(error, Exception) else RuntimeError(repr(error)))
            self.stats.last_error = " ".join(str(error).split())[:1000]
        commit = self._should_commit(error) and error is None
        self.last_committed = commit
        if commit:
            self.stats.committed_steps += 1
        else:
            self._refused(self.stats.quorum_size)
        if error is not None and (not isinstance(error, DeMoSyncError) or isinstance(error, DeMoSettingsError)):
            raise error  # a bug, or settings that differ between replica groups: a retry would meet them again
        return commit

    def _should_commit(self, error: BaseException | None) -> bool:
        """torchft's ``should_commit()``. Where this step raised a :class:`DeMoSettingsError` (held by every process
        of every replica group alike), a failure of that call is its consequence and the step is refused: in an HSDP
        replica group shard rank 0 hosts the group's torchft manager server, and raising the settings error first
        it may take the server with it while another shard rank's call is in flight or late (that rank meets
        torchft's raw ``transport error``, shard rank 0 a timeout). The settings error is then raised there too,
        torchft's failure in its traceback (``__context__``). Any other step's failure of the call is raised."""
        try:
            return bool(self.manager.should_commit())
        except Exception as exc:
            if not isinstance(error, DeMoSettingsError):
                raise
            error.__context__, error.__suppress_context__ = exc, False
            return False

    def _check_armed(self) -> None:
        """One step (one commit decision) per quorum: :meth:`start_step` must come first."""
        if not self._armed:
            raise DeMoSetupError("hf_demo.elastic: call elastic.start_step() before each elastic.step()")

    def _refused(self, world: int) -> None:
        self.stats.refused_steps += 1
        self.stats.batches_lost += world
        self.stats.samples_lost += world * self.batch_size
        self._unreported_lost += world * self.batch_size
        if self._refused_since is None:
            self._refused_since = self._step_started

    # ------------------------------------------------------------------ recovery
    def agreed_state(self) -> dict:
        """What a joiner receives (torchft's ``state_dict`` callback, on a live peer): the model's state and DeMo's
        state but each rank's own momentum, as copies."""
        optim = self.opt.state_dict()
        optim["state"] = {pid: {k: v for k, v in s.items() if not own_key(k)} for pid, s in optim["state"].items()}
        if "demo" in optim:
            optim["demo"] = {**optim["demo"], "pending": None}  # overlap: dropped by every replica at the new quorum
        state = {"model": self.model.state_dict(), "optimizer": optim}
        return _copied(state if self.node is None else local_tree(state))  # HSDP: this shard's, to the same shard

    def load_agreed(self, state: dict) -> None:
        """A peer's agreed state, loaded (torchft's ``load_state_dict`` callback, before the forward pass): the
        model, the rule state, the counters, the policy's tier; this replica's own momentum is kept where it has
        one (a replica that lagged), zero otherwise (a restarted one). This replica's own learning rate and weight
        decay are kept too (:data:`OWN_GROUP_KEYS`; DeMo's per-group settings are kept by the load itself): where
        they differ from the quorum's, the first exchange raises :class:`DeMoSettingsError` on every replica, naming
        both values, instead of this replica taking the peer's silently."""
        own = {p: {k: v for k, v in s.items() if own_key(k)} for p, s in self.opt.state.items()}
        mine = [{k: g[k] for k in OWN_GROUP_KEYS if k in g} for g in self.opt.param_groups]
        if self.node is None:
            self.model.load_state_dict(state["model"])
            self.opt.load_peer_state(state["optimizer"])
        else:  # HSDP: this shard's state, from the same shard rank of a live replica group
            load_local_model(self.model, state["model"])
            self.opt.load_peer_state(placed_optimizer_state(self.opt, state["optimizer"]))
        for p, kept in own.items():
            self.opt.state[p].update(kept)
        for group, kept in zip(self.opt.param_groups, mine):  # never the peer's silently: the headers compare them
            group.update(kept)
        if self._snapshot is not None and not any(own.values()):  # a restarted replica: its momentum from disk
            restored = own_momentum.restore(self._snapshot, self.opt, self.manager.current_step(), self.replica_name)
            if restored is not None:
                self.stats.momentum_restored += 1
        self.stats.recoveries += 1

    def after_commit(self) -> None:
        """After a committed step's transaction is applied (:meth:`step`): this replica's momentum snapshot, every
        ``momentum_every`` committed steps (``momentum_dir``)."""
        step = self.manager.current_step()
        if self._snapshot is not None and step % self.momentum_every == 0:
            own_momentum.save(self._snapshot, self.opt, step, self.replica_name)

    def shutdown(self) -> None:
        """Stop this replica's Manager (its server and checkpoint transport); DeMo is its own again (its own group,
        the peers of the quorum forgotten, its own ``step()``)."""
        self.manager.shutdown(wait=False)
        self.opt.reset_peers(None)

    # ------------------------------------------------------------------ the optimizer the loop steps
    @torch.no_grad()
    def step(self, closure=None):
        """One elastic step of DeMo on every replica, after :meth:`start_step` and the backward pass: DeMo's step
        prepared over this quorum's group (:meth:`DeMo.prepare_step`), torchft's ``should_commit()`` asked with what
        the step raised (:meth:`decide`), the step committed or discarded, and after a commit this replica's
        momentum snapshot (:meth:`after_commit`). An error that is not a lost peer's is raised once torchft is told.
        Returns the closure's loss, where one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_armed()  # before any collective of the step
        try:
            staged = self.opt.prepare_step(elastic=True)
        except BaseException as exc:
            self.decide(exc)  # told to torchft, the step refused (raised if not a sync error)
            return loss
        if self.decide(None):
            staged.commit()
            self.after_commit()
        else:
            staged.discard()
        return loss

    @property
    def optimizer(self):
        """The DeMo this wraps (also :attr:`opt`; ``hf_demo.hf.data_parallel.unwrap_optimizer`` finds it here)."""
        return self.opt

    @property
    def param_groups(self) -> list[dict]:
        return self.opt.param_groups

    @property
    def state(self):
        return self.opt.state

    @property
    def defaults(self) -> dict:
        return self.opt.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        self.opt.add_param_group(param_group)

    def state_dict(self) -> dict:
        return self.opt.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.opt.load_state_dict(state_dict)


def _copied(tree):
    if torch.is_tensor(tree):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _copied(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_copied(v) for v in tree)
    return tree


def refuse_modes(opt) -> None:
    """The modes elastic DeMo does not run, refused with the reason (never a silent fallback)."""
    found = [refusals.text("elastic_mesh")] if opt.device_mesh is not None or opt.process_group is not None else []
    found += mode_refusals(opt.settings, opt.tiers, any(is_sharded(p) for g in opt.param_groups for p in g["params"]))
    if found:
        raise refusals.elastic_error(found)


def mode_refusals(settings, tiers, sharded: bool) -> list[str]:
    """What elastic DeMo does not run of ``settings`` (with ``tiers``, the budget policy's) on a layout of whole
    (``sharded`` False) or FSDP2-sharded parameters (HSDP replica groups), each with its reason; [] when it runs
    (:func:`refuse_modes`; the planner asks it of a method's settings and layout)."""
    if not sharded:
        return []
    found = []
    if settings.overlap:
        found.append(refusals.text("elastic_overlap_hsdp"))
    if settings.sync_every > 1 or (settings.comm_budget and any(t.sync_every > 1 for t in tiers)):
        found.append(refusals.text("elastic_local_steps_hsdp"))
    return found


# ---------------------------------------------------------------------------------------------- HSDP replica groups
@dataclass(frozen=True)
class NodeShards:
    """An HSDP replica group: the processes of one node (or launcher) hold the shards of one replica, FSDP2 on
    their own process group (``torch.distributed``'s world in each process, ``--nproc_per_node`` of them); DeMo
    exchanges shard ``i`` with shard ``i`` of every other replica group over torchft's managed group."""

    spec: object  # the parameters' ShardSpec (hf_demo.topology.sharded): the shard group's mesh and ranks
    shards: Transport  # the shard group (the node's world), with a timeout above the replicate collectives'

    @property
    def rank(self) -> int:
        return self.shards.rank

    @property
    def world(self) -> int:
        return self.shards.world


def node_shards(opt, timeout: float) -> NodeShards | None:
    """The HSDP layout of ``opt``'s parameters (FSDP2 DTensors sharded over every process of this replica group),
    or None for a replica group of one process with whole parameters. Raises naming the fix for the layouts elastic
    DeMo does not run. ``timeout``: the replicate collectives'; the shard group waits longer (a shard rank may wait
    there for another one's replicate collective to time out)."""
    import torch.distributed as dist

    from hf_demo.topology.sharded import ShardSpec, refuse_unshardable

    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    spec = ShardSpec.of(params)
    if spec is None:
        return None
    if not (dist.is_available() and dist.is_initialized()) or len(spec.ranks) != dist.get_world_size():
        refusals.refuse("elastic_hsdp_partial", ranks=list(spec.ranks))
    refuse_unshardable(opt.param_groups)
    return NodeShards(spec, Transport(None, 2 * timeout + 10))


class LockstepTransport(ManagedTransport):
    """:class:`ManagedTransport` for a replica group of several processes (HSDP): shard rank ``i`` exchanges with
    shard rank ``i`` of every replica of the quorum over torchft's managed group, and the outcome of every such
    collective is agreed over the shard group right after it (one 8-byte all-gather on the fast link). A collective
    that failed on any shard rank (a peer replica group died between two shard ranks' collectives) then raises on
    every shard rank of the replica group at the same collective: their shard-group collectives stay in step, the
    step is refused on all of them, and torchft's ``should_commit`` (which needs every rank of a replica group)
    agrees."""

    def __init__(self, pg, rank: int, world: int, timeout: float, node: NodeShards, replica_name: str | None = None):
        super().__init__(pg, rank, world, timeout, replica_name)
        self.node = node

    def _run(self, name, sent, received, op, device, step, traffic) -> None:
        failed = None
        try:
            super()._run(name, sent, received, op, device, step, traffic)
        except DeMoSyncError as exc:
            failed = exc
        self._agree(name, step, traffic, failed)

    def _agree(self, name: str, step: int, traffic, failed: DeMoSyncError | None) -> None:
        from hf_demo.wire.agreement import pack_words, unpack_words

        inside = traffic.within() if traffic is not None else None  # the shard group's: counted apart (intra_*)
        rows = self.node.shards.all_gather(pack_words([int(failed is not None)]), "node_replicate", step, inside)
        if failed is not None:
            raise failed
        failing = [r for r, (bad,) in enumerate(unpack_words(rows, 1)) if bad]
        if failing:
            raise DeMoSyncError(
                f"DeMo's {name} exchange of optimizer step {step} failed on shard rank(s) {failing} of this replica "
                "group (a peer replica group is gone): every shard rank refuses the step. No state was changed"
            )

    def start_all_gather(self, buf, name, step):
        raise refusals.elastic_error([refusals.text("elastic_overlap_hsdp")])  # refused at construction already

    start_all_reduce = start_all_gather


def sharded_topology(transport, node: NodeShards):
    """The sharded topology of an HSDP replica group: DeMo over ``transport`` (the replicate dimension: torchft's
    managed group, or a world of one before the first quorum), the shard group the node's own."""
    from hf_demo.topology.sharded import ShardedTopology

    return ShardedTopology(transport, node.shards, node.spec)


def local_tree(tree):
    """``tree`` with every DTensor replaced by this rank's local shard (what torchft's checkpoint transport sends
    from shard rank ``i`` to shard rank ``i`` of a recovering replica group)."""
    if is_sharded(tree):
        return local(tree)
    if isinstance(tree, dict):
        return {k: local_tree(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(local_tree(v) for v in tree)
    return tree


@torch.no_grad()
def load_local_model(model: torch.nn.Module, shards: dict) -> None:
    """A peer's local shards of ``model``'s state (:func:`local_tree`), copied into this rank's shards."""
    for name, mine in model.state_dict().items():
        local(mine).copy_(shards[name])


def placed_optimizer_state(opt, optim: dict) -> dict:
    """A peer's agreed optimizer state as local shards (:func:`local_tree` of ``opt.state_dict()`` without each
    rank's own entries), placed again as the DTensors ``opt.load_state_dict`` takes: every tensor entry left is
    computed from the averaged update and placed like its parameter."""
    from hf_demo.optim.sharded_checkpoint import SAME_ON_REPLICAS, params_by_id

    by_id = params_by_id(optim, opt.param_groups)
    state = {}
    for pid, entry in optim["state"].items():
        placed = dict(entry)
        for key, value in entry.items():
            if not (torch.is_tensor(value) and value.dim() > 0):
                continue
            if key not in SAME_ON_REPLICAS:
                raise DeMoSetupError(f"hf_demo.elastic: the agreed state holds {key!r}, which is no agreed entry")
            placed[key] = placed_like(by_id[pid], value)
        state[pid] = placed
    groups = [dict(g) for g in optim["param_groups"]]
    rank, world, scope = opt.identity()  # a live peer's state, not a resume: the resume's checks of whose it is pass
    groups[0]["demo"] = {**groups[0]["demo"], "rank": rank, "world_size": world, "rank_scope": scope, "run_id": None}
    return {**optim, "state": state, "param_groups": groups}
