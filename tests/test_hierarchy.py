"""hierarchy="node" on a 2 x 2 gloo world: dense mean inside a node, DeMo between nodes, sharded parameters."""

import os

import pytest
import torch

import hf_demo
from dist_utils import RankError, expect_ok, run_ranks
from models import loss_and_backward, node_mean_backward, restart, tiny_mlp

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
        node_mean_backward(model, rank, step)
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
    with pytest.raises(ValueError, match="hierarchy='node' is not combined with comm_budget"):
        hf_demo.DeMo([torch.nn.Parameter(torch.zeros(4))], hierarchy="node", comm_budget=0.2)
    with pytest.raises(ValueError, match="overlap=True needs hierarchy='flat'"):
        hf_demo.DeMo([torch.nn.Parameter(torch.zeros(4))], hierarchy="node", overlap=True)


# ---------------------------------------------------------------- faults and checks
def _apart_then_checked(rank, world):
    """Nodes start from different weights (an un-broadcast model); a drift check, then full_sync_every."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    out = []
    for kw in ({"check_every": 2, "drift": "resync"}, {"full_sync_every": 3, "check_every": 0}):
        model = tiny_mlp(seed=rank // 2)  # the same inside a node, different between nodes
        opt = hf_demo.DeMo(model.parameters(), hierarchy="node", identical_gradients="allow", **KW, **kw)
        for step in range(6):
            loss_and_backward(model, rank, step)
            opt.step()
        out.append(([p.detach().clone() for p in model.parameters()], opt.resyncs))
    return out


def test_node_hierarchy_resync_gives_every_rank_the_same_parameters():
    """A resync copies rank 0's parameters to every rank: before the fix each owner stepped from its own
    un-resynced values and the replicas stayed apart while DeMo warned it had copied them."""
    results = expect_ok(run_ranks(_apart_then_checked, 4))
    for case in range(2):
        params0, _ = results[0][case]
        for params, resyncs in (r[case] for r in results):
            assert resyncs >= 1
            assert all(torch.equal(a, b) for a, b in zip(params0, params))


def _one_bad_gradient(rank, world):
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    model = tiny_mlp()
    opt = hf_demo.DeMo(model.parameters(), hierarchy="node", comm_timeout=20.0, **KW)
    for step in range(4):
        loss_and_backward(model, rank, step)
        if step == 1 and rank == 0:
            next(model.parameters()).grad[0, 0] = float("nan")  # parameter 0: local rank 0's shard
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.skipped_steps, opt.steps


def test_node_hierarchy_skips_a_bad_gradient_on_every_rank():
    """A NaN in one parameter's gradient on one rank: every rank skips that step (each checks every node-mean
    gradient, not only its shard's); before the fix the other local ranks waited in the in-node share."""
    results = expect_ok(run_ranks(_one_bad_gradient, 4, timeout=120))
    assert [(skipped, steps) for _, skipped, steps in results] == [(1, 4)] * 4
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0][0], r[0]))


def _fewer_parameters_than_local_ranks(rank, world, exchange):
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4, bias=False)  # one parameter: local rank 1 owns none
    opt = hf_demo.DeMo(model.parameters(), hierarchy="node", exchange=exchange, lr=1e-2, compression_chunk=8)
    for step in range(3):
        model.zero_grad()
        g = torch.Generator().manual_seed(rank * 10 + step)
        model(torch.randn(4, 8, generator=g)).square().sum().backward()
        opt.step()
    return model.weight.detach().clone()


@pytest.mark.parametrize("exchange", ["all_gather", "all_reduce"])
def test_node_hierarchy_with_a_rank_that_owns_no_parameter(exchange):
    results = expect_ok(run_ranks(_fewer_parameters_than_local_ranks, 4, exchange))
    assert all(torch.equal(results[0], r) for r in results[1:])
    assert not torch.equal(results[0], torch.nn.Linear(8, 4, bias=False).weight)


def _load_neighbours_state(rank, world):
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    model = tiny_mlp()
    opt = hf_demo.DeMo(model.parameters(), hierarchy="node", **KW)
    loss_and_backward(model, rank, 0)
    opt.step()
    states = [None] * world
    torch.distributed.all_gather_object(states, opt.state_dict())
    fresh = hf_demo.DeMo(model.parameters(), hierarchy="node", **KW)
    fresh.load_state_dict(states[rank ^ 1])  # the other local rank of the same node
    loss_and_backward(model, rank, 1)
    fresh.step()


