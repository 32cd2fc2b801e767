"""``DeMo.state_dict()`` and ``load_state_dict()``: what each rank saves of its own state, and how it is restored.

Each rank's momentum, error feedback and (inside a local phase) parameters are its own, so every rank saves and
loads its own state (``DeMoTrainer`` writes ``optimizer.rank<r>.pt``), its own entries in the one format of
:mod:`hf_demo.optim.own_state` (read back by its one reader, which takes older rank files too); a sharded state
places the same pieces as DTensors for ``torch.distributed.checkpoint`` (:mod:`hf_demo.optim.sharded_checkpoint`).
Settings given to the new optimizer win over the checkpoint's (a warning names the differences; the momentum is
re-planned when the chunk changed).
"""

from __future__ import annotations

import dataclasses
import datetime
import uuid
import warnings
from dataclasses import astuple

import torch
import torch.distributed as dist

from hf_demo.errors import DeMoStateError
from hf_demo.exchange import teardown
from hf_demo.guards import fingerprint
from hf_demo.optim import overlap, sharded_checkpoint
from hf_demo.optim import policy as policies
from hf_demo.optim.groups import replan_momentum
from hf_demo.optim.own_state import entry_shape, load_own_state, own_state
from hf_demo.optim.state import PendingExchange, SavedState, saved_tensors
from hf_demo.refusals import refuse
from hf_demo.settings import DeMoSettings
from hf_demo.topology.dtensor import local


def save(opt, sd: dict) -> dict:
    """``sd`` (torch's state dict) with the ``"demo"`` entry."""
    ids = [pid for g in sd["param_groups"] for pid in g["params"]]
    own = list(own_parameters(opt))
    rank, world, scope = opt.identity()
    saved = SavedState(
        counters=opt.counters,
        rank=rank,
        world_size=world,
        rank_scope=scope,
        settings=opt.settings.as_dict(),
        policy={**opt.policy.state_dict(), "tier_spec": list(astuple(opt.tiers[opt.policy.tier]))},
        comm={k: v for k, v in opt.comm_stats.as_dict().items() if k.startswith("total_") or k == "steps"},
        pending=overlap.to_state(opt),
        local_params={ids[i]: local(p).detach().clone() for i, p in own},
        run_id=opt.establish_run_id(),
        params_print=fingerprint(trainable(opt)),
    )
    topology = opt.topology
    if topology.name != "sharded":  # each rank saves its own (torch.save): its own entries as pieces
        params = [p for g in opt.param_groups for p in g["params"]]
        saved = dataclasses.replace(saved, shapes={pid: list(p.shape) for pid, p in zip(ids, params)})
        sd["demo"] = saved.to_dict()
        return with_pieces(sd, own_state(sd["state"]))
    sd["demo"] = saved.to_dict()
    sharded_checkpoint.check_saveable(opt.pending is not None, bool(own), opt.steps)
    return sharded_checkpoint.to_checkpoint(sd, opt.param_groups, topology.world_mesh(), topology.shards.world)


def with_pieces(sd: dict, pieces: dict) -> dict:
    """``sd`` with each parameter's own entries replaced by their pieces (torch's entries are the optimizer's own
    dicts: copied, never changed)."""
    sd["state"] = {pid: {**entry, **pieces.get(pid, {})} for pid, entry in sd["state"].items()}
    return sd


def unpacked(opt, state_dict: dict, resume: bool = True) -> tuple[dict, SavedState, list[dict]]:
    """``state_dict`` checked before anything is loaded: (torch's part of it, DeMo's saved state, the settings
    each parameter group asks for now). ``resume``: a checkpoint of this run, whose refusal the other ranks hear
    at once; ``False``: a live peer's agreed state (elastic recovery)."""
    state_dict = dict(state_dict)
    if opt.topology.name == "sharded":
        state_dict = sharded_checkpoint.from_checkpoint(state_dict, opt.param_groups)
    try:
        saved = SavedState.from_dict(state_dict.pop("demo", None))
        refuse_unfit(opt, saved)
    except DeMoStateError as exc:
        if resume:
            announce_refused(opt, exc)  # the other ranks' comparison hears it now, not after comm_timeout
        raise
    requested = [{k: g[k] for k in DeMoSettings.per_group_names()} for g in opt.param_groups]
    return state_dict, saved, requested


