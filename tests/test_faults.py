"""Faults on real gloo ranks: every error leaves the whole state untouched, names the problem, and nothing hangs.

Each test injects one fault (a corrupted payload, a frozen or vanished peer, a drifted replica, a different
secret, ...) and checks what every rank raised, how long it took, and the full state afterwards.
"""

import os
import time

import pytest
import torch

import hf_demo
from dist_utils import (
    RankError,
    corrupt_indices,
    expect_ok,
    flip_received_header_bit,
    flip_received_payload_bit,
    run_ranks,
)
from models import loss_and_backward, small_demo, tiny_mlp

pytestmark = pytest.mark.ranks  # real gloo ranks in forked processes


def _snapshot(model, opt):
    return (
        [p.detach().clone() for p in model.parameters()],
        {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())},
        (opt.steps, opt.skipped_steps, opt.resyncs),
        opt.comm_stats.as_dict(),
    )


def _same(a, b) -> bool:
    params_a, state_a, counters_a, stats_a = a
    params_b, state_b, counters_b, stats_b = b
    return (
        all(torch.equal(x, y) for x, y in zip(params_a, params_b))
        and state_a.keys() == state_b.keys()
        and all(torch.equal(state_a[i][k], state_b[i][k]) for i in state_a for k in state_a[i])
        and counters_a == counters_b
        and stats_a == stats_b
    )


def _fail_on_second_step(rank, world, fault, kw):
    """Step once cleanly, inject ``fault`` into the second step, report (error, state unchanged?, seconds)."""
    from hf_demo.wire import codec

    model = tiny_mlp()
    opt = small_demo(model, **kw)
    loss_and_backward(model, rank, 0)
    opt.step()
    loss_and_backward(model, rank, 1)
    before = _snapshot(model, opt)
    if fault == "index" and rank == world - 1:
        corrupt_indices(codec.index_coding(opt.settings.index_coding))
    if fault == "repeat" and rank == world - 1:  # every block names its first position k times
        coding = codec.index_coding(opt.settings.index_coding)
        real_pack = coding.pack_rows
        coding.pack_rows = lambda idx, bsize, k: real_pack(idx[:, :1].expand_as(idx).contiguous(), bsize, k)
    if fault == "nan" and rank == world - 1:
        fmt = codec.value_format(kw.get("value_format", "bf16"))
        real_encode = fmt.encode_rows  # a bucket's values (the step encodes per bucket)

        def nan_encode(values, bucket):
            sent, wires = real_encode(values, bucket)
            return sent, [torch.full_like(wire, 0xFF) for wire in wires]

        fmt.encode_rows = nan_encode
    if fault == "freeze" and rank == 1:
        time.sleep(kw["comm_timeout"] + 12)  # a frozen peer: never joins this step's collective
        return ("slept", True, 0.0)
    if fault == "nan_grad" and rank == 1:
        next(model.parameters()).grad[0, 0] = float("nan")
    started = time.monotonic()
    try:
        opt.step()
        opt.confirm()  # a steady step's verdict settles in the next exchange, or here
    except Exception as exc:  # noqa: BLE001 - reported with the state check
        return (RankError(exc), _same(before, _snapshot(model, opt)), time.monotonic() - started)
    return ("no error", _same(before, _snapshot(model, opt)), time.monotonic() - started)


