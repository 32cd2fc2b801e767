"""The parts of a step (:mod:`hf_demo.optim.pipeline`), each one job. A part is an object with a ``name`` and
``run(ctx)``; it reads the context, adds its results to it and stages its writes in ``ctx.tx``."""

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
from hf_demo.optim import overlap
from hf_demo.optim import policy as policies
from hf_demo.optim.pipeline import StepContext
from hf_demo.wire import agreement, codec

logger = logging.getLogger("hf_demo.optim.optimizer")


class Plan:
    """The step's tier, every trainable parameter's block layout, and the checksums the ranks compare."""

    name = "plan"
    exchanging = False

    def run(self, ctx: StepContext) -> None:
        opt = ctx.opt
        ctx.tier_index = (ctx.decided or opt.policy).tier
        ctx.tier = opt.tiers[ctx.tier_index]
        ctx.all_items, ctx.layout_ck, ctx.settings_ck = opt.plan(ctx.tier)
        ctx.generator = F.rounding_noise(ctx.settings.param_rounding, ctx.transport.step)


class Select:
    """The topology's choice: which parameters this rank steps and with which gradient."""

    name = "topology"
    exchanging = False

    def run(self, ctx: StepContext) -> None:
        ctx.opt.topology.select(ctx)


class Signal:
    """What enters the momentum: the gradient, or at a synchronisation the change since the last one (local
    steps). A local step that does not synchronise ends the exchange here (``ctx.communicates`` False)."""

    name = "signal"
    exchanging = False

    def run(self, ctx: StepContext) -> None:
        ctx.opt.signal_for(ctx.tier).select(ctx)


class Inspect:
    """Local checks, as header flags: non-finite gradients and replicas; the replicas' fingerprint when due (and
    at this process's first exchange); the gradient fingerprint for the DDP guard. Overlap: the exchange the last
    step started is finished here, and a refusal of it rides in the header."""

    name = "inspect"

    def run(self, ctx: StepContext) -> None:
        opt = ctx.opt
        if opt.in_flight:
            try:
                ctx.late = opt.finish_in_flight(ctx.transport.traffic)
            except DeMoPayloadError as exc:
                ctx.late_refusal = exc
        ctx.started = time.monotonic()
        verdicts.inspect(ctx, opt.first_checked, opt.ddp_suspects)
        ctx.flags |= opt.topology.agree_step(ctx, ctx.flags & verdicts.AGREED_FLAGS)


class Momentum:
    """``working = decay * momentum + scale * T(signal)`` (the signal as the update rule lets it in), on copies
    (the momenta are committed with the step), once per bucket of parameters with the same block shape
    (:mod:`hf_demo.compression.buckets`)."""

    name = "momentum"

    def run(self, ctx: StepContext) -> None:
        if ctx.flags & (codec.FLAG_NONFINITE | codec.FLAG_NONFINITE_PARAMS):
            return
        opt = ctx.opt
        source = opt.signal_for(ctx.tier)
        factors = [source.decay_and_scale(ctx, g, layout) for _, g, layout in ctx.items]
        entering = [source.entering(ctx, p, g, signal) for (p, g, _), signal in zip(ctx.items, ctx.signals)]
        momenta = [opt.momentum(p, layout) for p, _, layout in ctx.items]
        ctx.working = F.accumulate_many(momenta, entering, ctx.layouts, factors, opt.transform)


class Prepare:
    """The exchange's local part: top-k, encoding and error feedback on the working momenta; the payload."""

    name = "prepare"

    def run(self, ctx: StepContext) -> None:
        average = "world" if ctx.local else None  # a synchronisation averages over every rank
        spec = ctx.opt.exchange_spec(ctx.layouts, ctx.tier.value_format, ctx.transport.world, average)
        ctx.exchange = exchanges.build(ctx.settings.exchange, spec)
        if ctx.flags & (codec.FLAG_NONFINITE | codec.FLAG_NONFINITE_PARAMS):  # every rank will skip: zeros travel
            ctx.payload = torch.zeros(ctx.exchange.payload_nbytes, dtype=torch.uint8, device=ctx.device)
        else:
            ctx.payload = ctx.exchange.prepare(ctx.working)


class Agreement:
    """Every rank's header (step, layout, settings, flags, payload CRC, fingerprints, timings): built, signed,
    all-gathered and checked, so every rank knows what every other rank is about to do. In steady state the
    payload rides in the same all-gather (:func:`hf_demo.wire.agreement.gather_headers`): one round trip."""

    name = "agreement"

    def run(self, ctx: StepContext) -> None:
        opt = ctx.opt
        header = codec.Header(
            step=ctx.transport.step,
            layout_checksum=ctx.layout_ck,
            settings_checksum=ctx.settings_ck,
            flags=ctx.flags,
            world_size=ctx.transport.world,
            payload_bytes=ctx.exchange.payload_nbytes,
            fingerprint=ctx.replica_print if ctx.check_drift else 0,
            grad_fingerprint=ctx.grad_print,
            **opt.header_timings(ctx.started),
        )
        agreed = opt.wire_agreed.get((ctx.transport.world, ctx.tier_index), 0)  # every rank's own, and the same
        riding = agreement.Riding(ctx.payload, agreed, ctx.exchange.riding_name)
        if ctx.settings.overlap or not ctx.exchange.rides or not agreement.RIDE:  # overlap: in the background
            riding = None
        gathered = agreement.gather_headers(
            ctx.transport,
            header,
            ctx.payload,
            opt.secret,
            ctx.device,
            lambda: opt.settings_view(ctx.tier),
            opt.sealer,
            riding,
        )
        ctx.headers, ctx.arrived = gathered.headers, gathered.rows
        ctx.header_refusal = ctx.header_refusal or gathered.refusal  # raised through the vote (Communicate, Vote)
        ctx.wire_bytes = gathered.wire_bytes


