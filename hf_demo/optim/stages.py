"""The parts of a step (:mod:`hf_demo.optim.pipeline`), each one job. A part is an object with a ``name``, the
record it ``makes`` and ``run(step, <the records it reads>)`` (:mod:`hf_demo.optim.records`); it returns its record
and stages its writes in ``step.tx``."""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings

import torch

from hf_demo.compression import functional as F
from hf_demo.errors import DeMoPayloadError, DeMoSyncError
from hf_demo.exchange import exchanges
from hf_demo.guards import verdicts
from hf_demo.optim import overlap, settle, signals
from hf_demo.optim.records import (
    Agreed,
    Chosen,
    Decision,
    Exchanged,
    Findings,
    Landed,
    Momenta,
    Outcome,
    Prepared,
    Settled,
    Signalled,
    Step,
    StepPlan,
    Verdict,
)
from hf_demo.wire import agreement, codec

logger = logging.getLogger("hf_demo.optim.optimizer")


class Plan:
    """The step's tier, every trainable parameter's block layout, and the checksums the ranks compare."""

    name = "plan"
    makes = "plan"
    exchanging = False

    def run(self, step: Step) -> StepPlan:
        view = step.view
        tier_index = (step.decided or view.policy).tier
        tier = view.tiers[tier_index]
        items, layout_ck, settings_ck = view.plan(tier)
        generator = F.rounding_noise(step.settings.param_rounding, step.transport.step)
        return StepPlan(tier_index, tier, items, layout_ck, settings_ck, generator)


class Select:
    """The topology's choice: which parameters this rank steps and with which gradient."""

    name = "topology"
    makes = "chosen"
    exchanging = False

    def run(self, step: Step, plan: StepPlan) -> Chosen:
        return step.view.topology.select(plan.items)


class Signal:
    """What enters the momentum: the gradient, or at a synchronisation the change since the last one (local
    steps). A local step that does not synchronise ends the exchange here (``communicates`` False)."""

    name = "signal"
    makes = "signal"
    exchanging = False

    def run(self, step: Step, plan: StepPlan, chosen: Chosen) -> Signalled:
        return signals.for_tier(plan.tier).select(step, plan, chosen)


class Inspect:
    """Local checks, as header flags: non-finite gradients and replicas; the replicas' fingerprint when due (and
    at this process's first exchange); the gradient fingerprint for the DDP guard. Overlap: the exchange the last
    step started is finished here, and a refusal of it rides in the header."""

    name = "inspect"
    makes = "found"

    def run(self, step: Step, plan: StepPlan, chosen: Chosen, signal: Signalled) -> Findings:
        view, late, late_refusal = step.view, None, None
        if view.pending is not None:
            try:
                late = overlap.finish(view, step.transport.traffic)
            except DeMoPayloadError as exc:
                late_refusal = exc
        started = time.monotonic()
        found = verdicts.inspect(step, signal, late_refusal is not None)
        bits, refusal = view.topology.agree_step(
            step.transport, plan.settings_ck, found.flags & verdicts.AGREED_FLAGS, view.secret, chosen.device
        )
        return dataclasses.replace(
            found,
            flags=found.flags | bits,
            started=started,
            late=late,
            late_refusal=late_refusal,
            header_refusal=refusal,
        )


class Momentum:
    """``working = decay * momentum + scale * T(signal)`` (the signal as the update rule lets it in), on copies
    (the momenta are committed with the step), once per bucket of parameters with the same block shape
    (:mod:`hf_demo.compression.buckets`)."""

    name = "momentum"
    makes = "momenta"

    def run(self, step: Step, plan: StepPlan, chosen: Chosen, signal: Signalled, found: Findings) -> Momenta:
        if found.skipping:
            return Momenta([])
        view = step.view
        source = signals.for_tier(plan.tier)
        factors = [source.decay_and_scale(step.settings, g, layout) for _, g, layout in chosen.items]
        entering = [source.entering(step, p, g, s) for (p, g, _), s in zip(chosen.items, signal.signals)]
        momenta = [view.momentum(p, layout) for p, _, layout in chosen.items]
        return Momenta(F.accumulate_many(momenta, entering, chosen.layouts, factors, view.transform))


