"""Each update rule declares its facts once (``Rule.facts``); what the package knows of rules derives from them, and
the facts are what a real DeMo keeps and runs: the state entries and their bytes, the Newton-Schulz runs per step,
and the planner's memory model (which once left out ``muon_signal``'s and ``orthogonal_momentum``'s state)."""

from __future__ import annotations

import pytest
import torch

import hf_demo
from hf_demo.ops import methods
from hf_demo.optim import sharded_checkpoint, update_rules
from hf_demo.optim.local_steps import INNER
from hf_demo.settings import DeMoSettings

SHAPES = [(16, 8), (16,), (4, 2, 3)]  # a matrix, a vector and a tensor of 3 dimensions (a matrix to the rules)


def _model() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]


def _steps(params, opt, steps: int = 2) -> None:
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()


def _rule_bytes(opt, keys) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items() if k in keys and v.dim())


def test_the_tables_about_rules_are_derived_and_say_what_they_said():
    assert update_rules.STATE_KEYS == ("exp_avg", "exp_avg_sq", "rule_step")
    assert update_rules.SIGNAL_KEYS == ("signal_momentum",)
    assert update_rules.ORTHOGONAL == ("orthogonal", "orthogonal_momentum", "orthogonal_signal", "muon_signal")
    assert update_rules.NOT_INNER == ("orthogonal_momentum", "orthogonal_signal", "muon_signal")
    assert update_rules.WHOLE_STATE == ("orthogonal_momentum", "orthogonal_signal", "muon_signal")
    assert sharded_checkpoint.SAME_ON_REPLICAS == ("exp_avg", "exp_avg_sq", "anchor")


@pytest.mark.parametrize("rule", update_rules.UPDATE_RULES)
def test_a_rule_keeps_the_state_it_declares_and_the_planner_counts_it(rule):
    facts = update_rules.FACTS[rule]
    params = _model()
    opt = hf_demo.DeMo(params, lr=1e-3, update_rule=rule, compression_chunk=4, compression_topk=2)
    _steps(params, opt)
    declared = {e.key for e in facts.state}
    rule_keys = set(update_rules.STATE_KEYS) | set(update_rules.SIGNAL_KEYS)
    kept = {k for s in opt.state.values() for k in s if k in rule_keys}
    assert kept == declared, (rule, kept, declared)
    measured = _rule_bytes(opt, declared)
    assert measured == facts.state_bytes(SHAPES), (rule, measured)
    settings, raw = DeMoSettings(update_rule=rule), DeMoSettings(update_rule="raw")
    planned = methods._demo_memory(SHAPES, settings, 4) - methods._demo_memory(SHAPES, raw, 4)
    assert planned == measured, (rule, planned, measured)  # muon_signal, orthogonal_momentum: their state counted


@pytest.mark.parametrize("rule", [r for r in update_rules.UPDATE_RULES if update_rules.FACTS[r].may_be_inner])
def test_an_inner_rule_keeps_the_state_it_declares_and_the_planner_counts_it(rule):
    facts = update_rules.FACTS[rule]
    params = _model()
    kw = dict(lr=1e-3, sync_every=2, compression_chunk=4, compression_topk=2)
    opt = hf_demo.DeMo(params, inner_rule=rule, **kw)
    _steps(params, opt, 3)  # a local step, a synchronisation, a local step
    measured = _rule_bytes(opt, {INNER + e.key for e in facts.state})
    assert measured == facts.state_bytes(SHAPES), (rule, measured)
    settings, plain = DeMoSettings(inner_rule=rule, sync_every=2), DeMoSettings(inner_rule="raw", sync_every=2)
    assert methods._demo_memory(SHAPES, settings, 4) - methods._demo_memory(SHAPES, plain, 4) == measured


@pytest.mark.parametrize("rule", update_rules.UPDATE_RULES)
def test_a_rule_runs_the_newton_schulz_iterations_it_declares(rule, monkeypatch):
    calls = []
    real = update_rules.newton_schulz
    monkeypatch.setattr(update_rules, "newton_schulz", lambda *a, **k: calls.append(1) or real(*a, **k))
    params = _model()
    opt = hf_demo.DeMo(params, lr=1e-3, update_rule=rule, compression_chunk=4, compression_topk=2)
    _steps(params, opt, 1)
    matrices = sum(len(s) >= 2 for s in SHAPES)
    assert len(calls) == update_rules.FACTS[rule].ns_runs * matrices, (rule, len(calls))
    assert methods.orthogonalisations(DeMoSettings(update_rule=rule), 1) == update_rules.FACTS[rule].ns_runs
