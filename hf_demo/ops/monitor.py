"""One rank's training step, measured: the time split, DeMo's traffic, and the optimizer's counters.

:class:`StepMonitor` is told where a step's phases begin and end (the Trainer callbacks of
:mod:`hf_demo.ops.callbacks` call it, or a custom loop does) and returns a :class:`StepSample` per step:

- ``forward_backward_s``: from the step's start to the optimizer step (forward, backward, clipping), less the
  wait in DDP's buffer broadcast before each forward (``forward_wait_s``, part of ``exchange_s``);
- ``exchange_s``: the wait on the step's collectives, wherever it happens: DeMo's collectives inside the optimizer
  step (``CommStats`` seconds, :attr:`StepSample.demo_exchange_s`) and DDP's buffer broadcast before each forward
  (``forward_wait_s``, where :meth:`StepMonitor.record_forward_wait` is told of it);
- ``demo_compute_s``: the rest of the optimizer step (DCT, top-k, coding, the update);
- ``other_s``: the time since the previous step outside any step and outside the phases below (data loading);
- ``evaluate_s``, ``save_s``, ``log_s``: the evaluation, checkpoint and logging phases since the previous step
  (:meth:`StepMonitor.phase_done` marks each one's end; the Trainer callbacks call it from ``on_log``,
  ``on_evaluate`` and ``on_save``): their own series, never a rank's own time;
- bytes this rank handed to DeMo's collectives and got back, the dense fp32 all-reduce they replace, the
  bytes on DeMo's collectives inside a node (HSDP, :mod:`hf_demo.fsdp`: those ``ShardedTopology.COLLECTIVES``
  describes over the shard group; what is left crossed nodes; FSDP2's own all-gathers and reduce-scatters are
  not DeMo's and are not counted), the effective bandwidth (bytes received over the
  wait), and the tier, skips, resyncs and drift checks (fingerprint comparisons, counted from ``check_every``
  at each communicating step);
- elastic runs (:mod:`hf_demo.elastic`): the quorum's size and the quorum's events since the previous step
  (joins, losses, this replica's recoveries and their seconds, the samples lost), from the
  :class:`~hf_demo.elastic.ElasticEvent` objects given to :meth:`StepMonitor.record_elastic`
  (``elastic.add_listener(monitor.record_elastic)``; ``DeMoOpsCallback`` does it for a Trainer), and the samples
  no replica reads (``ElasticStats.samples_unread``, read at each step's end).

``bytes_between_nodes`` (what the price table bills as traffic between sites) is the received bytes of the
collectives over DeMo's group (those over the shard group excluded) times the share of the group's other ranks that
sit on another node (rank // devices per node): 0 when every rank of the group shares this node.

A rank's **own time** (:attr:`StepSample.own_s`) is its step and the time outside it (evaluation, checkpoints
and logging excluded) less the wait on the collectives: the ranks of a synchronous step all take about as long,
and the one the others waited for is the one with the most own time (``ops/slowest_rank``; the ``step_time``
alert judges it).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from hf_demo.exchange.collectives import SHARDS
from hf_demo.ops.prices import Prices
from hf_demo.topology.sharded import ShardedTopology


@dataclass
class StepSample:
    step: int
    rank: int
    node: int
    wall_s: float  # since the monitor started
    step_s: float
    forward_backward_s: float
    demo_compute_s: float
    exchange_s: float
    other_s: float
    bytes_sent: float
    bytes_received: float
    dense_bytes: float
    bytes_between_nodes: float
    bandwidth: float  # bytes received per second of waiting (nan without traffic)
    tier: int
    skipped: int  # this step
    resyncs: int  # this step
    drift_checks: int  # this step
    collectives: int  # DeMo's collectives this step
    world: int  # ranks DeMo exchanges with
    optimizer_steps: int  # DeMo's own step count after this step (skipped steps included)
    loss: float | None  # the step's training loss as the trainer sums it (None: none recorded)
    cost: float  # this rank's running cost estimate (nan without a price table)
    timestamp: float = math.nan  # Unix time at the step's end
    tokens: float = 0.0  # tokens of the step's inputs on this rank (0: none recorded)
    forward_wait_s: float = 0.0  # part of exchange_s: DDP's work before the model's forward (its buffer broadcast)
    evaluate_s: float = 0.0  # since the previous step: evaluation (a phase of its own, not in other_s)
    save_s: float = 0.0  # ... checkpoints
    log_s: float = 0.0  # ... logging (the log row's gathering and the reporting callbacks)
    quorum: int = 0  # elastic: replicas in torchft's quorum at the step's end (0: not an elastic run)
    joins: int = 0  # elastic: quorum events since the previous step where replicas joined
    losses: int = 0  # ... where replicas were lost
    recoveries: int = 0  # ... where this replica received the agreed state from a live peer
    recovery_s: float = 0.0  # the seconds of those recoveries
    samples_lost: int = 0  # the samples of the steps refused for those events
    samples_unread: int = 0  # elastic: samples no replica reads, counted since the previous step (lost replicas'
    # shards at the committed steps they are away: ElasticStats.samples_unread)

    @property
    def bytes_saved(self) -> float:
        return self.dense_bytes - self.bytes_sent

    @property
    def own_s(self) -> float:
        """The rank's own time: the step and the time outside it (not the evaluation, checkpoint or logging
        phases), less the wait on the collectives (``exchange_s``: DeMo's and DDP's buffer broadcast)."""
        return max(0.0, self.step_s + self.other_s - self.exchange_s)

    @property
    def demo_exchange_s(self) -> float:
        """The wait on DeMo's own collectives (``exchange_s`` less DDP's buffer broadcast)."""
        return max(0.0, self.exchange_s - self.forward_wait_s)

    @property
    def phases_s(self) -> float:
        """Evaluation, checkpoints and logging since the previous step."""
        return self.evaluate_s + self.save_s + self.log_s

    def row(self, run: str) -> dict:
        return {"run": run, **asdict(self), "bytes_saved": self.bytes_saved, "own_s": self.own_s}


# the upper bounds (seconds) of the step-time histogram's buckets (+Inf added by the exporter)
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Totals:
    """A rank's running totals (what the Prometheus counters and the log rows read)."""

    steps: int = 0
    seconds: dict = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    bytes_sent: float = 0.0
    bytes_received: float = 0.0
    dense_bytes: float = 0.0
    bytes_between_nodes: float = 0.0
    skipped: int = 0
    resyncs: int = 0
    drift_checks: int = 0
    alerts: dict = field(default_factory=dict)
    step_buckets: list = field(default_factory=lambda: [0] * len(STEP_BUCKETS))  # steps at or under each bound
    last_timestamp: float = math.nan
    ongoing: dict = field(default_factory=dict)  # alert kind -> 1 while a time alert is ongoing, 0 once recovered
    finished: bool = False  # training ended (on_train_end): the series going away after it is no dead run
    quorum: int = 0  # elastic: the last step's quorum (0: not elastic)
    joins: int = 0
    losses: int = 0
    recoveries: int = 0
    recovery_s: float = 0.0
    last_recovery_s: float = math.nan
    samples_lost: int = 0
    samples_unread: int = 0

    def add(self, s: StepSample) -> None:
        self.steps += 1
        self.last_timestamp = s.timestamp
        for i, bound in enumerate(STEP_BUCKETS):
            self.step_buckets[i] += s.step_s <= bound
        for part in PARTS:
            self.seconds[part] += getattr(s, f"{part}_s")
        self.bytes_sent += s.bytes_sent
        self.bytes_received += s.bytes_received
        self.dense_bytes += s.dense_bytes
        self.bytes_between_nodes += s.bytes_between_nodes
        self.skipped += s.skipped
        self.resyncs += s.resyncs
        self.drift_checks += s.drift_checks
        self.quorum = s.quorum
        self.joins += s.joins
        self.losses += s.losses
        self.recoveries += s.recoveries
        self.recovery_s += s.recovery_s
        self.samples_lost += s.samples_lost
        self.samples_unread += s.samples_unread