class Prepare:
    """The exchange's local part: top-k, encoding and error feedback on the working momenta; the payload."""

    name = "prepare"
    makes = "prepared"

    def run(
        self, step: Step, plan: StepPlan, chosen: Chosen, signal: Signalled, found: Findings, momenta: Momenta
    ) -> Prepared:
        average = "world" if signal.local else None  # a synchronisation averages over every rank
        spec = step.view.exchange_spec(chosen.layouts, plan.tier.value_format, step.transport.world, average)
        exchange = exchanges.build(step.settings.exchange, spec)
        if found.skipping:  # every rank will skip: zeros travel
            return Prepared(exchange, torch.zeros(exchange.payload_nbytes, dtype=torch.uint8, device=chosen.device))
        return Prepared(exchange, exchange.prepare(momenta.working))


class Agreement:
    """Every rank's header (step, layout, settings, flags, payload CRC, fingerprints, timings): built, signed,
    all-gathered and checked, so every rank knows what every other rank is about to do. In steady state the
    payload rides in the same all-gather (:func:`hf_demo.wire.agreement.gather_headers`): one round trip."""

    name = "agreement"
    makes = "agreed"

    def run(self, step: Step, plan: StepPlan, chosen: Chosen, found: Findings, prepared: Prepared) -> Agreed:
        view, transport, exchange = step.view, step.transport, prepared.exchange
        header = codec.Header(
            step=transport.step,
            layout_checksum=plan.layout_ck,
            settings_checksum=plan.settings_ck,
            flags=found.flags,
            world_size=transport.world,
            payload_bytes=exchange.payload_nbytes,
            fingerprint=found.replica_print if found.check_drift else 0,
            grad_fingerprint=found.grad_print,
            **view.header_timings(found.started),
        )
        agreed = view.wire_agreed.get((transport.world, plan.tier_index), 0)  # every rank's own, and the same
        riding = agreement.Riding(prepared.payload, agreed, exchange.riding_name)
        if step.settings.overlap or not exchange.rides or not agreement.RIDE:  # overlap: in the background
            riding = None
        gathered = agreement.gather_headers(
            transport,
            header,
            prepared.payload,
            view.secret,
            chosen.device,
            lambda: view.topology.node_settings(transport, view.settings_view(plan.tier)),
            view.sealer,
            riding,
            strict=not found.first,  # a process's first exchange names a rank without the secret on every rank
        )
        if gathered.settling:  # rows settling the last step: a rank refused it (hf_demo.optim.settle)
            raise settle.refused_before(transport, gathered.settling, view.unsettled)
        refusal = found.header_refusal or gathered.refusal  # raised through the vote (Communicate, Vote)
        if refusal is None:
            view.settle_prior()  # every row a step's header, trusted: every rank received the last step whole
        row_bytes = codec.HEADER_BYTES + (riding.agreed if riding is not None else 0)
        return Agreed(gathered.headers, gathered.rows, refusal, gathered.wire_bytes, row_bytes)


class Policy:
    """The budget policy's decision from the headers: a move down makes this step go again in the lower tier."""

    name = "policy"
    makes = "decision"

    def run(self, step: Step, chosen: Chosen, agreed: Agreed) -> Decision:
        view = step.view
        if not step.settings.comm_budget or step.decided is not None:
            return Decision(step.decided or view.policy)
        figures = view.topology.agree_figures(  # the whole model's, where it is sharded
            step.transport,
            chosen.device,
            max(h.exchange_ms for h in agreed.headers),
            max(h.elapsed_ms for h in agreed.headers),
            view.bytes_by_tier(chosen.items),
        )
        policy = view.policy.decide(*figures, view.clock.last_exchange_tier)
        return Decision(policy, policy if policy.tier > view.policy.tier else None)


class Judge:
    """What the headers say about this step, the same on every rank: raise, resync from rank 0, or skip."""

    name = "judge"
    makes = "verdict"

    def run(self, step: Step, chosen: Chosen, signal: Signalled, found: Findings, agreed: Agreed) -> Verdict:
        verdict = verdicts.judge(step, chosen.device, found, agreed.headers)
        if not verdict.resynced:
            return verdict
        fresh = agreement.fetch_rank0(signal.replicas, step.transport, step.view.sealer)
        for r, value in zip(signal.replicas, fresh):
            step.tx.copy(r, value)
        cause = "non-finite parameters" if verdict.bad_param_ranks else "full_sync_every"
        cause = "drift" if verdict.drifted else cause
        if found.first and verdict.drifted:
            cause = f"the replicas differed at this process's first exchange. {verdicts.UNSYNCED_START}"
        message = f"DeMo: copied rank 0's parameters to every rank at optimizer step {step.transport.step} ({cause})"
        step.tx.stage(lambda: _warn(message), keeps_nothing=True)
        return verdict


