"""One rank's own state (its momenta, its inner rule's state) in one format on every path (issue 54, item 5): the
pieces of :mod:`hf_demo.optim.own_state`. A rank's file (Trainer, ``accelerator.save_state``, ``torch.save``), its
torchft momentum snapshot and its share of a DCP checkpoint hold the same pieces; each path loads the pieces another
wrote; files and snapshots written before the format load bit for bit."""

from __future__ import annotations

import io
import os

import pytest
import torch

import hf_demo
from dist_utils import expect_ok, run_ranks
from hf_demo import own_momentum
from hf_demo.errors import DeMoStateError
from hf_demo.optim.own_state import entry_shape, load_own_state, own_key, own_state
from models import batch, loss_and_backward, tiny_mlp

MODES = {
    "default": {},
    "muon_signal": {"update_rule": "muon_signal"},
    "local_phase_adamw": {"sync_every": 2, "inner_rule": "adamw", "update_rule": "sign", "value_format": "sign"},
}
KW = {"lr": 3e-3, "compression_topk": 4, "compression_chunk": 8}


def _trained(kw: dict, steps: int = 3, seed: int = 7, rank: int = 0):
    model = tiny_mlp(seed=seed)
    opt = hf_demo.DeMo(model.parameters(), **{**KW, **kw})
    for step in range(steps):
        loss_and_backward(model, rank, step)
        opt.step()
    return model, opt


def _live(opt) -> dict:
    """{position: the optimizer's state entries} (a rank's state as it trains)."""
    return {i: opt.state[p] for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}


def _same(a: dict, b: dict) -> bool:
    """Two sets of pieces hold the same entries, bit for bit (dtype and shape included)."""
    return a.keys() == b.keys() and all(
        x[k].keys() == y[k].keys()
        and all(torch.equal(x[k][e], y[k][e]) and x[k][e].dtype == y[k][e].dtype for e in x[k])
        for k, x, y in ((k, a, b) for k in a)
    )


def _rank_file(opt) -> dict:
    """What ``torch.save(optimizer.state_dict())`` writes (a Trainer's or Accelerate's rank file), read back."""
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _snapshot(opt, tmp_path, step: int = 3) -> dict:
    """torchft's momentum snapshot of ``opt`` (``Elastic(momentum_dir=...)``'s file), read back."""
    path = own_momentum.snapshot_path(tmp_path, "r0")
    own_momentum.save(path, opt, step, "r0")
    return torch.load(path, weights_only=True)


def _agreed(saved: dict, state: dict) -> dict:
    """``saved`` with ``state`` less each rank's own entries (what a live peer sends a joiner)."""
    return {**saved, "state": {pid: {k: v for k, v in e.items() if not own_key(k)} for pid, e in state.items()}}


def _continued(model, opt, steps=range(3, 6)) -> list[torch.Tensor]:
    for step in steps:
        loss_and_backward(model, 0, step)
        opt.step()
    opt.flush()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", MODES)
def test_a_ranks_own_state_is_the_same_pieces_in_its_rank_file_and_its_snapshot(tmp_path, mode):
    _, opt = _trained(MODES[mode])
    pieces = own_state(_live(opt))
    saved = _rank_file(opt)
    blob = _snapshot(opt, tmp_path)
    assert pieces and all(own_key(k) for entry in pieces.values() for k in entry)
    assert all(v.dim() <= 1 for entry in pieces.values() for v in entry.values())  # flat pieces (and counters)
    own_in_file = {pid: {k: v for k, v in e.items() if own_key(k)} for pid, e in saved["state"].items()}
    assert _same({pid: e for pid, e in own_in_file.items() if e}, pieces)  # the rank file holds the pieces
    assert _same(own_state(saved["state"]), pieces) and _same(blob["own"], pieces)  # so does the snapshot
    shaped = load_own_state(pieces, lambda i, key: _shape_of(opt, i, key))
    assert _same(shaped, {i: {k: v for k, v in e.items() if own_key(k)} for i, e in _live(opt).items() if e})


def _shape_of(opt, i: int, key: str) -> tuple[int, ...]:
    params = [(p, g) for g in opt.param_groups for p in g["params"]]
    p, group = params[i]
    return entry_shape(p.shape, key, group["compression_chunk"])


