"""The orthogonal rule's variants: ``orthogonal_momentum`` (Muon's Nesterov momentum of the averaged update before
Newton-Schulz), ``orthogonal_signal`` (each rank's gradient orthogonalised before it enters DeMo's momentum) and
``muon_signal`` (each rank's Muon direction, from a Nesterov momentum of its own gradients, enters it).

Each rule's math on its own (orthogonal_momentum and muon_signal against torch.optim.Muon fed the same
sequence); DeMo with each against the float64 reference on 1 and 2 gloo ranks; bitwise replicas and exact resume
(muon_signal also with all_reduce and overlap); a skipped step leaves the rank's state; the refusals.
"""

import pytest
import torch

import hf_demo
from dist_utils import expect_ok, run_ranks
from hf_demo.optim import update_rules
from hf_demo.optim.param_groups import model_groups, muon_style_groups
from hf_demo.optim.reference import ReferenceDeMo
from models import REFERENCE_SETTINGS, awkward_mlp, demo_as_reference, loss_and_backward, restart, tiny_mlp

RULE = "orthogonal_momentum"
VARIANTS = ("orthogonal_momentum", "orthogonal_signal", "muon_signal")
SETTINGS = REFERENCE_SETTINGS
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


def test_the_signal_rule_lets_orthogonalised_matrices_and_plain_vectors_in():
    rule = update_rules.get("orthogonal_signal")
    g = torch.randn(12, 4, 3, generator=torch.Generator().manual_seed(1))
    expected = update_rules.newton_schulz(g.reshape(12, 12)).reshape(12, 4, 3)
    entered, changed = rule.signal(g, {})
    assert torch.equal(entered, expected) and entered.shape == g.shape and changed == {}
    singular = torch.linalg.svdvals(entered.reshape(12, 12))
    assert singular.min() > 0.6 and singular.max() < 1.25  # orthogonalised; unscaled
    vector = torch.randn(7)
    for name in ("orthogonal_signal", "muon_signal"):  # vectors and missing gradients enter as they are
        assert update_rules.get(name).signal(vector, {}) == (vector, {})
        assert update_rules.get(name).signal(None, {}) == (None, {})
    plain = [name for name in update_rules.RULES if name not in ("orthogonal_signal", "muon_signal")]
    assert all(update_rules.get(name).signal(g, {}) == (g, {}) for name in plain)
    # the momentum phase asks only these rules for their signal: the others let every gradient in as it is
    assert sorted(update_rules.OWN_SIGNAL) == ["muon_signal", "orthogonal_signal"]


def test_muon_signal_lets_in_what_torch_muon_would_orthogonalise(monkeypatch):
    """Fed the same gradients, torch.optim.Muon (Nesterov 0.95) hands its Newton-Schulz the matrices whose
    iterates the rule lets in, step after step; the rule's state is new tensors, the old ones left as they were."""
    from torch.optim import _muon

    seen = []
    monkeypatch.setattr(_muon, "_zeropower_via_newtonschulz", lambda g, c, s, e: seen.append(g.clone()) or g)
    gen = torch.Generator().manual_seed(2)
    theirs = torch.zeros(16, 24, requires_grad=True)
    muon = torch.optim.Muon([theirs], lr=1e-2, weight_decay=0.0)
    rule, state = update_rules.get("muon_signal"), {}
    for _ in range(5):
        grad = torch.randn(16, 24, generator=gen)
        theirs.grad = grad.clone()
        muon.step()
        before = dict(state)
        entered, changed = rule.signal(grad, state)
        assert all(changed["signal_momentum"] is not v for v in before.values())
        state.update(changed)
        torch.testing.assert_close(entered, update_rules.newton_schulz(seen[-1]), atol=1e-6, rtol=0)
    assert set(state) == set(update_rules.SIGNAL_KEYS)


def test_a_skipped_step_leaves_the_ranks_signal_momentum():
    model = tiny_mlp()
    opt = _make(model, "muon_signal")
    loss_and_backward(model, 0, 0)
    opt.step()
    weight = model[0].weight
    kept = opt.state[weight]["signal_momentum"].clone()
    loss_and_backward(model, 0, 1)
    weight.grad[0, 0] = float("nan")
    opt.step()
    assert opt.skipped_steps == 1 and torch.equal(opt.state[weight]["signal_momentum"], kept)
    loss_and_backward(model, 0, 2)
    opt.step()
    assert not torch.equal(opt.state[weight]["signal_momentum"], kept)