class Communicate:
    """The exchange's collectives, finished now, on every rank whatever the headers will decide (a skip, a
    resync): the vote then comes before any collective that the headers' content chooses, so a rank that could
    not trust a header still meets every other rank there. Where the payload rode with the headers nothing more
    travels for an all-gather exchange. Overlap starts its exchange later, in ``land``, after the judge."""

    name = "communicate"
    makes = "exchanged"

    def run(self, step: Step, momenta: Momenta, prepared: Prepared, agreed: Agreed) -> Exchanged:
        if step.settings.overlap:
            return Exchanged()
        transport, exchange = step.transport, prepared.exchange
        if codec.flagged(agreed.headers, codec.FLAG_NONFINITE | codec.FLAG_NONFINITE_PARAMS):
            # every rank skips: the exchange's collectives still run, with zeros of the sizes they always have
            # (nothing more where the payload rode with the headers), as on a rank that refused the flagging
            # header and so goes on as if the step were taken; what arrives is left unread
            started = exchange.start(
                transport, agreed.headers, prepared.payload, momenta.working, arrived=agreed.arrived, skipped=True
            )
            started.wait(transport.traffic)
            return Exchanged(refusal=agreed.header_refusal)
        updates, refusal = None, None
        try:
            in_flight = exchange.start(
                transport, agreed.headers, prepared.payload, momenta.working, arrived=agreed.arrived
            )
            updates = exchange.finish(in_flight, transport.traffic)
        except DeMoPayloadError as exc:
            refusal = exc
        except DeMoSyncError as exc:
            raise _parted(agreed, exc) from exc
        if agreed.header_refusal is not None:  # the collectives ran as on every rank; the header is what is refused
            return Exchanged(refusal=agreed.header_refusal)
        return Exchanged(updates, refusal)


class Vote:
    """All ranks commit the step, or none: every rank's verdict on what it received (passed its checks or not)
    reaches every rank before any rank keeps the step, and a refusal anywhere raises the same error on every rank
    (``commit_vote``). It runs before the parts that act on the headers (policy, judge), on every rank alike.

    With ``commit_vote="on"``, where the mode allows it (:func:`hf_demo.optim.settle.defers`: the defaults), a
    steady step's verdict settles in the next exchange's all-gather: the step commits tentatively with an undo
    log, no collective here (one round trip per step); a refusal posts a settling row and waits for the next
    step; a step that is not steady runs the settling all-gather now (:mod:`hf_demo.optim.settle`).

    Elsewhere (``commit_vote="separate"``, overlap, ``exchange="all_reduce"``, local steps, sharded parameters,
    elastic runs: why, in :mod:`hf_demo.optim.settle`) the verdict is a small all-gather of its own here
    (:func:`hf_demo.wire.agreement.vote`): two round trips per step; ``commit_vote="off"`` leaves it out (one
    round trip, and a refusal raises on the refusing rank only)."""

    name = "vote"
    makes = "settled"

    def run(
        self, step: Step, plan: StepPlan, chosen: Chosen, found: Findings, agreed: Agreed, exchanged: Exchanged
    ) -> Settled:
        if step.settings.commit_vote == "on" and settle.defers(step, plan):
            return settle.vote(step, chosen, found, agreed, exchanged.refusal)
        refusal, transport = exchanged.refusal, step.transport
        alone = step.settings.overlap or transport.world == 1  # overlap votes in the next header
        if not alone and step.settings.commit_vote != "off":
            try:
                view = step.view
                agreement.vote(transport, exchanged.refusal, chosen.device, view.sealer, view.secret, agreed.headers)
            except DeMoPayloadError as exc:
                refusal = exc
            except DeMoSyncError as exc:
                raise _parted(agreed, exc) from exc
        refusal = step.view.topology.agree_refusal(transport, chosen.device, refusal)  # every shard, where sharded
        if refusal is not None:
            raise refusal
        return Settled(row_bytes=agreed.row_bytes)


class Update:
    """The update rule on the averaged update (or, at a synchronisation, the mean change from the anchor):
    its state computed on copies now, the parameters written in place at the commit."""

    name = "update"
    makes = None

    def run(
        self,
        step: Step,
        plan: StepPlan,
        chosen: Chosen,
        signal: Signalled,
        momenta: Momenta,
        exchanged: Exchanged,
        verdict: Verdict,
    ) -> None:
        if verdict.skip:
            return
        if step.settings.overlap:
            for p, m in zip(chosen.params, momenta.working):
                step.tx.set(step.view.state[p], "momentum", m)
            return
        signals.for_tier(plan.tier).update(step, plan, chosen, signal, momenta.working, exchanged.updates)


