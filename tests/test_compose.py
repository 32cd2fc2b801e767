"""Modes that compose now that the step is made of parts: overlap x all_reduce, hierarchy x sync_every, and the
identity transform. Each with the checks the other modes have: bitwise-identical replicas, exact resume, and
agreement with a slower spelling of the same training."""

import io
import os

import pytest
import torch
import torch.distributed as dist

import hf_demo
from dist_utils import expect_ok, run_ranks
from models import loss_and_backward, node_mean_backward, tiny_mlp

pytestmark = pytest.mark.ranks  # real gloo ranks in forked processes

KW = dict(lr=3e-3, compression_topk=4, compression_chunk=8)


def _resume_like_trainer(model, opt, make):
    """A resume as Trainer does it: every rank loads rank 0's model file and its own optimizer state."""
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    weights = [model.state_dict()]
    if dist.is_initialized():
        dist.broadcast_object_list(weights, src=0)
    new_model = tiny_mlp(seed=7)
    new_model.load_state_dict(weights[0])
    new_opt = make(new_model)
    new_opt.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    return new_model, new_opt


def _train(rank, world, kw, steps, resume_at=None, local_world=None):
    if local_world:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
    model = tiny_mlp()

    def make(m):
        return hf_demo.DeMo(m.parameters(), **{**KW, **kw})

    opt = make(model)
    for step in range(steps):
        if step == resume_at:
            model, opt = _resume_like_trainer(model, opt, make)
        loss_and_backward(model, rank, step)
        opt.step()
    opt.flush()
    return [p.detach().clone() for p in model.parameters()], opt.comm_stats.total_collectives


def _identical(results):
    return all(torch.equal(a, b) for params, _ in results[1:] for a, b in zip(results[0][0], params))


# ---------------------------------------------------------------- overlap x all_reduce
OVERLAP_REDUCE = {"overlap": True, "exchange": "all_reduce", "value_format": "fp32"}


@pytest.mark.parametrize("world", [2, 4])
def test_overlap_with_all_reduce_keeps_replicas_identical_and_resumes_exactly(world):
    straight = expect_ok(run_ranks(_train, world, OVERLAP_REDUCE, 12))
    assert _identical(straight)
    resumed = expect_ok(run_ranks(_train, world, OVERLAP_REDUCE, 12, 6))  # the values' all-reduce in flight
    for (a, _), (b, _) in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    start = [p.detach() for p in tiny_mlp().parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(straight[0][0], start))


def test_overlap_with_all_reduce_lands_the_same_update_one_step_late():
    """One step, then flush(): the overlapped all-reduce's update is the immediate one's, bit for bit."""
    late = expect_ok(run_ranks(_train, 2, OVERLAP_REDUCE, 1))
    now = expect_ok(run_ranks(_train, 2, {**OVERLAP_REDUCE, "overlap": False}, 1))
    for (a, _), (b, _) in zip(late, now):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_overlap_with_all_reduce_on_one_rank_is_overlap_with_all_gather():
    """On one rank the union nominates the whole top-k: both exchanges send the same coefficients."""
    reduce = expect_ok(run_ranks(_train, 1, OVERLAP_REDUCE, 8))[0][0]
    gather = expect_ok(run_ranks(_train, 1, {**OVERLAP_REDUCE, "exchange": "all_gather"}, 8))[0][0]
    assert all(torch.equal(a, b) for a, b in zip(reduce, gather))


# ---------------------------------------------------------------- hierarchy x sync_every
NODE_LOCAL = {"hierarchy": "node", "sync_every": 4, "value_format": "fp32"}


def _flat_with_node_gradients(rank, world, steps):
    """Flat DeMo with local steps on 2 ranks, each given the mean gradient of its node's two batches."""
    model = tiny_mlp()
    opt = hf_demo.DeMo(model.parameters(), **{**KW, **NODE_LOCAL, "hierarchy": "flat"})
    for step in range(steps):
        node_mean_backward(model, rank, step)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_hierarchy_with_local_steps_equals_flat_local_steps_on_node_mean_gradients():
    """2 nodes x 2 ranks: the node's mean gradient, local steps on each rank's shard shared inside the node, and
    DeMo between the nodes at each synchronisation: flat local-step DeMo between 2 ranks fed those gradients."""
    node = expect_ok(run_ranks(_train, 4, NODE_LOCAL, 8, None, 2))
    assert _identical(node)  # synchronised at step 7: all four replicas are identical
    flat = expect_ok(run_ranks(_flat_with_node_gradients, 2, 8))[0]
    for a, b in zip(node[0][0], flat):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_hierarchy_with_local_steps_resumes_exactly_inside_a_local_phase():
    """Resumed at step 5, inside a local phase, from rank 0's model file (as Trainer does): each rank's own
    parameters come back from its optimizer state, and training goes on bit for bit."""
    straight = expect_ok(run_ranks(_train, 4, NODE_LOCAL, 10, None, 2))
    resumed = expect_ok(run_ranks(_train, 4, NODE_LOCAL, 10, 5, 2))
    for (a, _), (b, _) in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert _identical(straight)  # 10 steps end inside a phase: flush() averaged every rank's parameters


# ---------------------------------------------------------------- the identity transform
def test_the_identity_transform_sending_every_coefficient_matches_the_dct():
    """With top-k = the whole block, DeMo sends everything: the orthonormal DCT changes nothing but rounding."""
    everything = {"compression_topk": 64, "value_format": "fp32", "update_rule": "raw"}
    dct = expect_ok(run_ranks(_train, 2, everything, 10))
    raw = expect_ok(run_ranks(_train, 2, {**everything, "transform": "identity"}, 10))
    assert _identical(raw)
    for a, b in zip(dct[0][0], raw[0][0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_the_identity_transform_selects_other_coefficients_than_the_dct():
    dct = expect_ok(run_ranks(_train, 2, {}, 6))
    raw = expect_ok(run_ranks(_train, 2, {"transform": "identity"}, 6))
    assert _identical(raw)
    assert any(not torch.equal(a, b) for a, b in zip(dct[0][0], raw[0][0]))
