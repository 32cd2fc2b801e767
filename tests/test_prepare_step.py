"""The step's public phases: ``staged = opt.prepare_step()`` runs every phase of a step and applies nothing;
``staged.commit()`` applies it exactly as ``step()`` does, ``staged.discard()`` leaves the parameters, the optimizer
state and the counters bitwise as they were. ``step()`` is the two together."""

import pytest
import torch

from dist_utils import expect_ok, run_ranks
from models import loss_and_backward, small_demo, tiny_mlp

MODES = [{}, {"update_rule": "adam"}, {"sync_every": 2}, {"overlap": True}]
IDS = ["defaults", "adam", "local_steps", "overlap"]


def _state(model, opt):
    """Parameters, every state tensor, counters and traffic totals (bytes and collectives: the seconds differ from
    run to run): bitwise comparable."""
    state = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}
    totals = {k: v for k, v in opt.comm_stats.as_dict().items() if k.startswith("total_") and "second" not in k}
    counters = (opt.steps, opt.skipped_steps, opt.resyncs, opt.unsynced, opt.tier, opt.in_flight)
    return [p.detach().clone() for p in model.parameters()], state, counters, totals


def _equal(a, b, traffic: bool = True) -> bool:
    """``traffic``: the totals too (not where an overlapped exchange arrived in a discarded step: what happened on
    the wire is counted there, as where a step fails)."""
    (pa, sa, ca, ta), (pb, sb, cb, tb) = a, b
    ta, tb = (ta, tb) if traffic else (None, None)
    same_state = sa.keys() == sb.keys() and all(
        sa[i].keys() == sb[i].keys() and all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i]) for i in sa
    )
    return all(torch.equal(x, y) for x, y in zip(pa, pb)) and same_state and ca == cb and ta == tb


def _run(rank: int, kw: dict, discard_at: int | None, steps: int = 4):
    """``steps`` steps on (rank, step)'s batches; at ``discard_at`` a prepared step is discarded first (the state
    checked unchanged by it), then the step is taken again on the same gradients."""
    model = tiny_mlp()
    opt = small_demo(model, **kw)
    unchanged = None
    for step in range(steps):
        loss_and_backward(model, rank, step)
        if step == discard_at:
            before = _state(model, opt)
            staged = opt.prepare_step()
            assert not staged.empty
            staged.discard()
            unchanged = _equal(before, _state(model, opt), traffic=not kw.get("overlap"))
        if step % 2:
            opt.prepare_step().commit()
        else:
            opt.step()
    opt.flush()
    return _state(model, opt), unchanged


@pytest.mark.parametrize("kw", MODES, ids=IDS)
def test_a_discarded_step_changes_nothing_and_commit_is_step(kw):
    """One process: a discarded step leaves everything bitwise as it was, and a run that discards a step and takes
    it again (half of its steps through prepare_step().commit()) ends bitwise where step() alone ends."""
    plain, _ = _run(0, kw, None)
    model = tiny_mlp()
    opt = small_demo(model, **kw)
    for step in range(4):
        loss_and_backward(model, 0, step)
        opt.step()
    opt.flush()
    assert _equal(plain, _state(model, opt))  # prepare_step().commit() is step()
    again, unchanged = _run(0, kw, 2)
    assert unchanged and _equal(plain, again, traffic=not kw.get("overlap"))


def test_a_prepared_step_is_committed_or_discarded_once():
    model = tiny_mlp()
    opt = small_demo(model)
    loss_and_backward(model, 0, 0)
    staged = opt.prepare_step()
    staged.commit()
    assert opt.steps == 1
    with pytest.raises(RuntimeError, match="already committed"):
        staged.commit()
    with pytest.raises(RuntimeError, match="already committed"):
        staged.discard()
    staged = opt.prepare_step()
    staged.discard()
    with pytest.raises(RuntimeError, match="already discarded"):
        staged.commit()
    assert opt.steps == 1


def test_step_is_prepare_and_commit_with_its_closure():
    model = tiny_mlp()
    opt = small_demo(model)
    loss = opt.step(lambda: loss_and_backward(model, 0, 0))
    assert isinstance(loss, float) and opt.steps == 1


def _two_ranks(rank, world, kw, discard_at):
    state, unchanged = _run(rank, kw, discard_at)
    return state, unchanged


@pytest.mark.ranks
@pytest.mark.parametrize("kw", [{}, {"commit_vote": "separate"}], ids=["defaults", "separate"])
def test_every_rank_discarding_a_step_ends_where_the_run_without_it_ends(kw):
    """Two gloo ranks: every rank discards step 2 (its collectives ran, its verdict read or settling later) and
    takes it again; every rank ends bitwise where the run that never discarded it ends, and the discard changed
    nothing on any rank."""
    plain = expect_ok(run_ranks(_two_ranks, 2, kw, None, timeout=120))
    again = expect_ok(run_ranks(_two_ranks, 2, kw, 2, timeout=120))
    for (want, _), (got, unchanged) in zip(plain, again):
        assert unchanged and _equal(want, got)
