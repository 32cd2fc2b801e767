"""Encrypted, sender-bound DeMo traffic (HF_DEMO_ENCRYPT=1, hf_demo.wire.sealing): what crosses the link is
unreadable, and a row of another key, step, try or rank, or with a flipped bit, is refused as a bad HMAC is.

The rank tests run 2 real gloo ranks and tamper with what the transport receives (as tests/test_faults.py does)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from dist_utils import RankError, carries_header, expect_ok, run_ranks
from models import loss_and_backward, small_demo, tiny_mlp

SECRET = "s3cret"


# ------------------------------------------------------------------ without ranks
def _settings(**kw):
    from hf_demo.settings import DeMoSettings

    return DeMoSettings(**kw)


@pytest.mark.parametrize(
    "env,secret,kw,match",
    [
        ({"HF_DEMO_ENCRYPT": "yes"}, b"s", {}, "HF_DEMO_ENCRYPT='yes': set 1"),
        ({"HF_DEMO_ENCRYPT": "1"}, None, {}, "HF_DEMO_SECRET, which is not set"),
        ({"HF_DEMO_ENCRYPT": "1"}, b"s", {"exchange": "all_reduce"}, "encrypted values cannot be summed"),
    ],
)
def test_bad_switches_are_refused_naming_the_fix(env, secret, kw, match):
    from hf_demo.wire import sealing

    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        sealing.from_env(secret, _settings(**kw), env)


def test_off_unless_switched_on():
    from hf_demo.wire import sealing

    assert sealing.from_env(b"s", _settings(), {}) is None
    assert sealing.from_env(b"s", _settings(), {"HF_DEMO_ENCRYPT": "0"}) is None
    assert sealing.from_env(None, _settings(), {}) is None


def test_without_cryptography_the_error_names_the_extra(monkeypatch):
    from hf_demo.wire import sealing

    for name in [m for m in sys.modules if m == "cryptography" or m.startswith("cryptography.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "cryptography", None)  # import cryptography -> ImportError
    with pytest.raises(ImportError, match=r"hf-demo\[secure\]"):
        sealing.from_env(b"s", _settings(), {"HF_DEMO_ENCRYPT": "1"})


def test_nonces_differ_in_step_try_sender_and_kind():
    from hf_demo.wire import sealing

    seen = {
        sealing.nonce(step, tries, sender, kind)
        for step in (0, 1, 2**39)
        for tries in (1, 2)
        for sender in (0, 1, 300)
        for kind in sealing.KINDS
    }
    assert len(seen) == 3 * 2 * 3 * len(sealing.KINDS)
    assert all(len(n) == 12 for n in seen)


def test_a_sealed_header_is_as_long_as_a_clear_one_and_a_payload_16_bytes_longer():
    from hf_demo.wire import codec, sealing

    sealer = sealing.Sealer(b"s")
    header = codec.Header(step=3, layout_checksum=1, settings_checksum=2, flags=0, world_size=1, payload_bytes=40)
    row = sealer.seal_header(header, 3, 0)
    assert row.numel() == codec.HEADER_BYTES and sealing.is_sealed(row)
    assert header.words_bytes() not in row.numpy().tobytes()
    assert sealer.open_headers(row[None], 3, [0], 0)[0].words_bytes() == header.words_bytes()
    payload = torch.arange(40, dtype=torch.uint8)
    sealed = sealer.seal(payload, 3, "payload")
    assert sealed.numel() == 40 + sealing.TAG_BYTES
    assert torch.equal(sealer.open_rows(sealed[None], 3, "payload", 0)[0], payload)


def test_the_transit_cost_benchmark_prints_its_table(capsys):
    import transit_cost

    text = transit_cost.main(["--sizes", "1000", "--worlds", "2", "--repeats", "1"])
    assert "| payload | W | clear (CRC32) ms | HMAC-SHA256 ms | AES-256-GCM ms |" in text
    assert "| 0.001 MiB | 2 |" in capsys.readouterr().out
    assert transit_cost.smollm2_payload_bytes() > 3 * 2**20  # DeMo's 3.3 MB per step (docs/results.md)


def test_every_try_of_a_step_seals_under_a_new_nonce(monkeypatch):
    """The same header and payload sealed twice at one step (a step run again): new nonces, new ciphertexts."""
    from hf_demo.wire import codec, sealing

    used = []
    real = sealing.nonce
    monkeypatch.setattr(sealing, "nonce", lambda *a: used.append(real(*a)) or used[-1])
    sealer = sealing.Sealer(b"s")
    header = codec.Header(step=7, layout_checksum=1, settings_checksum=2, flags=0, world_size=1, payload_bytes=8)
    payload = torch.zeros(8, dtype=torch.uint8)
    sent = []
    for _ in range(2):
        sent.append(sealer.seal_header(header, 7, 0).numpy().tobytes())
        sent.append(sealer.seal(payload, 7, "payload").numpy().tobytes())
    assert len(set(used)) == len(used) == 4
    assert len(set(sent)) == 4


def test_a_row_opens_only_with_its_senders_key():
    """Two senders of one session id (one process) still have two keys: the key is derived per sender rank."""
    from hf_demo.errors import DeMoSyncError
    from hf_demo.wire import codec, sealing

    sealer = sealing.Sealer(b"s")
    header = codec.Header(step=0, layout_checksum=1, settings_checksum=2, flags=0, world_size=2, payload_bytes=8)
    row = sealer.seal_header(header, 0, 0)
    with pytest.raises(DeMoSyncError, match="the header from rank 0 at optimizer step 0 does not open with rank 0's"):
        sealer.open_headers(row[None], 0, [1], 0)  # opened as rank 1's
    assert sealer.open_headers(row[None], 0, [0], 0)[0] == header  # as rank 0's


def test_one_process_trains_bitwise_the_same_encrypted_on_its_device(device, monkeypatch):
    """A world of one seals and opens its own rows too: on the parameters' device, the same training."""
    if device.type == "cuda":  # gpu_check runs on the GPU machine's own packages, which may lack the secure extra
        pytest.importorskip("cryptography", reason="the secure extra: pip install 'hf-demo[secure]'")
    monkeypatch.setenv("HF_DEMO_SECRET", SECRET)
    runs = []
    for encrypt in ("0", "1"):
        monkeypatch.setenv("HF_DEMO_ENCRYPT", encrypt)
        model = tiny_mlp().to(device)
        opt = small_demo(model)
        assert (opt.sealer is not None) == (encrypt == "1")
        for step in range(3):
            loss_and_backward(model, 0, step)
            opt.step()
        assert opt.sealer is None or opt.sealer.tries == 3  # every step's header sealed
        runs.append(_params(model))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_sealed_resync_returns_every_parameter_whatever_its_dtype_and_size():
    """Rank 0's parameters travel as one buffer of bytes: a bf16 tensor of odd size before an fp32 one."""
    from hf_demo.exchange.transport import Transport
    from hf_demo.wire import agreement, codec, sealing

    sealer = sealing.Sealer(b"s")
    header = codec.Header(step=0, layout_checksum=1, settings_checksum=2, flags=0, world_size=1, payload_bytes=0)
    sealer.open_headers(sealer.seal_header(header, 0, 0)[None], 0, [0], 0)
    params = [torch.randn(3, dtype=torch.bfloat16), torch.randn(2, 5), torch.tensor(7, dtype=torch.int64)]
    fresh = agreement.fetch_rank0(params, Transport.alone().at(0), sealer)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(params, fresh))


