"""sync_every = H: local steps between synchronisations, DeMo on the pseudo-gradient, held to a slow reference."""

import copy
import io
import warnings

import pytest
import torch
import torch.distributed as dist

import hf_demo
from dist_utils import expect_ok, run_ranks
from hf_demo.optim.reference import dct_basis
from models import batch, loss_and_backward, restart, tiny_mlp

pytestmark = pytest.mark.ranks  # real gloo ranks in forked processes

SETTINGS = dict(lr=3e-3, sync_decay=0.97, compression_topk=6, compression_chunk=8, weight_decay=0.01)
H, STEPS, BETA, BETA2, EPS = 4, 10, 0.9, 0.999, 1e-8


def _grads(model, rank, step):
    x, y = batch(rank, step)
    x = x.to(next(model.parameters()).dtype)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.double().clone() for p in model.parameters()]


def _blocks(t, chunk):
    rows, cols = (1, t.numel()) if t.dim() <= 1 else (t.shape[0], t.numel() // t.shape[0])
    b0, b1 = min(chunk, rows), min(chunk, cols)
    x = t.reshape(rows, cols)
    d0, d1 = dct_basis(b0), dct_basis(b1)
    coords = [(r, c) for r in range(0, rows, b0) for c in range(0, cols, b1)]
    return [(d0 @ x[r : r + b0, c : c + b1] @ d1.T).reshape(-1) for r, c in coords], (rows, cols, b0, b1, coords)


def _unblocks(coeffs, shape, geometry):
    rows, cols, b0, b1, coords = geometry
    d0, d1 = dct_basis(b0), dct_basis(b1)
    x = torch.zeros(rows, cols, dtype=torch.float64)
    for (r, c), v in zip(coords, coeffs):
        x[r : r + b0, c : c + b1] = d0.T @ v.reshape(b0, b1) @ d1
    return x.reshape(shape)


def reference(world, inner_rule, outer_lr=1.0):
    """W ranks simulated in one process, float64, Python loops: inner Signum or Adam steps, then DeMo on
    anchor - param with decayed error feedback and the mean over every rank (unpicked = 0); the anchor moves by
    ``outer_lr`` times that mean."""
    lr, decay, k, chunk, wd = (
        SETTINGS[n] for n in ("lr", "sync_decay", "compression_topk", "compression_chunk", "weight_decay")
    )
    models = [tiny_mlp().double() for _ in range(world)]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    inner = [[torch.zeros_like(p) for p in anchor] for _ in range(world)]
    second = [[torch.zeros_like(p) for p in anchor] for _ in range(world)]  # inner Adam's v
    ef = [[torch.zeros_like(p) for p in anchor] for _ in range(world)]  # parameter domain
    for step in range(STEPS):
        for r, model in enumerate(models):
            grads = _grads(model, r, step)
            with torch.no_grad():
                for p, m, v, g in zip(model.parameters(), inner[r], second[r], grads):
                    m.mul_(BETA).add_(g, alpha=1 - BETA)
                    if inner_rule == "sign":
                        direction = m.sign()
                    else:  # Adam's second moment on the inner momentum, counted from the first step
                        v.mul_(BETA2).add_(m * m, alpha=1 - BETA2)
                        direction = m / ((v / (1 - BETA2 ** (step + 1))).sqrt() + EPS)
                    p.mul_(1 - lr * wd).sub_(lr * direction)
        if (step + 1) % H:
            continue
        for i, a in enumerate(anchor):
            sums = {}
            bsize = _blocks(a, chunk)[0][0].numel()  # the parameter's block size
            kk = min(k, bsize)
            beta = decay ** (100 * kk / bsize)  # per 1% of the block sent: 6 of 64 here, 0.97**9.375 = 0.75
            for r, model in enumerate(models):
                p = list(model.parameters())[i]
                ef[r][i].mul_(beta).add_(a - p.detach())
                blocks, geometry = _blocks(ef[r][i], chunk)
                sent = []
                for b, coeffs in enumerate(blocks):
                    top = coeffs.abs().topk(kk).indices
                    kept = torch.zeros_like(coeffs)
                    kept[top] = coeffs[top]
                    sent.append(kept)
                    for j in top.tolist():
                        sums[(b, j)] = sums.get((b, j), 0.0) + coeffs[j].item()
                ef[r][i].sub_(_unblocks(sent, a.shape, geometry))
            mean = [torch.zeros_like(c) for c in blocks]
            for (b, j), v in sums.items():
                mean[b][j] = v / world  # every rank's share, a rank that did not pick it counting 0
            a.sub_(outer_lr * _unblocks(mean, a.shape, geometry))
            for model in models:
                with torch.no_grad():
                    list(model.parameters())[i].copy_(a)
    return [[p.detach().float() for p in m.parameters()] for m in models]


def _hf_demo(rank, world, inner_rule, outer=None):
    model = tiny_mlp()
    opt = hf_demo.DeMo(
        model.parameters(), value_format="fp32", sync_every=H, inner_rule=inner_rule, **SETTINGS, **(outer or {})
    )
    for step in range(STEPS):
        loss_and_backward(model, rank, step)
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.comm_stats.total_collectives


@pytest.mark.parametrize(
    "world,inner_rule,outer,factor",
    [
        (2, "adam", {}, 1.0),
        (3, "adam", {}, 1.0),
        (2, "sign", {}, 1.0),
        (2, "adam", {"outer_lr": 1.7}, 1.7),  # the anchor moves by 1.7 x the mean change
        (3, "sign", {"outer_lr": 0.8, "outer_lr_scaling": "sqrt_world"}, 0.8 * (3 / 2) ** 0.5),
        (3, "adam", {"outer_lr": 1.3, "outer_lr_scaling": "fourth_root_world"}, 1.3 * (3 / 2) ** 0.25),
    ],
)
def test_sync_every_matches_the_slow_reference(world, inner_rule, outer, factor):
    expected = reference(world, inner_rule, factor)
    results = expect_ok(run_ranks(_hf_demo, world, inner_rule, outer))
    for rank, (params, collectives) in enumerate(results):
        # at each synchronisation only: the header with the payload and the vote; the first, the header alone first
        assert collectives == 2 * (STEPS // H) + 1
        for a, b in zip(params, expected[rank]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # after step 8 (a synchronisation) the replicas were identical; steps 9 and 10 were local again
    assert not all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0]))