def restored(opt, state_dict: dict, saved: SavedState, requested: list[dict], resume: bool) -> dict:
    """After torch's ``load_state_dict`` of ``state_dict``: the requested settings win over the saved ones (a
    warning names the differences), DeMo's state tensors are placed (the momentum re-planned where the chunk
    changed). Returns what the optimizer takes of the saved state, by attribute: its counters, policy (a fresh
    clock: the figures of an exchange run before the load are not the resumed run's), exchange in flight, run
    (a resumed run is the run it resumes) and, for ``resume``, whose state it is (checked once the group exists)."""
    saved_groups = state_dict["param_groups"]
    changed = _requested_win(opt, requested, saved_groups) + _changed_settings(opt, saved.settings)
    tensors, ids = saved_tensors(state_dict), [pid for g in saved_groups for pid in g["params"]]
    pairs = [(p, g, saved_g) for g, saved_g in zip(opt.param_groups, saved_groups) for p in g["params"]]
    tensors = load_own_state(tensors, *own_shapes(ids, pairs, opt.topology, saved.shapes))
    for pid, (p, group, saved_g) in zip(ids, pairs):
        _restore_tensors(opt, p, tensors.get(pid, {}), saved_g.get("compression_chunk"), group, pid)
    if changed:
        warnings.warn(
            "DeMo: resuming with settings that differ from the checkpoint's (the requested ones are used; momentum "
            "re-planned where the chunk changed): " + "; ".join(changed),
            stacklevel=3,
        )
    rank, world = opt.identity()[:2]
    pending = None if saved.pending is None else PendingExchange.from_state(saved.pending, rank, world, opt.device())
    return dict(
        counters=saved.counters,
        policy=loaded_policy(opt, saved),
        clock=policies.Clock(),
        pending=pending,
        run_id=saved.run_id or opt.run_id,
        saved_world=(saved.rank, saved.world_size, saved.rank_scope) if resume else None,
        saved_identity=(saved.run_id, saved.counters.steps, saved.params_print) if resume else (None, None, None),
    )


def check_saved_world(opt, saved_world: tuple[int, int, str]) -> None:
    """``DeMo.check_saved_world``: the loaded state (saved by ``saved_world``: rank, world, scope) must be this
    rank's, saved with this many ranks, by the run and at the step of every other rank's (compared first, through
    the store: a rank that refused its own state is heard before any group is built)."""
    compare_resumed(opt, _resume_timeout(opt))
    (saved_rank, saved_world_size, scope), (rank, world, here) = saved_world, opt.identity()
    if scope != here and "mesh" in (scope + here):
        refuse(
            "resume_other_mesh",
            saved=scope if "mesh" in scope else "flat layout",
            now=here if "mesh" in here else "flat layout",
        )
    if saved_world_size != world:
        refuse("resume_other_world", saved_world=saved_world_size, world=world)
    if saved_rank != rank:
        raise DeMoStateError(
            f"rank {rank} loaded the optimizer state saved by rank {saved_rank}; each rank must load its own state"
        )


def refuse_unfit(opt, saved: SavedState) -> None:
    """Refuse, before anything is loaded, a state this run could only resume wrongly."""
    if saved.pending is not None and opt.settings.sync_every > 1:
        refuse("resume_in_flight_local_steps")
    if not saved.counters.unsynced or saved.world_size <= 1:  # one rank: its parameters are everybody's
        return
    saved_every = saved.tier_spec[2]
    found = saved_tier(opt, saved)
    tier = found if found is not None else min(int(saved.policy.get("tier", 0)), len(opt.tiers) - 1)
    if opt.tiers[tier].sync_every > 1:
        return
    refuse("resume_local_phase_every_step", step=saved.counters.steps, saved_every=saved_every)


def saved_tier(opt, saved: SavedState) -> int | None:
    """The index among this run's tiers of the saved tier, found by what it is (format, top-k divisor,
    sync_every), not by its number; None when this run has no such tier."""
    tier = policies.Tier(*saved.tier_spec)
    return opt.tiers.index(tier) if tier in opt.tiers else None


def loaded_policy(opt, saved: SavedState) -> policies.BudgetPolicy:
    """The policy the saved state resumes (a new object: the optimizer keeps it), in the saved tier found among
    this run's tiers by what it is (a warning where this run has no such tier)."""
    found = saved_tier(opt, saved)
    policy = policies.BudgetPolicy(**vars(opt.policy))
    policy.load_state_dict({k: v for k, v in saved.policy.items() if k != "tier_spec"})
    if found is not None:
        return dataclasses.replace(policy, tier=found)
    tier = min(policy.tier, len(opt.tiers) - 1)
    warnings.warn(
        f"DeMo: the checkpoint's communication tier ({list(saved.tier_spec)}) is not among this run's tiers (other "
        f"settings); continuing in tier {tier} {astuple(opt.tiers[tier])}",
        stacklevel=4,
    )
    return dataclasses.replace(policy, tier=tier)


