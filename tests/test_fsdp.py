"""DeMo on FSDP2-sharded parameters (hf_demo.topology.sharded, hf_demo.fsdp) on real gloo ranks.

HSDP on 4 processes as a (2 replicas x 2 shards) mesh: FSDP2 reduce-scatters each gradient inside a shard group,
DeMo exchanges each shard across the replicate group. The slow spelling it must equal: flat DeMo between the
2 "nodes", each fed its node's mean gradient, on the parameters cut into the rows each shard holds.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import hf_demo
from dist_utils import corrupt_indices, expect_ok, run_ranks
from hf_demo import fsdp
from hf_demo.ops.monitor import INSIDE_NODE
from hf_demo.topology.dtensor import local
from hf_demo.wire import agreement, codec, uniform

pytestmark = pytest.mark.ranks  # real gloo ranks in forked processes

KW = dict(lr=3e-3, compression_topk=4, compression_chunk=8, value_format="fp32", update_rule="adam")
STEPS = 8


def awkward_model(seed: int = 0) -> torch.nn.Sequential:
    """Shapes two shards split unevenly (5 rows: 3 and 2) and one that leaves a shard empty (1 row: 1 and 0)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(13, 20), torch.nn.Tanh(), torch.nn.Linear(20, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)
    )


LAYERS = (0, 2, 4)


def data(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 13, generator=g), torch.randn(16, 1, generator=g)


def backward(model, rank: int, step: int) -> None:
    x, y = data(rank, step)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()


def sharded(rank, shard=2, seed=0, factory=False, **kw):
    """This rank's model, sharded by FSDP2 on a (world/shard, shard) mesh, and DeMo over its replicate group
    (``factory``: built by ``hf_demo.create_optimizer(model, device_mesh=...)``)."""
    mesh = fsdp.hsdp_mesh(shard=shard)
    model = awkward_model(seed)
    fsdp.shard_model(model, mesh, layers=[model[i] for i in LAYERS])
    hsdp = shard < dist.get_world_size()
    if factory:
        return model, hf_demo.create_optimizer(model, device_mesh=mesh if hsdp else None, **{**KW, **kw})
    return model, hf_demo.DeMo(model.parameters(), device_mesh=mesh if hsdp else None, **{**KW, **kw})


def full(model) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _hsdp(rank, world, shard=2, kw=None, steps=STEPS):
    model, opt = sharded(rank, shard, **(kw or {}))
    for step in range(steps):
        backward(model, rank, step)
        opt.step()
    return full(model), opt.steps, {k: v for k, v in opt.comm_stats.as_dict().items() if k.startswith("total")}


def _flat_on_shard_pieces(rank, world, shards=2, ranks_per_node=2, steps=STEPS, kw=None):
    """Flat DeMo between ``world`` nodes, on every parameter cut into the rows FSDP2's shards hold (torch.chunk),
    each fed the mean gradient of its node's ``ranks_per_node`` batches."""
    model = awkward_model()
    params = list(model.parameters())
    pieces = [[torch.nn.Parameter(c.clone()) for c in p.detach().chunk(shards, dim=0)] for p in params]
    opt = hf_demo.DeMo([c for cs in pieces for c in cs], **{**KW, **(kw or {})})
    for step in range(steps):
        grads = []
        for r in range(rank * ranks_per_node, (rank + 1) * ranks_per_node):
            backward(model, r, step)
            grads.append([p.grad.clone() for p in params])
        for i, cs in enumerate(pieces):
            mean = sum(g[i] for g in grads) / ranks_per_node
            for c, gc in zip(cs, mean.chunk(shards, dim=0)):
                c.grad = gc.clone()
        opt.step()
        with torch.no_grad():
            for p, cs in zip(params, pieces):
                p.copy_(torch.cat([c.detach() for c in cs]))
    return [p.detach().clone() for p in params]


MODES = {
    "adam_fp32": {},
    "overlap": {"overlap": True},
    "all_reduce_bf16": {"exchange": "all_reduce", "value_format": "bf16", "update_rule": "sign"},
    "sign_values": {"value_format": "sign", "update_rule": "adamw"},
}


