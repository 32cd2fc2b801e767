"""Deviation alerts: :class:`DeMoHealthCallback` watches every rank's steps and says when one goes wrong.

What it detects (per rank, against the rank's own rolling median of the last ``baseline_steps`` steps; the
thresholds are :class:`~hf_demo.ops.settings.HealthSettings`), each an :class:`Alert` with the step and rank.
Alerts on time are calibrated for busy hosts: the excess over the baseline must pass ``min_excess_s`` and the
rank's own jitter (``noise_factor`` robust standard deviations), for ``persist_steps`` steps in a row, or
:data:`SEVERE` times that floor at once.

- ``step_time``: the rank's own time (its step and the time outside it, less the wait on DeMo's exchange:
  :attr:`~hf_demo.ops.monitor.StepSample.own_s`) far above the baseline: this rank is the one the others wait
  for (a slow host, a stall in data loading); the ranks that waited for it see ``exchange_time`` instead;
- ``exchange_time``: the wait on DeMo's exchange far above the baseline (the network, or a slow peer);
- ``slow_link``: the exchange far slower than the link the plan assumed would carry its bytes;
- ``loss_spike``: the training loss far above its baseline; ``nonfinite_streak``: steps skipped in a row for
  NaN/Inf gradients (or a non-finite loss);
- ``drift``: a resync that ``full_sync_every`` did not schedule (fingerprints differed, or non-finite
  parameters); ``repeated_resyncs``: ``resync_limit`` resyncs within ``resync_window`` steps;
- ``tier_change``: the budget policy moved to another tier (the network changed);
- elastic runs (:mod:`hf_demo.elastic`): ``replica_lost`` (a replica left the quorum: the step in flight was
  refused, the survivors go on; each one, no cooldown), ``elastic_step_refused`` (a step refused with the quorum
  keeping its size: no replica left, or one was replaced at once), ``quorum_below_target`` (the quorum stayed below
  ``expected_replicas``, or the largest quorum seen, for ``quorum_patience`` steps: a lost replica is not
  back), ``slow_recovery`` (this replica's recovery from a peer took over ``recovery_alert_s``).

Each alert carries its wall-clock time (``time``, Unix seconds). Each is logged as a warning (logger
``hf_demo.ops``), counted as a metric event (the exporters' ``hf_demo_alerts_total{kind}``, the log rows'
``ops/alerts``, ``ops/alerts-rank<r>.jsonl``), and delivered as a Trainer callback event: every callback of
the trainer with an ``on_demo_alert(args, state, control, alert, **kwargs)`` method is called with it.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field

from transformers import TrainerCallback

from hf_demo.ops.links import Link, format_rate, parse_rate, parse_time
from hf_demo.ops.monitor import StepMonitor, StepSample, rank_and_node
from hf_demo.ops.settings import HealthSettings

logger = logging.getLogger("hf_demo.ops")
SEVERE = 2.0  # a time this many times its floor above the baseline alerts at once, without persist_steps
UNCOOLED = ("tier_change", "replica_lost")  # events each worth an alert, however close together


@dataclass(frozen=True)
class Alert:
    kind: str
    step: int
    rank: int
    node: int
    message: str
    value: float
    baseline: float
    severity: str = "warning"
    time: float = field(default_factory=time.time)  # Unix seconds when it was raised

    def as_dict(self) -> dict:
        out = asdict(self)
        out["time_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.time))
        return out


def plan_link(settings: HealthSettings) -> Link | None:
    """The link between nodes the plan assumed: ``link_bandwidth``, else the ``plan`` file's, else None."""
    if settings.link_bandwidth:
        return Link(parse_rate(settings.link_bandwidth), parse_time(settings.link_latency))
    if settings.plan:
        import json

        inter = json.loads(open(settings.plan).read())["cluster"]["inter"]
        return Link(float(inter["bandwidth"]), float(inter["latency"]))
    return None