# ------------------------------------------------------------------ 2 gloo ranks
class Wire:
    """Every all-gather of this rank: what it sent and received, and a ``tamper(kind, rows, call)`` applied to
    what it received (the collective's output) before DeMo reads it."""

    def __init__(self, world: int):
        from hf_demo.exchange import transport as comm
        from hf_demo.wire import codec, sealing, uniform

        self.world, self.sent, self.received, self.tamper = world, [], [], None
        self.kinds = {codec.HEADER_BYTES: "header", 8 + sealing.TAG_BYTES: "vote", 8: "vote", 16: "ddp_check"}
        self.kinds[uniform.WORD_BYTES] = "sealing"  # the first exchange's sealing round
        real = comm._all_gather

        def arrived(out, buf):
            for kind, sent, rows in self.parts(buf, out.view(self.world, -1)):
                self.sent.append((kind, sent.clone()))
                self.received.append((kind, rows.clone()))
                if self.tamper is not None:
                    self.tamper(kind, rows, len(self.received) - 1)  # in place: views of what arrived

        def gather(out, buf, group=None, async_op=False):
            if not async_op:
                real(out, buf, group=group)
                return arrived(out, buf)
            work = real(out, buf, group=group, async_op=True)
            return Arrival(work, lambda: arrived(out, buf))  # overlap: seen when the next step waits for it

        comm._all_gather = gather

    def parts(self, buf: torch.Tensor, rows: torch.Tensor) -> list:
        """(kind, sent, received rows) of one all-gather: a payload riding with the headers is its own part."""
        from hf_demo.wire import codec

        n, h = buf.numel(), codec.HEADER_BYTES
        if n > h and carries_header(buf):  # (a settling row's zeros after its header: sealed payloads never are)
            tail = "payload" if buf[h:].any() else "settle"
            return [("header", buf[:h], rows[:, :h]), (tail, buf[h:], rows[:, h:])]
        return [(self.kinds.get(n, "payload"), buf, rows)]

    def last(self, kind: str) -> torch.Tensor:
        return next(rows for k, rows in reversed(self.received) if k == kind)

    def first(self, kind: str) -> torch.Tensor:
        return next(rows for k, rows in self.received if k == kind)


