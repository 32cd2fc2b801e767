"""Every exchange and update rule on real gloo ranks: replicas bitwise identical, exact resume, traffic."""

import copy
import io
import warnings

import pytest
import torch

import hf_demo
from dist_utils import expect_ok, run_ranks
from hf_demo.exchange.transport import Traffic
from hf_demo.wire import codec
from hf_demo.wire.agreement import VOTE_ROW_BYTES
from models import loss_and_backward, restart, small_demo, tiny_mlp

pytestmark = pytest.mark.ranks  # real gloo ranks in forked processes

MODES = {
    "all_gather+sign": {},
    "all_gather+adam": {"update_rule": "adam"},
    "all_gather+adamw": {"update_rule": "adamw"},
    "all_reduce+sign": {"exchange": "all_reduce"},  # union positions, the default
    "all_reduce+leader": {"exchange": "all_reduce", "reduce_positions": "leader"},
    "all_reduce+adam+fp32": {"exchange": "all_reduce", "update_rule": "adam", "value_format": "fp32"},
    "all_gather+sign values+elias_fano": {"value_format": "sign", "index_coding": "elias_fano"},
    "all_gather+2bit values": {"value_format": "2bit"},
    "all_gather+2bit values+sync_every": {"value_format": "2bit", "sync_every": 2, "inner_rule": "sign"},
    "all_gather+2bit values+overlap": {"value_format": "2bit", "overlap": True},
}


def _train(rank, world, kw, steps, resume_at=None):
    model = tiny_mlp()
    opt = small_demo(model, **kw)
    for step in range(steps):
        if step == resume_at:  # a fresh process would do exactly this: new model and optimizer, load both
            model, opt = restart(model, opt, lambda m: small_demo(m, **kw))
        loss_and_backward(model, rank, step)
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.comm_stats.as_dict()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_replicas_bitwise_identical(mode, world):
    results = expect_ok(run_ranks(_train, world, MODES[mode], 30))
    start = [p.detach() for p in tiny_mlp().parameters()]
    for params, _ in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0][0], params))
    assert any(not torch.equal(a, b) for a, b in zip(results[0][0], start))


@pytest.mark.parametrize("mode", MODES)
def test_exact_resume(mode):
    straight = expect_ok(run_ranks(_train, 2, MODES[mode], 12))
    resumed = expect_ok(run_ranks(_train, 2, MODES[mode], 12, 6))
    for (a, _), (b, _) in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("exchange", ["all_gather", "all_reduce"])
def test_elias_fano_positions_train_bitwise_like_16_bit_ones_in_fewer_bytes(exchange):
    """The index code is lossless: the same parameters on every rank after 12 steps, fewer bytes moved."""
    kw = {"exchange": exchange, "compression_chunk": 16, "compression_topk": 8}
    plain = expect_ok(run_ranks(_train, 2, {**kw, "index_coding": "uint16"}, 12))
    coded = expect_ok(run_ranks(_train, 2, {**kw, "index_coding": "elias_fano"}, 12))
    for (a, _), (b, _) in zip(plain, coded):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    moved = {  # the last step's traffic (all_reduce: only its leader sends the positions)
        name: sum(stats["bytes_sent"] + stats["bytes_received"] for _, stats in run)
        for name, run in (("plain", plain), ("coded", coded))
    }
    assert moved["coded"] < moved["plain"]
    if exchange == "all_gather":  # bf16 top-8 of 16x16 blocks: 16 + 16 bits -> 7 + 16 per coefficient
        assert coded[0][1]["bytes_sent"] < 0.85 * plain[0][1]["bytes_sent"]


@pytest.mark.parametrize("positions,growth", [("union", 1.6), ("leader", 1.5)])
def test_all_reduce_traffic_is_flat_in_the_number_of_ranks(positions, growth):
    kw = {"exchange": "all_reduce", "reduce_positions": positions, "compression_chunk": 16, "compression_topk": 16}
    received = {}
    for world in (2, 4):
        stats = expect_ok(run_ranks(_train, world, kw, 2))
        # the headers are all-gathered in every mode: count the exchange itself
        received[world] = stats[0][1]["bytes_received"] - (world - 1) * (codec.HEADER_BYTES + VOTE_ROW_BYTES)
        # union: the header with the nominations, values, vote; leader: header, its positions, values, vote
        assert stats[0][1]["collectives"] == (3 if positions == "union" else 4)
    gathered = expect_ok(run_ranks(_train, 4, {**kw, "exchange": "all_gather"}, 2))[0][1]["bytes_received"]
    # a ring all-reduce: 2 (W-1)/W of the values each way (1.5x from W=2 to W=4); leader: the positions once;
    # union: (W-1) ranks' k/W nominations each, a few more bits per position as k/W halves
    assert received[4] <= growth * received[2]
    assert received[4] < 0.6 * gathered