class HealthRules:
    """The checks of one rank, sample by sample (no Trainer needed: a custom loop calls :meth:`observe`)."""

    def __init__(self, settings: HealthSettings):
        self.s = settings
        self.link = plan_link(settings)
        n = settings.baseline_steps
        self.step_times, self.exchange_times, self.losses = deque(maxlen=n), deque(maxlen=n), deque(maxlen=n)
        self.resync_steps: deque = deque()
        self.streak = 0
        self.seen = 0
        self.tier: int | None = None
        self.last_alert: dict[str, int] = {}
        self.deviating: dict[str, int] = {}  # time alerts: deviating steps in a row, per kind
        self.largest_quorum = 0
        self.last_quorum = 0  # the quorum at the last elastic step seen (0: none yet)
        self.below_target = 0  # steps in a row with the quorum below its target

    def observe(self, sample: StepSample, full_sync_every: int = 0) -> list[Alert]:
        self.seen += 1
        found: list[Alert] = []
        judged = self.seen > self.s.warmup_steps
        if judged:
            found += self._times(sample) + self._link(sample)
        found += self._loss(sample, judged) + self._resyncs(sample, full_sync_every) + self._tier(sample)
        found += self._quorum(sample)
        self.step_times.append(sample.own_s)
        if sample.bytes_received > 0:
            self.exchange_times.append(sample.exchange_s)
        return [a for a in found if self._fresh(a)]

    def _fresh(self, alert: Alert) -> bool:
        last = self.last_alert.get(alert.kind)
        if last is not None and alert.step - last < self.s.cooldown_steps and alert.kind not in UNCOOLED:
            return False
        self.last_alert[alert.kind] = alert.step
        return True

    def _alert(self, sample, kind, message, value, baseline, severity="warning") -> Alert:
        return Alert(kind, sample.step, sample.rank, sample.node, message, float(value), float(baseline), severity)

    def _above(self, history, value, factor) -> float | None:
        """The baseline (median of ``history``) when ``value`` is ``factor`` times above it, else None."""
        if factor <= 0 or len(history) < self.s.min_baseline:
            return None
        base = statistics.median(history)
        return base if value > factor * base else None

    def _floor(self, history) -> float:
        """The least excess of a time over its baseline worth an alert: ``min_excess_s``, or more where this rank's
        own times jitter widely (``noise_factor`` robust standard deviations: 1.4826 x the median absolute
        deviation, which a few stalled steps do not move)."""
        if len(history) < 2:
            return self.s.min_excess_s
        mid = statistics.median(history)
        spread = 1.4826 * statistics.median(abs(x - mid) for x in history)
        return max(self.s.min_excess_s, self.s.noise_factor * spread)

    def _persists(self, kind: str, excess: float, floor: float) -> bool:
        """Whether a time alert of ``kind`` is due: ``excess`` above ``floor`` for ``persist_steps`` steps in a row
        (this one included), or at once when it is :data:`SEVERE` times the floor."""
        deviating = excess > floor
        self.deviating[kind] = self.deviating.get(kind, 0) + 1 if deviating else 0
        return deviating and (excess > SEVERE * floor or self.deviating[kind] >= self.s.persist_steps)

    def _slow(self, kind: str, history, value: float, factor: float) -> float | None:
        """The baseline (median of ``history``) when time ``value`` is ``factor`` times above it, past this rank's
        floor (:meth:`_floor`) and persisting (:meth:`_persists`), else None."""
        if factor <= 0 or len(history) < self.s.min_baseline:
            return None
        base = statistics.median(history)
        excess = value - base if value > factor * base else 0.0
        return base if self._persists(kind, excess, self._floor(history)) else None

    def _times(self, s: StepSample) -> list[Alert]:
        out = []
        base = self._slow("step_time", self.step_times, s.own_s, self.s.step_time_factor)
        if base is not None:
            split = (
                f"forward+backward {s.forward_backward_s:.3g} s, DeMo compute {s.demo_compute_s:.3g} s, "
                f"outside the step {s.other_s:.3g} s; waited on the exchange {s.exchange_s:.3g} s and on DDP's "
                f"buffer broadcast {s.forward_wait_s:.3g} s"
            )
            why = (
                f"this rank's own time was {s.own_s:.3g} s, {s.own_s / base:.1f}x its baseline {base:.3g} s "
                f"({split}): the other ranks waited for it"
            )
            out.append(self._alert(s, "step_time", why, s.own_s, base))
        if s.bytes_received <= 0:  # a local step: no exchange to judge
            return out
        base = self._slow("exchange_time", self.exchange_times, s.exchange_s, self.s.exchange_time_factor)
        if base is not None:
            why = f"waited {s.exchange_s:.3g} s on the exchange, {s.exchange_s / base:.1f}x its baseline {base:.3g} s"
            out.append(self._alert(s, "exchange_time", why, s.exchange_s, base))
        return out

    def _link(self, s: StepSample) -> list[Alert]:
        if self.link is None or s.bytes_received <= 0 or s.world < 2:
            return []
        expected = s.bytes_received / self.link.bandwidth + s.collectives * (s.world - 1) * self.link.latency
        excess = s.exchange_s - self.s.slow_link_factor * expected
        if not self._persists("slow_link", excess, self._floor(self.exchange_times)):
            return []
        rate = s.bytes_received / s.exchange_s
        why = (
            f"the exchange took {s.exchange_s:.3g} s where the planned link ({format_rate(self.link.bandwidth)}) "
            f"carries its {s.bytes_received:.0f} bytes in {expected:.3g} s: effective {format_rate(rate)}"
        )
        return [self._alert(s, "slow_link", why, s.exchange_s, expected)]

    def _loss(self, s: StepSample, judged: bool) -> list[Alert]:
        bad = s.skipped > 0 or (s.loss is not None and not math.isfinite(s.loss))
        self.streak = self.streak + 1 if bad else 0
        out = []
        if self.streak == self.s.nonfinite_patience:
            why = (
                f"{self.streak} steps in a row with NaN/Inf gradients or loss (skipped by DeMo): lower the learning "
                "rate, check the data"
            )
            out.append(self._alert(s, "nonfinite_streak", why, self.streak, 0))
        if s.loss is None or not math.isfinite(s.loss):
            return out
        base = self._above(self.losses, s.loss, self.s.loss_spike_factor) if judged else None
        if base is not None:
            why = f"loss {s.loss:.4g}, {s.loss / base:.1f}x its baseline {base:.4g}"
            out.append(self._alert(s, "loss_spike", why, s.loss, base))
        self.losses.append(s.loss)
        return out

    def _resyncs(self, s: StepSample, full_sync_every: int) -> list[Alert]:
        if not s.resyncs:
            return []
        out = []
        scheduled = full_sync_every > 0 and s.optimizer_steps % full_sync_every == 0  # the optimizer's own rule
        if not scheduled:
            why = "rank 0's parameters were copied to every rank: the replicas had drifted apart (or held NaN/Inf)"
            out.append(self._alert(s, "drift", why, s.resyncs, 0))
        self.resync_steps.append(s.step)
        while self.resync_steps and self.resync_steps[0] <= s.step - self.s.resync_window:
            self.resync_steps.popleft()
        n = len(self.resync_steps)
        if n >= self.s.resync_limit:
            why = f"{n} resyncs in the last {self.s.resync_window} steps (each a dense broadcast of the parameters)"
            out.append(self._alert(s, "repeated_resyncs", why, n, self.s.resync_limit))
        return out

    def _tier(self, s: StepSample) -> list[Alert]:
        before, self.tier = self.tier, s.tier
        if before is None or before == s.tier:
            return []
        way = "down to fewer bytes" if s.tier > before else "back up to more bytes"
        why = f"the budget policy moved {way}: tier {before} -> {s.tier}"
        return [self._alert(s, "tier_change", why, s.tier, before, "info")]

    def _quorum(self, s: StepSample) -> list[Alert]:
        """Elastic runs: a replica lost, a quorum below its target for ``quorum_patience`` steps, a slow recovery."""
        if not s.quorum:
            return []
        out = []
        self.largest_quorum = max(self.largest_quorum, s.quorum)
        target = self.s.expected_replicas or self.largest_quorum
        shrank = s.quorum < (self.last_quorum or s.quorum + 1)  # the first sample: no size to compare with
        self.last_quorum = s.quorum
        if s.losses and shrank:
            why = (
                f"a replica left torchft's quorum: {s.quorum} of {target} replicas now; the step in flight was refused "
                f"({s.samples_lost} samples lost) and the survivors go on without reloading anything"
            )
            out.append(self._alert(s, "replica_lost", why, s.quorum, target))
        elif s.losses:  # as many replicas as before: none left, or one was replaced at once (a warm standby)
            why = (
                f"a step was refused and torchft formed a new quorum of {s.quorum} of {target} replicas (no replica "
                f"left, or one was replaced at once; {s.samples_lost} samples lost): the step's error is "
                "ElasticStats.last_error (demo_elastic: trainer.demo_elastic.stats.last_error)"
            )
            out.append(self._alert(s, "elastic_step_refused", why, s.quorum, target))
        self.below_target = self.below_target + 1 if s.quorum < target else 0
        if self.below_target == self.s.quorum_patience:
            why = (
                f"the quorum has been {s.quorum} of {target} replicas for {self.below_target} steps: a lost replica is "
                "not back (is its launcher restarting it? --max-restarts, the host, the Lighthouse's address)"
            )
            out.append(self._alert(s, "quorum_below_target", why, s.quorum, target))
        slowest = s.recovery_s / s.recoveries if s.recoveries else 0.0
        if self.s.recovery_alert_s > 0 and slowest > self.s.recovery_alert_s:
            why = (
                f"this replica's recovery from a live peer took {slowest:.3g} s (over "
                f"{self.s.recovery_alert_s:.3g} s), and the quorum waited for it: the link to that peer, or the "
                "size of the agreed state"
            )
            out.append(self._alert(s, "slow_recovery", why, slowest, self.s.recovery_alert_s))
        return out