@pytest.mark.parametrize(
    "kw,match",
    [
        (
            {"value_format": "fp32", "index_coding": "uint16"},
            "repeated positions (a block naming one position twice) for parameter 0 (shape (32, 16)) from rank(s) [1]",
        ),
        (
            {"value_format": "sign", "index_coding": "uint16"},
            "repeated positions (a block naming one position twice) for parameter 0 (shape (32, 16)) from rank(s) [1]",
        ),
        (
            {"value_format": "fp32", "exchange": "all_reduce", "index_coding": "uint16"},
            "repeated positions (a block naming one position twice) for parameter 0 (shape (32, 16), block of 64) "
            "nominated by rank(s) [1]",
        ),
    ],
    ids=["all_gather", "sign", "all_reduce nominations"],
)
def test_repeated_positions_are_refused_by_every_rank_and_change_nothing(kw, match):
    """A block naming one position k times counted its sender k times among the pickers (and 256 copies wrapped
    the uint8 count to 0: an Inf coefficient): every rank now refuses the step alike, through the vote."""
    results = expect_ok(run_ranks(_fail_on_second_step, 2, "repeat", kw))
    for rank, (error, unchanged, _) in enumerate(results):
        assert isinstance(error, RankError) and error.type == "DeMoPayloadError", f"rank {rank}: {error}"
        assert (match if rank == 1 else "every rank refused optimizer step 1 because rank(s) [0, 1]") in error.message
        assert unchanged, f"rank {rank}: parameters, momentum or counters changed by a failed step"


@pytest.mark.parametrize(
    "fault,kw,match",
    [
        (
            "index",
            {"value_format": "fp32"},
            "out-of-range indices for parameter 0 (shape (32, 16), block of 64) from rank(s) [2]",
        ),
        (
            "index",
            {"value_format": "fp32", "exchange": "all_reduce", "index_coding": "uint16"},
            "out-of-range positions for parameter 0 (shape (32, 16), block of 64) nominated by rank(s) [2]",
        ),
        ("nan", {"value_format": "bf16"}, "NaN/Inf coefficients for parameter 0 (shape (32, 16)) from rank(s) [2]"),
        ("nan", {"value_format": "2bit"}, "NaN/Inf coefficients for parameter 0 (shape (32, 16)) from rank(s) [2]"),
        ("nan_grad", {"nonfinite": "raise"}, "non-finite gradients on rank(s) [1] at optimizer step 1"),
    ],
)
def test_every_error_leaves_the_whole_state_untouched_on_every_rank(fault, kw, match):
    results = expect_ok(run_ranks(_fail_on_second_step, 3, fault, kw))
    for rank, (error, unchanged, _) in enumerate(results):
        assert isinstance(error, RankError), f"rank {rank} did not raise"
        assert match in error.message, error.message
        assert unchanged, f"rank {rank}: parameters, momentum or counters changed by a failed step"


def _flip(rank, world, kw, header_byte=None, secret=None):
    """One byte of rank 0's payload (or, ``header_byte``, of its header) flipped on its way to rank 1."""

    if secret is not None:
        os.environ["HF_DEMO_SECRET"] = secret
    model = tiny_mlp()
    opt = small_demo(model, **{"comm_timeout": 5.0, **kw})
    loss_and_backward(model, rank, 0)
    opt.step()
    whole = None
    if rank == 1:
        whole = flip_received_payload_bit() if header_byte is None else flip_received_header_bit(header_byte)
    loss_and_backward(model, rank, 1)
    before = _snapshot(model, opt)
    started = time.monotonic()
    try:
        opt.step()
        opt.confirm()  # a steady step's verdict settles in the next exchange, or here
        return "no error", True, 0.0, None
    except Exception as exc:  # noqa: BLE001
        error, unchanged, secs = RankError(exc), _same(before, _snapshot(model, opt)), time.monotonic() - started
    if kw.get("commit_vote") == "off":
        return error, unchanged, secs, None  # rank 0 committed the step: the ranks are apart
    if rank == 1:
        whole()  # the link is whole again: the same step, retried, commits everywhere
    opt.step()
    opt.confirm()
    return error, unchanged, secs, [p.detach().clone() for p in model.parameters()]