def test_node_hierarchy_refuses_another_ranks_state():
    """The state records the rank in the whole world: two local ranks of a node are told apart (the rank of
    the inter-node group, which the state recorded before, is the same for both)."""
    results = run_ranks(_load_neighbours_state, 4)
    for rank, result in enumerate(results):
        assert isinstance(result, RankError), result
        assert f"rank {rank} loaded the optimizer state saved by rank {rank ^ 1}" in result.message


def _local_world_sizes(rank, world, values):
    """Each rank reads its own LOCAL_WORLD_SIZE (None: unset), then takes a step."""
    if values[rank] is None:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    else:
        os.environ["LOCAL_WORLD_SIZE"] = values[rank]
    model = tiny_mlp()
    opt = hf_demo.DeMo(model.parameters(), hierarchy="node", **KW)
    loss_and_backward(model, rank, 0)
    opt.step()


def test_node_hierarchy_with_different_processes_per_node_says_so_on_every_rank():
    for result in run_ranks(_local_world_sizes, 4, ["1", "2", "2", "1"], timeout=60):  # each divides 4
        assert isinstance(result, RankError), result
        assert "same number of processes on every node" in result.message and "['1', '2', '2', '1']" in result.message


def _one_rank_off(rank, world, fault):
    """World rank 3 (node 1, local rank 1) holds a wrong copy of parameter 0, which local rank 0 owns."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    model = tiny_mlp()
    opt = hf_demo.DeMo(model.parameters(), hierarchy="node", check_every=1, comm_timeout=20.0, **KW)
    for step in range(3):
        loss_and_backward(model, rank, step)
        if step == 1 and rank == 3:
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("nan") if fault == "nan" else 1e-3
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.steps


@pytest.mark.parametrize("fault", ["nan", "drift"])
def test_node_hierarchy_heals_a_wrong_copy_of_a_parameter_another_local_rank_owns(fault):
    """Parameters are checked per shard: a non-owner's wrong copy is overwritten by the owner's share, and every
    rank goes on alike (checking every parameter on every rank made the local ranks of a node decide apart)."""
    results = expect_ok(run_ranks(_one_rank_off, 4, fault, timeout=120))
    assert [steps for _, steps in results] == [3] * 4
    for params, _ in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0][0], params))
    assert all(bool(p.isfinite().all()) for p in results[0][0])


def test_node_hierarchy_with_local_world_size_missing_on_one_rank_says_so_on_every_rank():
    for result in run_ranks(_local_world_sizes, 4, ["2", "2", "2", None], timeout=60):
        assert isinstance(result, RankError), result
        assert "['2', '2', '2', None]" in result.message


def _fp64(rank, world, hierarchy):
    """fp64 parameters on one node of ``world`` ranks, or (flat, one process) with the node's mean gradient."""
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    params = [
        torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i)))
        for i in range(3)
    ]
    opt = hf_demo.DeMo(params, lr=1e-3, weight_decay=0.1, compression_topk=4, compression_chunk=8, hierarchy=hierarchy)
    for step in range(3):
        grads = [
            [
                torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * r + 10 * step + i))
                for i in range(len(params))
            ]
            for r in range(2)
        ]
        for i, p in enumerate(params):
            p.grad = grads[rank][i] if hierarchy == "node" else (grads[0][i] + grads[1][i]) / 2
        opt.step()
    return [p.detach().clone() for p in params]


def test_node_hierarchy_keeps_fp64_parameters_in_fp64():
    """The node's gradient mean and the owners' new values travel in the parameters' dtype where wider than
    fp32 (they were rounded to fp32 at every step, on every rank alike)."""
    node = expect_ok(run_ranks(_fp64, 2, "node"))
    flat = expect_ok(run_ranks(_fp64, 1, "flat"))[0]
    for params in node:
        assert all(torch.equal(a, b) for a, b in zip(params, flat))
    assert any(not torch.equal(p, p.float().double()) for p in flat)  # not representable in fp32


