"""hierarchy="node" on a 2 x 2 gloo world: dense mean inside a node, DeMo between nodes, sharded parameters."""

import os

import pytest
import torch

import hf_demo
from dist_utils import RankError, expect_ok, run_ranks
from models import loss_and_backward, restart, tiny_mlp

pytestmark = pytest.mark.ranks  # real gloo ranks in forked processes

KW = dict(lr=3e-3, compression_topk=4, compression_chunk=8, value_format="fp32", update_rule="adam")
STEPS = 12


def _hierarchical(rank, world, resume_at=None):
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    model = tiny_mlp()
    opt = hf_demo.DeMo(model.parameters(), hierarchy="node", **KW)
    for step in range(STEPS):
        if step == resume_at:
            model, opt = restart(model, opt, lambda m: hf_demo.DeMo(m.parameters(), hierarchy="node", **KW))
        loss_and_backward(model, rank, step)
        opt.step()
    owned = sum(1 for s in opt.state.values() if "momentum" in s)
    return [p.detach().clone() for p in model.parameters()], owned, opt.comm_stats.as_dict()


def _flat_with_node_gradients(rank, world):
    """The same training as flat DeMo on 2 ranks, each given the mean gradient of its node's two batches."""
    model = tiny_mlp()
    opt = hf_demo.DeMo(model.parameters(), **KW)
    for step in range(STEPS):
        grads = []
        for r in (2 * rank, 2 * rank + 1):
            loss_and_backward(model, r, step)
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_node_hierarchy_equals_flat_demo_on_node_mean_gradients():
    results = expect_ok(run_ranks(_hierarchical, 4))
    for params, _, _ in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0][0], params))  # all four replicas identical
    flat = expect_ok(run_ranks(_flat_with_node_gradients, 2))[0]
    for a, b in zip(results[0][0], flat):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    # momentum sharded: each local rank keeps half of the 4 parameters' momenta
    assert [owned for _, owned, _ in results] == [2, 2, 2, 2]


def test_node_hierarchy_resumes_exactly():
    straight = expect_ok(run_ranks(_hierarchical, 4))
    resumed = expect_ok(run_ranks(_hierarchical, 4, 5))
    for (a, _, _), (b, _, _) in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _no_topology(rank, world):
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    model = tiny_mlp()
    opt = hf_demo.DeMo(model.parameters(), hierarchy="node")
    loss_and_backward(model, rank, 0)
    opt.step()


def test_node_hierarchy_without_a_topology_says_so():
    for r in run_ranks(_no_topology, 2):
        assert isinstance(r, RankError) and "LOCAL_WORLD_SIZE" in r.message, r


def test_node_hierarchy_refuses_what_it_does_not_combine_with():
    with pytest.raises(ValueError, match="hierarchy='node'"):
        hf_demo.DeMo([torch.nn.Parameter(torch.zeros(4))], hierarchy="node", sync_every=4)
