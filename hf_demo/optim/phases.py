"""One optimizer step, phase by phase: :func:`run_step` calls the phases below in order, each with the records it
reads, and each returns the frozen record it makes (:mod:`hf_demo.optim.records`)::

    plan -> topology -> signal -> inspect -> momentum -> compress -> agreement -> communicate -> vote
         -> policy -> judge -> land -> update -> commit       (then DeMo takes the outcome and commits the step)

Every phase is given the :class:`~hf_demo.optim.records.Step` (the optimizer's narrow view
:class:`~hf_demo.optim.view.OptimizerView`, this step's transport, its transaction) and the records it reads, as
its arguments say. No phase writes to the optimizer, the parameters or the counters: a phase stages its writes in
``step.tx`` (:mod:`hf_demo.optim.transaction`), and the optimizer stages the outcome last and commits once the
whole step has succeeded on every rank. Two branches are taken in the open in :func:`run_step`: a local step (its
``signal`` does not communicate) leaves out every phase from ``inspect`` to ``update``; a policy's move down
(``Decision.retry``) ends the try after ``policy`` and runs the step again in the lower tier. Two phases act only
where their setting asks: ``policy`` under a ``comm_budget`` (else the tier stays), ``land`` with an exchange to land
or start in the background (``overlap``); their trace ranges open on every step alike.

What plugs in where is chosen from a registry: the topology by the parameters (:mod:`hf_demo.topology`), the
signal by the tier's ``sync_every`` (the gradient here, local steps' in :mod:`hf_demo.optim.signals`), the
transform by ``transform`` (:mod:`hf_demo.compression`), the exchange by ``exchange``
(:mod:`hf_demo.exchange.transport`), the update rule by ``update_rule`` (:mod:`hf_demo.optim.update_rules`).
``docs/DESIGN.md`` shows how to add one.

Traces: the step is a ``torch.profiler.record_function`` range ``DeMo.step``, each phase one named ``DeMo.<phase>``
(:data:`PHASES`), and ``DeMo.exchange`` spans ``agreement`` (whose all-gather carries the payload in steady state)
and ``communicate`` (the exchange's own collectives), so the step's exchange collectives sit inside it; the
PyTorch profiler, TensorBoard and Perfetto show them; on CUDA the same names are NVTX ranges too (Nsight).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import warnings

import torch

from hf_demo import compression as F
from hf_demo import guards as verdicts
from hf_demo.errors import DeMoPayloadError, DeMoStateError, DeMoSyncError
from hf_demo.exchange import transport as exchanges
from hf_demo.optim import local_steps, overlap, settle, signals, update_rules
from hf_demo.optim import view as views
from hf_demo.optim.policy import Clock
from hf_demo.optim.records import (
    SKIPPING_FLAGS,
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
from hf_demo.optim.transaction import Transaction, keep_mapping
from hf_demo.wire import agreement as wire_agreement
from hf_demo.wire import codec

logger = logging.getLogger("hf_demo.optim.optimizer")

PHASES = (  # the phases of a step in order, each traced as ``DeMo.<phase>``
    "plan",
    "topology",
    "signal",
    "inspect",
    "momentum",
    "compress",
    "agreement",
    "communicate",
    "vote",
    "policy",
    "judge",
    "land",
    "update",
    "commit",
)
LOCAL_STEP = ("plan", "topology", "signal", "commit")  # a local step's phases: no exchange


@contextlib.contextmanager
def traced(name: str):
    """A ``record_function`` range named ``name`` and an NVTX range of the same name: a range of a step on CUDA
    (elsewhere :func:`run_step` opens the ``record_function`` range itself, with no frame of ours)."""
    with torch.profiler.record_function(name):
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()


def run_step(view, transport, cuda: bool = False) -> tuple[Step, Settled | None, Outcome]:
    """The step, phase after phase; again in a lower tier as long as the policy moves down at its headers (a loop,
    not recursion): every try's traffic is counted (the step's one transport), nothing else of a try that moved
    down is kept (a fresh transaction). Returns the last try's step (its transaction holds the step's writes), its
    vote's record (None for a local step) and its outcome. The policy decides only under a budget (else the tier
    stays), and ``land`` runs only where an exchange lands late or starts in the background (overlap)."""
    span = traced if cuda else torch.profiler.record_function  # a range (on CUDA with its NVTX range: traced)
    with span("DeMo.step"):
        decided = None
        while True:
            step = Step(view, transport, Transaction(), decided, view.settings)
            with span("DeMo.plan"):
                planned = plan(step)
            with span("DeMo.topology"):
                chosen = topology(step, planned)
            with span("DeMo.signal"):
                signalled = signal(step, planned, chosen)
            if not signalled.communicates:  # a local step: no exchange this time
                with span("DeMo.commit"):
                    return step, None, commit(step, planned, chosen, signalled)
            with span("DeMo.inspect"):
                found = inspect(step, planned, chosen, signalled)
            with span("DeMo.momentum"):
                momenta = momentum(step, planned, chosen, signalled, found)
            with span("DeMo.compress"):
                prepared = compress(step, planned, chosen, signalled, found, momenta)
            with span("DeMo.exchange"):
                with span("DeMo.agreement"):
                    agreed = agreement(step, planned, chosen, found, prepared)
                with span("DeMo.communicate"):
                    exchanged = communicate(step, momenta, prepared, agreed)
            with span("DeMo.vote"):
                settled = vote(step, planned, chosen, found, agreed, exchanged)
            with span("DeMo.policy"):
                budget = step.settings.comm_budget and decided is None
                decision = policy(step, chosen, agreed) if budget else Decision(decided or view.policy)
            if decision.retry is not None:  # the policy moves down: this try ends, the step goes again lower
                decided = decision.retry
                continue
            with span("DeMo.judge"):
                verdict = judge(step, chosen, signalled, found, agreed)
            with span("DeMo.land"):
                lands = step.settings.overlap or found.late is not None
                landed = land(step, planned, chosen, found, momenta, prepared, agreed, verdict) if lands else None
            with span("DeMo.update"):
                update(step, planned, chosen, signalled, momenta, exchanged, verdict)
            with span("DeMo.commit"):
                outcome = commit(step, planned, chosen, signalled, found, agreed, decision, verdict, landed)
            return step, settled, outcome


def plan(step: Step) -> StepPlan:
    """The step's tier, every trainable parameter's block layout, and the checksums the ranks compare."""
    view = step.view
    tier_index = (step.decided or view.policy).tier
    tier = view.tiers[tier_index]
    items, layout_ck, shared, settings_ck, whole = views.plan_items(
        view.param_groups, step.settings, view.secret, tier, view.topology.sharded
    )
    generator = F.rounding_noise(step.settings.param_rounding, step.transport.step)
    return StepPlan(tier_index, tier, items, layout_ck, shared, settings_ck, generator, whole)


def topology(step: Step, plan: StepPlan) -> Chosen:
    """The topology's choice: which parameters this rank steps and with which gradient."""
    return step.view.topology.select(plan.items)


