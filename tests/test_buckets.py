"""The batched math (hf_demo.compression): buckets by block shape, and bitwise the per-parameter results."""

import pytest
import torch

from hf_demo import compression
from hf_demo import compression as F
from hf_demo.optim import update_rules

SHAPES = [(16, 16), (16,), (16, 24), (24, 16), (20, 13), (16, 16), (16,), ()]


def _layouts(shapes=SHAPES, chunk=8, k=3):
    return [compression.plan(s, chunk, k) for s in shapes]


def test_parameters_of_the_same_block_shape_share_a_bucket_and_each_shape_is_one_run():
    bucketing = compression.plan_buckets(tuple(_layouts()))
    keys = [(b.b0, b.b1, b.k) for b in bucketing.buckets]
    assert len(keys) == len(set(keys))  # one bucket per block shape (none is over the cap here)
    square = next(b for b in bucketing.buckets if (b.b0, b.b1) == (8, 8))
    assert [run.members for run in square.runs] == [(0, 5), (2,), (3,)]  # (16, 16) twice: one run
    for i, layout in enumerate(bucketing.layouts):
        b, row = bucketing.where[i]
        bucket = bucketing.buckets[b]
        start = next(r.start + r.members.index(i) * layout.nblocks for r in bucket.runs if i in r.members)
        assert start == row


def test_a_bucket_over_the_cap_is_cut_into_buckets_of_whole_parameters(monkeypatch):
    monkeypatch.setattr(compression, "MAX_BUCKET_ELEMENTS", 3 * 64)
    layouts = tuple(_layouts([(16, 16)] * 5 + [(8, 8)]))  # 4 blocks each, then 1; a bucket holds 3 blocks
    compression.plan_buckets.cache_clear()
    try:
        bucketing = compression.plan_buckets(layouts)
    finally:
        compression.plan_buckets.cache_clear()
    # a parameter larger than the cap is a bucket of its own; the next one does not fit beside it
    assert [b.members for b in bucketing.buckets] == [(0,), (1,), (2,), (3,), (4,), (5,)]
    assert [bucketing.where[i] for i in range(6)] == [(i, 0) for i in range(6)]


@pytest.mark.parametrize("transform", ["dct", "identity"])
def test_the_batched_momentum_and_inverse_transform_are_bitwise_the_per_parameter_ones(transform):
    torch.manual_seed(0)
    t = compression.get_transform(transform)
    layouts = _layouts()
    momenta = [torch.randn(lay.nblocks, lay.bsize) for lay in layouts]
    grads = [torch.randn(lay.shape) for lay in layouts]
    grads[2] = None  # a parameter without a gradient counts zero
    factors = [(0.9, 1e-2)] * len(layouts)
    factors[-1] = (0.5, 1.0)  # another group's decay and scale in the bucket
    batched = F.accumulate_many(momenta, grads, layouts, factors, t)
    for m, g, lay, (d, s), out in zip(momenta, grads, layouts, factors, batched):
        assert torch.equal(out, F.accumulate(m, g, lay, d, s, t))
    decoded = F.decode_many(batched, layouts, t)
    for coeffs, lay, out in zip(batched, layouts, decoded):
        assert out.shape == lay.shape and torch.equal(out, t.decode(coeffs, lay))


def test_a_bucketed_list_is_views_of_its_buckets():
    layouts = _layouts()
    bucketing = compression.plan_buckets(tuple(layouts))
    rows = [torch.zeros(b.rows, b.bsize) for b in bucketing.buckets]
    items = compression.Bucketed.of(rows, bucketing)
    assert compression.bucket_rows(items, bucketing) is items.buckets
    items[0].add_(1.0)
    b, row = bucketing.where[0]
    assert rows[b][row : row + layouts[0].nblocks].eq(1).all() and rows[b].sum() == items[0].numel()


@pytest.mark.parametrize("rule", ["sign", "raw", "adam", "adamw", "orthogonal"])
def test_every_rules_batched_directions_are_bitwise_its_per_parameter_ones(rule):
    torch.manual_seed(1)
    params = [torch.randn(s) for s in [(6, 4), (5,), (6, 4)]]
    updates = [torch.randn(p.shape) for p in params]
    states = [{}, {}, {}]
    r = update_rules.get(rule)
    for _ in range(3):  # a fresh state, then states of a few steps
        one = [{k: v.clone() for k, v in s.items()} for s in states]
        expected = [r.direction(p, u.clone(), s) for p, u, s in zip(params, updates, one)]
        found, states = r.directions(params, [u.clone() for u in updates], states)
        assert all(torch.equal(a, b) for a, b in zip(found, expected))
        for s, o in zip(states, one):
            assert s.keys() == o.keys() and all(torch.equal(s[k], o[k]) for k in s)


def test_the_batched_step_is_bitwise_one_step_per_parameter():
    torch.manual_seed(2)
    params = [torch.randn(s) for s in [(6, 4), (5,), (3,)]]
    directions = [torch.randn(p.shape) for p in params]
    lrs, wds = [1e-2, 1e-2, 3e-3], [0.1, 0.0, 0.1]
    one = [p.clone() for p in params]
    for p, d, lr, wd in zip(one, directions, lrs, wds):
        F.apply_step(p, d, lr, wd)
    F.apply_steps(params, directions, lrs, wds)
    assert all(torch.equal(a, b) for a, b in zip(params, one))


def test_the_batched_local_steps_are_bitwise_one_inner_step_per_parameter():
    """local_steps.inner_steps (every parameter at once) against inner_step (one at a time): mixed inner rules,
    learning rates and weight decays, a parameter without a gradient, bf16 parameters rounded stochastically."""
    from hf_demo.optim import local_steps
    from hf_demo.topology.flat import WholeMatrices

    torch.manual_seed(3)
    shapes = [(6, 4), (5,), (6, 4), (4, 6), (3,), (8, 2)]
    params = [torch.randn(s) for s in shapes[:4]] + [torch.randn(s).bfloat16() for s in shapes[4:]]
    rules = [update_rules.get(n) for n in ("orthogonal", "adam", "orthogonal", "sign", "adamw", "adam")]
    lrs, wds = [1e-2, 1e-3, 1e-2, 3e-3, 1e-3, 1e-3], [0.1, 0.0, 0.1, 0.0, 0.01, 0.0]
    states = [{} for _ in params]
    for step in range(3):  # fresh states, then states of a few steps
        grads = [torch.randn(p.shape) for p in params]
        grads[1] = None if step == 1 else grads[1]
        gen_one, gen_all = torch.Generator().manual_seed(step), torch.Generator().manual_seed(step)
        one = [
            local_steps.inner_step(p, g, s, r, lr, wd, gen_one)
            for p, g, s, r, lr, wd in zip(params, grads, states, rules, lrs, wds)
        ]
        found = local_steps.inner_steps(params, grads, states, rules, lrs, wds, gen_all, WholeMatrices())
        for (a, m, rs), (b, n, ss) in zip(found, one):
            assert a.dtype == b.dtype and torch.equal(a, b) and torch.equal(m, n)
            assert rs.keys() == ss.keys() and all(torch.equal(rs[k], ss[k]) for k in rs)
        for p, s, (after, m_in, rule_state) in zip(params, states, found):
            local_steps.commit_inner(p, s, after, m_in, rule_state)