def _agreed_positions(rank, world, positions):
    """With all_reduce, every rank's update is the mean over all ranks at the agreed positions: the step's
    leader's top-k (``leader``), or the union of every rank's top-(k // W) (``union``), each counted once."""
    from hf_demo import compression as F
    from hf_demo.compression import decode, plan

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(8, 8))
    k = 6
    opt = hf_demo.DeMo(
        [p],
        lr=1.0,
        compression_topk=k,
        compression_chunk=8,
        exchange="all_reduce",
        reduce_positions=positions,
        value_format="fp32",
        update_rule="raw",
        compression_decay=0.0,
        check_every=0,
    )
    grads = [torch.randn(8, 8, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    p.grad = grads[rank].clone()
    opt.step()
    layout = plan((8, 8), 8, k)
    coeffs = [hf_demo.compression.encode(g, layout) for g in grads]
    if positions == "leader":  # step 0: rank 0 leads
        idx = F.select(coeffs[0].clone(), k)[0]
    else:  # the slow way: a Python set of every rank's top-2
        union = sorted({int(i) for c in coeffs for i in F.select(c.clone(), k // world)[0][0]})
        assert len(union) > k // world  # the ranks nominated different positions
        idx = torch.tensor([union])
    mean = torch.stack([c.gather(1, idx) for c in coeffs]).mean(0)
    expected = -decode(torch.zeros(1, 64).scatter(1, idx, mean), layout)
    return torch.allclose(p.detach(), expected, atol=1e-6), opt.state[p]["momentum"].gather(1, idx).abs().max().item()


def test_all_reduce_uses_the_leaders_positions_and_the_mean_of_all_ranks():
    for ok, residual_at_sent in expect_ok(run_ranks(_agreed_positions, 3, "leader")):
        assert ok
        assert residual_at_sent == 0.0  # exact error feedback: each rank subtracted what it contributed


def test_all_reduce_sums_every_rank_at_the_union_of_their_nominations():
    for ok, residual_at_sent in expect_ok(run_ranks(_agreed_positions, 3, "union")):
        assert ok
        assert residual_at_sent == 0.0


@pytest.mark.parametrize("fmt", ["sign", "2bit"])
def test_all_reduce_refuses_formats_with_their_own_scales(fmt):
    with pytest.raises(ValueError, match=f"all_reduce.*value_format.*{fmt}.*scales.*exchange='all_gather' for {fmt}"):
        hf_demo.DeMo([torch.nn.Parameter(torch.zeros(4))], exchange="all_reduce", value_format=fmt)


def _overlap(rank, world, steps, resume_at=None, flush=True, coding=None, resumed_coding=None):
    model = tiny_mlp()
    kw = {"overlap": True, **({"index_coding": coding} if coding else {})}
    opt = small_demo(model, **kw)
    losses = []
    for step in range(steps):
        if step == resume_at:
            # state_dict() finishes the exchange in flight: it travels in the state
            if resumed_coding:
                kw["index_coding"] = resumed_coding
            model, opt = restart(model, opt, lambda m: small_demo(m, **kw))
        losses.append(loss_and_backward(model, rank, step % 5))
        opt.step()
    if flush:
        opt.flush()
    return [p.detach().clone() for p in model.parameters()], losses, opt.comm_stats.total_collectives


@pytest.mark.parametrize("world", [2, 4])
def test_overlap_keeps_replicas_identical_and_trains(world):
    results = expect_ok(run_ranks(_overlap, world, 40))
    for params, _, _ in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0][0], params))
    losses = results[0][1]
    assert sum(losses[-5:]) < 0.98 * sum(losses[:5])  # it trains (one step late)
    assert results[0][2] == 2 * 40 + 1  # the header now, the payload in the background; flush()'s vote


def test_overlap_resumes_exactly_with_an_exchange_in_flight():
    straight = expect_ok(run_ranks(_overlap, 2, 12))
    resumed = expect_ok(run_ranks(_overlap, 2, 12, 6))
    for (a, _, _), (b, _, _) in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_overlap_resumes_an_exchange_in_flight_coded_with_another_index_code():
    """The exchange in flight is decoded with the code it travelled in (an old checkpoint's: 16-bit)."""
    straight = expect_ok(run_ranks(_overlap, 2, 12, None, True, "uint16"))
    resumed = expect_ok(run_ranks(_overlap, 2, 12, 6, True, "uint16", "elias_fano"))
    for (a, _, _), (b, _, _) in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_overlap_applies_each_update_one_step_late():
    (late, _, _), _ = expect_ok(run_ranks(_overlap, 2, 1, None, False))
    assert all(torch.equal(a, b) for a, b in zip(late, tiny_mlp().parameters()))  # nothing applied yet
    (flushed, _, _), _ = expect_ok(run_ranks(_overlap, 2, 1))
    assert not all(torch.equal(a, b) for a, b in zip(flushed, tiny_mlp().parameters()))


def _staged(freeze_a_at_step_1: bool):
    """Two same-shape layers, overlap on: A alone trains at step 0; at step 1 either B trains instead of A
    (staged fine-tuning) or A stays, with a zero gradient. One process."""
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8, 8))
    opt = hf_demo.DeMo([a, b], lr=0.1, compression_topk=4, compression_chunk=8, overlap=True)
    b.requires_grad_(False)
    a.grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    opt.step()  # A's exchange is in flight
    if freeze_a_at_step_1:
        a.requires_grad_(False)
        a.grad = None
        b.requires_grad_(True)
        b.grad = torch.zeros(8, 8)
    else:
        a.grad = torch.zeros(8, 8)
    b_before = b.detach().clone()
    opt.step()  # applies the exchange in flight
    return a.detach().clone(), b.detach(), b_before, opt