def signal(step: Step, plan: StepPlan, chosen: Chosen) -> Signalled:
    """What enters the momentum: the gradient, or at a synchronisation the change since the last one (local
    steps: :class:`~hf_demo.optim.signals.LocalSignal`). A local step that does not synchronise ends the exchange
    here (``communicates`` False)."""
    if plan.tier.sync_every > 1:
        return signals.LocalSignal().select(step, plan, chosen)
    state = step.view.state
    for p in chosen.params:  # a tier without local steps: a later local phase starts afresh
        if any(k in state[p] for k in local_steps.LOCAL_KEYS):
            step.tx.stage(lambda state=state[p]: local_steps.forget(state), before=keep_mapping(state[p]))
    return Signalled(local=False, signals=list(chosen.grads), replicas=list(chosen.views))


def inspect(step: Step, plan: StepPlan, chosen: Chosen, signal: Signalled) -> Findings:
    """Local checks, as header flags: non-finite gradients and replicas; the replicas' fingerprint when due (and
    at this process's first exchange); the gradient fingerprint for the DDP guard. Overlap: the exchange the last
    step started is finished here, and a refusal of it rides in the header."""
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


def momentum(step: Step, plan: StepPlan, chosen: Chosen, signal: Signalled, found: Findings) -> Momenta:
    """``working = decay * momentum + scale * T(signal)`` (the signal as the update rule lets it in), on copies
    (the momenta are committed with the step), once per bucket of parameters with the same block shape
    (:mod:`hf_demo.compression`)."""
    if found.flags & SKIPPING_FLAGS:
        return Momenta([])
    view = step.view
    if plan.tier.sync_every > 1:  # the pseudo-gradient as it is, into an error feedback (signals.LocalSignal)
        factors = [signals.LocalSignal.decay_and_scale(step.settings, g, layout) for _, g, layout in chosen.items]
        entering = list(signal.signals)
    else:  # the gradient, scaled by the learning rate, as the group's update rule lets it in (its state staged)
        factors, entering = [(g["compression_decay"], g["lr"]) for g in chosen.groups], []
        for (p, g, _), grad in zip(chosen.items, signal.signals):
            if g["update_rule"] in update_rules.OWN_SIGNAL:  # (the plan resolved every group's rule: a known name)
                grad, changed = update_rules.get(g["update_rule"]).signal(grad, view.state[p])
                if changed:
                    step.tx.update(view.state[p], changed)
            entering.append(grad)
    momenta = []
    for p, _, layout in chosen.items:  # each one's momentum (zeros before its first step), its blocks checked
        state, blocked = view.state[p], (layout.nblocks, layout.bsize)
        if "momentum" not in state:
            momenta.append(torch.zeros(blocked, dtype=torch.float32, device=p.device))
        elif state["momentum"].shape != blocked:
            raise DeMoStateError(_rechunked(p, state["momentum"], blocked))
        else:
            momenta.append(state["momentum"])
    return Momenta(F.accumulate_many(momenta, entering, chosen.layouts, factors, view.transform, view.workspace))