class Policy:
    """The budget policy's decision from the headers: a move down makes this step go again in the lower tier."""

    name = "policy"

    def run(self, ctx: StepContext) -> None:
        opt = ctx.opt
        ctx.policy = ctx.decided or opt.policy
        if not ctx.settings.comm_budget or ctx.decided is not None:
            return
        figures = opt.topology.agree_figures(  # the whole model's, where it is sharded
            ctx,
            max(h.exchange_ms for h in ctx.headers),
            max(h.elapsed_ms for h in ctx.headers),
            opt.bytes_by_tier(ctx.items),
        )
        ctx.policy = opt.policy.decide(*figures, opt.clock.last_exchange_tier)
        if ctx.policy.tier > opt.policy.tier:
            ctx.retry = ctx.policy


class Judge:
    """What the headers say about this step, the same on every rank: raise, resync from rank 0, or skip."""

    name = "judge"

    def run(self, ctx: StepContext) -> None:
        verdicts.judge(ctx)
        if not ctx.resync:
            return
        ctx.fresh = agreement.fetch_rank0(ctx.replicas, ctx.transport, ctx.opt.sealer)
        for r, value in zip(ctx.replicas, ctx.fresh):
            ctx.tx.copy(r, value)
        cause = "drift" if ctx.drifted else "non-finite parameters" if ctx.bad_param_ranks else "full_sync_every"
        if ctx.first and ctx.drifted:
            cause = f"the replicas differed at this process's first exchange. {verdicts.UNSYNCED_START}"
        message = f"DeMo: copied rank 0's parameters to every rank at optimizer step {ctx.transport.step} ({cause})"
        ctx.tx.stage(lambda: _warn(message))
        ctx.resynced = True


class Communicate:
    """The exchange's collectives, finished now, on every rank whatever the headers will decide (a skip, a
    resync): the vote then comes before any collective that the headers' content chooses, so a rank that could
    not trust a header still meets every other rank there. Where the payload rode with the headers nothing more
    travels for an all-gather exchange. Overlap starts its exchange later, in ``land``, after the judge."""

    name = "communicate"

    def run(self, ctx: StepContext) -> None:
        if ctx.settings.overlap:
            return
        transport = ctx.transport
        if codec.flagged(ctx.headers, codec.FLAG_NONFINITE | codec.FLAG_NONFINITE_PARAMS):
            # every rank skips: the exchange's collectives still run, with zeros of the sizes they always have
            # (nothing more where the payload rode with the headers), as on a rank that refused the flagging
            # header and so goes on as if the step were taken; what arrives is left unread
            started = ctx.exchange.start(
                transport, ctx.headers, ctx.payload, ctx.working, arrived=ctx.arrived, skipped=True
            )
            started.wait(transport.traffic)
            ctx.refusal = ctx.header_refusal
            return
        try:
            in_flight = ctx.exchange.start(transport, ctx.headers, ctx.payload, ctx.working, arrived=ctx.arrived)
            ctx.updates = ctx.exchange.finish(in_flight, transport.traffic)
        except DeMoPayloadError as exc:
            ctx.refusal = exc
        except DeMoSyncError as exc:
            raise _parted(ctx, exc) from exc
        if ctx.header_refusal is not None:  # the collectives ran as on every rank; the header is what is refused
            ctx.refusal, ctx.updates = ctx.header_refusal, None


class Vote:
    """All ranks commit the step, or none: every rank says whether what it received passed its checks (one
    small all-gather), and a refusal anywhere raises the same error on every rank (``commit_vote``). It runs
    before the parts that act on the headers (policy, judge), on every rank alike.

    Why it is a round trip of its own and does not ride in the next step's row: a verdict that arrives a step
    late means every rank commits before knowing it, so a rank that refused what it received would owe the
    step's update and need it sent again, and a rank that refused a header would not know the step's other
    collectives (a resync's broadcast, a policy's second try): the ranks would meet out of step. Each step
    therefore costs two round trips with the vote and one with ``commit_vote="off"``."""

    name = "vote"

    def run(self, ctx: StepContext) -> None:
        refusal = ctx.refusal
        alone = ctx.settings.overlap or ctx.transport.world == 1  # overlap votes in the next header
        if not alone and ctx.settings.commit_vote == "on":
            try:
                agreement.vote(ctx.transport, ctx.refusal, ctx.device, ctx.opt.sealer)
            except DeMoPayloadError as exc:
                refusal = exc
            except DeMoSyncError as exc:
                raise _parted(ctx, exc) from exc
        refusal = ctx.opt.topology.agree_refusal(ctx, refusal)  # every shard of the model, where sharded
        if refusal is not None:
            raise refusal