class DeMoHealthCallback(TrainerCallback):
    """Deviation alerts for a Trainer (see the module's docstring). On by default in ``DeMoTrainer``; for any
    other trainer use :func:`hf_demo.ops.attach`, which also wires the alerts to the other callbacks."""

    def __init__(self, settings: HealthSettings | None = None):
        self.settings = settings or HealthSettings()
        self.rules = HealthRules(self.settings)
        self.sinks: list = []  # functions called with each alert (the exporters' metric event)
        self.handler = None  # the trainer's CallbackHandler: its callbacks get on_demo_alert
        self.fed = False  # True when DeMoOpsCallback hands it the samples; else it measures on its own
        self._monitor: StepMonitor | None = None
        self.alerts: list[Alert] = []

    # ---------------------------------------------------------------- standalone measuring
    def on_train_begin(self, args, state, control, **kwargs):
        if not self.fed and self.settings.enabled:
            rank, node, local = rank_and_node(args)
            self._monitor = StepMonitor(rank, node, local, None)

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if self._monitor is not None:
            from hf_demo.hf.data_parallel import unwrap_optimizer

            self._monitor.step_begin(unwrap_optimizer(optimizer))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._monitor is not None:
            self._monitor.pre_optimizer()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._monitor is not None:
            self._monitor.optimizer_done()

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if self._monitor is not None:
            from hf_demo.hf.data_parallel import unwrap_optimizer

            opt = unwrap_optimizer(optimizer)
            self.observe(self._monitor.step_end(state.global_step, opt), opt, args, state, control)

    def on_train_end(self, args, state, control, **kwargs):
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None

    # ---------------------------------------------------------------- judging and reporting
    def observe(self, sample: StepSample, opt, args=None, state=None, control=None) -> list[Alert]:
        if not self.settings.enabled:
            return []
        every = opt.settings.full_sync_every if opt is not None else 0
        found = self.rules.observe(sample, every)
        for alert in found:
            self.emit(alert, args, state, control)
        return found

    def emit(self, alert: Alert, args=None, state=None, control=None) -> None:
        self.alerts.append(alert)
        log = logger.info if alert.severity == "info" else logger.warning
        log(
            "DeMo health [%s] step %d, rank %d (node %d): %s",
            alert.kind,
            alert.step,
            alert.rank,
            alert.node,
            alert.message,
        )
        for sink in self.sinks:
            sink(alert)
        for cb in self.handler.callbacks if self.handler is not None else ():
            hook = getattr(cb, "on_demo_alert", None)
            if hook is not None:
                hook(args, state, control, alert=alert)