def compress(
    step: Step, plan: StepPlan, chosen: Chosen, signal: Signalled, found: Findings, momenta: Momenta
) -> Prepared:
    """The exchange's local part: top-k, encoding and error feedback on the working momenta; the payload."""
    average = "world" if signal.local else None  # a synchronisation averages over every rank
    layouts, value_format, world = chosen.layouts, plan.tier.value_format, step.transport.world
    spec = dataclasses.replace(step.view.spec, layouts=layouts, value_format=value_format, world=world, average=average)
    exchange = exchanges.build(step.settings.exchange, spec)
    if found.flags & SKIPPING_FLAGS:  # every rank will skip: zeros travel
        return Prepared(exchange, torch.zeros(exchange.payload_nbytes, dtype=torch.uint8, device=chosen.device))
    return Prepared(exchange, exchange.prepare(momenta.working, step.view.workspace))


def agreement(step: Step, plan: StepPlan, chosen: Chosen, found: Findings, prepared: Prepared) -> Agreed:
    """Every rank's header (step, layout, settings, flags, payload CRC, fingerprints, timings): built, signed,
    all-gathered and checked, so every rank knows what every other rank is about to do. In steady state the
    payload rides in the same all-gather (:func:`hf_demo.wire.agreement.gather_headers`): one round trip."""
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
    riding = wire_agreement.Riding(prepared.payload, agreed, exchange.riding_name)
    if step.settings.overlap or not exchange.rides or not wire_agreement.RIDE:  # overlap: in the background
        riding = None
    gathered = wire_agreement.gather_headers(
        transport,
        header,
        prepared.payload,
        view.secret,
        chosen.device,
        lambda: view.topology.node_settings(transport, plan.settings_view),
        view.sealer,
        riding,
        first=found.first,
    )
    if gathered.settling:  # rows settling the last step: a rank refused it (hf_demo.optim.settle)
        raise settle.refused_before(transport, gathered.settling, view.unsettled)
    refusal = found.header_refusal or gathered.refusal  # raised through the vote (communicate, vote)
    if refusal is None:
        view.settle_prior()  # every row a step's header, trusted: every rank received the last step whole
    row_bytes = codec.HEADER_BYTES + (riding.agreed if riding is not None else 0)
    return Agreed(gathered.headers, gathered.rows, refusal, gathered.wire_bytes, row_bytes)