@pytest.mark.parametrize("mode", MODES)
def test_hsdp_equals_flat_demo_between_nodes_on_each_shards_rows(mode):
    results = expect_ok(run_ranks(_hsdp, 4, 2, MODES[mode]))
    for params, steps, _ in results[1:]:
        assert steps == STEPS
        assert all(torch.equal(a, b) for a, b in zip(results[0][0], params))  # every replica, every shard
    flat = expect_ok(run_ranks(_flat_on_shard_pieces, 2, 2, 2, STEPS, MODES[mode]))[0]
    for a, b in zip(results[0][0], flat):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_the_factory_takes_the_device_mesh_and_builds_the_same_optimizer():
    by_class = expect_ok(run_ranks(_hsdp, 4, 2, None, 3))
    by_factory = expect_ok(run_ranks(_hsdp, 4, 2, {"factory": True}, 3))
    for (params, steps, stats), (params_f, steps_f, stats_f) in zip(by_class, by_factory):
        assert steps == steps_f == 3 and stats["total_bytes_sent"] == stats_f["total_bytes_sent"] > 0
        assert all(torch.equal(a, b) for a, b in zip(params, params_f))


def test_pure_fsdp_is_a_local_optimizer_over_shards():
    """One dimension over both ranks: no replica, nothing to exchange; each shard steps on both ranks' mean."""
    results = expect_ok(run_ranks(_hsdp, 2, 2))
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0]))
    flat = expect_ok(run_ranks(_flat_on_shard_pieces, 1, 2, 2))[0]
    for a, b in zip(results[0][0], flat):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- what crosses which link
def _recorded(rank, world, pieces=False):
    """Every collective of 4 steps: torch.distributed's calls (op, the group's ranks, dtype, bytes), and DeMo's
    own by name (its collective hook), per rank."""
    from hf_demo.exchange import transport

    calls, named = [], []
    ops = ("all_reduce", "reduce_scatter_single", "all_gather_single", "broadcast")
    real = {n: getattr(dist, n) for n in ops}
    real_demo = transport._all_gather  # DeMo's all-gather, bound at import

    def recorder(op, fn):
        def call(*args, group=None, **kwargs):
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(world))
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            t = max(tensors, key=torch.Tensor.numel)
            calls.append((op, ranks, str(t.dtype), t.numel() * t.element_size()))
            return fn(*args, group=group, **kwargs)

        return call

    for op in ops:
        setattr(dist, op, recorder(op, real[op]))
    transport._all_gather = recorder("all_gather_single", real_demo)
    handle = transport.register_collective_hook(lambda name, nbytes: named.append((name, nbytes)))
    try:
        if pieces:
            # HSDP keeps a vote of its own (a refusal stops the shard group): compare with flat DeMo voting alike
            _flat_on_shard_pieces(rank, world, steps=4, kw={"commit_vote": "separate"})
        else:
            _hsdp(rank, world, steps=4)
    finally:
        handle.remove()
        transport._all_gather = real_demo
        for op, fn in real.items():
            setattr(dist, op, fn)
    return calls, named


def test_hsdp_sends_nothing_dense_across_the_replicate_dimension_and_demo_bytes_stay_ddps():
    results = expect_ok(run_ranks(_recorded, 4))
    for rank, (calls, _) in enumerate(results):
        replicas = (rank % 2, rank % 2 + 2)
        across = [c for c in calls if c[1] == replicas]
        assert across and not [c for c in across if c[0] != "all_gather_single" or c[2] != "torch.uint8"], across
        assert any(c[0] == "reduce_scatter_single" and c[1] == (rank - rank % 2, rank - rank % 2 + 1) for c in calls)
    # DeMo's bytes across the replicate dimension: each node's two shards together send what flat DeMo sends for
    # the same rows, plus the second rank's header and tagged vote per step, its sealing word at the first exchange
    # (hf_demo.wire.uniform) and its payload's byte alignment (<= 8 B)
    flat = expect_ok(run_ranks(_recorded, 2, True))
    for node in range(2):
        hsdp = sum(n for r in (2 * node, 2 * node + 1) for name, n in results[r][1] if name not in INSIDE_NODE)
        ddp = sum(n for _, n in flat[node][1])
        second = 4 * (codec.HEADER_BYTES + agreement.VOTE_ROW_BYTES) + uniform.WORD_BYTES
        assert 0 <= hsdp - ddp - second <= 4 * 8, (hsdp, ddp)


# ---------------------------------------------------------------- the guards, on sharded parameters
def _state(model, opt):
    return full(model), (opt.steps, opt.skipped_steps, opt.resyncs)


