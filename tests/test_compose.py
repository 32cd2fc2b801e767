"""Modes that compose now that the step is made of parts: overlap x all_reduce, FSDP2-sharded parameters (HSDP) x
sync_every, and the identity transform. Each with the checks the other modes have: bitwise-identical replicas,
exact resume, and agreement with a slower spelling of the same training."""

import io

import pytest
import torch
import torch.distributed as dist

import hf_demo
from dist_utils import expect_ok, run_ranks
from hf_demo import fsdp
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


def _train(rank, world, kw, steps, resume_at=None):
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


# ---------------------------------------------------------------- sharded (HSDP) x sync_every
SHARDED_LOCAL = {"sync_every": 4, "value_format": "fp32"}
UNEVEN = dict(hidden=5, outputs=3)  # rows 5 and 3: two shards of 3 and 2, 2 and 1 rows


def _shard(model):
    """``model`` sharded by FSDP2 on a (2 replicas x 2 shards) mesh, and the mesh for DeMo."""
    mesh = fsdp.hsdp_mesh(shard=2)
    return fsdp.shard_model(model, mesh, layers=[m for m in model if isinstance(m, torch.nn.Linear)]), mesh


def _hsdp(seed=0):
    model, mesh = _shard(tiny_mlp(seed=seed, **UNEVEN))
    return model, hf_demo.DeMo(model.parameters(), device_mesh=mesh, **{**KW, **SHARDED_LOCAL})


def _hsdp_train(rank, world, steps, save_at=None, where=None):
    """``steps`` steps of HSDP-DeMo with local steps; at ``save_at`` every rank saves the model and DeMo through
    DCP (``hf_demo.fsdp.save_checkpoint``), and a fresh model (another init) and optimizer load it and go on.
    A save refused returns its message."""
    model, opt = _hsdp()
    for step in range(steps):
        if step == save_at:
            try:
                fsdp.save_checkpoint(where, model, opt)
            except hf_demo.DeMoStateError as exc:
                return str(exc)
            model, opt = _hsdp(seed=7)
            fsdp.load_checkpoint(where, model, opt)
        loss_and_backward(model, rank, step)
        opt.step()
    opt.flush()
    return [p.full_tensor() for p in model.parameters()], opt.comm_stats.total_collectives


def _flat_on_shard_rows(rank, world, steps):
    """Flat local-step DeMo between 2 ranks (the nodes) on every parameter cut into the rows each FSDP2 shard
    holds (torch.chunk), each piece given its rows of the node's mean gradient."""
    model = tiny_mlp(**UNEVEN)
    params = list(model.parameters())
    pieces = [[torch.nn.Parameter(c.clone()) for c in p.detach().chunk(2)] for p in params]
    opt = hf_demo.DeMo([c for cs in pieces for c in cs], **{**KW, **SHARDED_LOCAL})
    for step in range(steps):
        node_mean_backward(model, rank, step)
        for p, cs in zip(params, pieces):
            for c, g in zip(cs, p.grad.chunk(2)):
                c.grad = g.clone()
        opt.step()
        with torch.no_grad():
            for p, cs in zip(params, pieces):
                p.copy_(torch.cat([c.detach() for c in cs]))
    return [p.detach().clone() for p in params]


def test_sharded_with_local_steps_equals_flat_local_steps_on_each_shards_rows():
    """2 nodes x 2 shards: FSDP2's node-mean gradient on each shard, local steps on the shard, and DeMo across
    the replicate dimension at each synchronisation: flat local-step DeMo between 2 ranks on each shard's rows,
    fed the node's mean gradient."""
    hsdp = expect_ok(run_ranks(_hsdp_train, 4, 8))
    assert _identical(hsdp)  # synchronised at step 8: all four replicas are identical
    flat = expect_ok(run_ranks(_flat_on_shard_rows, 2, 8))[0]
    for a, b in zip(hsdp[0][0], flat):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    start = [p.detach() for p in tiny_mlp(**UNEVEN).parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(hsdp[0][0], start))


def test_sharded_with_local_steps_resumes_exactly_into_a_local_phase(tmp_path):
    """Saved through DCP at a synchronisation (step 4 of sync_every=4) and resumed on a fresh model: the local
    phase that follows goes on bit for bit. Inside a local phase each rank's own shard is not in a DCP
    checkpoint: the save stops on every rank, naming when to save."""
    straight = expect_ok(run_ranks(_hsdp_train, 4, 10))
    resumed = expect_ok(run_ranks(_hsdp_train, 4, 10, 4, str(tmp_path / "sync")))
    for (a, _), (b, _) in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert _identical(straight)  # 10 steps end inside a phase: flush() averaged every replica's shards
    for error in expect_ok(run_ranks(_hsdp_train, 4, 10, 5, str(tmp_path / "local"))):
        assert "inside a local phase" in error and "multiple of sync_every" in error


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