def _synchronised_at(rank, world, steps, outer):
    """Every rank's parameters after ``steps`` steps that end on a synchronisation, and the anchor before it."""
    model = tiny_mlp()
    opt = hf_demo.DeMo(model.parameters(), value_format="fp32", sync_every=H, **SETTINGS, **outer)
    for step in range(steps):
        if step == steps - H:
            anchors = [p.detach().clone() for p in model.parameters()]
        loss_and_backward(model, rank, step)
        opt.step()
    return [p.detach().clone() for p in model.parameters()], anchors


def test_the_outer_lr_moves_every_rank_alike_by_its_multiple_of_the_mean_change():
    """2 gloo ranks: after a synchronisation every rank holds the same bits, anchor - outer_lr x the mean change,
    where the mean change is what the same run applies at outer_lr 1 (the same local steps before it); at 2 ranks
    outer_lr_scaling='sqrt_world' is the factor 1, bit for bit the run without it."""
    plain = expect_ok(run_ranks(_synchronised_at, 2, H, {}))
    for outer, factor in (({"outer_lr": 2.5}, 2.5), ({"outer_lr_scaling": "sqrt_world"}, 1.0)):
        scaled = expect_ok(run_ranks(_synchronised_at, 2, H, outer))
        (params0, anchors), (params1, _) = scaled
        assert all(torch.equal(a, b) for a, b in zip(params0, params1))  # identical replicas
        for p, p1, a in zip(params0, plain[0][0], anchors):
            torch.testing.assert_close(p, a - factor * (a - p1), atol=1e-6, rtol=0)
        assert all(torch.equal(p, p1) for p, p1 in zip(params0, plain[0][0])) == (factor == 1.0)
    later = expect_ok(run_ranks(_synchronised_at, 2, 2 * H, {"outer_lr": 2.5}))  # a second synchronisation
    assert all(torch.equal(a, b) for a, b in zip(later[0][0], later[1][0]))