PARTS = ("step", "forward_backward", "demo_compute", "exchange", "other", "evaluate", "save", "log")
PHASES = ("evaluate", "save", "log")  # the phases between steps that are their own series
# an ElasticEvent's kind -> the StepSample field counting it
ELASTIC_KINDS = {"join": "joins", "loss": "losses", "recovered": "recoveries"}


class _ElasticWindow:
    """The quorum's events since the last step's end (:meth:`StepMonitor.record_elastic`), its last size and the
    samples no replica reads since then."""

    def __init__(self):
        self.quorum = 0
        self.counts = dict.fromkeys(ELASTIC_KINDS.values(), 0)
        self.recovery_s = 0.0
        self.samples_lost = 0
        self.unread_seen = 0  # the replica's ElasticStats.samples_unread at the last step's end

    def observe(self, elastic) -> int:
        """At a step's end: the quorum ``elastic`` ran with, and the samples it counted unread since the last
        step's end (a count the Trainer's elastic callback adds to, in either order with the monitor's)."""
        self.quorum = elastic.world
        total = int(getattr(getattr(elastic, "stats", None), "samples_unread", 0))
        new, self.unread_seen = max(total - self.unread_seen, 0), total
        return new

    def add(self, event) -> None:
        if event.kind not in ELASTIC_KINDS:
            raise ValueError(f"ElasticEvent kind {event.kind!r}: expected one of {', '.join(ELASTIC_KINDS)}")
        self.quorum = int(event.quorum)
        self.counts[ELASTIC_KINDS[event.kind]] += 1
        if event.kind == "recovered":
            self.recovery_s += float(event.seconds)
        self.samples_lost += int(event.samples_lost)

    def take(self) -> dict:
        out = {**self.counts, "quorum": self.quorum, "recovery_s": self.recovery_s, "samples_lost": self.samples_lost}
        self.counts = dict.fromkeys(self.counts, 0)
        self.recovery_s, self.samples_lost = 0.0, 0
        return out