def _two_refuse_then_confirm(rank, world):
    """Rank 0's payload of step 1 reaches ranks 1 and 2 corrupted (rank 0 received every payload whole and commits
    the steady step tentatively); every rank calls confirm(), then runs the step again with the link whole."""
    model = tiny_mlp()
    opt = small_demo(model, comm_timeout=60.0)  # a wait for it outlasts run_ranks' timeout: a failure
    loss_and_backward(model, rank, 0)
    opt.step()
    whole = flip_received_payload_bit() if rank in (1, 2) else None
    loss_and_backward(model, rank, 1)
    try:
        opt.step()
        opt.confirm()
        error = None
    except Exception as exc:  # noqa: BLE001
        error = RankError(exc)
    if whole is not None:
        whole()
    opt.step()
    opt.confirm()
    return error, opt.steps, [p.detach().clone() for p in model.parameters()]


def test_two_ranks_refusing_a_steady_step_confirm_with_the_rank_that_kept_it_and_the_retry_commits():
    """Ranks 1 and 2 refuse rank 0's payload, rank 0 keeps the step tentatively; in confirm() each refusing rank
    reads the other's refusal (a settling row without FLAG_CONFIRM) beside rank 0's confirm row, and every rank
    runs confirm's later rounds alike (were the refusers to leave them to rank 0, rank 0's later rounds would pair
    with their retry). Every rank raises the same refusal and the retry commits with identical parameters."""
    results = expect_ok(run_ranks(_two_refuse_then_confirm, 3, timeout=45))
    for rank, (error, steps, params) in enumerate(results):
        assert isinstance(error, RankError) and error.type == "DeMoPayloadError", (rank, error)
        assert "every rank refused optimizer step 1 because rank(s) [1, 2]" in error.message, error.message
        assert steps == results[0][1] and all(torch.equal(a, b) for a, b in zip(params, results[0][2])), rank


@pytest.mark.parametrize("kw", [{}, {"exchange": "all_reduce"}], ids=["payload", "all_reduce nominations"])
def test_a_byte_flipped_on_the_way_to_one_rank_stops_that_step_on_every_rank_and_the_retry_commits(kw):
    """Rank 1 refuses rank 0's payload (CRC32); rank 0 received everything intact. The vote makes both refuse
    the step at once (no timeout), nothing is applied on either, and retrying the step keeps them identical."""
    (err0, unchanged0, secs0, after0), (err1, unchanged1, _, after1) = expect_ok(run_ranks(_flip, 2, kw, timeout=90))
    assert isinstance(err1, RankError) and err1.type == "DeMoPayloadError", err1
    assert "the payload from rank 0 at optimizer step 1 fails its CRC32 check" in err1.message, err1.message
    assert isinstance(err0, RankError) and err0.type == "DeMoPayloadError", err0
    assert "every rank refused optimizer step 1 because rank(s) [1]" in err0.message, err0.message
    assert secs0 < 5.0, secs0  # the vote answers at once: nobody waits for comm_timeout (5 s)
    assert unchanged0 and unchanged1
    assert all(torch.equal(a, b) for a, b in zip(after0, after1))


@pytest.mark.parametrize(
    "kw,byte,secret",
    [
        ({}, 5 * 8, None),  # the flags word: rank 1 alone would skip the step (skip flag) and abort in gloo
        ({"exchange": "all_reduce"}, 9 * 8, None),  # the replica fingerprint: rank 1 alone would see drift
        ({}, 14 * 8, "s3cret"),  # the header's HMAC tag
    ],
    ids=["flags", "fingerprint all_reduce", "hmac tag"],
)
def test_a_header_corrupted_on_the_way_to_one_rank_stops_the_step_on_every_rank_and_the_retry_commits(kw, byte, secret):
    """Rank 1 refuses rank 0's header (its own CRC32, or the HMAC); rank 0 received every header intact. Rank 1
    goes on into the step's collectives like rank 0, and the vote makes both raise the same refusal at once,
    naming the header and its sender (not a peer that 'did not answer'); nothing is applied, the retry commits."""
    results = expect_ok(run_ranks(_flip, 2, kw, byte, secret, timeout=90))
    (err0, unchanged0, secs0, after0), (err1, unchanged1, _, after1) = results
    assert isinstance(err1, RankError) and err1.type == "DeMoPayloadError", err1
    why = "HMAC-SHA256" if secret else "CRC32"
    assert "rank 1: the header from rank 0 at optimizer step 1" in err1.message and why in err1.message, err1.message
    assert isinstance(err0, RankError) and err0.type == "DeMoPayloadError", err0
    assert "rank 1 refused the header from rank 0" in err0.message, err0.message
    assert secs0 < 5.0, secs0  # the vote answers at once: nobody waits for comm_timeout (5 s)
    assert unchanged0 and unchanged1
    assert all(torch.equal(a, b) for a, b in zip(after0, after1))