def _resumes_bit_for_bit(mode, model_state, state, after, snapshot=None) -> None:
    """A fresh model and optimizer that load ``model_state`` and ``state`` (then restore ``snapshot``, a snapshot
    path, if given) continue exactly as the trained pair did (``after``)."""
    model, opt = _trained(MODES[mode], steps=0, seed=1)
    model.load_state_dict(model_state)
    opt.load_state_dict(state)
    if snapshot is not None:
        assert own_momentum.restore(snapshot, opt, 3, "r0") == 3
    assert all(torch.equal(a, b) for a, b in zip(_continued(model, opt), after))


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_file_and_a_snapshot_load_each_others_pieces(tmp_path, mode):
    model, opt = _trained(MODES[mode])
    saved, blob = _rank_file(opt), _snapshot(opt, tmp_path)
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    after = _continued(model, opt)

    # the rank file, its own entries replaced by the snapshot's pieces, resumes bit for bit
    swapped = {**saved, "state": {pid: {**e, **blob["own"].get(pid, {})} for pid, e in saved["state"].items()}}
    _resumes_bit_for_bit(mode, model_state, swapped, after)

    # a replica that receives the agreed state (the rank file without its own entries) and restores a snapshot
    # made of the rank file's pieces resumes bit for bit too
    made = {**blob, "own": own_state(saved["state"])}
    made["sha256"] = own_momentum.checksum(made)
    path = own_momentum.snapshot_path(tmp_path, "made")
    torch.save(made, path)
    _resumes_bit_for_bit(mode, model_state, _agreed(saved, saved["state"]), after, snapshot=path)