def test_the_outer_lr_is_refused_where_no_synchronisation_applies_a_mean_change():
    for bad in ({"outer_lr": 2.0}, {"outer_lr_scaling": "sqrt_world"}):
        with pytest.raises(ValueError, match="without local steps") as refused:
            hf_demo.DeMo(tiny_mlp().parameters(), **bad)  # sync_every=1
        assert "sync_every > 1" in str(refused.value)
        with pytest.raises(ValueError, match="policy_sync_every=1"):
            hf_demo.DeMo(tiny_mlp().parameters(), comm_budget=0.2, policy_sync_every=1, **bad)
        hf_demo.DeMo(tiny_mlp().parameters(), comm_budget=0.2, **bad)  # the policy's last tier takes local steps
        hf_demo.DeMo(tiny_mlp().parameters(), sync_every=2, **bad)
    for value in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="invalid outer_lr"):
            hf_demo.DeMo(tiny_mlp().parameters(), sync_every=2, outer_lr=value)
    with pytest.raises(
        ValueError, match="invalid outer_lr_scaling='linear'; expected one of none, sqrt_world, fourth_root_world$"
    ):
        hf_demo.DeMo(tiny_mlp().parameters(), sync_every=2, outer_lr_scaling="linear")


def test_the_from_scratch_presets_scale_the_outer_lr_with_the_number_of_ranks():
    from hf_demo.optim.local_steps import outer_factor
    from hf_demo.settings import DeMoSettings

    # from_scratch: the mean change x sqrt(2) (W/2)^(1/4); from_scratch_few_bytes (4 local steps' change): x sqrt(W)
    for preset, expected in (
        ("from_scratch", [2**0.25, 2**0.5, 8**0.25, 2, 32**0.25]),
        ("from_scratch_few_bytes", [1, 2**0.5, 2, 8**0.5, 4]),
    ):
        s = DeMoSettings.resolve(preset)
        factors = [outer_factor(s.outer_lr, s.outer_lr_scaling, w) for w in (1, 2, 4, 8, 16)]
        assert factors == pytest.approx(expected, rel=1e-15, abs=0)
    assert outer_factor(1.5, "none", 8) == 1.5 and outer_factor(1.5, "sqrt_world", 8) == 3.0
    # fourth_root_world: outer_lr x (W/2)^(1/4), 1 at 2 ranks
    assert [outer_factor(1.5, "fourth_root_world", w) for w in (2, 32)] == [1.5, 3.0]


def _sync_resume(rank, world, resume_at):

    model = tiny_mlp()
    opt = hf_demo.DeMo(model.parameters(), sync_every=3, **SETTINGS)
    for step in range(10):
        if step == resume_at:
            model, opt = restart(model, opt, lambda m: hf_demo.DeMo(m.parameters(), sync_every=3, **SETTINGS))
        loss_and_backward(model, rank, step)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_sync_every_resumes_exactly_between_synchronisations():
    straight = expect_ok(run_ranks(_sync_resume, 2, None))
    resumed = expect_ok(run_ranks(_sync_resume, 2, 4))  # mid-interval: anchor and inner momentum matter
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("update_rule", ["sign", "adam"])
def test_the_inner_rule_keeps_its_state_apart_from_the_update_rule(update_rule):
    model = tiny_mlp()
    # the budget policy's last tier takes local steps; its every-step tiers run the update rule
    opt = hf_demo.DeMo(model.parameters(), comm_budget=0.2, update_rule=update_rule, **SETTINGS)  # one process
    opt.policy.tier = len(opt.tiers) - 1
    loss_and_backward(model, 0, 0)
    opt.step()  # a local step: inner Adam (the default inner_rule), whatever the every-step rule
    state = opt.state[model[0].weight]
    assert {"anchor", "inner_momentum", "inner_exp_avg_sq", "inner_rule_step"} <= set(state)
    assert "exp_avg_sq" not in state and int(state["inner_rule_step"]) == 1


_LOCAL_RESUME = dict(lr=3e-3, compression_topk=6, compression_chunk=8, sync_every=4, exchange="all_reduce")


