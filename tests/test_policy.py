"""The communication-budget policy: its rule, identical decisions on every rank, exact resume in a lower tier."""

import pytest
import torch

import hf_demo
from dist_utils import expect_ok, run_ranks
from hf_demo.optim.policy import BudgetPolicy, tiers
from hf_demo.wire import codec
from models import loss_and_backward, restart, tiny_mlp

BYTES = [100.0, 50.0, 20.0, 2.5]


def _run(policy, observations):
    out = []
    for exchange_ms, elapsed_ms in observations:
        policy = policy.decide(exchange_ms, elapsed_ms, BYTES)
        out.append(policy.tier)
    return out, policy


def test_moves_down_after_patience_steps_over_budget_and_not_before():
    tiers_seen, policy = _run(BudgetPolicy(0.2, 2), [(300, 1000)] * 7)
    assert tiers_seen == [0, 1, 1, 2, 2, 3, 3]  # and it stops at the last tier
    assert policy.moves_down == 3


def test_a_link_that_drops_far_is_answered_in_one_move():
    # 70% of a 1 s step in the exchange: tier 1 (half the bytes) predicted 350/650, tier 2 140/440, tier 3
    # 17.5/317.5 = 6% <= 20%: straight to tier 3 after the patience, one move
    tiers_seen, policy = _run(BudgetPolicy(0.2, 2), [(700, 1000)] * 3)
    assert tiers_seen == [0, 3, 3] and policy.moves_down == 1
    # 40% of the step: tier 1 predicted 200/800 = 25%, tier 2 80/680 = 12%: tier 2
    assert _run(BudgetPolicy(0.2, 2), [(400, 1000)] * 2)[0] == [0, 2]


def test_a_step_far_over_budget_moves_without_waiting_for_the_patience():
    # 90% of the step waiting, budget 20%: more than SEVERE (4) x over, so the first such step moves
    tiers_seen, policy = _run(BudgetPolicy(0.2, 3), [(900, 1000)] * 3)
    assert tiers_seen == [3, 3, 3] and policy.moves_down == 1
    # just under 4x (79%) waits for the patience of 3
    assert _run(BudgetPolicy(0.2, 3), [(790, 1000)] * 3)[0] == [0, 0, 3]
    # a single severe step (a link that dropped for a moment) moves down; the way back up keeps its patience
    seen, _ = _run(BudgetPolicy(0.2, 2), [(900, 1000)] + [(5, 1000)] * 8)
    assert seen[0] == 3 and seen[1:3] == [3, 2] and seen[-1] == 0


def test_moves_up_only_when_the_upper_tier_is_predicted_well_under_budget():
    policy = BudgetPolicy(0.2, 2, tier=2)
    # 10% now; tier 1 would send 2.5x the bytes: 25% > 70% of 20%: stay
    assert _run(policy, [(100, 1000)] * 4)[0] == [2, 2, 2, 2]
    # 4% now: tier 1 predicted 10% < 14%: up after two steps; tier 0 predicted 8% ... up again
    assert _run(policy, [(40, 1000)] * 4)[0] == [2, 1, 1, 0]


def test_figures_are_scaled_from_the_tier_they_were_measured_in():
    # in tier 2, 100 ms of a 1 s step measured in tier 0 (the headers after a move report the last exchange):
    # tier 2 sends 20/100 of those bytes, so it is at 20/920 = 2% and tier 1 is predicted 50/950 = 5% < 14%
    assert BudgetPolicy(0.2, 1, tier=2).decide(100, 1000, BYTES, measured_in=0).tier == 1
    # read as tier 2's own exchange, the same figures are 10% now and 25% predicted for tier 1: stay
    assert BudgetPolicy(0.2, 1, tier=2).decide(100, 1000, BYTES).tier == 2
    # 90% measured in tier 0 is 18% once in tier 3 (2.5/100 of the bytes): under a budget of 20%, no move
    assert BudgetPolicy(0.2, 1, tier=3).decide(900, 1000, BYTES, measured_in=0).moves_down == 0


def test_an_oscillating_link_does_not_make_it_flap():
    seen, _ = _run(BudgetPolicy(0.2, 3), [(300, 1000), (10, 1000)] * 10)
    assert set(seen) == {0}