def _train_both(rank, world, model, rule):
    fast_model, ref_model = model(), model()
    fast = demo_as_reference(muon_style_groups(fast_model, hidden={"update_rule": rule}, exclude=HEAD))
    ref = ReferenceDeMo(ref_model.parameters(), rule=[rule, "sign", "sign", "sign"], **SETTINGS)
    for step in range(20):
        loss_and_backward(fast_model, rank, step)
        loss_and_backward(ref_model, rank, step)
        fast.step()
        ref.step()
    return [p.detach().clone() for p in fast_model.parameters()], [p.detach().clone() for p in ref_model.parameters()]


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.ranks
@pytest.mark.parametrize("rule", VARIANTS)
@pytest.mark.parametrize("world,model", [(1, awkward_mlp), (2, tiny_mlp)])
def test_matches_the_float64_reference(world, model, rule):
    results = expect_ok(run_ranks(_train_both, world, model, rule))
    for fast, ref in results:
        assert _max_diff(fast, ref) <= 1e-5
    assert _max_diff(results[0][0], [p.detach() for p in model().parameters()]) > 1e-3


def _make(model, rule, **kw):
    groups = muon_style_groups(model, hidden={"update_rule": rule}, exclude=HEAD)
    settings = {"lr": 3e-3, "compression_topk": 4, "compression_chunk": 8, "value_format": "sign", **kw}
    return hf_demo.DeMo(groups, **settings)


def _train(rank, world, steps, resume_at, rule, kw=None):
    kw = kw or {}
    model = tiny_mlp()
    opt = _make(model, rule, **kw)
    for step in range(steps):
        if step == resume_at:  # a fresh process: new model and optimizer, both loaded
            model, opt = restart(model, opt, lambda m: _make(m, rule, **kw))
        loss_and_backward(model, rank, step)
        opt.step()
    opt.flush()
    return [p.detach().clone() for p in model.parameters()]


MODES = {
    "all_gather": {},
    "all_reduce": {"exchange": "all_reduce", "value_format": "bf16"},
    "overlap": {"overlap": True},
}
CASES = [(rule, "all_gather") for rule in VARIANTS] + [(r, m) for r in VARIANTS[1:] for m in ("all_reduce", "overlap")]


@pytest.mark.ranks
@pytest.mark.parametrize("rule,mode", CASES)
def test_replicas_stay_bitwise_identical_and_resume_exactly(rule, mode):
    kw = MODES[mode]
    straight = expect_ok(run_ranks(_train, 2, 12, None, rule, kw))
    assert all(torch.equal(a, b) for a, b in zip(*straight))
    resumed = expect_ok(run_ranks(_train, 2, 12, 6, rule, kw))
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    plain = expect_ok(run_ranks(_train, 2, 12, None, "orthogonal", kw))[0]
    assert _max_diff(straight[0], plain) > 1e-4  # the variant changed the steps


@pytest.mark.parametrize("rule", VARIANTS)
def test_synchronisations_and_the_variants_as_inner_rules_are_refused_with_the_fix(rule):
    with pytest.raises(ValueError, match=f"update_rule='{rule}' with sync_every=4"):
        hf_demo.DeMo(tiny_mlp().parameters(), update_rule=rule, sync_every=4)
    with pytest.raises(ValueError, match=f"inner_rule='{rule}'.*set inner_rule='orthogonal'"):
        hf_demo.DeMo(tiny_mlp().parameters(), inner_rule=rule, sync_every=4)


@pytest.mark.parametrize("rule", VARIANTS)
def test_model_groups_give_the_variants_muon_style_groups(rule):
    model = tiny_mlp()
    groups = model_groups(model, 0.0, rule)
    assert [(g["update_rule"], len(g["params"])) for g in groups] == [(rule, 2), ("sign", 2)]
    assert groups[0]["params"][0] is model[0].weight and groups[0]["params"][1] is model[2].weight