def _resume_from_rank0_weights(rank, world, resume_at):
    model = tiny_mlp()
    opt = hf_demo.DeMo(model.parameters(), **_LOCAL_RESUME)
    for step in range(8):  # steps 3 and 7 synchronise
        if step == resume_at:  # a checkpoint as Trainer writes one: rank 0's model, every rank's optimizer state
            weights = [model.state_dict() if rank == 0 else None]
            dist.broadcast_object_list(weights, 0)
            buf = io.BytesIO()
            torch.save(opt.state_dict(), buf)
            model = tiny_mlp(seed=7)
            model.load_state_dict(weights[0])  # every rank resumes from rank 0's weights
            opt = hf_demo.DeMo(model.parameters(), **_LOCAL_RESUME)
            opt.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
        loss_and_backward(model, rank, step)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_resume_inside_a_local_phase_from_rank_0s_model_weights_is_exact():
    """Trainer saves the model from rank 0 only. Inside a local phase each rank's parameters are its own, so the
    optimizer state carries them (they used to be lost: every rank went on from rank 0's, silently)."""
    straight = expect_ok(run_ranks(_resume_from_rank0_weights, 2, None))
    resumed = expect_ok(run_ranks(_resume_from_rank0_weights, 2, 2))  # after two local steps
    assert all(torch.equal(a, b) for a, b in zip(straight[0], straight[1]))  # synchronised at the end
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _end_after(rank, world, steps, settings=None):
    model = tiny_mlp()
    opt = hf_demo.DeMo(model.parameters(), **{**_LOCAL_RESUME, **(settings or {})})
    for step in range(steps):
        loss_and_backward(model, rank, step)
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    sent = opt.comm_stats.total_bytes_sent
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.flush()  # what DeMoTrainer.train() calls after the last step
    after = [p.detach().clone() for p in model.parameters()]
    anchors_moved = all(torch.equal(opt.state[p]["anchor"], p) for p in model.parameters())
    return [str(w.message) for w in caught], before, after, anchors_moved, opt.comm_stats.total_bytes_sent - sent


def test_ending_inside_a_local_phase_averages_the_ranks_or_warns():
    results = expect_ok(run_ranks(_end_after, 2, 6))  # step 7 would synchronise; end_local_phase='average'
    (m0, before0, after0, moved0, sent0), (m1, before1, after1, moved1, sent1) = results
    assert m0 == m1 == [] and moved0 and moved1
    assert not all(torch.equal(a, b) for a, b in zip(before0, before1))  # apart after 2 local steps
    for a, b, x, y in zip(after0, after1, before0, before1):  # the mean of both ranks, on both
        assert torch.equal(a, b) and torch.equal(a, ((x.float() + y.float()) / 2).to(a.dtype))
    n = sum(p.numel() for p in after0)
    assert sent0 == sent1 == 4 * n  # one dense fp32 all-reduce (a ring at W=2 sends the buffer once)
    for messages, before, after, _, sent in expect_ok(run_ranks(_end_after, 2, 6, {"end_local_phase": "warn"})):
        assert len(messages) == 1 and "inside a local phase" in messages[0] and "multiple of 4" in messages[0]
        assert all(torch.equal(a, b) for a, b in zip(before, after)) and sent == 0  # left apart
    for messages, before, after, _, sent in expect_ok(run_ranks(_end_after, 2, 8)):  # ended on a sync
        assert messages == [] and sent == 0 and all(torch.equal(a, b) for a, b in zip(before, after))


def _end_after_a_skipped_sync(rank, world, dtype):
    model = tiny_mlp().to(dtype)
    opt = hf_demo.DeMo(model.parameters(), **_LOCAL_RESUME)
    for step in range(4):  # step 3 would synchronise; rank 1's NaN gradient makes every rank skip it
        loss_and_backward(model, rank, step)
        if step == 3 and rank == 1:
            next(model.parameters()).grad.view(-1)[0] = float("nan")
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    opt.flush()
    return opt.steps, opt.skipped_steps, before, [p.detach().clone() for p in model.parameters()]