def communicate(step: Step, momenta: Momenta, prepared: Prepared, agreed: Agreed) -> Exchanged:
    """The exchange's collectives, finished now, on every rank whatever the headers will decide (a skip, a
    resync): the vote then comes before any collective that the headers' content chooses, so a rank that could
    not trust a header still meets every other rank there. Where the payload rode with the headers nothing more
    travels for an all-gather exchange. Overlap starts its exchange later, in :func:`land`, after the judge."""
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
        in_flight = exchange.start(transport, agreed.headers, prepared.payload, momenta.working, arrived=agreed.arrived)
        updates = exchange.finish(in_flight, transport.traffic, step.view.workspace)  # read by this step's update
    except DeMoPayloadError as exc:
        refusal = exc
    except DeMoSyncError as exc:
        raise _parted(agreed, exc) from exc
    if agreed.header_refusal is not None:  # the collectives ran as on every rank; the header is what is refused
        return Exchanged(refusal=agreed.header_refusal)
    return Exchanged(updates, refusal)


def vote(step: Step, plan: StepPlan, chosen: Chosen, found: Findings, agreed: Agreed, exchanged: Exchanged) -> Settled:
    """All ranks commit the step, or none: every rank's verdict on what it received (passed its checks or not)
    reaches every rank before any rank keeps the step, and a refusal anywhere raises the same error on every rank
    (``commit_vote``). It runs before the phases that act on the headers (policy, judge), on every rank alike.

    With ``commit_vote="on"``, where the mode allows it (``defers``: the defaults), a steady step's verdict settles
    in the next exchange's all-gather: the step commits tentatively with an undo log, no collective here (one round
    trip per step); a refusal posts a settling row and waits for the next step; a step that is not steady runs the
    settling all-gather now (:func:`hf_demo.optim.settle.vote`).

    Elsewhere (``commit_vote="separate"``, overlap, ``exchange="all_reduce"``, local steps, sharded parameters,
    elastic runs: why, in :mod:`hf_demo.optim.settle`) the verdict is a small all-gather of its own here
    (:func:`hf_demo.wire.agreement.vote`): two round trips per step; ``commit_vote="off"`` leaves it out (one
    round trip, and a refusal raises on the refusing rank only)."""
    s, view, refusal, transport = step.settings, step.view, exchanged.refusal, step.transport
    defers = (  # the modes where the verdict may settle in the next exchange (the others: hf_demo.optim.settle)
        s.commit_vote == "on" and not s.overlap and s.exchange == "all_gather" and wire_agreement.RIDE
        and transport.world > 1 and plan.tier.sync_every == 1 and view.topology.name == "flat" and not view.elastic
    )  # fmt: skip
    if defers:
        return settle.vote(step, chosen, found, agreed, exchanged.refusal)
    alone = s.overlap or transport.world == 1  # overlap votes in the next header
    if not alone and s.commit_vote != "off":
        try:
            wire_agreement.vote(transport, exchanged.refusal, chosen.device, view.sealer, view.secret, agreed.headers)
        except DeMoPayloadError as exc:
            refusal = exc
        except DeMoSyncError as exc:
            raise _parted(agreed, exc) from exc
    refusal = view.topology.agree_refusal(transport, chosen.device, refusal)  # every shard, where sharded
    if refusal is not None:
        raise refusal
    return Settled(row_bytes=agreed.row_bytes)


