"""A step's verdict settles in the next exchange (hf_demo.optim.settle): one round trip per steady step, all ranks
or none. A steady step commits tentatively with an undo log; a refusal anywhere makes every rank undo it and raise
the same error at the next step (or confirm()), bitwise back to the state before it; nothing hangs."""

import os
import time

import pytest
import torch

from dist_utils import RankError, expect_ok, flip_received_header_bit, flip_received_payload_bit, run_ranks
from hf_demo.optim.transaction import Transaction, keep_fields, keep_mapping
from models import loss_and_backward, small_demo, tiny_mlp

TIMEOUT = 20.0  # comm_timeout of these runs: every error below must come well before it


def _state(model, opt):
    """Parameters, every state tensor (momenta, the rule's), counters and traffic totals: bitwise comparable."""
    state = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}
    totals = {k: v for k, v in opt.comm_stats.as_dict().items() if k.startswith("total_")}
    return [p.detach().clone() for p in model.parameters()], state, (opt.steps, opt.skipped_steps), totals


def _equal(a, b) -> bool:
    (pa, sa, ca, ta), (pb, sb, cb, tb) = a, b
    same_state = sa.keys() == sb.keys() and all(
        sa[i].keys() == sb[i].keys() and all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i]) for i in sa
    )
    return all(torch.equal(x, y) for x, y in zip(pa, pb)) and same_state and ca == cb and ta == tb


# ------------------------------------------------------------------ the transaction's undo log (one process)
def test_an_undo_log_puts_every_write_back_bitwise():
    p = torch.randn(5, 3)
    q = torch.randn(4)
    state = {"momentum": torch.randn(2), "kept": 1}
    extra = {"gone": torch.ones(1)}

    class Holder:  # as DeMo holds its one record (RunState), replaced whole: the undo puts the old one back
        record = ((1, 2), "tier 0")

    holder, stats = Holder(), type("Stats", (), {})()
    stats.sent = 10
    before = (p.clone(), q.clone(), dict(state), dict(extra), holder.record, stats.sent)
    tx = Transaction()
    new_momentum = torch.zeros(2)
    tx.set(state, "momentum", new_momentum)
    tx.update(state, {"exp_avg": torch.ones(2), "kept": 2})
    tx.copy(p, torch.zeros(5, 3))
    tx.stage(lambda: p.mul_(3).add_(1), touches=[p])  # the same tensor written twice: restored to the first image
    tx.stage(lambda: q.add_(5), touches=[q])
    tx.stage(lambda: extra.clear(), before=keep_mapping(extra))
    kept = lambda: lambda old=holder.record: setattr(holder, "record", old)  # noqa: E731
    tx.stage(lambda: setattr(holder, "record", ((2, 3), "tier 0")), before=kept)
    tx.stage(lambda: setattr(stats, "sent", 99), before=keep_fields(stats))
    tx.stage(lambda: None, keeps_nothing=True)
    assert tx.undoable
    undo = tx.commit(undo=True)
    assert torch.equal(p, torch.ones(5, 3)) and state["momentum"] is new_momentum and state["kept"] == 2
    assert undo.nbytes == (p.numel() * 2 + q.numel()) * 4  # p cloned twice (copy, then in place), q once
    undo()
    assert torch.equal(p, before[0]) and torch.equal(q, before[1])
    assert state.keys() == before[2].keys() and state["momentum"] is before[2]["momentum"] and state["kept"] == 1
    assert extra.keys() == before[3].keys() and extra["gone"] is before[3]["gone"]
    assert (holder.record, stats.sent) == before[4:]


def test_an_undo_log_reuses_the_copies_of_the_last_one():
    p = torch.randn(6)
    first = Transaction()
    first.stage(lambda: p.add_(1), touches=[p])
    log = first.commit(undo=True)
    [copy] = log._copies
    spare = log.spare()
    again = Transaction()
    before = p.clone()
    again.stage(lambda: p.mul_(2), touches=[p])
    log = again.commit(undo=True, spare=spare)
    assert log._copies[0] is copy and not spare[(p.shape, p.dtype, p.device)]  # the same memory, refilled
    log()
    assert torch.equal(p, before)


def test_a_write_without_a_pre_image_cannot_commit_with_an_undo_log():
    tx = Transaction()
    tx.stage(lambda: None)
    assert not tx.undoable
    with pytest.raises(RuntimeError, match="keeps no pre-image"):
        tx.commit(undo=True)
    tx.commit()  # a plain commit is as it was


def test_a_step_commits_tentatively_only_in_a_group():
    """Alone (world of one) nothing settles later: no undo log is kept."""
    model = tiny_mlp()
    opt = small_demo(model)
    loss_and_backward(model, 0, 0)
    opt.step()
    assert opt.unsettled is None and not opt.unconfirmed
    opt.confirm()  # nothing to settle: no collective


