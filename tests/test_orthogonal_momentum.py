"""update_rule="orthogonal_momentum": Muon's step (Nesterov momentum, then Newton-Schulz) on DeMo's averaged update.

The rule against torch.optim.Muon fed the same updates; DeMo with it against the float64 reference on 1 and 2
gloo ranks; bitwise replicas and exact resume (the momentum is saved with the optimizer); the refusals.
"""

import pytest
import torch

import hf_demo
from dist_utils import expect_ok, run_ranks
from hf_demo.optim import update_rules
from hf_demo.optim.param_groups import model_groups, muon_style_groups
from hf_demo.optim.reference import ReferenceDeMo
from models import awkward_mlp, loss_and_backward, restart, tiny_mlp

RULE = "orthogonal_momentum"
SETTINGS = dict(lr=3e-3, decay=0.9, topk=6, chunk=8, weight_decay=0.01)
HEAD = ("2.",)  # tiny_mlp's output layer: a 2-D parameter marked as not hidden


def test_the_rule_is_torch_muon_on_the_averaged_updates(monkeypatch):
    """Fed the same sequence of updates as gradients, torch.optim.Muon (Nesterov 0.95, AdamW-matched lr, no weight
    decay; its Newton-Schulz set to the rule's fp32 one) takes the same steps."""
    from torch.optim import _muon

    monkeypatch.setattr(_muon, "_zeropower_via_newtonschulz", lambda g, c, s, e: update_rules.newton_schulz(g, s, c))
    g = torch.Generator().manual_seed(0)
    param = torch.randn(24, 40, generator=g)
    theirs = param.clone().requires_grad_(True)
    muon = torch.optim.Muon([theirs], lr=1e-2, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
    rule, state, ours = update_rules.get(RULE), {}, param.clone()
    for _ in range(6):
        update = torch.randn(24, 40, generator=g)
        ours -= 1e-2 * rule.direction(ours, update.clone(), state)
        theirs.grad = update.clone()
        muon.step()
    torch.testing.assert_close(ours, theirs.detach(), atol=1e-6, rtol=0)
    assert (ours - param).abs().max() > 1e-3
    assert torch.equal(update_rules.get(RULE).direction(torch.zeros(5), torch.tensor([1.0, -2, 0, 3, -4]), {}),
                       torch.tensor([1.0, -1, 0, 1, -1]))  # fmt: skip


def _train_both(rank, world, model):
    fast_model, ref_model = model(), model()
    fast = hf_demo.DeMo(
        muon_style_groups(fast_model, hidden={"update_rule": RULE}, exclude=HEAD),
        lr=SETTINGS["lr"],
        compression_decay=SETTINGS["decay"],
        compression_topk=SETTINGS["topk"],
        compression_chunk=SETTINGS["chunk"],
        weight_decay=SETTINGS["weight_decay"],
        value_format="fp32",
    )
    ref = ReferenceDeMo(ref_model.parameters(), rule=[RULE, "sign", "sign", "sign"], **SETTINGS)
    for step in range(20):
        loss_and_backward(fast_model, rank, step)
        loss_and_backward(ref_model, rank, step)
        fast.step()
        ref.step()
    return [p.detach().clone() for p in fast_model.parameters()], [p.detach().clone() for p in ref_model.parameters()]


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.ranks
@pytest.mark.parametrize("world,model", [(1, awkward_mlp), (2, tiny_mlp)])
def test_matches_the_float64_reference(world, model):
    results = expect_ok(run_ranks(_train_both, world, model))
    for fast, ref in results:
        assert _max_diff(fast, ref) <= 1e-5
    assert _max_diff(results[0][0], [p.detach() for p in model().parameters()]) > 1e-3


def _make(model, rule=RULE, **kw):
    groups = muon_style_groups(model, hidden={"update_rule": rule}, exclude=HEAD)
    return hf_demo.DeMo(groups, lr=3e-3, compression_topk=4, compression_chunk=8, value_format="sign", **kw)


def _train(rank, world, steps, resume_at=None, rule=RULE):
    model = tiny_mlp()
    opt = _make(model, rule)
    for step in range(steps):
        if step == resume_at:  # a fresh process: new model and optimizer, both loaded
            model, opt = restart(model, opt, lambda m: _make(m, rule))
        loss_and_backward(model, rank, step)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.ranks
def test_replicas_stay_bitwise_identical_and_resume_exactly():
    straight = expect_ok(run_ranks(_train, 2, 12))
    assert all(torch.equal(a, b) for a, b in zip(*straight))
    resumed = expect_ok(run_ranks(_train, 2, 12, 6))
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    plain = expect_ok(run_ranks(_train, 2, 12, None, "orthogonal"))[0]
    assert _max_diff(straight[0], plain) > 1e-4  # the momentum changed the steps


def test_synchronisations_and_a_second_inner_momentum_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="update_rule='orthogonal_momentum' with sync_every=4"):
        hf_demo.DeMo(tiny_mlp().parameters(), update_rule=RULE, sync_every=4)
    with pytest.raises(ValueError, match="set inner_rule='orthogonal'"):
        hf_demo.DeMo(tiny_mlp().parameters(), inner_rule=RULE, sync_every=4)


def test_model_groups_give_the_rule_muon_style_groups():
    model = tiny_mlp()
    groups = model_groups(model, 0.0, RULE)
    assert [(g["update_rule"], len(g["params"])) for g in groups] == [(RULE, 2), ("sign", 2)]
    assert groups[0]["params"][0] is model[0].weight and groups[0]["params"][1] is model[2].weight