def test_tiers_are_ordered_by_bytes():
    def described(*args):
        return [(t.value_format, t.topk_divisor, t.sync_every) for t in tiers(*args)]

    # every step down to top-k/4, then synchronising every policy_sync_every steps with fewer coefficients
    assert described("bf16", "all_gather", 1, 8) == [
        ("bf16", 1, 1),
        ("sign", 1, 1),
        ("sign", 2, 1),
        ("sign", 4, 1),
        ("sign", 1, 8),
        ("sign", 2, 8),
        ("sign", 4, 8),
        ("sign", 8, 8),
    ]
    assert described("fp32", "all_reduce", 1, 8) == [
        ("fp32", 1, 1),
        ("fp32", 2, 1),
        ("fp32", 4, 1),
        ("fp32", 1, 8),
        ("fp32", 2, 8),
        ("fp32", 4, 8),
        ("fp32", 8, 8),
    ]
    # no tier twice (sign values already, sync_every already 8, no local-step tier at all), and a local-step
    # tier only where it sends less than the last one before it (sync_every 4: top-k/4 every 4 ~ top-k/16)
    assert described("sign", "all_gather", 1, 8)[0:2] == [("sign", 1, 1), ("sign", 2, 1)]
    assert described("2bit", "all_gather", 1, 8)[0:3] == [("2bit", 1, 1), ("sign", 1, 1), ("sign", 2, 1)]
    assert described("bf16", "all_gather", 4, 8)[-3:] == [("sign", 4, 4), ("sign", 4, 8), ("sign", 8, 8)]
    assert described("bf16", "all_gather", 8, 8)[-2:] == [("sign", 4, 8), ("sign", 8, 8)]
    assert described("bf16", "all_gather", 1, 1)[-1] == ("sign", 8, 1)


def test_tiers_send_fewer_bytes_one_after_the_other():
    model = torch.nn.Sequential(torch.nn.Linear(256, 688), torch.nn.Linear(688, 256), torch.nn.Embedding(256, 256))
    for kw in ({}, {"sync_every": 2}, {"sync_every": 4}, {"exchange": "all_reduce"}, {"value_format": "sign"}):
        opt = hf_demo.DeMo(model.parameters(), comm_budget=0.15, **kw)
        view = opt.step_view()  # (DeMo.plan and DeMo.bytes_by_tier were the view's, moved there)
        sent = view.bytes_by_tier(view.plan(opt.tiers[0])[0])
        assert all(a > b for a, b in zip(sent, sent[1:])), (kw, sent)


def test_a_resume_finds_its_tier_by_what_it_is_not_by_its_number():
    params = [torch.nn.Parameter(torch.randn(16, 16))]
    saved = hf_demo.DeMo(params, lr=1e-3, comm_budget=0.2, policy_sync_every=8)
    saved.policy.tier = 7  # sign top-k/8, synchronising every 8 steps
    state = saved.state_dict()
    assert state["demo"]["policy"]["tier_spec"] == ["sign", 8, 8]
    # resumed with sign values configured: its ladder has no bf16 tier, the same tier is number 6
    signed = hf_demo.DeMo(params, lr=1e-3, comm_budget=0.2, policy_sync_every=8, value_format="sign")
    with pytest.warns(UserWarning, match="value_format"):
        signed.load_state_dict(state)
    assert signed.tier == 6 and signed.tiers[6] == saved.tiers[7]
    # a ladder without that tier: the nearest number, with a warning that says so
    other = hf_demo.DeMo(params, lr=1e-3, comm_budget=0.2, policy_sync_every=16)
    with pytest.warns(UserWarning, match=r"tier \(\['sign', 8, 8\]\) is not among this run's tiers"):
        other.load_state_dict(state)
    assert other.tier == 7
    # a pre-release checkpoint without tier_spec: refused, naming what it lacks
    del state["demo"]["policy"]["tier_spec"]
    older = hf_demo.DeMo(params, lr=1e-3, comm_budget=0.2, policy_sync_every=8)
    with pytest.raises(hf_demo.DeMoStateError, match="without tier_spec"):
        older.load_state_dict(state)