def test_a_skipped_synchronisation_still_ends_the_phase_at_the_end_exactly_in_the_parameters_dtype():
    for dtype in (torch.float32, torch.float64):
        (steps, skipped, before0, after0), (_, _, before1, after1) = expect_ok(
            run_ranks(_end_after_a_skipped_sync, 2, dtype)
        )
        assert steps == 4 and skipped == 1
        assert not all(torch.equal(a, b) for a, b in zip(before0, before1))  # still apart after the skip
        for a, b, x, y in zip(after0, after1, before0, before1):
            assert a.dtype == dtype and torch.equal(a, b) and torch.equal(a, (x + y) / 2)


def _resume_mid_phase_without_local_steps(rank, world, fix):
    model = tiny_mlp()
    opt = hf_demo.DeMo(model.parameters(), sync_every=3, **SETTINGS)
    for step in range(4):  # steps 0-2 end on a synchronisation, step 3 opens a new phase
        loss_and_backward(model, rank, step)
        opt.step()
    if fix:  # the fix the error names: end the phase with the old settings, then resume with the new ones
        opt.flush()
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
    state = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
    new_model = tiny_mlp(seed=7)
    new_model.load_state_dict(state["model"])
    new_opt = hf_demo.DeMo(new_model.parameters(), **SETTINGS)  # sync_every=1
    try:
        new_opt.load_state_dict(state["opt"])
    except hf_demo.DeMoStateError as exc:
        return str(exc), new_opt.steps, len(new_opt.state), None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no resync: the ranks agree
        loss_and_backward(new_model, rank, 4)
        new_opt.step()
    return None, new_opt.steps, new_opt.resyncs, [p.detach().clone() for p in new_model.parameters()]


def test_a_state_saved_inside_a_local_phase_is_refused_by_a_run_without_local_steps():
    """Resumed with sync_every=1, the first exchange found the ranks apart and copied rank 0's parameters over
    the others' (their local steps lost, the warning blaming unsynchronised initial weights)."""
    for error, steps, state_entries, _ in expect_ok(run_ranks(_resume_mid_phase_without_local_steps, 2, False)):
        assert "saved inside a local phase (optimizer step 4" in error and "sync_every=3" in error
        assert "optimizer.flush()" in error
        assert (steps, state_entries) == (0, 0)  # refused before anything was loaded
    fixed = expect_ok(run_ranks(_resume_mid_phase_without_local_steps, 2, True))
    for error, steps, resyncs, params in fixed:
        assert error is None and steps == 5 and resyncs == 0
        assert all(torch.equal(a, b) for a, b in zip(params, fixed[0][3]))


def _averaged_view(rank, world):
    model = tiny_mlp()
    opt = hf_demo.DeMo(model.parameters(), **_LOCAL_RESUME)
    for step in range(6):  # two local steps into a phase
        loss_and_backward(model, rank, step)
        opt.step()
    own = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    with opt.averaged_parameters():
        inside = [p.detach().clone() for p in model.parameters()]
    after = [p.detach().clone() for p in model.parameters()]
    unchanged_state = all(
        torch.equal(a, b) if torch.is_tensor(a) else a == b
        for x, y in zip(state["state"].values(), opt.state_dict()["state"].values())
        for a, b in zip(x.values(), y.values())
    )
    opt.end_local_phase()
    ended = [p.detach().clone() for p in model.parameters()]
    with opt.averaged_parameters():  # outside a local phase: nothing, no communication
        sent = opt.comm_stats.total_bytes_sent
    return own, inside, after, ended, unchanged_state, opt.comm_stats.total_bytes_sent - sent


def test_averaged_parameters_shows_the_ranks_mean_and_restores_each_ranks_own():
    """What an evaluation or a checkpoint's model file inside a local phase sees (DeMoTrainer): the mean that
    ending the phase would give, with this rank's own parameters back afterwards, bit for bit."""
    (own0, inside0, after0, ended0, kept0, sent0), (own1, inside1, after1, ended1, kept1, sent1) = expect_ok(
        run_ranks(_averaged_view, 2)
    )
    assert not all(torch.equal(a, b) for a, b in zip(own0, own1))  # apart inside the phase
    for a, b, c, d in zip(inside0, inside1, ended0, ended1):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(c, d)
    assert all(torch.equal(a, b) for a, b in zip(own0, after0)) and all(torch.equal(a, b) for a, b in zip(own1, after1))
    assert kept0 and kept1 and sent0 == sent1 == 0