def test_overlap_applies_the_update_in_flight_to_the_parameter_it_was_computed_for():
    """Freezing and unfreezing parameters between steps must not move the update in flight to another one
    (it was matched by position among the trainable parameters: A's update landed on B)."""
    a_staged, b_staged, b_before, opt = _staged(True)
    a_plain, _, _, _ = _staged(False)
    assert torch.equal(a_staged, a_plain)  # A got its own update, now frozen or not
    assert torch.equal(b_staged, b_before)  # B's first update is still in flight
    opt.flush()  # B had a zero gradient and no momentum: its own update moves nothing
    assert torch.equal(b_staged, b_before)


# ---------------------------------------------------------------- overlap: an exchange in flight across a resume
def _in_flight(**kw):
    """A one-process overlap run with an exchange in flight, its saved state, and the update it carries."""
    model = tiny_mlp()
    opt = small_demo(model, overlap=True, value_format="fp32", update_rule="raw", lr=1e-2, **kw)
    for step in range(3):
        loss_and_backward(model, 0, step)
        opt.step()
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
    before = [p.detach().clone() for p in model.parameters()]
    opt.flush()
    carried = [p.detach() - b for p, b in zip(model.parameters(), before)]
    return torch.load(io.BytesIO(saved.getvalue()), weights_only=True), carried