def _fake_timings(slow_rank, slow_until):
    """Each rank reports its own figures: one rank's link is slow for a while (injected, deterministic)."""

    def timings(self, started):  # DeMo.header_timings
        rank = torch.distributed.get_rank()
        slow = rank == slow_rank and self.steps < slow_until
        return {"exchange_ms": 500 if slow else 1, "elapsed_ms": 1000 + 37 * rank}

    return timings


def _train(rank, timings, steps, resume_at, record, **kw):
    """``steps`` steps of the tiny MLP under injected timings (resumed at ``resume_at``): what ``record``
    said of the optimizer after each step, the parameters, the optimizer."""
    hf_demo.DeMo.header_timings = timings
    kw = dict(lr=3e-3, compression_topk=8, compression_chunk=8, **kw)
    model = tiny_mlp()
    opt = hf_demo.DeMo(model.parameters(), **kw)
    seen = []
    for step in range(steps):
        if step == resume_at:
            model, opt = restart(model, opt, lambda m: hf_demo.DeMo(m.parameters(), **kw))
        loss_and_backward(model, rank, step)
        opt.step()
        seen.append(record(opt))
    return seen, [p.detach().clone() for p in model.parameters()], opt


def _policy_run(rank, world, steps, resume_at=None):
    timings = _fake_timings(slow_rank=1, slow_until=10)
    seen, params, opt = _train(
        rank, timings, steps, resume_at, lambda opt: opt.tier, comm_budget=0.2, policy_patience=2
    )
    return seen, params, opt.comm_stats.total_bytes_sent


@pytest.mark.ranks
def test_every_rank_takes_the_same_decisions_and_the_replicas_stay_identical():
    (tiers0, params0, _), (tiers1, params1, _) = expect_ok(run_ranks(_policy_run, 2, 30))
    assert tiers0 == tiers1
    assert max(tiers0) == 4 and tiers0[-1] == 0  # down to synchronising every 8 steps, then back up
    # down in two moves (tiers predicted over budget are skipped), back up one tier at a time
    top = tiers0.index(4)
    assert set(tiers0[:top]) == {0, 3}
    assert tiers0[top:] == sorted(tiers0[top:], reverse=True) and set(tiers0[top:]) == set(range(5))
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))


@pytest.mark.ranks
@pytest.mark.parametrize("resume_at", [2, 12])  # in tier 3; in tier 4 between two synchronisations
def test_resume_in_a_lower_tier_is_exact(resume_at):
    straight = expect_ok(run_ranks(_policy_run, 2, 30))
    resumed = expect_ok(run_ranks(_policy_run, 2, 30, resume_at))
    assert straight[0][0][resume_at] == {2: 3, 12: 4}[resume_at]
    for (tiers_a, params_a, bytes_a), (tiers_b, params_b, bytes_b) in zip(straight, resumed):
        # the resumed process's first exchange is not steady: it settles at once, in a header row more
        assert tiers_a == tiers_b and bytes_b == bytes_a + codec.HEADER_BYTES
        assert all(torch.equal(x, y) for x, y in zip(params_a, params_b))


def _one_slow_exchange(slow_step, exchange_ms):
    """Rank 1 reports one slow exchange, in the headers of ``slow_step``; every other figure is fast."""

    def timings(self, started):  # DeMo.header_timings
        slow = torch.distributed.get_rank() == 1 and self.steps == slow_step
        return {"exchange_ms": exchange_ms if slow else 1, "elapsed_ms": 1000}

    return timings


def _move_run(rank, world, steps, slow_step, exchange_ms, budget, patience, resume_at=None):
    def record(opt):  # the tier after the step, and the step's own collectives and bytes
        return opt.tier, opt.comm_stats.collectives, opt.comm_stats.bytes_sent

    timings = _one_slow_exchange(slow_step, exchange_ms)
    seen, params, _ = _train(rank, timings, steps, resume_at, record, comm_budget=budget, policy_patience=patience)
    return seen, params