def _flip_header_of_a_skip(rank, world, at, settings=None):
    """Rank 0's header says skip (NaN gradient) and reaches rank 1 corrupted: rank 1 cannot read the skip.
    ``at``: 0, the process's first exchange (the header alone, the payload in its own all-gather), or 1."""

    model = tiny_mlp()
    opt = small_demo(model, comm_timeout=5.0, **(settings or {}))
    if at:
        loss_and_backward(model, rank, 0)
        opt.step()
    if rank == 1:
        flip_received_header_bit(9 * 8)  # rank 0's fingerprint word: its CRC32 fails, its skip flag is not read
    loss_and_backward(model, rank, 1)
    if rank == 0:
        next(model.parameters()).grad[0, 0] = float("nan")
    before = _snapshot(model, opt)
    started = time.monotonic()
    try:
        opt.step()
        opt.confirm()  # rank 1, which refused, raises here, and so does rank 0 (it read rank 1's row: DEFERS)
        return "no error", True, 0.0
    except Exception as exc:  # noqa: BLE001
        return RankError(exc), _same(before, _snapshot(model, opt)), time.monotonic() - started


SKIP_EXCHANGES = {
    "all_gather": {},
    "all_reduce_union": {"exchange": "all_reduce"},
    "all_reduce_leader": {"exchange": "all_reduce", "reduce_positions": "leader"},
}


@pytest.mark.parametrize("exchange", list(SKIP_EXCHANGES))
@pytest.mark.parametrize("at", [0, 1], ids=["header_alone", "payload_rides"])
def test_a_refused_header_that_said_skip_stops_every_rank_at_once(at, exchange):
    """Rank 0 skips (its own NaN), rank 1 could not read that: the vote comes before any part acts on the
    headers, and a skipped step runs the exchange's collectives with zeros (all_reduce's sum too), so both meet
    there and raise the same refusal at once (no comm_timeout), with nothing changed."""
    results = expect_ok(run_ranks(_flip_header_of_a_skip, 2, at, SKIP_EXCHANGES[exchange], timeout=90))
    for rank, (error, unchanged, seconds) in enumerate(results):
        assert isinstance(error, RankError) and error.type == "DeMoPayloadError", (rank, error)
        assert "rank 1 refused the header from rank 0" in error.message, error.message
        assert seconds < 5.0, (rank, seconds)
        assert unchanged or not at, rank  # (a process's first step creates its state before the step)


def _retry_a_refused_skip(rank, world, settings, confirm_each):
    """A loop that stays alive and runs a refused step again, as its error invites: rank 0's gradient of the first
    step after step 0 is NaN once (its header says skip), and rank 0's headers reach rank 1 corrupted until rank 1
    raises (the settling rows too). ``confirm_each``: the loop confirms every step (as one that saves a checkpoint
    at each). Returns (every error as (loop iteration, class, message), the step counter, the parameters)."""

    model = tiny_mlp()
    opt = small_demo(model, comm_timeout=60.0, **settings)  # a wait for it outlasts run_ranks' timeout: a failure
    loss_and_backward(model, rank, 0)
    opt.step()
    whole = flip_received_header_bit(9 * 8) if rank == 1 else None
    errors, iteration, nan = [], 1, rank == 0
    while iteration < 4 and len(errors) < 3:
        loss_and_backward(model, rank, iteration)
        if nan:
            next(model.parameters()).grad[0, 0] = float("nan")
            nan = False
        try:
            opt.step()
            if confirm_each:
                opt.confirm()
            iteration += 1
        except Exception as exc:  # noqa: BLE001 - the same iteration runs again
            errors.append((iteration, type(exc).__name__, str(exc)))
            if whole is not None:
                whole = whole()  # the link is whole again
    opt.confirm()
    return errors, opt.steps, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3: two ranks read rank 0 intact