class LandLate:
    """Overlap: the update of the exchange the last step started lands (after a resync's copies, before this
    step's own writes), and this step's exchange starts in the background: it becomes the one in flight. A
    skipped step's exchange runs too, with zeros, and lands nothing: so a rank that refused the header saying
    skip meets every other rank in it, and its refusal rides in the next step's header."""

    name = "land"
    makes = "landed"

    def run(
        self,
        step: Step,
        plan: StepPlan,
        chosen: Chosen,
        found: Findings,
        momenta: Momenta,
        prepared: Prepared,
        agreed: Agreed,
        verdict: Verdict,
    ) -> Landed | None:
        in_flight = None
        if step.settings.overlap:  # a skipped step's exchange too, with zeros (nothing of it lands): see Communicate
            exchange, transport, working = prepared.exchange, step.transport, momenta.working
            in_flight = exchange.start(transport, agreed.headers, prepared.payload, working, True, skipped=verdict.skip)
            in_flight.refused = in_flight.refused or agreed.header_refusal  # raised when it is finished
        if not step.settings.overlap and found.late is None:
            return None
        overlap.stage_late(step.view, step.tx, found.late, step.transport)
        return Landed(overlap.pending_from(step.view, plan.tier, chosen, in_flight))


class Conclude:
    """The step's counters, policy, clock and traffic: the :class:`~hf_demo.optim.records.Outcome` the optimizer
    takes last at the commit (they change whatever the step did)."""

    name = "commit"
    makes = "outcome"
    exchanging = False

    def run(
        self,
        step: Step,
        plan: StepPlan,
        chosen: Chosen,
        signal: Signalled,
        found: Findings | None,
        agreed: Agreed | None,
        decision: Decision | None,
        verdict: Verdict | None,
        landed: Landed | None,
    ) -> Outcome:
        view = step.view
        dense = 4 * sum(layout.numel for layout in chosen.layouts)
        outcome = Outcome(dense, step.transport.traffic, view.counters, landed=landed)
        counters = view.counters
        if verdict is not None and verdict.resynced:
            counters = dataclasses.replace(counters, resyncs=counters.resyncs + 1)
        if not signal.communicates:  # a local step: the ranks stay apart until a synchronisation commits
            counters = dataclasses.replace(counters, unsynced=True)
            outcome = dataclasses.replace(outcome, policy=step.decided)  # moved down into a local phase, or None
        else:
            policy = decision.policy
            if not step.settings.comm_budget and policy.tier:  # a budget's tier resumed without a budget
                policy = dataclasses.replace(policy, tier=0, over=0, under=0)
            outcome = dataclasses.replace(
                outcome, policy=policy, exchanged=True, started=found.started, tier_index=plan.tier_index
            )
            if agreed.wire_bytes is not None:  # what the payload takes on the wire, agreed: it rides from now on
                wire = {**view.wire_agreed, (step.transport.world, plan.tier_index): agreed.wire_bytes}
                outcome = dataclasses.replace(outcome, wire_agreed=wire)
        if verdict.skip if verdict is not None else signal.skip:
            counters = counters.skipped()
            outcome = dataclasses.replace(outcome, warn_skips=True)
        else:
            counters = dataclasses.replace(counters, steps=counters.steps + 1)
            if signal.communicates:  # a synchronisation: the replicas agree
                counters = dataclasses.replace(counters, consecutive_skips=0, unsynced=False)
        return dataclasses.replace(outcome, counters=counters)


def _parted(agreed: Agreed, exc: DeMoSyncError) -> DeMoSyncError:
    """A collective failed after this rank refused a header: the refused header's true content (a skip, a drift)
    may have taken the others elsewhere, so the peer is not to blame; say so (else the error as it is)."""
    if agreed.header_refusal is None:
        return exc
    return DeMoSyncError(
        f"{agreed.header_refusal}; this rank went on into the step's collectives with a stand-in for that header, "
        "and the others, which read it intact, did not meet it there (what it said, a skipped step or a drift, "
        f"took them elsewhere): {exc}. No state was changed; resume every rank from the last checkpoint"
    )


def _warn(message: str) -> None:
    logger.warning(message)
    warnings.warn(message, stacklevel=5)


def warn_skips(settings, counters) -> None:
    """Warn once the skipped steps in a row reach ``nonfinite_patience`` (staged with the counters)."""
    if counters.consecutive_skips == settings.nonfinite_patience:
        warnings.warn(
            f"DeMo skipped the last {counters.consecutive_skips} optimizer steps for NaN/Inf "
            "gradients: the loss has likely diverged (lower the learning rate, check the data)",
            stacklevel=5,
        )