@pytest.mark.ranks
def test_a_move_down_applies_to_the_step_whose_headers_called_for_it():
    # 40% of the step waiting at step 3, budget 20%, patience 1: tier 1 (sign values, 0.37x the bytes) is
    # the first predicted to fit. Step 3 goes again in tier 1: two headers and tier 1's payload, no tier-0 one
    (seen0, params0), (seen1, params1) = expect_ok(run_ranks(_move_run, 2, 6, 3, 400, 0.2, 1))
    assert seen0 == seen1 and all(torch.equal(a, b) for a, b in zip(params0, params1))
    tiers_seen, collectives, sent = zip(*seen0)
    assert tiers_seen == (0, 0, 0, 1, 0, 0)  # back up at step 4 (1 ms), from step 5 on
    # header with payload (its verdict rides in the next step); the first step's header alone first, then the
    # payload and the settling row. Step 3: its tier-0 try (header with payload, then its settling row: a policy's
    # move is not steady, and the verdict comes before the policy acts), then tier 1, whose payload's size is not
    # agreed yet (header alone, payload, settling row). Step 4 moves back up: header with payload, settling row
    assert collectives == (3, 1, 1, 5, 2, 1)
    header = codec.HEADER_BYTES
    tier1 = sent[4] // 2 - header  # tier 1's payload
    assert sent[3] == 2 * sent[2] + 2 * header + tier1  # the tier-0 try and its row, then tier 1's first exchange
    assert tier1 < 0.5 * (sent[2] - header) and sent[5] == sent[2]


@pytest.mark.ranks
@pytest.mark.parametrize("resume_at", [None, 5, 6])
def test_a_collapsed_link_costs_the_one_exchange_that_revealed_it(resume_at):
    # 90% waiting (severe, budget 20%) reported at step 5: straight to synchronising every 8 steps. Step 5 is
    # then a local step: its first header was its only collective; the next one is step 7's synchronisation.
    # 16 steps end on a synchronisation (step 15): the replicas are identical again
    straight = expect_ok(run_ranks(_move_run, 2, 16, 5, 900, 0.2, 3))
    (seen0, params0), (seen1, params1) = straight
    assert seen0 == seen1 and all(torch.equal(a, b) for a, b in zip(params0, params1))
    tiers_seen, collectives, sent = zip(*seen0)
    assert tiers_seen[4:6] == (0, 7)
    # step 5: its tier-0 try (header with payload, then its settling row: a move is not steady) is its only
    # exchange; step 7's synchronisation sends its header alone first (tier 7's payload size is not agreed yet),
    # then the payload and the vote (local steps keep a vote of their own)
    assert collectives[4:8] == (1, 2, 0, 3) and sent[5] == 2 * sent[4]
    if resume_at is not None:  # resumed before or after the step that moved: the same run (a resumed process's
        # first exchange sends its header alone, and settles at once: at step 5 a row of another size)
        resumed = expect_ok(run_ranks(_move_run, 2, 16, 5, 900, 0.2, 3, resume_at))
        for (seen_a, params_a), (seen_b, params_b) in zip(straight, resumed):
            assert [t for t, _, _ in seen_a] == [t for t, _, _ in seen_b]
            assert [b for i, (_, _, b) in enumerate(seen_a) if i != 5] == [
                b for i, (_, _, b) in enumerate(seen_b) if i != 5
            ]
            assert all(torch.equal(x, y) for x, y in zip(params_a, params_b))


def test_a_budget_tier_resumed_without_a_budget_returns_to_the_settings_after_its_synchronisation():
    """A checkpoint saved in a policy's local-step tier, resumed with comm_budget=0: the warning said the
    requested settings are used, and the optimizer stayed in the saved tier for good."""

    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(16, 16)

    opt = hf_demo.DeMo(model().parameters(), preset="many_nodes", comm_budget=0.15)
    opt.policy.tier = 4  # the policy had moved to top-k/2 every 8 steps
    state = opt.state_dict()
    m = model()
    resumed = hf_demo.DeMo(m.parameters(), preset="many_nodes")  # comm_budget=0: fixed settings
    with pytest.warns(UserWarning, match="comm_budget"):
        resumed.load_state_dict(state)
    for _ in range(8):  # the local phase in flight ends with its synchronisation (step 8)
        m.weight.grad, m.bias.grad = torch.randn(16, 16), torch.randn(16)
        resumed.step()
    assert resumed.tier == 0
    m.weight.grad, m.bias.grad = torch.randn(16, 16), torch.randn(16)
    resumed.step()
    assert "anchor" not in resumed.state[m.weight]  # every-step DeMo again