class Arrival:
    """A background all-gather's work whose rows :class:`Wire` sees when it is waited for."""

    def __init__(self, work, seen):
        self.work, self.seen = work, seen

    def wait(self, *args):
        self.work.wait(*args)
        self.seen()
        return True


def _env(secret: str | None, encrypt: bool) -> None:
    for name, value in (("HF_DEMO_SECRET", secret), ("HF_DEMO_ENCRYPT", "1" if encrypt else None)):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _train(rank, steps: int = 3, **kw):
    model = tiny_mlp()
    opt = small_demo(model, **kw)
    for step in range(steps):
        loss_and_backward(model, rank, step)
        opt.step()
    return model, opt


def _wire_and_results(rank, world, kw):
    """The same 4 steps HMAC-signed, then encrypted (capturing the wire); and what the sealer was given."""
    from hf_demo.wire import sealing

    _env(SECRET, False)
    signed, _ = _train(rank, 4, **kw)
    _env(SECRET, True)
    plain = []
    real_seal = sealing.Sealer.seal
    sealing.Sealer.seal = lambda self, buf, step, kind: (
        plain.append((kind, buf.clone())) or real_seal(self, buf, step, kind)
    )
    wire = Wire(world)
    sealed, opt = _train(rank, 4, **kw)
    return _params(signed), _params(sealed), plain, wire.sent, opt.comm_stats.bytes_sent


@pytest.mark.parametrize("kw", [{}, {"sync_every": 2, "value_format": "sign"}], ids=["defaults", "sync_every 2"])
def test_nothing_readable_crosses_the_link_and_training_is_the_same(gloo, kw):
    from hf_demo.wire import codec, sealing

    exchanges = 4 // kw.get("sync_every", 1)
    results = expect_ok(run_ranks(_wire_and_results, 2, kw))
    for rank, (signed, sealed, plain, sent, bytes_sent) in enumerate(results):
        assert all(torch.equal(a, b) for a, b in zip(signed, sealed)), f"rank {rank}: encryption changed training"
        payloads = [buf for kind, buf in plain if kind == "payload"]
        wire_payloads = [buf for kind, buf in sent if kind == "payload"]
        assert len(payloads) == len(wire_payloads) == exchanges
        for clear, wire in zip(payloads, wire_payloads):
            assert wire.numel() == clear.numel() + sealing.TAG_BYTES  # a fixed length per layout
            assert clear.numpy().tobytes() not in wire.numpy().tobytes()
            assert (wire[: clear.numel()] == clear).float().mean() < 0.1  # ~1/256 of the bytes equal by chance
        headers = [buf for kind, buf in sent if kind == "header"]
        # every-step DeMo: the first step settles at once (a sealed row more), the others in the next step
        settling = 0 if kw else 1
        assert len(headers) == exchanges + settling and all(sealing.is_sealed(h) for h in headers)
        magic = codec.MAGIC.to_bytes(8, "little")
        assert not any(magic in h.numpy().tobytes() for h in headers)  # no header word in the clear
        votes = [buf for kind, buf in sent if kind == "vote"]
        assert len(votes) == (exchanges if kw else 0) and all(v.numel() == 8 + sealing.TAG_BYTES for v in votes)
        assert bytes_sent == codec.HEADER_BYTES + wire_payloads[-1].numel() + sum(v.numel() for v in votes[-1:])