def _one_bad_gradient(rank, world):
    """A NaN in rank 1's gradient shard (replica 0, shard 1) at step 1: every shard of every replica skips."""
    from hf_demo.topology.dtensor import local

    model, opt = sharded(rank, comm_timeout=20.0)
    for step in range(4):
        backward(model, rank, step)
        if step == 1 and rank == 1:
            local(next(model.parameters()).grad)[0, 0] = float("nan")
        opt.step()
    return _state(model, opt)


def test_a_nan_in_one_shard_skips_the_step_for_every_shard_and_replica():
    results = expect_ok(run_ranks(_one_bad_gradient, 4))
    assert [counters for _, counters in results] == [(4, 1, 0)] * 4
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0][0], r[0]))


def _one_replica_drifts(rank, world, drift):
    """Rank 3 (replica 1, shard 1) holds a wrong copy of its shard of parameter 0 from step 2 on."""
    from hf_demo.topology.dtensor import local

    model, opt = sharded(rank, check_every=1, drift=drift, comm_timeout=20.0)
    error = None
    for step in range(4):
        backward(model, rank, step)
        if step == 2 and rank == 3:
            with torch.no_grad():
                local(next(model.parameters()))[0, 0] += 1.0
        try:
            opt.step()
        except hf_demo.DeMoSyncError as exc:
            error = str(exc)
            break
    return _state(model, opt), error


def test_a_drifted_shard_is_resynced_or_stops_every_rank():
    results = expect_ok(run_ranks(_one_replica_drifts, 4, "resync"))
    for (_, (steps, _, resyncs)), error in results:
        assert error is None and steps == 4 and resyncs == 1
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0][0][0], r[0][0]))
    for (_, (steps, _, _)), error in expect_ok(run_ranks(_one_replica_drifts, 4, "raise")):
        assert error is not None and "drifted apart at optimizer step 2" in error and steps == 2


def _corrupted_payload(rank, world):
    """Rank 3's index code sends out-of-range positions at step 1: every rank refuses, none commits; the retry
    (with the fault gone) commits everywhere."""
    from hf_demo.wire import codec

    model, opt = sharded(rank, comm_timeout=20.0)
    backward(model, rank, 0)
    opt.step()
    backward(model, rank, 1)
    before = _state(model, opt)
    coding = codec.index_coding(opt.settings.index_coding)
    real = coding.pack_rows
    if rank == 3:
        corrupt_indices(coding)
    try:
        opt.step()
        error = None
    except hf_demo.DeMoPayloadError as exc:
        error = str(exc)
    unchanged = _state(model, opt)
    coding.pack_rows = real
    opt.step()
    return error, before, unchanged, _state(model, opt)


def test_a_corrupted_payload_for_one_shard_stops_the_step_on_every_rank_and_the_retry_commits():
    results = expect_ok(run_ranks(_corrupted_payload, 4))
    for error, before, unchanged, after in results:
        assert error is not None and "refused" in error
        assert all(torch.equal(a, b) for a, b in zip(before[0], unchanged[0])) and before[1] == unchanged[1]
        assert after[1][0] == 2
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0][3][0], r[3][0]))


def _disagreeing(rank, world, fault):
    """Rank 1 (the other shard of replica 0) has another lr, or another HF_DEMO_SECRET; rank 2 is frozen."""
    if fault == "secret":
        os.environ["HF_DEMO_SECRET"] = "B" if rank == 1 else "A"
    model, opt = sharded(rank, comm_timeout=3.0, lr=KW["lr"] * (2 if fault == "lr" and rank == 1 else 1))
    backward(model, rank, 0)
    if fault == "freeze" and rank == 2:
        time.sleep(10)
    start = time.monotonic()
    try:
        opt.step()
        error = None
    except hf_demo.DeMoSyncError as exc:
        error = str(exc)
    finally:
        os.environ.pop("HF_DEMO_SECRET", None)
    return error, time.monotonic() - start, opt.steps


