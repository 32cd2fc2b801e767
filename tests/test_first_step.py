"""DeMo's own guards at a process's first exchange (they protect custom loops too), on real gloo ranks.

* replicas that start apart (initial weights never synchronised) are copied from rank 0, logged, or with
  ``drift="raise"`` stopped with a message naming the cause;
* local gradients bitwise identical on every rank (DDP still averaging, or every rank reading the same
  batches) stop the step with a message naming both causes, every state untouched.
"""

import warnings

import pytest
import torch

import hf_demo
from dist_utils import RankError, expect_ok, run_ranks
from models import loss_and_backward, tiny_mlp

pytestmark = pytest.mark.ranks


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _started_apart(rank, world, drift):
    model = tiny_mlp(seed=rank)  # another initialisation on every rank
    opt = hf_demo.DeMo(model.parameters(), lr=1e-3, compression_topk=4, compression_chunk=8, drift=drift)
    loss_and_backward(model, rank, 0)
    before = _params(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            opt.step()
        except hf_demo.DeMoSyncError as exc:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and opt.steps == 0
            return "raised", str(exc), unchanged
    for step in (1, 2):
        loss_and_backward(model, rank, step)
        opt.step()
    return _params(model), [str(w.message) for w in caught], opt.resyncs


def test_replicas_that_start_apart_are_copied_from_rank_0_and_logged():
    results = expect_ok(run_ranks(_started_apart, 2, "resync"))
    (p0, warned0, resyncs0), (p1, warned1, resyncs1) = results
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))  # one model on every rank from the first step on
    assert resyncs0 == resyncs1 == 1  # once, at the first exchange; not again
    for warned in (warned0, warned1):
        assert any("first exchange" in w and "never synchronised" in w and "evaluate()" in w for w in warned)


def test_replicas_that_start_apart_raise_with_drift_raise_and_nothing_changes():
    for r in run_ranks(_started_apart, 2, "raise"):
        assert r[0] == "raised" and r[2], r  # every rank raised, parameters and counters untouched
        assert "started apart at optimizer step 0" in r[1] and "never synchronised" in r[1]


def _same_batches(rank, world, identical_gradients):
    model = tiny_mlp(seed=0)
    kw = {"identical_gradients": identical_gradients}
    opt = hf_demo.DeMo(model.parameters(), lr=1e-3, compression_topk=4, compression_chunk=8, **kw)
    loss_and_backward(model, 0, 0)  # every rank reads rank 0's batch
    before = _params(model)
    try:
        opt.step()
    except hf_demo.DeMoSetupError as exc:
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        fresh = all(not v.any() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
        return str(exc), unchanged and opt.steps == 0 and fresh  # momenta still zero
    loss_and_backward(model, rank, 1)  # later steps: no check (it costs one fingerprint, once)
    opt.step()
    return opt.steps


def test_identical_gradients_on_every_rank_stop_the_first_step_naming_both_causes():
    for r in run_ranks(_same_batches, 2, "raise"):
        assert not isinstance(r, RankError), r
        message, unchanged = r
        assert unchanged
        assert "bitwise identical on all 2 ranks at optimizer step 0" in message
        assert "DDP still averages" in message and "same batches" in message
        assert "hf_demo.prepare" in message and "ACCELERATE_USE_CPU=1" in message
        # a custom loop, not Trainer: the fix there is Accelerate's switch, not Trainer's --use_cpu
        assert "Accelerator(cpu=True)" in message and "--use_cpu" not in message


def test_identical_gradients_allowed_when_asked():
    assert expect_ok(run_ranks(_same_batches, 2, "allow")) == [2, 2]


def _zero_gradients(rank, world):
    """All-zero gradients (nothing learned yet, e.g. a frozen head) are not a set-up error."""
    model = tiny_mlp(seed=0)
    opt = hf_demo.DeMo(model.parameters(), lr=1e-3, compression_topk=4, compression_chunk=8)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return opt.steps


def test_all_zero_gradients_pass_the_check():
    assert expect_ok(run_ranks(_zero_gradients, 2)) == [1, 1]


def test_one_process_has_nothing_to_compare():
    model = tiny_mlp(seed=0)
    opt = hf_demo.DeMo(model.parameters(), lr=1e-3, compression_topk=4, compression_chunk=8)
    loss_and_backward(model, 0, 0)
    opt.step()
    assert opt.steps == 1 and opt.resyncs == 0