def _overlap_wire(rank, world, resume_at):
    """overlap=True, 4 steps and the flush, HMAC-signed; then encrypted (the wire captured), its state saved after
    ``resume_at`` steps (an exchange in flight) and loaded into a new optimizer, a new process's keys."""
    _env(SECRET, False)
    signed, signed_opt = _train(rank, 4, overlap=True)
    signed_opt.flush()
    _env(SECRET, True)
    wire = Wire(world)
    model, opt = _train(rank, resume_at, overlap=True)
    state = opt.state_dict()
    opt = small_demo(model, overlap=True)
    opt.load_state_dict(state)
    for step in range(resume_at, 4):
        loss_and_backward(model, rank, step)
        opt.step()
    opt.flush()
    return _params(signed), _params(model), wire.sent, wire.received, state["demo"]["pending"]


def test_overlap_travels_sealed_and_trains_the_same_also_across_a_checkpoint(gloo):
    """The payload is sealed when its all-gather starts and opened when the next step finishes it, with the
    envelopes of the step that sent it (the next step's headers came in between); a checkpoint keeps what opens
    it (sender, session id, try, associated data: no key, no plaintext)."""
    from hf_demo.wire import sealing

    for rank, (signed, sealed, sent, received, pending) in enumerate(expect_ok(run_ranks(_overlap_wire, 2, 2))):
        assert all(torch.equal(a, b) for a, b in zip(signed, sealed)), f"rank {rank}: encryption changed training"
        payloads = [buf for kind, buf in sent if kind == "payload"]
        assert len(payloads) == 4 and all(sealing.is_sealed(h) for kind, h in sent if kind == "header")
        assert pending is not None and len(pending["envelopes"]) == 2 and "key" not in str(pending["envelopes"])
        rows = next(rows for kind, rows in received if kind == "payload")
        assert torch.equal(rows[rank], payloads[0])  # what arrived is what was sent: ciphertext