def policy(step: Step, chosen: Chosen, agreed: Agreed) -> Decision:
    """The budget policy's decision from the headers: a move down makes this step go again in the lower tier
    (under a budget, at a step's first try: :func:`run_step`)."""
    after = verdicts.policy_after(step, chosen, agreed.headers)
    return Decision(after, after if after.tier > step.view.policy.tier else None)


def judge(step: Step, chosen: Chosen, signal: Signalled, found: Findings, agreed: Agreed) -> Verdict:
    """What the headers say about this step, the same on every rank: raise, resync from rank 0, or skip."""
    verdict = verdicts.judge(step, chosen.device, found, agreed.headers)
    if not verdict.resynced:
        return verdict
    fresh = wire_agreement.fetch_rank0(signal.replicas, step.transport, step.view.sealer)
    for r, value in zip(signal.replicas, fresh):
        step.tx.copy(r, value)
    cause = "non-finite parameters" if verdict.bad_param_ranks else "full_sync_every"
    cause = "drift" if verdict.drifted else cause
    if found.first and verdict.drifted:
        cause = f"the replicas differed at this process's first exchange. {verdicts.UNSYNCED_START}"
    message = f"DeMo: copied rank 0's parameters to every rank at optimizer step {step.transport.step} ({cause})"
    step.tx.stage(lambda: _warn(message), keeps_nothing=True)
    return verdict


def land(
    step: Step,
    plan: StepPlan,
    chosen: Chosen,
    found: Findings,
    momenta: Momenta,
    prepared: Prepared,
    agreed: Agreed,
    verdict: Verdict,
) -> Landed:
    """Overlap (or an exchange in flight to land: :func:`run_step` calls it then): the update of the exchange the
    last step started lands (after a resync's copies, before this step's own writes), and this step's exchange
    starts in the background: it becomes the one in flight. A
    skipped step's exchange runs too, with zeros, and lands nothing: so a rank that refused the header saying
    skip meets every other rank in it, and its refusal rides in the next step's header."""
    in_flight = None
    if step.settings.overlap:  # a skipped step's exchange too, with zeros (nothing of it lands): see communicate
        exchange, transport, working = prepared.exchange, step.transport, momenta.working
        in_flight = exchange.start(transport, agreed.headers, prepared.payload, working, True, skipped=verdict.skip)
        in_flight.refused = in_flight.refused or agreed.header_refusal  # raised when it is finished
    overlap.stage_late(step.view, step.tx, found.late, step.transport)
    return Landed(overlap.pending_from(step.view, plan.tier, chosen, in_flight))


def update(
    step: Step,
    plan: StepPlan,
    chosen: Chosen,
    signal: Signalled,
    momenta: Momenta,
    exchanged: Exchanged,
    verdict: Verdict,
) -> None:
    """The update rule on the averaged update (or, at a synchronisation, the mean change from the anchor):
    its state computed on copies now, the parameters written in place at the commit."""
    if verdict.skip:
        return
    view, tx, params, working = step.view, step.tx, chosen.params, momenta.working
    if step.settings.overlap:
        for p, m in zip(params, working):
            tx.update(view.state[p], {"momentum": m})
        return
    if plan.tier.sync_every > 1:  # param = anchor - outer_lr * mean change (signals.LocalSignal)
        return signals.LocalSignal().update(step, plan, chosen, signal, working, exchanged.updates)
    for p, m in zip(params, working):  # the rule's direction for every item, on copies of its state, once per
        tx.update(view.state[p], {"momentum": m})  # bucket and rule (the commit cannot fail in a rule): staged in place
    matrices = view.topology.matrices(params, plan.whole, step.transport)
    views_ = chosen.views
    directions, rule_states = view.directions(
        params, chosen.groups, exchanged.updates, chosen.layouts, matrices, views_
    )
    for p, rule_state in zip(params, rule_states):
        tx.update(view.state[p], rule_state)
    lrs, wds = [g["lr"] for g in chosen.groups], [g["weight_decay"] for g in chosen.groups]
    generator = plan.generator
    tx.stage(lambda: F.apply_steps(views_, directions, lrs, wds, generator), touches=views_)