def own_shapes(ids: list[int], pairs: list[tuple], topology, saved_shapes: dict | None = None) -> tuple:
    """(shape, width) of each own entry a saved state's pieces are read into: this rank's part of the parameter at
    that position as it was saved (``saved_shapes``, where the state says; its momentum blocked by the saved chunk,
    re-planned after, which refuses a momentum of another parameter's shape), and the length of its piece (under
    FSDP2 the widest shard's; None: as many values as the shape holds)."""
    by_id, saved_shapes = dict(zip(ids, pairs)), saved_shapes or {}

    def chunk(pid: int) -> int:
        _, group, saved_g = by_id[pid]
        return saved_g.get("compression_chunk") or group["compression_chunk"]

    def shape(pid: int, key: str) -> tuple[int, ...]:
        shape = saved_shapes.get(pid)
        return entry_shape(local(by_id[pid][0]).shape if shape is None else tuple(shape), key, chunk(pid))

    if topology.name != "sharded":
        return shape, None
    shards = topology.shards.world
    return shape, lambda pid, key: max(sharded_checkpoint.own_numel(by_id[pid][0], key, shards, chunk(pid)))


def _requested_win(opt, requested, saved_groups) -> list[str]:
    changed = []
    for group, req, saved in zip(opt.param_groups, requested, saved_groups):
        changed += [f"{k}: saved {saved[k]!r}, requested {v!r}" for k, v in req.items() if saved.get(k, v) != v]
        group.update(req)  # the requested settings win over the checkpoint's
    return changed


def _changed_settings(opt, saved: dict) -> list[str]:
    now = opt.settings.as_dict()
    return [f"{k}: saved {saved[k]!r}, requested {v!r}" for k, v in now.items() if k in saved and saved[k] != v]


def _restore_tensors(opt, p, tensors: dict, saved_chunk, group, pid) -> None:
    """DeMo's state stays fp32 on the parameter's device and its counters int64 on the host."""
    for key, value in tensors.items():
        if not value.is_floating_point():
            opt.state[p][key] = value.to(device="cpu", copy=True)
            continue
        value = value.to(device=p.device, dtype=torch.float32, copy=True)
        if key == "momentum":
            chunk = group["compression_chunk"]
            value = replan_momentum(pid, value, p, saved_chunk or chunk, chunk, opt.transform)
        opt.state[p][key] = value


def trainable(opt) -> list[torch.Tensor]:
    """This rank's part of every trainable parameter, in order (what a saved state's fingerprint covers)."""
    return [local(p).detach() for g in opt.param_groups for p in g["params"] if p.requires_grad]


def check_model(opt) -> None:
    """Raise :class:`DeMoStateError` when the parameters now are not those this rank's loaded state was saved
    with: the model file and the optimizer file come from different checkpoints or runs (call it once the model's
    weights are loaded; ``DeMoTrainer`` does)."""
    run_id, step, saved_print = getattr(opt, "saved_identity", (None, None, None))
    if saved_print is None:
        return  # saved by an hf_demo without the fingerprint
    now = fingerprint(trainable(opt))
    if now != saved_print:
        rank = opt.identity()[0]
        raise DeMoStateError(
            f"rank {rank}: the model's parameters are not those its optimizer state was saved with (run {run_id}, "
            f"optimizer step {step}; parameter fingerprint {saved_print:#x} saved, {now:#x} now): the model file "
            "and this rank's optimizer file come from different checkpoints or runs. Resume from a checkpoint "
            "saved whole by one run (or start the optimizer afresh)"
        )


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


RUN_KEY = "hf_demo/run_id"