@pytest.mark.parametrize("fault", ["lr", "secret", "freeze"])
def test_disagreeing_or_frozen_shards_stop_every_rank_within_comm_timeout(fault):
    results = run_ranks(_disagreeing, 4, fault, timeout=90)
    for rank, result in enumerate(results):
        if fault == "freeze" and rank == 2:
            continue  # it wakes up to peers that gave up
        error, waited, steps = expect_ok([result])[0]
        assert error is not None and steps == 0 and waited < 9, (rank, result)
    first = expect_ok([results[0]])[0][0]
    if fault == "lr":
        assert "different optimizer settings" in first and "param_groups[0].lr: rank 0 0.003, rank 1 0.006" in first
    if fault == "secret":
        assert "HMAC-SHA256" in first and "the header from rank 1" in first  # refused through the vote


# ---------------------------------------------------------------- what is refused, and why
def _layouts_refused(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    native = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    for name, build in {
        "native_hsdp": lambda m: fully_shard(m, mesh=native),
        "mixed": lambda m: fully_shard(m[0], mesh=mesh),
        "orthogonal": lambda m: fully_shard(m, mesh=mesh),  # gathers each matrix whole: steps
        "orthogonal_signal": lambda m: fully_shard(m, mesh=mesh),
        "orthogonal_momentum": lambda m: fully_shard(m, mesh=mesh),
    }.items():
        model = awkward_model()
        build(model)
        kw = {"update_rule": name} if "orthogonal" in name else {}
        opt = hf_demo.DeMo(model.parameters(), **kw)
        backward(model, rank, 0)
        try:
            opt.step()
        except ValueError as exc:
            out[name] = str(exc)
    return out


def _one_node_mesh(rank, world):
    import warnings

    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # torchrun --nproc_per_node <world> on one machine
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        default = fsdp.hsdp_mesh()
        explicit = fsdp.hsdp_mesh(shard=2)
        pure = fsdp.hsdp_mesh(shard=world)
    return tuple(default.shape), tuple(explicit.shape), tuple(pure.shape), [str(w.message) for w in caught]


def test_hsdp_mesh_on_one_node_says_there_is_no_replica_and_how_to_get_one():
    """torchrun --nproc_per_node 4 on one machine built a 1 x 4 mesh without a word (issue 44, item 5)."""
    results = expect_ok(run_ranks(_one_node_mesh, 4))
    assert all(r[:3] == ((1, 4), (2, 2), (1, 4)) for r in results)
    (message,) = results[0][3]
    assert "no replicate dimension" in message and "hsdp_mesh(shard=2) for 2 x 2" in message, message
    assert all(r[3] == [] for r in results[1:])  # rank 0 says it, once


def test_layouts_demo_cannot_step_are_refused_naming_the_fix():
    for errors in expect_ok(run_ranks(_layouts_refused, 2)):
        assert "FSDP2's own HSDP" in errors["native_hsdp"] and "mesh['shard']" in errors["native_hsdp"]
        assert "plain one(s)" in errors["mixed"] and "fully_shard the root module" in errors["mixed"]
        assert "orthogonal" not in errors  # pure FSDP over 2 shards: each matrix orthogonalised whole
        assert (
            "'orthogonal_signal' is not combined" in errors["orthogonal_signal"]
            and "each rank's own gradient" in (errors["orthogonal_signal"])
        )
        assert "'orthogonal_momentum' is not combined" in errors["orthogonal_momentum"]


@pytest.mark.parametrize("value", ["node", "flat"])
def test_the_retired_node_hierarchy_names_its_replacement(value):
    """``hierarchy`` is no setting any more: passed where settings are taken, it names what replaces it."""
    from hf_demo.optim.factory import optimizer_cls_and_kwargs, parse_optim_args
    from hf_demo.settings import DeMoSettings

    params = [torch.nn.Parameter(torch.zeros(4))]
    ways = [
        lambda: hf_demo.DeMo(params, hierarchy=value),
        lambda: hf_demo.create_optimizer(params, hierarchy=value),
        lambda: optimizer_cls_and_kwargs(hierarchy=value),
        lambda: parse_optim_args(f"hierarchy={value}"),
        lambda: DeMoSettings.resolve(hierarchy=value),
    ]
    for way in ways:
        with pytest.raises(ValueError, match="hierarchy setting is retired.*HSDP on PyTorch's FSDP2.*shard_model"):
            way()
    assert "hierarchy" not in DeMoSettings.names()


# ---------------------------------------------------------------- orthogonal rules on sharded matrices
def _zeroed_raw_updates(opt, pieces) -> list[torch.Tensor]:
    """Each parameter's averaged update of this step, read off flat DeMo with the raw rule at lr 1 on zeroed pieces
    (``piece = 0 - 1 * update``): DeMo's momentum and what it sends depend on the gradients, not on the values."""
    with torch.no_grad():
        for cs in pieces:
            for c in cs:
                c.zero_()
    opt.step()
    return [-torch.cat([c.detach() for c in cs]).double() for cs in pieces]


def _flat_orthogonal_reference(rank, world, steps=STEPS):
    """The slow spelling of HSDP with update_rule="orthogonal": flat DeMo between the 2 nodes on each shard's rows
    (fed the node's mean gradient) gives each whole matrix's averaged update, which is orthogonalised whole in
    float64 (``reference.orthogonalised``: Muon's step; vectors take their sign) and applied at lr 3e-3."""
    from hf_demo.optim.reference import orthogonalised

    model = awkward_model()
    params = list(model.parameters())
    pieces = [[torch.nn.Parameter(c.clone()) for c in p.detach().chunk(2, dim=0)] for p in params]
    opt = hf_demo.DeMo([c for cs in pieces for c in cs], **{**KW, "update_rule": "raw", "lr": 1.0})
    for step in range(steps):
        grads = []
        for r in (2 * rank, 2 * rank + 1):
            backward(model, r, step)
            grads.append([p.grad.clone() for p in params])
        for i, cs in enumerate(pieces):
            for c, gc in zip(cs, ((grads[0][i] + grads[1][i]) / 2).chunk(2, dim=0)):
                c.grad = gc.clone()
        with torch.no_grad():
            for p, update in zip(params, _zeroed_raw_updates(opt, pieces)):
                p.copy_((p.double() - KW["lr"] * orthogonalised(update)).float())
    return [p.detach().clone() for p in params]


def test_hsdp_orthogonalises_each_sharded_matrix_whole_as_the_flat_reference_does():
    """Uneven (3 and 2 rows) and empty (1 and 0) shards: each matrix's rows go to its owner in the shard group,
    which orthogonalises it whole and sends each rank its rows; nothing dense crosses the replicate dimension."""
    results = expect_ok(run_ranks(_hsdp, 4, 2, {"update_rule": "orthogonal"}))
    for params, steps, _ in results:
        assert steps == STEPS
        assert all(torch.equal(a, b) for a, b in zip(results[0][0], params))  # every replica, every shard
    flat = expect_ok(run_ranks(_flat_orthogonal_reference, 2))[0]
    for a, b in zip(results[0][0], flat):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


def _schemed(rank, world, scheme, shard, kw, steps=4):
    """HSDP (or pure FSDP at ``shard=world``) with whole matrices made by ``scheme``; the shapes of this rank's
    Newton-Schulz calls."""
    from hf_demo.optim import update_rules
    from hf_demo.topology.sharded import ShardedTopology

    ShardedTopology.matrix_scheme = scheme
    calls, real = [], update_rules.newton_schulz
    update_rules.newton_schulz = lambda m, *a, **k: (calls.append(tuple(m.shape)), real(m, *a, **k))[1]
    params, _, stats = _hsdp(rank, world, shard, kw, steps)
    return params, calls, stats


@pytest.mark.parametrize(
    "shard, kw",
    [
        (2, {"update_rule": "orthogonal"}),
        (2, {"sync_every": 2, "inner_rule": "orthogonal", "update_rule": "sign"}),
        (4, {"update_rule": "orthogonal"}),
    ],
    ids=["hsdp_orthogonal", "hsdp_local_muon_steps", "fsdp4_orthogonal"],
)
def test_each_sharded_matrix_is_orthogonalised_once_by_its_owner_bitwise_as_on_every_rank(shard, kw):
    """The owner scheme: each matrix's Newton-Schulz runs on its owner alone (the 1-row matrix's owner holds no rows
    of it; over 4 shards one rank owns nothing), and every rank's parameters are bitwise those of the scheme where
    every rank orthogonalises every matrix it holds rows of; replicas identical."""
    from collections import Counter

    from hf_demo.topology import owners
    from hf_demo.topology.dtensor import shard_rows

    steps = 4
    by_owner = expect_ok(run_ranks(_schemed, 4, "owner", shard, kw, steps))
    everywhere = expect_ok(run_ranks(_schemed, 4, "everywhere", shard, kw, steps))
    shapes = [tuple(p.shape) for p in awkward_model().parameters() if p.dim() >= 2]
    owner_of = owners.owners(shapes, shard)
    for rank, ((mine, calls, _), (theirs, calls_everywhere, _)) in enumerate(zip(by_owner, everywhere)):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
        assert all(torch.equal(a, b) for a, b in zip(by_owner[0][0], mine))  # every replica and shard alike
        owned = [s for s, o in zip(shapes, owner_of) if o == rank % shard]
        assert Counter(calls) == Counter({s: steps for s in owned}), (rank, calls)
        held = [s for s in shapes if shard_rows(s[0], shard)[rank % shard]]
        assert Counter(calls_everywhere) == Counter({s: steps for s in held}), (rank, calls_everywhere)
    assert sum(len(calls) for _, calls, _ in by_owner[:shard]) == steps * len(shapes)  # once per shard group


def _first_local_step(rank, world):
    model, opt = sharded(rank, sync_every=4, inner_rule="orthogonal", update_rule="sign")
    start = full(model)
    backward(model, rank, 0)
    opt.step()  # a local step: inner momentum 0.1 * the node's mean gradient, orthogonalised whole
    return start, full(model), opt.comm_stats.as_dict()


def test_a_local_muon_step_on_hsdp_orthogonalises_the_whole_matrix_of_the_nodes_mean_gradient():
    from hf_demo.optim.reference import orthogonalised

    results = expect_ok(run_ranks(_first_local_step, 4))
    model = awkward_model()
    for node in (0, 1):
        grads = []
        for r in (2 * node, 2 * node + 1):
            backward(model, r, 0)
            grads.append([p.grad.double() for p in model.parameters()])
        for shard in (0, 1):
            start, after, _ = results[2 * node + shard]
            for p0, p1, g0, g1 in zip(start, after, *grads):
                expected = p0.double() - KW["lr"] * orthogonalised(0.1 * (g0 + g1) / 2)
                torch.testing.assert_close(p1.double(), expected, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- the budget policy: one tier for the whole model
def _slow_shard_timings(self, started):  # DeMo.header_timings: global rank 1 (shard 1 of replica 0) is slow a while
    slow = dist.get_rank() == 1 and self.steps < 10
    return {"exchange_ms": 500 if slow else 1, "elapsed_ms": 1000 + 37 * dist.get_rank()}


def _hsdp_policy(rank, world, steps, where=None, resume_at=None):
    """``steps`` steps under the budget policy where only shard 1's replicate group sees the slow link (in its
    headers); a DCP save and resume into a fresh model at ``resume_at``."""
    hf_demo.DeMo.header_timings = _slow_shard_timings
    kw = {"comm_budget": 0.2, "policy_patience": 2, "compression_topk": 8}
    model, opt = sharded(rank, **kw)
    tiers = []
    for step in range(steps):
        if step == resume_at:
            fsdp.save_checkpoint(where, model, opt)
            model, opt = sharded(rank, seed=7, **kw)
            fsdp.load_checkpoint(where, model, opt)
        backward(model, rank, step)
        opt.step()
        tiers.append(opt.tier)
    return tiers, full(model), opt.skipped_steps


def test_the_budget_policy_takes_one_tier_for_the_whole_sharded_model_and_resumes_exactly(tmp_path):
    results = expect_ok(run_ranks(_hsdp_policy, 4, 40))
    tiers = results[0][0]
    assert max(tiers) == 4 and tiers[-1] == 0, tiers  # down to the local-step tiers for every shard, then back up
    for other_tiers, params, _ in results[1:]:
        assert other_tiers == tiers  # the fast shard's replicate group follows the slow one's
        assert all(torch.equal(a, b) for a, b in zip(results[0][1], params))  # every replica, every shard
    resumed = expect_ok(run_ranks(_hsdp_policy, 4, 40, str(tmp_path / "p"), 2))  # 2: in a lower tier
    for (tiers_a, params_a, _), (tiers_b, params_b, _) in zip(results, resumed):
        assert tiers_a == tiers_b
        assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))