def _old_snapshot(opt, step: int, replica_id: str) -> dict:
    """A snapshot as the release before the one format wrote it (format 2: one dict of shaped entries a parameter)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    blob = {
        "format": 2,
        "run_id": opt.run_id,
        "replica_id": replica_id,
        "step": step,
        "shapes": [list(p.shape) for p in params],
        "own": [{k: v.clone() for k, v in opt.state.get(p, {}).items() if own_key(k)} for p in params],
    }
    blob["sha256"] = own_momentum.checksum(blob)
    return blob


@pytest.mark.parametrize("mode", MODES)
def test_rank_files_and_snapshots_of_the_format_before_load_bit_for_bit(tmp_path, mode):
    model, opt = _trained(MODES[mode])
    saved = _rank_file(opt)
    live = {i: {k: v.clone() for k, v in e.items()} for i, e in _live(opt).items()}
    old_file = {**saved, "state": live}  # each own entry in the optimizer's shape, as state_dict() wrote it before
    path = own_momentum.snapshot_path(tmp_path, "old")
    torch.save(_old_snapshot(opt, 3, "r0"), path)
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    after = _continued(model, opt)

    _resumes_bit_for_bit(mode, model_state, old_file, after)
    _resumes_bit_for_bit(mode, model_state, _agreed(saved, live), after, snapshot=path)


def test_pieces_of_another_length_are_refused_naming_the_parameter():
    _, opt = _trained({})
    saved = _rank_file(opt)
    small = tiny_mlp(seed=1, hidden=16)
    with pytest.raises(DeMoStateError, match=r"saved momentum of parameter 0 has shape \(\d+, \d+\), this model needs"):
        hf_demo.DeMo(small.parameters(), **KW).load_state_dict(saved)  # (the rank file says the shape it was saved in)
    del saved["demo"]["shapes"]  # a rank file without the shapes: the piece's length
    with pytest.raises(DeMoStateError, match=r"saved .momentum. of parameter 0 has 512 values, this model needs 256 "):
        hf_demo.DeMo(small.parameters(), **KW).load_state_dict(saved)


def test_a_rank_file_for_a_parameter_of_another_shape_and_the_same_size_is_refused():
    """The pieces are flat: a momentum saved for a 64x64 parameter has the length a 32x128 one needs. The rank file
    says the shapes it was saved for, and loading it into the other shape is refused."""
    p = torch.nn.Parameter(torch.randn(64, 64))
    opt = hf_demo.DeMo([p], lr=1e-3)
    p.grad = torch.randn_like(p)
    opt.step()
    saved = opt.state_dict()
    assert saved["demo"]["shapes"] == {0: [64, 64]}
    other = hf_demo.DeMo([torch.nn.Parameter(torch.randn(32, 128))], lr=1e-3)
    with pytest.raises(DeMoStateError, match="saved momentum of parameter 0 has shape"):
        other.load_state_dict(saved)


def test_a_snapshot_whose_pieces_have_another_length_is_not_loaded_and_a_warning_says_why(tmp_path):
    _, opt = _trained({})
    blob = _snapshot(opt, tmp_path)
    _, fresh = _trained({}, steps=0)
    blob["own"][0]["momentum"] = blob["own"][0]["momentum"][:-1]  # whole and checksummed, but not this model's
    blob["run_id"] = fresh.run_id  # the run's identity (a fresh optimizer's: none yet)
    blob["sha256"] = own_momentum.checksum(blob)
    path = own_momentum.snapshot_path(tmp_path, "short")
    torch.save(blob, path)
    with pytest.warns(UserWarning, match=r"not loaded: saved 'momentum' of parameter 0 has 511 values"):
        assert own_momentum.restore(path, fresh, 3, "r0") is None
    assert not fresh.state


# ---------------------------------------------------------------- every rank, through Accelerate and DCP
def _through_accelerate(rank, world, folder):
    """Two ranks of a custom Accelerate loop: ``accelerator.save_state`` writes each rank's file; each rank's pieces
    there, in its torchft snapshot and of its live state are compared, then a fresh loop's ``load_state`` resumes
    them."""
    os.environ.update(ACCELERATE_USE_CPU="1", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from hf_demo.hf.accelerated import rank_state_file

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True)
    model = tiny_mlp(seed=7)
    model, opt = hf_demo.prepare(accelerator, model, hf_demo.DeMo(model.parameters(), **KW))
    for step in range(3):
        opt.zero_grad()
        x, y = batch(rank, step)
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        opt.step()
    accelerator.save_state(folder)
    demo = opt.demo
    pieces = own_state(_live(demo))
    saved = torch.load(os.path.join(folder, rank_state_file(0, rank)), weights_only=True)
    path = own_momentum.snapshot_path(folder, f"rank{rank}")
    own_momentum.save(path, demo, 3, f"rank{rank}")
    blob = torch.load(path, weights_only=True)
    same = _same(own_state(saved["state"]), pieces) and _same(blob["own"], pieces)
    return same, pieces[0]["momentum"].clone()


@pytest.mark.ranks
def test_every_ranks_accelerate_file_and_snapshot_hold_its_own_pieces(tmp_path):
    results = expect_ok(run_ranks(_through_accelerate, 2, str(tmp_path / "ckpt")))
    assert all(same for same, _ in results)
    assert not torch.equal(results[0][1], results[1][1])  # each rank's own momentum, not one copy


def _through_dcp(rank, world, where):
    """HSDP on 2 x 2 ranks: each rank's own state in the DCP state dict (its piece of the DTensor over every rank)
    is its pieces, padded to the widest shard's; read back, the shaped state it trains with."""
    import torch.distributed as dist

    from hf_demo import fsdp
    from hf_demo.optim.sharded_checkpoint import own_numel, params_by_id
    from hf_demo.topology.dtensor import is_sharded, local, local_shape

    mesh = fsdp.hsdp_mesh(shard=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 20), torch.nn.Tanh(), torch.nn.Linear(20, 5))
    fsdp.shard_model(model, mesh, layers=[model[0], model[2]])
    opt = hf_demo.DeMo(model.parameters(), device_mesh=mesh, **KW)
    for step in range(3):
        g = torch.Generator().manual_seed(100 * rank + step)
        model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(torch.randn(8, 13, generator=g)), torch.randn(8, 5, generator=g)).backward()
        opt.step()
    sd = opt.state_dict()
    by_id = params_by_id(sd, opt.param_groups)
    width = lambda pid, key: max(own_numel(by_id[pid], key, 2, 8))  # noqa: E731
    live = {pid: opt.state[p] for pid, p in by_id.items() if 0 not in local_shape(p)}
    pieces = own_state(live, width)
    placed = {pid: {k: v for k, v in e.items() if own_key(k) and is_sharded(v)} for pid, e in sd["state"].items()}
    in_dcp = {pid: {k: local(v) for k, v in e.items()} for pid, e in placed.items() if pid in live}
    widths = {(pid, k): tuple(v.shape) for pid, e in placed.items() for k, v in e.items()}
    shaped = load_own_state(in_dcp, lambda pid, key: entry_shape(local_shape(by_id[pid]), key, 8), width)
    back = all(torch.equal(shaped[pid][k], live[pid][k]) for pid in shaped for k in shaped[pid])
    fsdp.save_checkpoint(where, model, opt)
    dist.barrier()
    return _same(in_dcp, pieces), back, widths