@pytest.mark.parametrize(
    "exchange,confirm_each",
    [("all_gather", False), ("all_gather", True), ("all_reduce_union", False)],
    ids=["all_gather", "all_gather-confirm_each", "all_reduce_union"],
)
def test_a_refused_skip_raises_in_the_same_call_on_every_live_rank_and_the_retry_commits(exchange, confirm_each, world):
    """Rank 0 skips its step (NaN), rank 1 cannot read the header that says so: every rank stays alive and runs
    the step again when it raises. Every rank raises the same error in the same call (rank 1, which cannot tell
    the step is a skip, returns from step() and raises at its next call: the ranks that settle the skip at once
    read that in its row and do the same), nobody waits for comm_timeout (60 s, beyond run_ranks' timeout), and
    the retry commits with identical parameters everywhere."""
    results = expect_ok(run_ranks(_retry_a_refused_skip, world, SKIP_EXCHANGES[exchange], confirm_each, timeout=45))
    errors, steps, params = results[0]
    assert len(errors) == 1 and errors[0][1] == "DeMoPayloadError", errors
    assert "rank 1 refused the header from rank 0" in errors[0][2], errors[0][2]
    for rank, (errors_r, steps_r, params_r) in enumerate(results):
        assert [e[:2] for e in errors_r] == [e[:2] for e in errors], (rank, errors_r, errors)
        assert steps_r == steps, (rank, steps_r, steps)
        assert all(torch.equal(a, b) for a, b in zip(params, params_r)), rank


def _flip_header_overlap(rank, world):
    """overlap=True: rank 0's header of step 1 corrupted on its way to rank 1; the steps after it."""

    model = tiny_mlp()
    opt = small_demo(model, overlap=True, comm_timeout=5.0)
    loss_and_backward(model, rank, 0)
    opt.step()
    if rank == 1:
        flip_received_header_bit(5 * 8, once=True)  # rank 0's flags word
    errors = []
    for step in (1, 2):
        loss_and_backward(model, rank, step)
        try:
            opt.step()
            errors.append(None)
        except Exception as exc:  # noqa: BLE001
            errors.append(RankError(exc))
    return errors


def _flip_header_of_a_skip_overlap(rank, world, settings):
    """overlap=True: rank 0's header of step 1 says skip (NaN gradient) and reaches rank 1 corrupted; steps 1, 2."""

    model = tiny_mlp()
    opt = small_demo(model, overlap=True, comm_timeout=5.0, **settings)
    loss_and_backward(model, rank, 0)
    opt.step()
    if rank == 1:
        flip_received_header_bit(9 * 8, once=True)  # rank 0's fingerprint word: its skip flag is not read
    outcomes = []
    for step in (1, 2):
        loss_and_backward(model, rank, step)
        if rank == 0 and step == 1:
            next(model.parameters()).grad[0, 0] = float("nan")
        before = _snapshot(model, opt)[:3]  # (the traffic of the exchange in flight, which did travel, is counted)
        started = time.monotonic()
        try:
            opt.step()
            outcomes.append(None)
        except Exception as exc:  # noqa: BLE001
            after = _snapshot(model, opt)[:3]
            outcomes.append((RankError(exc), _same((*before, 0), (*after, 0)), time.monotonic() - started))
    return outcomes