def _overlap_flipped(rank, world):
    """overlap=True encrypted: one bit of rank 0's payload of step 0 flipped on its way to rank 1."""
    _env(SECRET, True)
    model = tiny_mlp()
    opt = small_demo(model, overlap=True, comm_timeout=20.0)
    wire = Wire(world)

    def tamper(kind, rows, call):
        if kind == "payload" and rank == 1 and wire.tamper is tamper:
            rows[0, rows.shape[1] // 2] ^= 0x01
            wire.tamper = None

    wire.tamper = tamper
    errors = []
    for step in range(3):
        loss_and_backward(model, rank, step)
        try:
            opt.step()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.append(RankError(exc))
    return errors


def test_overlap_refuses_a_flipped_bit_of_the_payload_in_flight_on_every_rank(gloo):
    """Rank 1 cannot open it when the next step finishes it, says so in that step's header, and every rank
    stops alike (overlap's refusal: the exchange cannot be sent again)."""
    for rank, errors in enumerate(expect_ok(run_ranks(_overlap_flipped, 2))):
        assert errors and errors[0].type == "DeMoSyncError", (rank, errors)
        assert "rank(s) [1] refused the exchange still in flight (overlap=True) from optimizer step 0" in (
            errors[0].message
        )


def _tampered(rank, world, secrets, fault):
    """Step 0 clean, then ``fault`` on step 1, which is run until it commits (3 tries at most): ([error, state
    unchanged?] of each refused try, the parameters after, the optimizer's step count)."""
    _env(secrets[rank], secrets[rank] is not None)
    model = tiny_mlp()
    opt = small_demo(model, comm_timeout=20.0)
    wire = Wire(world)
    loss_and_backward(model, rank, 0)
    opt.step()
    step0 = {kind: wire.first(kind) for kind in ("header", "payload")}  # (then step 0 settles in a header row)
    refused_try = {}
    FAULTS[fault](wire, rank, step0, refused_try)
    loss_and_backward(model, rank, 1)
    before = _params(model), opt.steps
    errors = []
    for _ in range(3):  # the step, then retries: the fault may hold for a try
        try:
            opt.step()
            opt.confirm()  # a steady step's verdict settles in the next exchange, or here
            break
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.append(RankError(exc))
            unchanged = all(torch.equal(a, b) for a, b in zip(before[0], _params(model))) and opt.steps == before[1]
            errors.append(unchanged)
    return errors, _params(model), opt.steps


def _flip(wire, rank, step0, refused_try):
    def tamper(kind, rows, call):
        if kind == "payload" and rank == 1 and wire.tamper is tamper:
            rows[0, rows.shape[1] // 2] ^= 0x01  # one bit of rank 0's payload, on its way to rank 1
            wire.tamper = None  # the retry's link is whole

    wire.tamper = tamper


def _replay_step(wire, rank, step0, refused_try):
    def tamper(kind, rows, call):  # rank 0's payload of step 0 in place of its payload of step 1, to rank 1
        if kind == "payload" and rank == 1 and wire.tamper is tamper:
            rows[0] = step0["payload"][0]
            wire.tamper = None

    wire.tamper = tamper


def _replay_headers(wire, rank, step0, refused_try):
    def tamper(kind, rows, call):  # step 0's headers (and payloads) again at step 1, on every rank
        if kind == "header" and wire.tamper is tamper:
            rows.copy_(step0[kind])
            wire.tamper = None  # refused at the header: the retry's link is whole

    wire.tamper = tamper


def _replay_try(wire, rank, step0, refused_try):
    """Try 1 of step 1 refused (a bit flipped on the way to rank 1); try 2 gets try 1's payload of rank 0 again."""

    def tamper(kind, rows, call):
        if kind != "payload" or rank != 1:
            return
        if "payload" not in refused_try:
            refused_try["payload"] = rows[0].clone()
            rows[0, rows.shape[1] // 2] ^= 0x01
        elif "replayed" not in refused_try:
            refused_try["replayed"] = True
            rows[0] = refused_try["payload"]
        else:
            wire.tamper = None

    wire.tamper = tamper


def _swap_rows(wire, rank, step0, refused_try):
    def tamper(kind, rows, call):  # rank 0's header in rank 1's place and back, on every rank
        if kind == "header" and wire.tamper is tamper:
            rows.copy_(rows.flip(0))
            wire.tamper = None  # refused at the header: the retry's link is whole

    wire.tamper = tamper


def _swap_payloads(wire, rank, step0, refused_try):
    def tamper(kind, rows, call):  # the payloads only, swapped on their way to rank 1
        if kind == "payload" and rank == 1 and wire.tamper is tamper:
            rows.copy_(rows.flip(0))
            wire.tamper = None

    wire.tamper = tamper


def _nothing(wire, rank, step0, refused_try):
    pass


FAULTS = {
    "flip": _flip,
    "replay_step": _replay_step,
    "replay_headers": _replay_headers,
    "replay_try": _replay_try,
    "swap_rows": _swap_rows,
    "swap_payloads": _swap_payloads,
    "none": _nothing,
}


def _voted(results, tries: int, match: str):
    """Rank 1 refused what it received ``tries`` times, rank 0 with it each time (the vote); the retry commits."""
    (errors0, after0, steps0), (errors1, after1, steps1) = results
    assert len(errors0) == len(errors1) == 2 * tries, (errors0, errors1)
    for attempt in range(tries):
        err0, unchanged0, err1, unchanged1 = (
            errors0[2 * attempt : 2 * attempt + 2] + errors1[2 * attempt : 2 * attempt + 2]
        )
        assert err1.type == "DeMoPayloadError" and match in err1.message, err1.message
        assert err0.type == "DeMoPayloadError", err0
        assert "every rank refused optimizer step 1 because rank(s) [1]" in err0.message, err0.message
        assert unchanged0 and unchanged1
    assert steps0 == steps1 == 2
    assert all(torch.equal(a, b) for a, b in zip(after0, after1))


@pytest.mark.parametrize("fault", ["flip", "replay_step", "swap_payloads"])
def test_a_tampered_payload_is_refused_by_every_rank_and_the_retry_commits(gloo, fault):
    results = expect_ok(run_ranks(_tampered, 2, (SECRET, SECRET), fault, timeout=120))
    _voted(results, 1, "the payload from rank 0 at optimizer step 1 does not open with rank 0's key")


def test_a_payload_of_an_earlier_try_is_refused(gloo):
    results = expect_ok(run_ranks(_tampered, 2, (SECRET, SECRET), "replay_try", timeout=120))
    _voted(results, 2, "the payload from rank 0 at optimizer step 1 does not open with rank 0's key")


@pytest.mark.parametrize(
    "fault,match",
    [
        ("replay_headers", "at optimizer step 1 is a replay: its try 1 is not beyond the last one accepted"),
        ("swap_rows", "the header from rank 0 at optimizer step 1 carries a session id that rank has not sent with"),
    ],
)
def test_a_replayed_or_swapped_header_stops_every_rank(gloo, fault, match):
    """A header that does not open or is a replay is refused like one that fails its HMAC: voted on, so every rank
    refuses the step alike (also where only one rank received it tampered: tests/test_verdict_faults.py)."""
    results = expect_ok(run_ranks(_tampered, 2, (SECRET, SECRET), fault, timeout=120))
    for errors, _, steps in results:
        assert errors[0].type == "DeMoPayloadError" and match in errors[0].message, errors[0].message
        assert "every rank refused optimizer step 1" in errors[0].message, errors[0].message
        assert errors[1] and steps == 2  # nothing changed, and the retry over the whole link committed


def _first_step(rank, world, secrets, encrypt):
    _env(secrets[rank], encrypt[rank])
    try:
        _train(rank, steps=1, comm_timeout=20.0)
    except Exception as exc:  # noqa: BLE001
        return RankError(exc)
    return "no error"


def test_a_different_secret_is_refused_on_every_rank(gloo):
    results = run_ranks(_first_step, 2, (SECRET, "guess"), (True, True), timeout=120)
    for rank, error in enumerate(results):
        other = 1 - rank
        assert isinstance(error, RankError) and error.type == "DeMoSyncError", error
        assert (
            f"the header from rank {other} at optimizer step 0 does not open with rank {other}'s key" in error.message
        )


def test_one_rank_without_the_secret_stops_every_rank_naming_it(gloo):
    results = run_ranks(_first_step, 2, (SECRET, None), (True, False), timeout=120)
    for error in results:
        assert isinstance(error, RankError) and error.type == "DeMoSyncError", error
        assert "rank(s) [0] encrypt their traffic and rank(s) [1] send it in the clear" in error.message, error.message
        assert "HF_DEMO_ENCRYPT=1 on every rank" in error.message


def _resync(rank, world):
    _env(SECRET, True)
    model = tiny_mlp(seed=rank)  # replicas apart: the first exchange copies rank 0's (sealed) to every rank
    opt = small_demo(model, identical_gradients="allow")
    wire_broadcasts = []
    real = torch.distributed.broadcast

    def broadcast(tensor, src=None, group=None, **kw):
        out = real(tensor, src=src, group=group, **kw)
        wire_broadcasts.append(tensor.clone())
        return out

    torch.distributed.broadcast = broadcast
    loss_and_backward(model, rank, 0)
    with pytest.warns(UserWarning, match="copied rank 0's parameters"):
        opt.step()
    rank0 = _params(tiny_mlp(seed=0))
    return _params(model), opt.resyncs, wire_broadcasts, rank0


def test_a_resync_sends_rank_0s_parameters_sealed(gloo):
    from hf_demo.wire import sealing

    (after0, resyncs0, sent0, rank0), (after1, resyncs1, _, _) = expect_ok(run_ranks(_resync, 2, timeout=120))
    assert resyncs0 == resyncs1 == 1
    assert all(torch.equal(a, b) for a, b in zip(after0, after1))
    assert len(sent0) == 1
    clear = torch.cat([p.reshape(-1).view(torch.uint8) for p in rank0])
    assert sent0[0].numel() == clear.numel() + sealing.TAG_BYTES
    assert clear[:64].numpy().tobytes() not in sent0[0].numpy().tobytes()