def _resumed(state, **kw):
    model = tiny_mlp(seed=7)
    opt = small_demo(model, value_format="fp32", update_rule="raw", lr=1e-2, **kw)
    model.load_state_dict(state["model"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "resuming with settings that differ from the checkpoint's"
        opt.load_state_dict(state["opt"])
    return model, opt


@pytest.mark.parametrize("coding", ["elias_fano", "uint16"])
@pytest.mark.parametrize("change", [{"compression_topk": 2}, {"compression_topk": 8}, {"compression_chunk": 4}])
def test_overlap_in_flight_exchange_is_decoded_with_the_layout_it_was_sent_with(change, coding):
    """Resuming with another top-k or chunk (allowed, with a warning) must apply the update that was in flight:
    before the fix its rows were decoded with the new layout (an error, or with 16-bit positions a wrong update)."""
    state, carried = _in_flight(index_coding=coding)
    model, opt = _resumed(state, overlap=True, index_coding=coding, **change)
    before = [p.detach().clone() for p in model.parameters()]
    opt.flush()
    for p, b, c in zip(model.parameters(), before, carried):
        assert torch.equal(p.detach() - b, c)


@pytest.mark.parametrize("exchange", ["all_gather", "all_reduce"])
def test_overlap_checkpoint_resumed_without_overlap_applies_the_update_in_flight(exchange):
    """The next step applies the exchange in flight, then its own update, and nothing is left in flight (before:
    an AttributeError at every step with all_reduce; with all_gather the update was held back and a flush()
    many steps later applied it)."""
    state, carried = _in_flight()
    model, opt = _resumed(state, exchange=exchange)
    assert opt.in_flight
    without = copy.deepcopy(state)
    without["opt"]["demo"]["pending"] = None  # the same state with nothing in flight: this step's own update
    own_model, own_opt = _resumed(without, exchange=exchange)
    before = [p.detach().clone() for p in model.parameters()]
    for m, o in ((model, opt), (own_model, own_opt)):
        loss_and_backward(m, 0, 3)
        o.step()
    assert not opt.in_flight
    for p, q, b, c in zip(model.parameters(), own_model.parameters(), before, carried):
        torch.testing.assert_close(p.detach() - b, (q.detach() - b) + c, atol=1e-6, rtol=0)
    before = [p.detach().clone() for p in model.parameters()]
    opt.flush()  # nothing left to apply
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_overlap_refuses_to_checkpoint_an_exchange_that_arrived_corrupted():
    model = tiny_mlp()
    opt = small_demo(model, overlap=True)
    for step in range(2):
        loss_and_backward(model, 0, step)
        opt.step()
    in_flight = opt.pending.in_flight
    rows = in_flight.wait(Traffic()).clone()
    rows[0, 3] ^= 0x01  # one bit flipped on the wire
    in_flight.data = rows
    before = [p.detach().clone() for p in model.parameters()]
    loss_and_backward(model, 0, 2)
    with pytest.raises(hf_demo.DeMoSyncError, match="CRC32.*in flight.*Resume every rank from the last checkpoint"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))  # nothing applied
    with pytest.raises(hf_demo.DeMoSyncError, match="none is written"):
        opt.state_dict()  # a checkpoint that could never be resumed is not written


def test_an_exchange_in_flight_is_not_resumed_where_it_cannot_be_applied():
    """Local steps cannot apply an overlap exchange in flight: refused at load, naming the way out, instead of
    losing the update silently."""
    state, _ = _in_flight()
    model = tiny_mlp(seed=7)
    opt = small_demo(model, value_format="fp32", lr=1e-2, sync_every=2)
    with pytest.raises(hf_demo.DeMoStateError, match="exchange still in flight.*flush"):
        opt.load_state_dict(state["opt"])
    assert opt.steps == 0 and not opt.in_flight and not opt.state  # refused before anything was loaded


def _retried_overlap(rank, world, fail):
    from hf_demo.exchange import transport as comm

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = hf_demo.DeMo([p], lr=1e-2, compression_topk=4, compression_chunk=8, overlap=True)
    armed = [fail]

    def hook(name, n):  # any error after the exchange in flight arrived: here the header collective's
        if armed[0] and name == "header" and opt.steps == 2:
            armed[0] = False
            raise RuntimeError("injected failure")

    comm.register_collective_hook(hook)
    for step in range(4):
        p.grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(10 * rank + step))
        try:
            opt.step()
        except RuntimeError:
            opt.step()  # the state is as it was: retry
    opt.flush()
    stats = opt.comm_stats
    return stats.total_collectives, stats.total_bytes_received, stats.total_bytes_sent, p.detach().clone()


def test_a_retried_overlap_step_keeps_the_exchange_in_flight_counted():
    """The failed step had waited for the exchange in flight; rolling the counters back lost it for good (the
    retry finds it arrived), so the totals, saved with every checkpoint, stayed one payload short."""
    straight = expect_ok(run_ranks(_retried_overlap, 2, False))
    retried = expect_ok(run_ranks(_retried_overlap, 2, True))
    for a, b in zip(straight, retried):
        assert a[:3] == b[:3] and torch.equal(a[3], b[3])


def _planned_and_sent(rank, world, kw):
    """The planner's bytes for one step of these settings, and what the last of 4 steps handed to collectives."""
    from hf_demo.ops.traffic import demo_collectives

    model = tiny_mlp()
    opt = small_demo(model, **kw)
    for step in range(4):
        loss_and_backward(model, rank, step)
        opt.step()
    shapes = [tuple(p.shape) for p in model.parameters()]
    planned = sum(c.nbytes for c in demo_collectives(shapes, opt.settings, world, 1))
    return planned, opt.comm_stats.as_dict()["bytes_sent"]


@pytest.mark.parametrize("fmt", codec.VALUE_FORMATS)
def test_the_planner_counts_every_value_format_byte_for_byte(fmt):
    for planned, sent in expect_ok(run_ranks(_planned_and_sent, 2, {"value_format": fmt})):
        assert planned == sent