@pytest.mark.parametrize("exchange", ["all_gather", "all_reduce_union"])
def test_with_overlap_a_refused_header_that_said_skip_stops_every_rank_at_the_next_step(exchange):
    """overlap=True: a skipped step's exchange still starts (zeros, nothing of it lands), so rank 1, which could
    not read the skip, meets rank 0 there; its refusal rides in the next header and both raise at step 2 at once
    (no comm_timeout), nothing applied."""
    results = expect_ok(run_ranks(_flip_header_of_a_skip_overlap, 2, SKIP_EXCHANGES[exchange], timeout=90))
    for rank, (at_1, at_2) in enumerate(results):
        assert at_1 is None, (rank, at_1)
        error, unchanged, seconds = at_2
        assert isinstance(error, RankError) and error.type == "DeMoSyncError", (rank, error)
        assert "rank(s) [1] refused the exchange still in flight" in error.message, error.message
        assert seconds < 5.0 and unchanged, (rank, seconds, unchanged)


def test_with_overlap_a_corrupted_header_stops_every_rank_at_the_next_step():
    """overlap=True votes in the next step's header: the refused header rides there (flag 64), every rank raises
    at step 2 naming rank 1, and nothing of the refused exchange is applied."""
    for rank, (at_1, at_2) in enumerate(expect_ok(run_ranks(_flip_header_overlap, 2, timeout=90))):
        assert at_1 is None, (rank, at_1)
        assert isinstance(at_2, RankError) and "rank(s) [1] refused the exchange still in flight" in at_2.message
        if rank == 1:
            assert "the header from rank 0 at optimizer step 1 fails its CRC32 check" in at_2.message, at_2.message


@pytest.mark.parametrize("vote", ["on", "off"])
def test_without_the_vote_the_ranks_commit_apart(vote):
    """What the vote prevents: with commit_vote='off' the rank whose payload arrived intact commits the step."""
    results = expect_ok(run_ranks(_flip, 2, {"commit_vote": vote, "comm_timeout": 5.0}, timeout=90))
    (err0, unchanged0, _, _), (err1, unchanged1, _, _) = results
    assert isinstance(err1, RankError) and unchanged1
    assert (isinstance(err0, RankError) and unchanged0) == (vote == "on")


def test_a_frozen_peer_makes_the_survivor_raise_within_comm_timeout_naming_it():
    timeout = 4.0
    started = time.monotonic()
    results = expect_ok(run_ranks(_fail_on_second_step, 2, "freeze", {"comm_timeout": timeout}, timeout=90))
    error, unchanged, seconds = results[0]
    assert isinstance(error, RankError) and error.type == "DeMoSyncError", error
    assert "rank(s) [1] did not answer" in error.message, error.message
    assert f"comm_timeout={timeout:g}s" in error.message and "optimizer step 1" in error.message
    assert timeout <= seconds < timeout + 10, seconds
    assert unchanged
    assert time.monotonic() - started < 60


def _extra_step(rank, world):
    model = tiny_mlp()
    opt = small_demo(model, comm_timeout=20.0)
    for step in range(3 + (rank == 1)):  # rank 1 calls step() one time more than rank 0
        loss_and_backward(model, rank, step)
        before = _snapshot(model, opt)
        started = time.monotonic()
        try:
            opt.step()
        except Exception as exc:  # noqa: BLE001
            return RankError(exc), _same(before, _snapshot(model, opt)), time.monotonic() - started
    return "finished", True, 0.0


def test_a_rank_stepping_once_more_gets_a_named_error_not_a_raw_gloo_one():
    results = expect_ok(run_ranks(_extra_step, 2, timeout=90))
    assert results[0][0] == "finished"
    error, unchanged, seconds = results[1]
    assert isinstance(error, RankError) and error.type == "DeMoSyncError", error
    assert "optimizer step 3" in error.message, error.message
    assert "did not answer" in error.message or "a peer is missing or out of step" in error.message, error.message
    assert unchanged and seconds < 30