# ---------------------------------------------------------------- checkpoints (torch.distributed.checkpoint)
def _resumed(rank, world, where, kw, resume_at=None, shard_after=2):
    """STEPS steps; at ``resume_at`` every rank saves the model and DeMo through DCP, then a fresh model (another
    init) and optimizer, sharded ``shard_after`` ways, load it and go on."""
    model, opt = sharded(rank, **kw)
    for step in range(STEPS):
        if step == resume_at:
            fsdp.save_checkpoint(where, model, opt)
            model, opt = sharded(rank, shard_after, seed=7, **kw)
            try:
                fsdp.load_checkpoint(where, model, opt)
            except hf_demo.DeMoStateError as exc:
                # every rank refuses alike: none leaves (tearing the store down) while another still builds the
                # new layout's groups
                dist.barrier()
                return str(exc)
        backward(model, rank, step)
        opt.step()
    states = [{k: local(v).clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in opt.state.values()]
    return full(model), (opt.steps, opt.skipped_steps), states


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"update_rule": "sign", "value_format": "sign"},
        {
            "exchange": "all_reduce",
            "value_format": "bf16",
            "sync_every": 2,
            "inner_rule": "adamw",
            "update_rule": "sign",
        },
        {"factory": True, "preset": "from_scratch", "update_rule": "sign", "value_format": "sign"},
        {"factory": True, "preset": "from_scratch", "update_rule": "sign", "value_format": "2bit"},
    ],
    ids=["adam", "sign", "all_reduce_local_steps", "from_scratch_preset", "from_scratch_preset_2bit"],
)
def test_hsdp_resumes_bit_for_bit_from_a_dcp_checkpoint(tmp_path, kw):
    straight = expect_ok(run_ranks(_resumed, 4, str(tmp_path / "a"), kw))
    resumed = expect_ok(run_ranks(_resumed, 4, str(tmp_path / "b"), kw, 4))  # 4: a synchronisation of sync_every=2
    for (p1, c1, s1), (p2, c2, s2) in zip(straight, resumed):
        assert c1 == c2 and all(torch.equal(a, b) for a, b in zip(p1, p2))
        assert len(s1) == len(s2) and all(
            torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for a, b in zip(s1, s2) for k in a
        )