def commit(
    step: Step,
    plan: StepPlan,
    chosen: Chosen,
    signal: Signalled,
    found: Findings | None = None,
    agreed: Agreed | None = None,
    decision: Decision | None = None,
    verdict: Verdict | None = None,
    landed: Landed | None = None,
) -> Outcome:
    """The step's counters, policy, clock and traffic: the :class:`~hf_demo.optim.records.Outcome` the optimizer
    takes last at the commit (they change whatever the step did): its ``record``, the fields of the optimizer's
    record the step replaces. A local step has no records of the exchange."""
    view = step.view
    dense = 4 * sum(layout.numel for layout in chosen.layouts)
    counters, record = view.counters, {}
    if landed is not None:  # overlap: the exchange this step started
        record["pending"] = landed.pending
    if verdict is not None and verdict.resynced:
        counters = dataclasses.replace(counters, resyncs=counters.resyncs + 1)
    if not signal.communicates:  # a local step: the ranks stay apart until a synchronisation commits
        counters = dataclasses.replace(counters, unsynced=True)
        if step.decided is not None:  # moved down into a local phase
            record["policy"] = step.decided
    else:
        policy = decision.policy
        if not step.settings.comm_budget and policy.tier:  # a budget's tier resumed without a budget
            policy = dataclasses.replace(policy, tier=0, over=0, under=0)
        seconds = step.transport.traffic.seconds  # the step's traffic (every try's), what its commit counts last
        clock = Clock(seconds * 1000.0, found.started, plan.tier_index)
        record.update(policy=policy, first_checked=True, clock=clock)
        if agreed.wire_bytes is not None:  # what the payload takes on the wire, agreed: it rides from now on
            record["wire_agreed"] = {**view.wire_agreed, (step.transport.world, plan.tier_index): agreed.wire_bytes}
    skip = verdict.skip if verdict is not None else signal.skip
    if skip:
        counters = counters.skipped()
    else:
        counters = dataclasses.replace(counters, steps=counters.steps + 1)
        if signal.communicates:  # a synchronisation: the replicas agree
            counters = dataclasses.replace(counters, consecutive_skips=0, unsynced=False)
    record["counters"] = counters
    return Outcome(dense, step.transport.traffic, record, exchanged=signal.communicates, warn_skips=skip)


def _rechunked(p, momentum, blocked) -> str:
    """Why a momentum whose blocks no longer match the plan's is refused (``compression_chunk`` changed)."""
    return (
        f"the momentum of a parameter of shape {tuple(p.shape)} is blocked as {tuple(momentum.shape)} but "
        f"compression_chunk now asks for {blocked}: compression_chunk was changed during training. Change it across "
        "a checkpoint instead (save, then resume with the new chunk: the momentum is re-planned); nothing was changed"
    )


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
    warnings.warn(message, stacklevel=6)


def warn_skips(settings, counters) -> None:
    """Warn once the skipped steps in a row reach ``nonfinite_patience`` (staged with the counters)."""
    if counters.consecutive_skips == settings.nonfinite_patience:
        warnings.warn(
            f"DeMo skipped the last {counters.consecutive_skips} optimizer steps for NaN/Inf "
            "gradients: the loss has likely diverged (lower the learning rate, check the data)",
            stacklevel=6,
        )
