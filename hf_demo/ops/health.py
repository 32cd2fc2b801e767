"""Deviation alerts: :class:`DeMoHealthCallback` watches every rank's steps and says when one goes wrong.

What it detects (per rank, against the rank's own rolling median of the last ``baseline_steps`` steps; the
thresholds are :class:`~hf_demo.ops.settings.HealthSettings`), each an :class:`Alert` with the step and rank.
Alerts on time are calibrated for busy hosts: the excess over the baseline must pass ``min_excess_s`` and the
rank's own jitter (``noise_factor`` robust standard deviations), for ``persist_steps`` steps in a row, or
:data:`SEVERE` times that floor at once. They are states (:data:`~hf_demo.ops.settings.CONDITIONS`): an alert with
``state="ongoing"`` at the onset, nothing while the deviation lasts (its steps stay out of the baseline, which
cannot absorb it), and one with ``state="resolved"`` (severity ``info``) once ``persist_steps`` steps in a row are
back under the bar. Every other alert is an ``"event"``.

- ``step_time``: the rank's own time (its step and the time outside it, less the wait on the collectives:
  :attr:`~hf_demo.ops.monitor.StepSample.own_s`; evaluation, checkpoints and logging are their own series, never
  in it) far above the baseline: this rank is the one the others wait for (a slow host, a stall in data
  loading); the ranks that waited for it see ``exchange_time`` instead;
- ``exchange_time``: the wait on the collectives (DeMo's exchange, and DDP's buffer broadcast before the forward
  where the others' lateness lands first) far above the baseline (the network, or a slow peer); the steps with
  DeMo's exchange and those with DDP's broadcast alone have a baseline each; the first step after an evaluation,
  a checkpoint or a log row is not judged (the ranks leave those at different times), unless every step logs;
- ``slow_link``: DeMo's exchange far slower than the link the plan assumed would carry its bytes;
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

Each alert carries its wall-clock time (``time``, Unix seconds) and its ``state``. Each is logged as a warning
(logger ``hf_demo.ops``; a resolution as info), counted as a metric event (the exporters'
``hf_demo_alerts_total{kind}`` and the log rows' ``ops/alerts`` count onsets and events; the gauge
``hf_demo_alert_ongoing{kind}`` is 1 while an alert on time is ongoing), written to
``ops/alerts-rank<r>.jsonl`` (resolutions too), and delivered as a Trainer callback event: every callback of
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
from hf_demo.ops.monitor import StepMonitor, StepSample, phase_of_log, rank_and_node
from hf_demo.ops.settings import CONDITIONS, HealthSettings

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
    state: str = "event"  # "event"; alerts on time (CONDITIONS): "ongoing" at the onset, "resolved" at recovery

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


class _Condition:
    """The state of one alert on time: steps in a row above (``deviating``) and back under (``calm``) its bar, and
    the onset while it is ongoing."""

    def __init__(self):
        self.deviating = self.calm = 0
        self.onset: Alert | None = None


class HealthRules:
    """The checks of one rank, sample by sample (no Trainer needed: a custom loop calls :meth:`observe`)."""

    def __init__(self, settings: HealthSettings):
        self.s = settings
        self.link = plan_link(settings)
        n = settings.baseline_steps
        self.step_times, self.exchange_times, self.losses = deque(maxlen=n), deque(maxlen=n), deque(maxlen=n)
        self.local_waits: deque = deque(maxlen=n)  # the waits of steps without DeMo's exchange (DDP's broadcast)
        self.resync_steps: deque = deque()
        self.streak = 0
        self.seen = 0
        self.logged_before = False  # the previous step followed a logging phase
        self.tier: int | None = None
        self.last_alert: dict[str, int] = {}
        self.conditions = {kind: _Condition() for kind in CONDITIONS}
        self.largest_quorum = 0
        self.last_quorum = 0  # the quorum at the last elastic step seen (0: none yet)
        self.below_target = 0  # steps in a row with the quorum below its target

    @property
    def ongoing(self) -> dict[str, Alert]:
        """The alerts on time still ongoing: kind -> its onset."""
        return {k: c.onset for k, c in self.conditions.items() if c.onset is not None}

    def observe(self, sample: StepSample, full_sync_every: int = 0) -> list[Alert]:
        self.seen += 1
        found: list[Alert] = []
        judged = self.seen > self.s.warmup_steps
        after_phase = self._after_phase(sample)
        if judged:
            found += self._own_time(sample)
            if not after_phase:
                found += self._wait(sample) + self._link(sample)
        found += self._loss(sample, judged) + self._resyncs(sample, full_sync_every) + self._tier(sample)
        found += self._quorum(sample)
        if self._normal("step_time"):  # a deviating or ongoing time stays out of its baseline
            self.step_times.append(sample.own_s)
        waits = self._waits(sample)
        if waits is not None and not after_phase and self._normal("exchange_time"):
            waits.append(sample.exchange_s)
        return [a for a in found if self._fresh(a)]

    def _after_phase(self, s: StepSample) -> bool:
        """Whether this step's wait is left unjudged: the ranks leave an evaluation, a checkpoint or a logging phase
        (rank 0's reporting callbacks) at different times, and the earliest waits in the next collective. A run
        that logs every step has its waits judged all the same (they would never be otherwise)."""
        logged = s.log_s > 0
        every_step, self.logged_before = logged and self.logged_before, logged
        return s.evaluate_s + s.save_s > 0 or (logged and not every_step)

    def _normal(self, kind: str) -> bool:
        c = self.conditions[kind]
        return c.deviating == 0 and c.onset is None

    def _waits(self, s: StepSample):
        """The baseline of this step's wait: steps with DeMo's exchange, else steps with DDP's broadcast alone."""
        if s.bytes_received > 0:
            return self.exchange_times
        return self.local_waits if s.forward_wait_s > 0 else None

    def _fresh(self, alert: Alert) -> bool:
        last = self.last_alert.get(alert.kind)
        cooled = alert.state == "event" and alert.kind not in UNCOOLED  # alerts on time have their own state
        if cooled and last is not None and alert.step - last < self.s.cooldown_steps:
            return False
        self.last_alert[alert.kind] = alert.step
        return True

    def _alert(self, sample, kind, message, value, baseline, severity="warning", state="event") -> Alert:
        return Alert(
            kind, sample.step, sample.rank, sample.node, message, float(value), float(baseline), severity, state=state
        )

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

    def _judge(self, history, value: float, factor: float) -> tuple[float, float, float] | None:
        """(baseline, excess, floor) of time ``value``: the median of ``history``, how far ``value`` is above it when
        it is ``factor`` times above it (else 0), and this rank's floor (:meth:`_floor`); None: not judged."""
        if factor <= 0 or len(history) < self.s.min_baseline:
            return None
        base = statistics.median(history)
        return base, (value - base if value > factor * base else 0.0), self._floor(history)

    def _condition(self, kind: str, s: StepSample, excess: float, floor: float, onset) -> list[Alert]:
        """An alert on time as a state: ongoing (``onset()`` builds its alert) once ``excess`` passes ``floor`` for
        ``persist_steps`` steps in a row, or at once at :data:`SEVERE` times it; resolved after as many steps in a
        row back under it. Nothing is repeated in between."""
        c = self.conditions[kind]
        deviating = excess > floor
        c.deviating = c.deviating + 1 if deviating else 0
        c.calm = 0 if deviating else c.calm + 1
        if c.onset is None:
            if deviating and (excess > SEVERE * floor or c.deviating >= self.s.persist_steps):
                c.onset = onset()
                return [c.onset]
            return []
        if c.calm < self.s.persist_steps:
            return []
        began, c.onset = c.onset, None
        why = (
            f"recovered: {s.step - began.step} steps after its onset at step {began.step} ({began.value:.3g} s "
            f"against a baseline of {began.baseline:.3g} s), {c.calm} steps in a row back under its bar"
        )
        return [self._alert(s, kind, why, began.value, began.baseline, "info", "resolved")]

    def _own_time(self, s: StepSample) -> list[Alert]:
        judged = self._judge(self.step_times, s.own_s, self.s.step_time_factor)
        if judged is None:
            return []
        base, excess, floor = judged

        def onset():
            split = (
                f"forward+backward {s.forward_backward_s:.3g} s, DeMo compute {s.demo_compute_s:.3g} s, "
                f"outside the step {s.other_s:.3g} s (evaluation, checkpoints and logging apart); waited on the "
                f"collectives {s.exchange_s:.3g} s, of which DDP's buffer broadcast {s.forward_wait_s:.3g} s"
            )
            why = (
                f"this rank's own time was {s.own_s:.3g} s, {s.own_s / base:.1f}x its baseline {base:.3g} s "
                f"({split}): the other ranks waited for it; ongoing until it recovers"
            )
            return self._alert(s, "step_time", why, s.own_s, base, state="ongoing")

        return self._condition("step_time", s, excess, floor, onset)

    def _wait(self, s: StepSample) -> list[Alert]:
        waits = self._waits(s)
        judged = None if waits is None else self._judge(waits, s.exchange_s, self.s.exchange_time_factor)
        if judged is None:
            return []
        base, excess, floor = judged

        def onset():
            why = (
                f"waited {s.exchange_s:.3g} s on the collectives, {s.exchange_s / base:.1f}x its baseline "
                f"{base:.3g} s (DeMo's exchange {s.demo_exchange_s:.3g} s, DDP's buffer broadcast before the forward "
                f"{s.forward_wait_s:.3g} s): a slow peer (a step_time alert on another rank names it) or the "
                "network; ongoing until it recovers"
            )
            return self._alert(s, "exchange_time", why, s.exchange_s, base, state="ongoing")

        return self._condition("exchange_time", s, excess, floor, onset)

    def _link(self, s: StepSample) -> list[Alert]:
        if self.link is None or s.bytes_received <= 0 or s.world < 2:
            return []
        expected = s.bytes_received / self.link.bandwidth + s.collectives * (s.world - 1) * self.link.latency
        took = s.demo_exchange_s
        excess = took - self.s.slow_link_factor * expected

        def onset():
            rate = s.bytes_received / took
            why = (
                f"the exchange took {took:.3g} s where the planned link ({format_rate(self.link.bandwidth)}) "
                f"carries its {s.bytes_received:.0f} bytes in {expected:.3g} s: effective {format_rate(rate)}; "
                "ongoing until it recovers"
            )
            return self._alert(s, "slow_link", why, took, expected, state="ongoing")

        return self._condition("slow_link", s, excess, self._floor(self.exchange_times), onset)

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

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._monitor is not None:
            self._monitor.phase_done(phase_of_log(logs))

    def on_evaluate(self, args, state, control, **kwargs):
        if self._monitor is not None:
            self._monitor.phase_done("evaluate")

    def on_save(self, args, state, control, **kwargs):
        if self._monitor is not None:
            self._monitor.phase_done("save")

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