class Update:
    """The update rule on the averaged update (or, at a synchronisation, the mean change from the anchor):
    its state computed on copies now, the parameters written in place at the commit."""

    name = "update"

    def run(self, ctx: StepContext) -> None:
        if ctx.skip:
            return
        opt = ctx.opt
        if ctx.settings.overlap:
            for (p, _, _), m in zip(ctx.items, ctx.working):
                ctx.tx.set(opt.state[p], "momentum", m)
            return
        opt.signal_for(ctx.tier).update(ctx)


class LandLate:
    """Overlap: the update of the exchange the last step started lands (after a resync's copies, before this
    step's own writes), and this step's exchange starts in the background: it becomes the one in flight. A
    skipped step's exchange runs too, with zeros, and lands nothing: so a rank that refused the header saying
    skip meets every other rank in it, and its refusal rides in the next step's header."""

    name = "land"

    def run(self, ctx: StepContext) -> None:
        opt = ctx.opt
        if ctx.settings.overlap:  # a skipped step's exchange too, with zeros (nothing of it lands): see Communicate
            exchange, transport = ctx.exchange, ctx.transport
            ctx.in_flight = exchange.start(transport, ctx.headers, ctx.payload, ctx.working, True, skipped=ctx.skip)
            ctx.in_flight.refused = ctx.in_flight.refused or ctx.header_refusal  # raised when it is finished
        if ctx.settings.overlap or ctx.late is not None:
            overlap.stage_late(opt, ctx.tx, ctx.late, ctx.transport)
            ctx.tx.stage(lambda: opt.land_in_flight(overlap.pending_from(ctx, ctx.in_flight)))


class Conclude:
    """The step's counters, policy, clock and traffic, staged last (they change whatever the step did)."""

    name = "commit"
    exchanging = False

    def run(self, ctx: StepContext) -> None:
        opt, tx = ctx.opt, ctx.tx
        dense = 4 * sum(layout.numel for layout in ctx.layouts)
        tx.stage(lambda: opt.comm_stats.commit_step(dense, ctx.transport.traffic))
        counters = opt.counters
        if ctx.resynced:
            counters = dataclasses.replace(counters, resyncs=counters.resyncs + 1)
        if not ctx.communicates:  # a local step: the ranks stay apart until a synchronisation commits
            counters = dataclasses.replace(counters, unsynced=True)
            if ctx.decided is not None:  # moved down into a local phase: this step communicates no more
                tx.stage(lambda: setattr(opt, "policy", ctx.decided))
        else:
            tx.stage(lambda: _conclude_exchange(ctx))
            if ctx.wire_bytes is not None:  # what the payload takes on the wire, agreed: it rides from now on
                agreed = {**opt.wire_agreed, (ctx.transport.world, ctx.tier_index): ctx.wire_bytes}
                tx.stage(lambda: setattr(opt, "wire_agreed", agreed))
        if ctx.skip:
            counters = counters.skipped()
            tx.stage(lambda: _warn_skips(opt, counters))
        else:
            counters = dataclasses.replace(counters, steps=counters.steps + 1)
            if ctx.communicates:  # a synchronisation: the replicas agree
                counters = dataclasses.replace(counters, consecutive_skips=0, unsynced=False)
        tx.stage(lambda: setattr(opt, "counters", counters))


def _parted(ctx: StepContext, exc: DeMoSyncError) -> DeMoSyncError:
    """A collective failed after this rank refused a header: the refused header's true content (a skip, a drift)
    may have taken the others elsewhere, so the peer is not to blame; say so (else the error as it is)."""
    if ctx.header_refusal is None:
        return exc
    return DeMoSyncError(
        f"{ctx.header_refusal}; this rank went on into the step's collectives with a stand-in for that header, "
        "and the others, which read it intact, did not meet it there (what it said, a skipped step or a drift, "
        f"took them elsewhere): {exc}. No state was changed; resume every rank from the last checkpoint"
    )


def _conclude_exchange(ctx: StepContext) -> None:
    opt, policy = ctx.opt, ctx.policy
    opt.first_checked = True
    if not ctx.settings.comm_budget and policy.tier:  # a budget's tier resumed without a budget: the settings
        policy = dataclasses.replace(policy, tier=0, over=0, under=0)
    opt.policy = policy
    opt.clock = policies.Clock(opt.comm_stats.seconds * 1000.0, ctx.started, ctx.tier_index)


def _warn(message: str) -> None:
    logger.warning(message)
    warnings.warn(message, stacklevel=5)


def _warn_skips(opt, counters) -> None:
    if counters.consecutive_skips == opt.settings.nonfinite_patience:
        warnings.warn(
            f"DeMo skipped the last {counters.consecutive_skips} optimizer steps for NaN/Inf "
            "gradients: the loss has likely diverged (lower the learning rate, check the data)",
            stacklevel=5,
        )