# ------------------------------------------------------------------ real gloo ranks


def _env(kw: dict) -> dict:
    kw = dict(kw)
    os.environ.update(kw.pop("env", {}))
    return kw


def _refused_at_the_next_step(rank, world, kw):
    """Steps 0 and 1 clean; rank 0's payload of step 2 (steady) reaches rank 1 with a flipped bit. Every rank then
    computes its next gradients and calls step() again: that call raises, on every rank, naming step 2."""
    model = tiny_mlp()
    opt = small_demo(model, comm_timeout=TIMEOUT, **_env(kw))
    for step in (0, 1):
        loss_and_backward(model, rank, step)
        opt.step()
    before = _state(model, opt)
    whole = flip_received_payload_bit() if rank == 1 else (lambda: None)
    loss_and_backward(model, rank, 2)
    opt.step()  # rank 0: committed tentatively; rank 1: refused, applied nothing, its verdict on its way
    whole()
    tentative = opt.unconfirmed
    loss_and_backward(model, rank, 3)
    started = time.monotonic()
    try:
        opt.step()
        return "no error", None, None, None
    except Exception as exc:  # noqa: BLE001
        error, seconds = RankError(exc), time.monotonic() - started
    restored = _equal(before, _state(model, opt))
    loss_and_backward(model, rank, 3)
    opt.step()  # the retry commits on every rank
    opt.confirm()
    return error, seconds, (tentative, restored), [p.detach().clone() for p in model.parameters()]


SECRET = {"env": {"HF_DEMO_SECRET": "s3cret"}}
SEALED = {"env": {"HF_DEMO_SECRET": "s3cret", "HF_DEMO_ENCRYPT": "1"}}


@pytest.mark.ranks
@pytest.mark.parametrize(
    "kw",
    [{}, SECRET, SEALED, {"update_rule": "adam", "value_format": "fp32"}],
    ids=["defaults", "secret", "sealed", "adam"],
)
def test_a_payload_refused_in_a_steady_step_is_undone_on_every_rank_at_the_next_step(kw):
    """Rank 1 refuses rank 0's payload of step 2 (CRC32, or the HMAC, or AES-GCM); rank 0 received everything and
    committed step 2 tentatively. At the next step() both raise the same DeMoPayloadError naming step 2 and rank 1,
    at once (no comm_timeout), and both are bitwise back to the state before step 2 (parameters, momenta, the
    rule's state, counters, traffic totals); the retried step commits identically on both."""
    if kw is SEALED:
        pytest.importorskip("cryptography")
    (err0, secs0, how0, after0), (err1, secs1, how1, after1) = expect_ok(
        run_ranks(_refused_at_the_next_step, 2, kw, timeout=120)
    )
    for rank, error, seconds in ((0, err0, secs0), (1, err1, secs1)):
        assert isinstance(error, RankError) and error.type == "DeMoPayloadError", (rank, error)
        assert "every rank refused optimizer step 2 because rank(s) [1]" in error.message, error.message
        assert seconds < TIMEOUT / 4, (rank, seconds)
    assert "the payload from rank 0 at optimizer step 2" in err1.message, err1.message
    assert "this rank undid it" in err0.message, err0.message
    assert how0 == (True, True), "rank 0 committed step 2 tentatively, then undid it bitwise"
    assert how1 == (True, True), "rank 1 applied nothing of step 2 and kept it unsettled"
    assert all(torch.equal(a, b) for a, b in zip(after0, after1))


def _verdict_header_corrupted(rank, world):
    """Step 1 is steady and whole everywhere; rank 0's row of step 2 (which carries its verdict on step 1) reaches
    rank 1 with its flags word flipped. Then confirm() on both."""
    model = tiny_mlp()
    opt = small_demo(model, comm_timeout=TIMEOUT)
    for step in (0, 1):
        loss_and_backward(model, rank, step)
        opt.step()
    after_1 = _state(model, opt)
    if rank == 1:
        flip_received_header_bit(5 * 8, once=True)
    loss_and_backward(model, rank, 2)
    started = time.monotonic()
    try:
        opt.step()
        opt.confirm()
        return "no error", None, None
    except Exception as exc:  # noqa: BLE001
        return RankError(exc), time.monotonic() - started, _equal(after_1, _state(model, opt))


@pytest.mark.ranks
def test_a_corrupted_row_carrying_the_verdict_stops_that_step_and_keeps_the_one_before():
    """Rank 1 cannot trust rank 0's row of step 2, which says rank 0 received step 1 whole: rank 1 refuses step 2
    and settles it; every rank raises naming step 2, keeps step 1 (every rank that answered had received it
    whole) and undoes step 2: all end at the state after step 1, bitwise, at once."""
    results = expect_ok(run_ranks(_verdict_header_corrupted, 2, timeout=120))
    for rank, (error, seconds, at_step_1) in enumerate(results):
        assert isinstance(error, RankError) and error.type == "DeMoPayloadError", (rank, error)
        assert "every rank refused optimizer step 2 because rank(s) [1]" in error.message, error.message
        assert "rank 1 refused the header from rank 0" in error.message, error.message
        assert seconds < TIMEOUT / 4 and at_step_1, (rank, seconds, at_step_1)