INSIDE_NODE = frozenset(c.name for c in ShardedTopology.COLLECTIVES if c.group == SHARDS)  # over the shard group


def phase_of_log(logs) -> str:
    """The phase a Trainer ``on_log`` ends: ``evaluate`` for the evaluation's own row (``eval_*`` keys: the
    evaluation ran since the last mark), else ``log``."""
    return "evaluate" if any(str(k).startswith("eval_") for k in logs or {}) else "log"


def rank_and_node(args) -> tuple[int, int, int]:
    """(rank, node, processes per node) from the arguments and the launcher's LOCAL_WORLD_SIZE."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    rank = int(getattr(args, "process_index", 0))
    return rank, rank // max(local, 1), local


class StepMonitor:
    """Turns one rank's step boundaries and DeMo's counters into :class:`StepSample` objects."""

    def __init__(self, rank: int, node: int, devices_per_node: int, prices: Prices | None, sync_cuda=True):
        self.rank, self.node, self.devices_per_node, self.prices = rank, node, devices_per_node, prices
        self.sync_cuda = sync_cuda and torch.cuda.is_available()
        self.start = time.perf_counter()
        self.totals = Totals()
        self._marks: dict[str, float] = {}
        self._last_end = self.start
        self._mark = self.start  # the last step's end or phase's end: other_s counts from it
        self._phases = dict.fromkeys(PHASES, 0.0)
        self._before = None
        self._losses: list = []
        self._tokens: list = []
        self._forward_wait = 0.0
        self._first_exchange = True
        self._remote_share: dict = {}
        self._elastic = _ElasticWindow()
        self._watched_elastic = None

    def close(self) -> None:
        pass  # nothing registered

    def _now(self) -> float:
        if self.sync_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def step_begin(self, opt=None) -> None:
        """A step begins; ``opt``: what the loop steps, DeMo or the elastic wrapper around it (:func:`stepped`)."""
        opt, elastic = stepped(opt)
        self._watch_elastic(elastic)
        self._marks = {"begin": self._now()}
        self._before = _counters(opt)
        self._losses = []
        self._tokens = []
        self._forward_wait = 0.0

    def pre_optimizer(self) -> None:
        self._marks["pre_optimizer"] = self._now()

    def optimizer_done(self) -> None:
        self._marks["optimizer"] = self._now()

    def phase_done(self, phase: str) -> None:
        """The end of an evaluation, checkpoint or logging phase (one of :data:`PHASES`): the time since the last
        step's or phase's end is that phase's, counted in the next step's sample and left out of ``other_s``."""
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r}: expected one of {', '.join(PHASES)}")
        now = self._now()
        self._phases[phase] += now - self._mark
        self._mark = now

    def record_loss(self, loss) -> None:
        """A micro-batch's loss as the trainer sums it (a tensor is read at the step's end, once)."""
        self._losses.append(loss.detach() if torch.is_tensor(loss) else float(loss))

    def record_forward_wait(self, seconds: float) -> None:
        """Time spent before a micro-batch's forward in a collective (DDP's buffer broadcast)."""
        self._forward_wait += seconds

    def record_tokens(self, inputs) -> None:
        """A micro-batch's tokens: its attention mask's ones, else its ``input_ids``' count (read at the step's
        end, once; inputs without either count nothing)."""
        if not hasattr(inputs, "get"):
            return
        mask, ids = inputs.get("attention_mask"), inputs.get("input_ids")
        if torch.is_tensor(mask):
            self._tokens.append(mask.detach().sum())
        elif torch.is_tensor(ids):
            self._tokens.append(ids.numel())

    def _watch_elastic(self, elastic) -> None:
        """An elastic wrapper's quorum events, from now on and those it had already (once per ``Elastic``)."""
        if elastic is None or elastic is self._watched_elastic:
            return
        self._watched_elastic = elastic
        for event in list(elastic.events):
            self.record_elastic(event)
        elastic.add_listener(self.record_elastic)

    def record_elastic(self, event) -> None:
        """An :class:`~hf_demo.elastic.ElasticEvent` (a join, a loss, this replica's recovery): counted in the next
        step's sample. ``elastic.add_listener(monitor.record_elastic)`` in a custom loop."""
        self._elastic.add(event)

    def step_end(self, step: int, opt=None) -> StepSample:
        """The step's sample; ``opt`` as :meth:`step_begin`'s."""
        opt, elastic = stepped(opt)
        end = self._now()
        m = self._marks
        begin = m.get("begin", self._last_end)
        pre = m.get("pre_optimizer", end)
        after = _counters(opt)
        before = self._before or after
        exchange = after["seconds"] - before["seconds"]  # DeMo's collectives
        received = after["received"] - before["received"]
        communicated = after["collectives"] > before["collectives"]
        # elastic: the quorum this step ran with, events or not
        unread = self._elastic.observe(elastic) if elastic is not None else 0
        sample = StepSample(
            step=step,
            rank=self.rank,
            node=self.node,
            wall_s=end - self.start,
            step_s=end - begin,
            forward_backward_s=max(0.0, pre - begin - self._forward_wait),
            demo_compute_s=max(0.0, m.get("optimizer", end) - pre - exchange),
            exchange_s=exchange + self._forward_wait,
            other_s=max(0.0, begin - self._mark),
            bytes_sent=after["sent"] - before["sent"],
            bytes_received=received,
            dense_bytes=after["dense"] if after["steps"] > before["steps"] else 0.0,
            bytes_between_nodes=received * self._share_between_nodes(opt),  # (HSDP's shard group: intra_*)
            bandwidth=received / exchange if exchange > 0 and received > 0 else math.nan,
            tier=after["tier"],
            skipped=after["skipped"] - before["skipped"],
            resyncs=after["resyncs"] - before["resyncs"],
            drift_checks=self._drift_checks(opt, after["steps_taken"], communicated),
            collectives=after["collectives"] - before["collectives"],
            world=_world(opt) if opt is not None else 1,
            optimizer_steps=after["steps_taken"],
            loss=self._loss(),
            cost=math.nan,
            timestamp=time.time(),
            tokens=float(sum(int(t) for t in self._tokens)),
            forward_wait_s=self._forward_wait,
            **{f"{phase}_s": s for phase, s in self._phases.items()},
            **self._elastic.take(),
            samples_unread=unread,
        )
        if sample.recoveries:
            self.totals.last_recovery_s = sample.recovery_s / sample.recoveries
        self.totals.add(sample)
        sample.cost = self.cost(sample.wall_s)
        self._last_end = self._mark = end
        self._phases = dict.fromkeys(PHASES, 0.0)
        return sample

    def cost(self, wall_s: float) -> float:
        if self.prices is None:
            return math.nan
        return self.prices.cost(wall_s / 3600, self.totals.bytes_between_nodes / 1e9, self.devices_per_node)

    def _share_between_nodes(self, opt) -> float:
        """The share of DeMo's group's other ranks on another node than this one (1 without a group)."""
        if opt is None or not (dist.is_available() and dist.is_initialized()):
            return 1.0
        key = id(opt.process_group)
        if key not in self._remote_share:
            ranks = dist.get_process_group_ranks(opt.process_group or dist.group.WORLD)
            others = [r for r in ranks if r != dist.get_rank()]
            local = max(1, self.devices_per_node)
            remote = sum(r // local != self.node for r in others)
            self._remote_share[key] = remote / len(others) if others else 0.0
        return self._remote_share[key]

    def _loss(self) -> float | None:
        if not self._losses:
            return None
        return float(sum(x.float().item() if torch.is_tensor(x) else x for x in self._losses))

    def _drift_checks(self, opt, steps_taken: int, communicated: bool) -> int:
        """1 when this step compared fingerprints: DeMo's first exchange in this process, then every
        ``check_every`` steps (the optimizer's rule), at communicating steps with more than one rank."""
        if opt is None or not communicated or _world(opt) < 2:
            return 0
        first, self._first_exchange = self._first_exchange, False
        every = opt.settings.check_every
        return int(first or (every > 0 and steps_taken % every == 0))


def stepped(opt) -> tuple:
    """(DeMo, the elastic wrapper around it or None) of what a loop steps: DeMo, or an elastic wrapper
    (:class:`hf_demo.elastic.Elastic`: what has ``add_listener``, its DeMo ``optimizer``), or None."""
    if opt is not None and hasattr(opt, "add_listener"):
        return opt.optimizer, opt
    return opt, None


def _world(opt) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(opt.process_group)


def _counters(opt) -> dict:
    if opt is None:
        keys = ("seconds", "sent", "received", "collectives", "steps", "dense", "skipped", "resyncs", "steps_taken")
        return {**dict.fromkeys(keys, 0), "tier": 0}
    s = opt.comm_stats
    return {
        "seconds": s.total_seconds,
        "sent": s.total_bytes_sent,
        "received": s.total_bytes_received,
        "collectives": s.total_collectives,
        "steps": s.steps,
        "dense": s.dense_bytes,
        "skipped": opt.skipped_steps,
        "resyncs": opt.resyncs,
        "tier": opt.tier,
        "steps_taken": opt.steps,
    }