def _settings(rank, world, name, values):
    model = tiny_mlp()
    opt = small_demo(model, **{name: values[rank]})
    loss_and_backward(model, rank, 0)
    opt.step()


@pytest.mark.parametrize(
    "name,values",
    [
        ("nonfinite", ("skip", "raise")),
        ("update_rule", ("sign", "adam")),
        ("check_every", (100, 50)),
        ("exchange", ("all_gather", "all_reduce")),
        ("value_format", ("bf16", "fp32")),
        ("index_coding", ("uint16", "elias_fano")),
        ("compression_topk", (4, 2)),
    ],
)
def test_every_setting_that_must_agree_is_checked(name, values):
    for r in run_ranks(_settings, 2, name, values):
        assert isinstance(r, RankError) and "DeMo ranks disagree" in r.message, r
        assert "different optimizer settings" in r.message or "different parameter layout" in r.message, r
        if name in ("exchange", "value_format", "index_coding"):  # the same blocks, sent another way
            assert "different parameter layout" not in r.message, r  # it showed two equal layout checksums


def _secret(rank, world, secrets, kw=None):
    if secrets[rank] is None:
        os.environ.pop("HF_DEMO_SECRET", None)
    else:
        os.environ["HF_DEMO_SECRET"] = secrets[rank]
    model = tiny_mlp()
    opt = small_demo(model, **(kw or {}))
    for step in range(3):
        loss_and_backward(model, rank, step)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_authenticated_payloads():
    same = expect_ok(run_ranks(_secret, 2, ("s3cret", "s3cret")))
    assert all(torch.equal(a, b) for a, b in zip(*same))
    forged = run_ranks(_secret, 2, ("s3cret", "guess"))
    assert all(isinstance(r, RankError) and "HMAC-SHA256" in r.message for r in forged), forged
    forged_all_reduce = run_ranks(_secret, 2, ("s3cret", "guess"), {"exchange": "all_reduce"})
    assert all(isinstance(r, RankError) and "header from rank" in r.message for r in forged_all_reduce), (
        forged_all_reduce
    )
    missing = run_ranks(_secret, 2, ("s3cret", None))
    assert all(isinstance(r, RankError) and "HF_DEMO_SECRET" in r.message for r in missing), missing
    # the rank with the secret gets the same named mismatch, not a refused HMAC
    assert all("rank 1 does not sign its payloads and rank 0 does" in r.message for r in missing), missing


def _drift(rank, world, policy, full_sync_every):
    model = tiny_mlp()
    opt = small_demo(model, check_every=5, drift=policy, full_sync_every=full_sync_every)
    for step in range(12):
        loss_and_backward(model, rank, step)
        if step == 2 and rank == 1:
            with torch.no_grad():
                next(model.parameters())[0, 0] += 1e-3  # a bit flip, a non-deterministic kernel
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.resyncs, opt.state_dict()["demo"]["resyncs"]


def test_drift_is_detected_and_resynced():
    (p0, n0, s0), (p1, n1, s1) = expect_ok(run_ranks(_drift, 2, "resync", 0))
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert n0 == n1 == s0 == s1 == 1  # found at the check of step 4; the check of step 9 finds them equal


def test_full_sync_every():
    (p0, n0, _), (p1, n1, _) = expect_ok(run_ranks(_drift, 2, "raise", 4))
    # the nudge of step 2 is overwritten by the full synchronisation of step 3, before the check of step 4
    assert all(torch.equal(a, b) for a, b in zip(p0, p1)) and n0 == n1 == 3


def test_drift_raises_with_policy_raise():
    results = run_ranks(_drift, 2, "raise", 0)
    for r in results:
        assert isinstance(r, RankError) and "replicas drifted apart at optimizer step 4" in r.message, r


