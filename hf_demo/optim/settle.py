"""One round trip per step in steady state, all ranks or none: a step's verdict settles in the next exchange.

A step's one collective is the headers' all-gather with the payloads riding in it (G_t). A step whose every
rank received everything whole and whose headers ask for nothing but the steady path commits *tentatively*:
the transaction commits and keeps an undo log (:class:`~hf_demo.optim.transaction.Undo`), and the verdict
travels with the next exchange. The rule every rank follows, since every rank took part in G_t and knows its row
size: **the collective after G_t is an all-gather of G_t's row size.** It is, on each rank, one of

* the next step's headers (G_t+1): this rank received step t whole and the step was steady;
* a *settling row* (a header with ``FLAG_SETTLES`` and the rank's verdict, zeros to the row size): posted at
  once, without waiting, by a rank that refused something at step t (a payload, a header: it cannot know what
  the others do next), and run and waited for by every rank whose step t is not steady (a skip, a resync, a
  policy's move, a tier's first exchange, a process's first exchange, a payload that did not ride) before any
  collective the headers choose, and by :func:`confirm` (``DeMo.confirm()``, ``flush()``) after the last step.

Every rank then reads every rank's verdict on step t in that all-gather. All whole: the undo log is dropped.
What a rank cannot trust there (a row that fails its CRC32, HMAC or AES-GCM, a replay, a row that claims
another signing than this rank's) is a finding of its own, agreed before any rank keeps the step: in a step's headers it
is a refusal of that step, whose settling row every rank reads in the collective after it; a rank that finds a
verdict it cannot trust in a non-steady step's settling all-gather keeps nothing and settles the step with that
finding in the next exchange (every rank that read only whole verdicts commits such a step tentatively, with an
undo log, where the next step exchanges alike); :func:`confirm` runs two rounds after its own, in which each
rank says what it found in the first (then once more, with what it read in the second), and every rank decides
from the findings it can trust.
Any refusal: every rank raises the same :class:`~hf_demo.errors.DeMoPayloadError` naming step t and the refusing
ranks, and a rank that committed step t tentatively undoes it first (bitwise back to before step t; nothing of
step t+1 was applied). A rank that refused step t returns from ``step()`` without applying it (so that it takes
part in whatever the training loop does between steps, Trainer's own collectives included) and raises at its next
``step()``/``confirm()``, where the others raise too (where the others settle step t at once, a refusing rank
that could not tell so, having refused the header that said it, marks its row :data:`~hf_demo.wire.agreement.DEFERS`
and they return from ``step()`` as it does). Non-steady steps keep two round trips (the second of the
row's size); a refusal of step t is never seen later than at step t+1's all-gather.

Where the verdict waits instead in a round trip of its own (``agreement.vote``, and why): ``commit_vote=
"separate"``; ``overlap=True`` (its exchange runs in the background and its verdict already rides in the next
header); ``exchange="all_reduce"`` (its values' all-reduce follows the headers, so the collective after G_t is
not row-sized); local steps (``sync_every > 1``: the next exchange is H steps away, and the undo would have to
span the local steps); the sharded (HSDP) topology (a refusal must stop the whole shard group, whose rules gather
matrices at step t); elastic runs (torchft counts a step committed at ``should_commit``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hf_demo import guards as verdicts
from hf_demo.errors import DeMoPayloadError, DeMoSyncError
from hf_demo.exchange.transport import Pending
from hf_demo.optim.records import Settled
from hf_demo.optim.transaction import Undo
from hf_demo.wire import agreement, codec


@dataclass(frozen=True)
class Unsettled:
    """A step whose verdict has not been read: ``undo`` where this rank committed it tentatively; ``posted`` (this
    rank's settling row on its way) and ``refusal`` where this rank refused it and applied nothing; ``earlier``:
    the step before's undo, kept where this rank refused step ``step`` without trusting every header of it."""

    step: int
    row_bytes: int
    undo: Undo | None = None
    posted: Pending | None = None
    refusal: Exception | None = None
    earlier: Undo | None = None


class Deferred(Exception):
    """This rank refused what it received at a step that settles later (raised by the vote phase, caught by
    ``DeMo.prepare_step``, which keeps :attr:`unsettled` and returns: the rank raises at its next step or confirm)."""

    def __init__(self, unsettled: Unsettled):
        super().__init__(f"optimizer step {unsettled.step} refused here: {unsettled.refusal}")
        self.unsettled = unsettled


def post(
    transport, settled: int, refusal, row_bytes: int, secret, sealer, device, flags: int = 0, word=None
) -> Pending:
    """This rank's settling row for step ``settled`` (its verdict ``word``, by default ``refusal``'s), signed with
    ``secret`` or sealed by ``sealer``, all-gathered in the background."""
    word = agreement.verdict(refusal) if word is None else word
    row = agreement.settling_row(transport, settled, word, row_bytes, secret, sealer, flags)
    return transport.start_all_gather(agreement.to_device(row, device), "settle")


def vote(step, chosen, found, agreed, refusal) -> Settled:
    """The vote part where the step's verdict may settle later (the modes in the module's docstring: the phase's,
    :func:`hf_demo.optim.phases.vote`): a steady step that this rank received whole commits tentatively (no
    collective). Steady: the same on every rank that trusted every header, the headers read as steady by the
    judge's own reading (:func:`hf_demo.guards.decide`) and the policy staying in its tier; a refusal posts this
    rank's settling row and defers (:class:`Deferred`), unless every other rank settles it now too (this rank then
    waits for that all-gather with them and raises at once, as they do); any other step runs the settling
    all-gather now and raises on every rank where any rank refused, or, where a refusing rank deferred
    (:data:`agreement.DEFERS` in its word: it could not tell the step was not steady), defers too, so that every
    rank raises in the same call, its next."""
    transport, row_bytes, number = step.transport, agreed.row_bytes, step.transport.step
    # not steady by what every rank that trusted every header knows too, so every rank runs its settling all-gather
    # now: what the ranks hold alike (a process's first exchange, a payload that did not ride, a policy's second
    # try, a resync due) or a header this rank read intact says (a flag asking for more, fingerprints apart). A rank
    # that refused a header (its stand-in decides nothing) can tell from this alone; the budget policy's figures,
    # which a stand-in changes, are read below
    unsteady = agreed.arrived is None or step.decided is not None
    unsteady = unsteady or not verdicts.decide(step.settings, number, transport.world, found, agreed.headers).steady
    if refusal is None and not unsteady:
        stays = not step.settings.comm_budget or (
            verdicts.policy_after(step, chosen, agreed.headers).tier == step.view.policy.tier
        )
        if stays:
            return Settled(tentative=True, row_bytes=row_bytes)
    # a refusing rank knows that every other rank settles now where the step is not steady by what they all know
    # and it keeps no step unsettled (so every row of the headers' all-gather was a header of this step: none it
    # refused can be a settling row of the step before, which would have made the others raise before the exchange)
    later = refusal is not None and not (unsteady and step.view.unsettled is None)
    word = agreement.verdict(refusal) | (agreement.DEFERS if later else 0)
    secret, sealer = step.view.secret, step.view.sealer
    posted = post(transport, transport.step, refusal, row_bytes, secret, sealer, chosen.device, word=word)
    if later:
        raise Deferred(Unsettled(transport.step, row_bytes, posted=posted, refusal=refusal))
    try:
        rows = posted.wait(transport.traffic)
    except DeMoSyncError as exc:
        raise DeMoSyncError(f"{exc} (settling optimizer step {transport.step}: no state was changed)") from exc
    words = agreement.read_settling(transport, rows, transport.step, step.view.secret, step.view.sealer)
    if any(w > 0 and w & agreement.DEFERS for w in words):  # a rank raises at its next call: every rank does
        raise Deferred(Unsettled(transport.step, row_bytes, posted=posted, refusal=refusal))
    if refusal is not None or any(w > 0 for w in words):  # a refusal, read here as by every rank that could trust it
        raise _refused_now(transport, words, refusal, found.first)
    if any(words):  # a verdict this rank could not trust: the step settles with that finding in the next exchange
        return Settled(row_bytes=row_bytes, again=True, owes=untrusted(transport, words))
    return Settled(row_bytes=row_bytes, again=True)


FIRST_UNAUTHENTIC = (
    "At this process's first exchange a header failed its authentication (its HMAC, its seal, or signed on one end "
    "only): corrupted in transit or sealed with another secret, which the ranks cannot tell apart. Run the step "
    "again; if every try fails alike, set the same HF_DEMO_SECRET (and HF_DEMO_ENCRYPT) on every rank"
)


def _refused_now(transport, words: list[int], refusal, first: bool) -> DeMoSyncError:
    """The error of a step refused in its own settling all-gather. At a process's first exchange (``first``), where
    this rank's own refusal or a verdict it read is of a header that failed its authentication
    (:data:`agreement.UNAUTHENTIC`), every such rank raises the same :class:`DeMoSyncError` naming both causes
    (:data:`FIRST_UNAUTHENTIC`); elsewhere the :class:`DeMoPayloadError` of :func:`agreement.refused_everywhere`."""
    exc = agreement.refused_everywhere(transport, transport.step, words, refusal)
    unauthentic = [w for w in words if w > 0 and w & agreement.HEADER_REFUSED and w & agreement.UNAUTHENTIC]
    if not first or not (unauthentic or getattr(refusal, "unauthentic", False)):
        return exc
    return DeMoSyncError(f"{exc}. {FIRST_UNAUTHENTIC}")


def untrusted(transport, words: list[int]) -> DeMoPayloadError:
    """This rank's refusal of a step whose verdict(s) it could not trust (:data:`agreement.UNREAD` in ``words``)."""
    unread = [transport.global_rank(r) for r, w in enumerate(words) if w == agreement.UNREAD]
    exc = DeMoPayloadError(
        f"rank {transport.global_rank(transport.rank)}: the verdict of rank(s) {unread} on optimizer step "
        f"{transport.step} failed its checks here (corrupted on the way, a replay, or not signed)"
    )
    exc.verdict_word = agreement.finding(transport, words, 0)
    return exc


def next_row_bytes(policy, wire_agreed: dict, tiers, outcome, world: int) -> int | None:
    """The row size of the next exchange's first all-gather after a step that concluded ``outcome``, where the
    next step exchanges in the same way (None where a local phase starts: no exchange follows at once);
    ``policy``, ``wire_agreed``: the optimizer's before the step, ``tiers`` its tiers."""
    policy = outcome.record.get("policy", policy)  # (the step's, where it changed it)
    if not outcome.exchanged or tiers[policy.tier].sync_every != 1:
        return None
    wire = outcome.record.get("wire_agreed", wire_agreed)
    return codec.HEADER_BYTES + (wire.get((world, policy.tier), 0) if agreement.RIDE else 0)


def keeps_undo(policy, wire_agreed: dict, tiers, tx, outcome, world: int) -> tuple[bool, int]:
    """(whether the step commits tentatively, the row size of the collective its verdict settles in) for a
    non-steady step whose every verdict was read whole (``Settled.again``; a steady step's: :func:`vote`): where
    its transaction keeps pre-images and the next step exchanges alike (its verdict settles again in the next
    exchange: a rank that could not trust one of its verdicts says so there)."""
    row_bytes = next_row_bytes(policy, wire_agreed, tiers, outcome, world)
    return (row_bytes is not None and tx.undoable), row_bytes or 0


def owe(view, transport, refusal: DeMoPayloadError, outcome, device) -> Unsettled:
    """A non-steady step this rank keeps nothing of, for a verdict it could not trust: its settling row goes out
    at once in the next exchange's all-gather (where every other rank committed it tentatively, or refused it
    too); this rank raises at its next step or confirm, with every rank (:func:`_refused_here`). Where no
    exchange follows at once (a local phase starts), it raises now. Returns the step kept unsettled (the optimizer
    keeps it). ``view``: the step's view of the optimizer (:class:`~hf_demo.optim.view.OptimizerView`)."""
    row_bytes = next_row_bytes(view.policy, view.wire_agreed, view.tiers, outcome, transport.world)
    if row_bytes is None:
        raise refusal
    posted = post(transport, transport.step, refusal, row_bytes, view.secret, view.sealer, device)
    return Unsettled(transport.step, row_bytes, posted=posted, refusal=refusal)


def refused_before(transport, settling: dict, unsettled) -> Exception:
    """Settling rows in this step's headers' all-gather: another rank refused the last step. The error this rank
    raises, marked to undo the last step (``undo_unsettled``) where it committed it tentatively."""
    if unsettled is None or unsettled.undo is None or not any(settling.values()):
        return DeMoSyncError(
            f"rank {transport.global_rank(transport.rank)}: rank(s) {[transport.global_rank(r) for r in settling]} "
            f"sent a verdict (a settling row) where this rank started optimizer step {transport.step}: they settle "
            "another step (one whose refusal did not reach every rank, which they undo now; or the ranks disagree "
            "on whether the step before was steady: different settings or state); no state was changed, run the "
            "step again"
        )
    words = [settling.get(r, 0) for r in range(transport.world)]
    exc = agreement.refused_everywhere(transport, unsettled.step, words, None, ", this rank undid it")
    exc.undo_unsettled = True
    return exc


@dataclass(frozen=True)
class Rounds:
    """What :func:`confirm`'s settling all-gathers take: the step ``u`` still unsettled, the transport at its step,
    what signs (``secret``) or seals (``sealer``) a row, and where a row is built (``device``)."""

    u: Unsettled
    transport: object
    secret: bytes | None
    sealer: object
    device: torch.device


@torch.no_grad()
def confirm(u: Unsettled, transport, secret, sealer, device, stats, settled, final: bool = True) -> None:
    """``DeMo.confirm()``: read every rank's verdict on the last step where it has not been read (three
    all-gathers: the verdicts, then every rank's finding on them, twice; nothing where it has). With
    ``commit_vote="on"`` a steady step commits tentatively and its verdict travels with the next step; after the
    last step, and before saving a checkpoint, call this on every rank (``flush()`` and ``DeMoTrainer`` do): where
    any rank refused the step, or could not trust a verdict on it, every rank undoes it and raises the same
    :class:`~hf_demo.errors.DeMoPayloadError`. (``final``: not from the next step, which only raises a refusal of
    this rank's.) ``u``: the optimizer's unsettled step (``DeMo.unsettled``), ``transport`` its transport,
    ``stats`` its traffic totals; ``settled``: its transition that drops ``u`` (``DeMo.settled``).

    Three rounds: every rank's verdict (:data:`codec.FLAG_CONFIRM`), then every rank's finding on that round, a
    verdict it could not trust included, then every rank's finding once more (a refusal it read in the second
    round relayed: :func:`_later_rounds`); the step stays where no trusted finding refuses it (a row that fails
    its checks in the later rounds is left out: the first round was whole then, or its finding travels twice)."""
    if u is None:
        return
    transport = transport.at(u.step)
    r = Rounds(u, transport, secret, sealer, device)
    if u.posted is not None:
        return _refused_here(r, settled, final)
    try:
        read = _round(r, 0, codec.FLAG_CONFIRM)
        own = agreement.finding(transport, agreement.settling_words(read, u.step), 0)
        words = _later_rounds(r, own)
    except DeMoSyncError as exc:
        undo(settled())
        raise DeMoSyncError(f"{exc}. Optimizer step {u.step} could not be confirmed: this rank undid it") from exc
    finally:
        stats.add(transport.traffic, "settle")
    if any(words):
        undo(settled())
        raise agreement.refused_everywhere(transport, u.step, words, None, ", this rank undid it")
    settled()


def _later_rounds(r: Rounds, own: int) -> list[int]:
    """confirm()'s second and third rounds after this rank's finding ``own`` on the first: every rank's finding
    (:data:`agreement.RELAY_ROUND`), then every rank's finding with a refusal read in the second relayed
    (:data:`agreement.FINAL_ROUND`); every rank's word of the third (or of the second, where the third's was left
    out). A row that fails its checks is left out in both, so a finding whose row of one round is corrupted still
    reaches every rank in the other: two corrupted messages (a verdict a rank could not trust, then that rank's
    row of a later round) leave every rank deciding alike."""
    relay, transport, step = agreement.RELAY_ROUND, r.transport, r.u.step
    relayed = agreement.final_words(transport, _round(r, own, relay), step, own, relay)
    own = own or (agreement.RELAYED if any(relayed) else 0)
    final = agreement.final_words(transport, _round(r, own, agreement.FINAL_ROUND), step, own)
    return [f or r for f, r in zip(final, relayed)]  # a finding read in either round, to name who found what


def _round(r: Rounds, word: int, flags: int) -> list:
    """One settling all-gather of confirm's: this rank's ``word``; every rank's row (:func:`agreement.read_rows`)."""
    transport, u = r.transport, r.u
    posted = post(transport, u.step, None, u.row_bytes, r.secret, r.sealer, r.device, flags, word)
    rows = posted.wait(transport.traffic)
    return agreement.read_rows(transport, rows, u.step, r.secret, r.sealer)


def _refused_here(r: Rounds, settled, final: bool) -> None:
    """This rank refused step ``u.step`` and posted its settling row: wait for the others' rows, and raise. A rank
    whose trusted row names an earlier step did not keep the step before: this rank undoes it too, where it kept
    its undo log (``u.earlier``). In confirm() (``final``), where every other row it trusts is a settling row
    (the others confirm, or hold a refused step unsettled as it does, :data:`agreement.DEFERS`; not a next step's
    header), this rank takes part in the later rounds, which every such rank runs alike. ``settled``: the optimizer's
    transition that drops the step."""
    u, transport = r.u, r.transport
    try:
        rows = u.posted.wait(transport.traffic)
    except DeMoSyncError as exc:
        settled()
        if u.earlier is not None:
            u.earlier()
        what = f", and undid optimizer step {u.step - 1}, whose verdict it could not read" if u.earlier else ""
        raise DeMoSyncError(f"{exc}. This rank refused optimizer step {u.step} ({u.refusal}){what}") from exc
    settled()  # every rank that answered received the step before whole: it stays, unless one is behind
    read = agreement.read_rows(transport, rows, u.step, r.secret, r.sealer)
    words, what = agreement.settling_words(read, u.step), ""
    behind = [transport.global_rank(r) for r in agreement.behind(read, u.step)]
    if behind and u.earlier is not None:
        u.earlier()
        what = f", and undid optimizer step {u.step - 1}, which rank(s) {behind} did not keep"
    others = [h for r, h in enumerate(read) if r != transport.rank and h is not None]
    if final and all(codec.settles(h) is not None for h in others):  # (a row it cannot trust: they may confirm)
        try:
            later = _later_rounds(r, agreement.verdict(u.refusal))
            words = later if any(later) else words
        except DeMoSyncError:
            pass  # this rank refuses the step whatever the others said
    raise agreement.refused_everywhere(transport, u.step, words, u.refusal, what)


def undo(u: Unsettled | None) -> None:
    """Put the optimizer back as it was before the step ``u`` (dropped by ``DeMo.settled()``) committed
    tentatively (nothing where there is none)."""
    if u is not None and u.undo is not None:
        u.undo()


def deferred(unsettled: Unsettled | None, exc: Deferred) -> Unsettled:
    """``DeMo.prepare_step``'s answer to :class:`Deferred`: the refused step, to keep unsettled (with the step
    before's undo where this rank did not trust every header, so did not read every verdict on it)."""
    earlier = unsettled.undo if unsettled is not None else None
    return replace(exc.unsettled, earlier=earlier)


def state_check(u: Unsettled | None, what: str = "saved") -> None:
    """``state_dict()`` (or ``load_state_dict()``) of a rank that refused a step still unsettled: no state is saved
    from there (the step is refused on every rank at the next step or confirm), and none is loaded while its
    settling row travels (the next collectives would pair with it)."""
    if u is not None and u.posted is not None:
        why = f"{u.refusal}; this rank refused" if u.refusal is not None else "a rank refused"
        raise DeMoPayloadError(
            f"{why} optimizer step {u.step}, which every rank refuses at its next step() "
            f"or confirm(): no state is {what} from here (call optimizer.confirm() on every rank first)"
        )