def test_a_dcp_checkpoint_on_another_shard_size_stops_naming_both_meshes(tmp_path):
    for error in expect_ok(run_ranks(_resumed, 4, str(tmp_path / "c"), {}, 3, 4)):
        assert "'mesh 2x2'" in error and "'mesh 1x4'" in error and "load the model only" in error


def _saved_and_continued(rank, world, where):
    """STEPS steps, saving a DCP checkpoint midway (``where``) and training on with the same optimizer."""
    model, opt = sharded(rank)
    for step in range(STEPS):
        if step == 4 and where is not None:
            fsdp.save_checkpoint(where, model, opt)
        backward(model, rank, step)
        opt.step()
    return full(model)


def test_saving_a_dcp_checkpoint_leaves_the_optimizer_training_as_before(tmp_path):
    """The checkpoint's state is placed as DTensors on copies: the live state keeps its own blocked momentum."""
    straight = expect_ok(run_ranks(_saved_and_continued, 4, None))
    saved = expect_ok(run_ranks(_saved_and_continued, 4, str(tmp_path / "d")))
    for a, b in zip(straight, saved):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------- a custom Accelerate loop
def _accelerate_loop(rank, world):
    """hf_demo.prepare with an FSDP2 model: Accelerate (on CPU) would wrap it in DDP, which cannot hold its
    uneven DTensor shards; the model stays as FSDP2 made it, the optimizer is prepared, DeMo trains it."""
    os.environ.update(ACCELERATE_USE_CPU="1", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # not a one-process state an earlier test left here
    accelerator = Accelerator(cpu=True)
    model, opt = sharded(rank)
    model, opt = hf_demo.prepare(accelerator, model, opt)
    for step in range(4):
        x, y = data(rank, step)
        opt.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
    return type(model).__name__, type(opt).__name__, full(model), accelerator.num_processes


def test_prepare_keeps_an_fsdp2_model_and_demo_trains_it_in_an_accelerate_loop():
    results = expect_ok(run_ranks(_accelerate_loop, 4))
    for name, opt_name, params, processes in results:
        assert name.startswith("FSDP") and opt_name == "DeMoAcceleratedOptimizer" and processes == 4
        assert all(torch.equal(a, b) for a, b in zip(results[0][2], params))
    straight = expect_ok(run_ranks(_hsdp, 4, 2, None, 4))[0][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][2], straight))