def _freeze_midway(rank, world, hierarchy):
    """Three parameters on one node of ``world`` ranks (or flat, one process, on the node's mean gradient);
    the first is frozen after three steps."""
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    params = [torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(i))) for i in range(3)]
    opt = hf_demo.DeMo(
        params, lr=1e-3, compression_topk=4, compression_chunk=8, hierarchy=hierarchy, update_rule="adam"
    )
    for step in range(6):
        if step == 3:
            params[0].requires_grad_(False)
            params[0].grad = None
        grads = [
            [
                torch.randn(8, 8, generator=torch.Generator().manual_seed(100 * r + 10 * step + i))
                for i in range(len(params))
            ]
            for r in range(2)
        ]
        for i, p in enumerate(params):
            if p.requires_grad:
                p.grad = grads[rank][i] if hierarchy == "node" else (grads[0][i] + grads[1][i]) / 2
        opt.step()
    return [p.detach().clone() for p in params]


def test_node_hierarchy_keeps_each_parameters_owner_when_another_is_frozen():
    """Ownership went by position among the trainable parameters: freezing one handed every later one to
    another local rank, whose momentum and Adam state for it started from zero."""
    node = expect_ok(run_ranks(_freeze_midway, 2, "node"))
    flat = expect_ok(run_ranks(_freeze_midway, 1, "flat"))[0]
    for params in node:
        for a, b in zip(params, flat):
            assert torch.equal(a, b)


def _node_settings_differ(rank, world):
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    params = [torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(i))) for i in range(2)]
    start = [p.detach().clone() for p in params]
    opt = hf_demo.DeMo(params, lr=1e-3 if rank == 0 else 0.5, compression_topk=4, compression_chunk=8, hierarchy="node")
    for p in params:
        p.grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(rank))
    try:
        opt.step()
    except hf_demo.DeMoSyncError as exc:
        return str(exc), opt.steps, all(torch.equal(p, s) for p, s in zip(params, start))
    return None, opt.steps, False


def test_node_hierarchy_compares_the_settings_of_the_ranks_inside_a_node():
    """The headers travel between nodes only, one local rank of each: two ranks of one node with different
    settings each stepped their own shard with their own learning rate, silently."""
    for error, steps, unchanged in expect_ok(run_ranks(_node_settings_differ, 2)):
        assert "different optimizer settings" in error and "local ranks of node 0" in error
        assert steps == 0 and unchanged


def _mixed_hierarchy(rank, world):
    """Rank 0 with hierarchy='node', rank 1 with 'flat'; rank 1 stays alive after its error (a launcher or a
    retry loop keeps it), so nothing but comm_timeout can end rank 0's wait."""
    import time

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = hf_demo.DeMo(
        [p], compression_topk=4, compression_chunk=8, comm_timeout=3, hierarchy="node" if rank == 0 else "flat"
    )
    p.grad = torch.randn(8, 8)
    start, before = time.monotonic(), p.detach().clone()
    try:
        opt.step()
        error = None
    except (hf_demo.DeMoSyncError, ValueError) as exc:
        error = str(exc)
    waited = time.monotonic() - start
    if rank == 1:
        time.sleep(12)
    return error, waited, opt.steps, torch.equal(p, before)


def test_a_rank_with_another_hierarchy_fails_within_comm_timeout_on_every_rank():
    """hierarchy='node' checked LOCAL_WORLD_SIZE on the default group, untimed: a 'flat' peer left it waiting
    for the default group's timeout (30 minutes), far beyond comm_timeout."""
    results = expect_ok(run_ranks(_mixed_hierarchy, 2, collective_timeout=60, timeout=90))
    for error, waited, steps, unchanged in results:
        assert error is not None and waited < 10  # comm_timeout=3, not the default group's 60 s here
        assert steps == 0 and unchanged
    assert "another hierarchy setting" in results[0][0]


def _node_secrets(rank, world):
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    os.environ["HF_DEMO_SECRET"] = "A" if rank == 0 else "B"
    try:
        model = tiny_mlp()
        opt = hf_demo.DeMo(model.parameters(), hierarchy="node", comm_timeout=20, **KW)
        loss_and_backward(model, rank, 0)
        try:
            opt.step()
        except hf_demo.DeMoSyncError as exc:
            return str(exc), opt.steps
        return None, opt.steps
    finally:
        os.environ.pop("HF_DEMO_SECRET", None)


def test_node_hierarchy_stops_ranks_of_one_node_with_different_secrets():
    """Within a node nothing was signed: two local ranks with different HF_DEMO_SECRET trained on."""
    for error, steps in expect_ok(run_ranks(_node_secrets, 2)):
        assert "HMAC-SHA256" in error and "local ranks of node 0" in error and steps == 0