def _frozen_param(rank, world):
    model = tiny_mlp()
    frozen = model[0].bias
    frozen.requires_grad_(False)
    value = frozen.detach().clone()
    opt = small_demo(model, weight_decay=0.1)
    for step in range(5):
        loss_and_backward(model, rank, step)
        opt.step()
    return torch.equal(frozen, value), frozen not in opt.state


def test_frozen_parameters_are_left_alone():
    for untouched, no_state in expect_ok(run_ranks(_frozen_param, 2)):
        assert untouched and no_state


def test_complex_and_empty_parameters_are_refused_at_construction():
    with pytest.raises(ValueError, match="complex"):
        hf_demo.DeMo([torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="empty parameter"):
        hf_demo.DeMo([torch.nn.Parameter(torch.zeros(0))])


def test_a_huge_finite_gradient_is_not_non_finite():
    p = torch.nn.Parameter(torch.zeros(8, 8))
    opt = hf_demo.DeMo([p], lr=1e-3)
    p.grad = torch.full((8, 8), 1e30)
    opt.step()
    assert opt.skipped_steps == 0 and bool(p.ne(0).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_nonfinite_check_is_element_wise_where_a_sum_overflows(dtype):
    """The check reads a tensor's sum first; finite values whose sum overflows must still count as finite,
    and one NaN/Inf anywhere (also beside values that overflow the sum) as non-finite."""
    from hf_demo.guards import any_nonfinite as _nonfinite

    big = torch.finfo(dtype).max
    overflowing = torch.full((64, 64), big, dtype=dtype)
    assert bool(overflowing.sum(dtype=torch.float64 if dtype == torch.float64 else torch.float32).isinf())
    assert not _nonfinite([torch.zeros(3, dtype=dtype), overflowing, -overflowing])
    for bad in (float("nan"), float("inf"), -float("inf")):
        for base in (torch.zeros(64, 64, dtype=dtype), overflowing.clone()):
            base[17, 5] = bad
            assert _nonfinite([torch.ones(2, dtype=dtype), base]), (dtype, bad, base[0, 0].item())
    assert not _nonfinite([]) and not _nonfinite([torch.zeros(0, dtype=dtype)])


def test_warns_after_patience_consecutive_skipped_steps():
    p = torch.nn.Parameter(torch.zeros(8, 8))
    opt = hf_demo.DeMo([p], lr=1e-3, nonfinite_patience=3)
    p.grad = torch.full((8, 8), float("nan"))
    opt.step()
    opt.step()
    with pytest.warns(UserWarning, match="skipped the last 3 optimizer steps"):
        opt.step()


def _inf_param(rank, world, policy, at_rank=1):
    model = tiny_mlp()
    opt = small_demo(model, drift=policy)
    for step in range(4):
        loss_and_backward(model, rank, step)
        if step == 1 and rank == at_rank:
            with torch.no_grad():
                model[2].weight[0, 0] = float("inf")
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.skipped_steps, opt.resyncs


def test_a_non_finite_parameter_on_one_rank_is_named_or_repaired():
    (p0, skipped0, resyncs0), (p1, _, resyncs1) = expect_ok(run_ranks(_inf_param, 2, "resync"))
    assert all(torch.equal(a, b) for a, b in zip(p0, p1)) and all(bool(p.isfinite().all()) for p in p1)
    assert (skipped0, resyncs0, resyncs1) == (1, 1, 1)
    for r in run_ranks(_inf_param, 2, "raise"):
        assert isinstance(r, RankError) and "non-finite parameters on rank(s) [1]" in r.message, r


def test_a_non_finite_parameter_on_rank_0_stops_every_rank_even_with_resync():
    """Rank 0 is the source of a resync: its Inf cannot be repaired from it, so every rank raises, naming it."""
    for r in run_ranks(_inf_param, 2, "resync", 0):
        assert isinstance(r, RankError) and r.type == "DeMoSyncError", r
        assert "non-finite parameters on rank(s) [0] (drift='resync'); no state was changed" in r.message, r
