"""No silent fallback in the setting space: every pair of values of the settings that change the step is either
refused at construction, with its reason, on every rank alike, or trains with identical replicas and runs the
rules it names (a call counter per rule and role), on 2 real gloo ranks.

A rule named away from its default must run: ``update_rule`` wherever a step synchronises every step,
``inner_rule`` wherever local steps are taken (``sync_every > 1``, or the budget policy's last tier, which this
test enters by hand). The sharded side of the space is in tests/test_fsdp.py (orthogonal rules, the budget policy
and the preset on HSDP; the refusals that remain)."""

from __future__ import annotations

import collections
import dataclasses
import itertools

import pytest
import torch

import hf_demo
from dist_utils import expect_ok, run_ranks
from hf_demo import settings as demo_settings
from hf_demo.optim import update_rules
from models import loss_and_backward, tiny_mlp

pytestmark = pytest.mark.ranks

DEFAULTS = demo_settings.DeMoSettings()
FIELDS = {f.name: f for f in dataclasses.fields(demo_settings.DeMoSettings)}
SPACE = {
    "update_rule": list(update_rules.UPDATE_RULES),
    "inner_rule": list(update_rules.UPDATE_RULES),
    "value_format": list(FIELDS["value_format"].metadata["choices"]),
    "exchange": list(FIELDS["exchange"].metadata["choices"]),
    "overlap": [False, True],
    "sync_every": [1, 2],
    "comm_budget": [0.0, 0.2],
    "transform": list(FIELDS["transform"].metadata["choices"]),
    "outer_lr": [1.0, 1.5],  # refused without local steps
}
STEPS = 3  # a synchronised step, the budget policy moved down at step 1, a local step after a sync
KW = dict(lr=3e-3, compression_topk=4, compression_chunk=8)


def pairs() -> list[dict]:
    """Every configuration that sets two of the settings (either may be at its default), each once."""
    seen, out = set(), []
    for a, b in itertools.combinations(SPACE, 2):
        for va, vb in itertools.product(SPACE[a], SPACE[b]):
            config = {k: v for k, v in ((a, va), (b, vb)) if v != getattr(DEFAULTS, k)}
            key = tuple(sorted(config.items()))
            if key not in seen:
                seen.add(key)
                out.append(config)
    return out


def _counting(role: str, get, calls: collections.Counter):
    """``get`` (a rule's name to a rule) whose rules count their ``directions`` calls under (role, rule name)."""

    def rule_of(name):
        rule = get(name)
        directions = rule.directions

        def counted(*args, **kwargs):
            calls[(role, rule.name)] += 1
            return directions(*args, **kwargs)

        rule.directions = counted
        return rule

    return rule_of


def _run(config: dict, calls: collections.Counter):
    """("refused", the message) or ("ran", a fingerprint of the parameters, the rules counted, the tiers taken)."""
    model = tiny_mlp()
    try:
        opt = hf_demo.DeMo(model.parameters(), **KW, **config)
    except ValueError as exc:
        return "refused", str(exc)
    calls.clear()
    local = False
    for step in range(STEPS):
        if config.get("comm_budget") and step == STEPS // 2:
            opt.policy.tier = len(opt.tiers) - 1  # the policy's last tier: local steps (a move down, by hand)
        local |= opt.tiers[opt.policy.tier].sync_every > 1
        loss_and_backward(model, torch.distributed.get_rank(), step)
        opt.step()
    opt.flush()
    fingerprint = torch.stack([p.detach().double().sum() for p in model.parameters()])
    every_step = opt.tiers[0].sync_every == 1
    return "ran", fingerprint, dict(calls), every_step, local


def _all(rank, world, configs):
    calls = collections.Counter()
    from hf_demo.optim import update_rules

    saved = update_rules.get, hf_demo.DeMo.inner_rule
    inner = _counting("inner", saved[0], calls)
    update_rules.get = _counting("update", saved[0], calls)  # the rules a synchronisation applies
    hf_demo.DeMo.inner_rule = staticmethod(lambda group: inner(group["inner_rule"]))  # the rule of local steps
    try:
        return [_run(config, calls) for config in configs]
    finally:
        update_rules.get, hf_demo.DeMo.inner_rule = saved[0], staticmethod(saved[1])


def test_every_pair_of_settings_is_refused_with_its_reason_or_runs_the_rules_it_names():
    configs = pairs()
    results = expect_ok(run_ranks(_all, 2, configs, timeout=900))
    refused = 0
    for config, mine, theirs in zip(configs, *results):
        assert mine[0] == theirs[0], config  # refused on every rank alike, or run on every rank
        if mine[0] == "refused":
            refused += 1
            assert mine[1] == theirs[1], config
            assert any(k in mine[1] for k in config) or "orthogonal" in mine[1], (config, mine[1])
            continue
        _, fingerprint, calls, every_step, local = mine
        assert torch.equal(fingerprint, theirs[1]), config  # identical replicas
        update_rule = config.get("update_rule", DEFAULTS.update_rule)
        inner_rule = config.get("inner_rule", DEFAULTS.inner_rule)
        if every_step:
            assert calls.get(("update", update_rule), 0) > 0, (config, calls)
        else:  # no step synchronises every step: only the default may be left unrun
            assert update_rule == DEFAULTS.update_rule, config
        if local:
            assert calls.get(("inner", inner_rule), 0) > 0, (config, calls)
        else:
            assert inner_rule == DEFAULTS.inner_rule, config
    assert 0 < refused < len(configs)