def _drift_header_corrupted(rank, world):
    """check_every=2: step 1 compares fingerprints. Rank 0's parameters drifted, so its header says so; it reaches
    rank 1 corrupted (its fingerprint word), so rank 1 cannot know that every other rank resyncs."""
    model = tiny_mlp()
    opt = small_demo(model, comm_timeout=TIMEOUT, check_every=2)
    loss_and_backward(model, rank, 0)
    opt.step()
    if rank == 0:
        with torch.no_grad():
            next(model.parameters())[0, 0] += 1.0
    else:
        flip_received_header_bit(9 * 8, once=True)
    loss_and_backward(model, rank, 1)
    before = _state(model, opt)
    started = time.monotonic()
    try:
        opt.step()
        opt.confirm()
        return "no error", None, None
    except Exception as exc:  # noqa: BLE001
        return RankError(exc), time.monotonic() - started, _equal(before, _state(model, opt))


@pytest.mark.ranks
def test_a_refused_header_that_said_resync_stops_every_rank_before_the_broadcast():
    """Rank 0 (which read the drift) settles the step before the resync's broadcast; rank 1 (which could not)
    posted its refusal: they meet, both raise naming step 1, nobody hangs and nothing is applied."""
    for rank, (error, seconds, unchanged) in enumerate(expect_ok(run_ranks(_drift_header_corrupted, 2, timeout=120))):
        assert isinstance(error, RankError) and error.type == "DeMoPayloadError", (rank, error)
        assert "every rank refused optimizer step 1 because rank(s) [1]" in error.message, error.message
        assert seconds < TIMEOUT / 4 and unchanged, (rank, seconds, unchanged)


def _saved_before_confirm(rank, world):
    """Step 1 refused by rank 1 (its payload); each rank saves (state_dict, no collective), then flush()."""
    model = tiny_mlp()
    opt = small_demo(model, comm_timeout=TIMEOUT)
    loss_and_backward(model, rank, 0)
    opt.step()
    before = _state(model, opt)
    if rank == 1:
        flip_received_payload_bit()
    loss_and_backward(model, rank, 1)
    opt.step()
    try:
        saved = "saved" if opt.state_dict()["demo"] else "empty"
    except Exception as exc:  # noqa: BLE001
        saved = RankError(exc)
    try:
        opt.flush()
        return saved, "no error", None
    except Exception as exc:  # noqa: BLE001
        return saved, RankError(exc), _equal(before, _state(model, opt))


@pytest.mark.ranks
def test_flush_settles_the_last_step_and_a_refusing_rank_saves_nothing():
    """After the last step: state_dict() runs no collective (rank 0 saves its tentative state: a checkpoint holds
    it on every rank only if every rank received it whole; rank 1, which refused it, raises instead of saving);
    flush() settles the step: both raise naming step 1, both back to the state before it."""
    (saved0, err0, back0), (saved1, err1, back1) = expect_ok(run_ranks(_saved_before_confirm, 2, timeout=120))
    assert saved0 == "saved"
    assert isinstance(saved1, RankError) and "no state is saved from here" in saved1.message, saved1
    for error in (err0, err1):
        assert isinstance(error, RankError), error
        assert "every rank refused optimizer step 1 because rank(s) [1]" in error.message, error.message
    assert back0 and back1


def _refused_and_no_one_answers(rank, world):
    """Rank 1 refuses step 2's payload; rank 0 ends without confirming (a loop without flush())."""
    model = tiny_mlp()
    opt = small_demo(model, comm_timeout=4.0)
    for step in (0, 1):
        loss_and_backward(model, rank, step)
        opt.step()
    if rank == 1:
        flip_received_payload_bit()
    loss_and_backward(model, rank, 2)
    opt.step()
    if rank == 0:
        return "left", None
    started = time.monotonic()
    try:
        opt.confirm()
        return "no error", None
    except Exception as exc:  # noqa: BLE001
        return RankError(exc), time.monotonic() - started


@pytest.mark.ranks
def test_a_refusing_rank_whose_peers_left_raises_within_comm_timeout():
    _, (error, seconds) = expect_ok(run_ranks(_refused_and_no_one_answers, 2, timeout=120))
    assert isinstance(error, RankError) and error.type == "DeMoSyncError", error
    assert "This rank refused optimizer step 2" in error.message, error.message
    assert seconds < 4.0 + 10, seconds