def agreed_run_id() -> str:
    """A new run's identity, the same on every rank: global rank 0's, handed over once per process group through
    the rendezvous store (no collective; called at a step or a save, which every rank reaches)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return new_run_id()
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0 and not store.check([RUN_KEY]):
        store.set(RUN_KEY, new_run_id())
    return store.get(RUN_KEY).decode()


_COMPARED = [0]  # resumed states compared in this process (the store keys of each comparison)


REFUSED = "refused@"  # what a rank whose state was refused before loading publishes instead of run@step


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _resume_timeout(opt) -> float:
    return opt.settings.comm_timeout or 300.0


def _publish(opt, value: str) -> tuple:
    """This rank's ``value`` for the next comparison of resumed states (every rank publishes once per load, in
    the same order); returns (store, the group's ranks, the comparison's key prefix)."""
    store, ranks = dist.distributed_c10d._get_default_store(), participants(opt)
    prefix = f"hf_demo/resumed/{_COMPARED[0]}/{ranks[0]}-{len(ranks)}"
    _COMPARED[0] += 1
    store.set(f"{prefix}/{dist.get_rank()}", value)
    return store, ranks, prefix


def announce_refused(opt, exc: DeMoStateError) -> None:
    """A state this rank refused before loading it (malformed, unfit): published in its place, so every other rank
    comparing its resumed state raises at once, naming this rank and why (rank 0, which may hold the rendezvous
    store, raises only once the others read it, or after comm_timeout: :func:`teardown.leave_together`)."""
    if _distributed():
        _, ranks, prefix = _publish(opt, REFUSED + str(exc)[:500])
        teardown.leave_together(prefix, ranks, _resume_timeout(opt))


def compare_resumed(opt, timeout_s: float) -> None:
    """Every rank's loaded state against every other's (run and optimizer step), through the rendezvous store:
    each rank publishes its own and reads them all, so every rank raises the same :class:`DeMoStateError`
    naming the ranks whose state differs from rank 0's and how (another run's file, another step's, an older
    hf_demo's), or a rank that refused its own state. Rank 0 raises last (:func:`teardown.leave_together`): its
    error must not take the store away from a peer still reading it."""
    run_id, step, _ = getattr(opt, "saved_identity", (None, None, None))
    if step is None or not _distributed():
        return  # (a state saved by an older hf_demo has no run identity: compared too, as "None")
    store, ranks, prefix = _publish(opt, f"{run_id}@{step}")
    keys = [f"{prefix}/{r}" for r in ranks]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
        values = [v.decode() for v in store.multi_get(keys)]
    except Exception as exc:  # noqa: BLE001 - a rank that never resumed (or froze, or left): named, not a raw error
        raise DeMoStateError(
            f"rank {dist.get_rank()}: not every rank loaded a DeMo optimizer state within {timeout_s:.0f} s, or a "
            f"rank left during the comparison ({type(exc).__name__}): resume every rank from the same checkpoint"
        ) from None
    problem = _resumed_problem(ranks, values)
    if problem:
        teardown.leave_together(prefix, ranks, timeout_s)
        raise DeMoStateError(problem)


def _resumed_problem(ranks: list[int], values: list[str]) -> str | None:
    """What the ranks' published ``run@step`` values (or refusals) say is wrong, the same on every rank; or None."""
    refused = [f"rank {r} refused its own: {v[len(REFUSED) :]}" for r, v in zip(ranks, values) if v.startswith(REFUSED)]
    if refused:
        return "not every rank could load its optimizer state: " + "; ".join(refused)
    seen = [v.split("@", 1) for v in values]
    differ = []
    for r, (rid, st) in zip(ranks, seen):
        if (rid, st) != tuple(seen[0]):
            what = "another run's" if rid != seen[0][0] else "another step's"
            what = "an older hf_demo's, without a run identity" if rid == "None" else what
            differ.append(f"rank {r}'s state is {what} (run {rid} at optimizer step {st}; rank {ranks[0]}'s: run "
                          f"{seen[0][0]} at step {seen[0][1]})")  # fmt: skip
    if not differ:
        return None
    return (
        "the ranks resumed optimizer states that do not belong together: " + "; ".join(differ) + ". Resume "
        "every rank from one checkpoint saved whole by one run (a checkpoint vouched for with write_manifest "
        "may hold another run's file)"
    )


def participants(opt) -> list[int]:
    """The global ranks of the optimizer's group (its mesh's, or its process group's; else every rank)."""
    if opt.device_mesh is not None:
        return sorted(int(r) for r in opt.device_mesh.mesh.flatten().tolist())
    if opt.process_group is not None:
        return sorted(dist.get_process_group_ranks(opt.process_group))
    return list(range(dist.get_world_size()))


def own_parameters(opt):
    """(position, parameter) of each parameter whose value is this rank's own, which a checkpoint's model file
    (rank 0's) does not hold: inside a local phase, those moved away from their anchor (the parameters at the
    last synchronisation)."""
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        anchor = opt.state[p].get("anchor") if p in opt.state else None
        if anchor is not None and not torch.equal(local(p).detach(), anchor):
            yield i, p


def restore_own_parameters(opt, state_dict: dict, saved: SavedState) -> None:
    """Mid local phase: this rank's own parameters, not the checkpoint's model weights (rank 0's, or the ranks'
    mean when written through averaged_parameters); one that had not moved is its anchor."""
    ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
    params, own = [p for g in opt.param_groups for p in g["params"]], saved.local_params
    with torch.no_grad():
        for pid, p in zip(ids, params):
            if pid in own:
                local(p).copy_(own[pid])
            elif saved.counters.unsynced and "anchor" in opt.state.get(p, {}):
                local(p).copy_(opt.state[p]["anchor"])