@pytest.mark.ranks
def test_each_ranks_share_of_a_dcp_checkpoint_is_its_pieces(tmp_path):
    results = expect_ok(run_ranks(_through_dcp, 4, str(tmp_path / "dcp")))
    assert all(same and back for same, back, _ in results)
    assert all(r[2] == results[0][2] for r in results)  # one DTensor over every rank: the same width everywhere


def _flat_through_dcp(rank, world, where):
    """Flat DeMo on 2 ranks: DCP (``hf_demo.fsdp.save_checkpoint``) holds each rank's own state as its pieces of a
    DTensor over every rank, the pieces its rank file and its snapshot hold; a fresh model and optimizer load it
    (``load_checkpoint``) and go on bit for bit."""
    import torch.distributed.checkpoint as dcp

    from hf_demo import fsdp
    from hf_demo.topology.dtensor import local

    model, opt = _trained({}, rank=rank)
    pieces = own_state(_live(opt))
    fsdp.save_checkpoint(where, model, opt)
    saved = _rank_file(opt)
    path = own_momentum.snapshot_path(where + "-snapshots", f"rank{rank}")
    own_momentum.save(path, opt, 3, f"rank{rank}")
    blob = torch.load(path, weights_only=True)
    held = fsdp.flat_template(where)
    dcp.load({"optimizer": held}, checkpoint_id=where)
    in_dcp = {int(pid): {k: local(v) for k, v in e.items()} for pid, e in held[fsdp.OWN].items()}
    same = _same(in_dcp, pieces) and _same(own_state(saved["state"]), pieces) and _same(blob["own"], pieces)
    for step in range(3, 6):
        loss_and_backward(model, rank, step)
        opt.step()
    opt.flush()
    after = [p.detach().clone() for p in model.parameters()]
    model_b, opt_b = _trained({}, steps=0, seed=1)
    fsdp.load_checkpoint(where, model_b, opt_b)
    for step in range(3, 6):
        loss_and_backward(model_b, rank, step)
        opt_b.step()
    opt_b.flush()
    resumed = all(torch.equal(a, b) for a, b in zip(model_b.parameters(), after))
    return same, resumed, pieces[0]["momentum"].clone()


@pytest.mark.ranks
def test_flat_demo_through_dcp_holds_each_ranks_pieces_and_resumes_bit_for_bit(tmp_path):
    results = expect_ok(run_ranks(_flat_through_dcp, 2, str(tmp_path / "flat")))
    assert all(same for same, _, _ in results) and all(resumed for _, resumed, _ in results)
    assert not torch.equal(results[0][2], results[1][2])  # each rank's own momentum came back, not rank 0's


def _flat_saved(rank, world, where):
    from hf_demo import fsdp

    model, opt = _trained({}, rank=rank)
    fsdp.save_checkpoint(where, model, opt)


def _flat_loaded(rank, world, where):
    from hf_demo import fsdp

    model, opt = _trained({}, steps=0)
    try:
        fsdp.load_checkpoint(where, model, opt)
    except DeMoStateError as exc:
        return str(exc)


@pytest.mark.ranks
def test_a_flat_dcp_checkpoint_on_another_number_of_ranks_is_refused(tmp_path):
    expect_ok(run_ranks(_flat_saved, 2, str(tmp_path / "flat")))
    (error,) = expect_ok(run_ranks(_flat_loaded, 1, str(tmp_path / "flat")))
    assert "saved with 2 process(es) but this run has 1" in error, error
