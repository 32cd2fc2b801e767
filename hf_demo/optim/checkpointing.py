"""``DeMo.state_dict()`` and ``load_state_dict()``: what each rank saves of its own state, and how it is restored.

Each rank's momentum, error feedback and (inside a local phase) parameters are its own, so every rank saves and
loads its own state (``DeMoTrainer`` writes ``optimizer.rank<r>.pt``). Settings given to the new optimizer win
over the checkpoint's (a warning names the differences; the momentum is re-planned when the chunk changed).
"""

from __future__ import annotations

import warnings
from dataclasses import astuple

import torch
import torch.distributed as dist

from hf_demo.errors import DeMoStateError
from hf_demo.optim import overlap
from hf_demo.optim import policy as policies
from hf_demo.optim.groups import replan_momentum
from hf_demo.optim.state import PendingExchange, SavedState, saved_tensors
from hf_demo.settings import DeMoSettings
from hf_demo.topology.dtensor import local


def save(opt, sd: dict) -> dict:
    """``sd`` (torch's state dict) with the ``"demo"`` entry."""
    ids = [pid for g in sd["param_groups"] for pid in g["params"]]
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
        local_params={ids[i]: local(p).detach().clone() for i, p in own_parameters(opt)},
    )
    sd["demo"] = saved.to_dict()
    return opt.topology.to_checkpoint(opt, sd)


def load(opt, state_dict: dict) -> None:
    state_dict = opt.topology.from_checkpoint(opt, dict(state_dict))
    saved = SavedState.from_dict(state_dict.pop("demo", None))
    refuse_unfit(opt, saved)
    requested = [{k: g[k] for k in DeMoSettings.per_group_names()} for g in opt.param_groups]
    tensors, saved_groups = saved_tensors(state_dict), state_dict["param_groups"]
    torch.optim.Optimizer.load_state_dict(opt, state_dict)
    changed = _requested_win(opt, requested, saved_groups) + _changed_settings(opt, saved.settings)
    ids = [pid for g in saved_groups for pid in g["params"]]
    pairs = [(p, g, saved_g) for g, saved_g in zip(opt.param_groups, saved_groups) for p in g["params"]]
    for pid, (p, group, saved_g) in zip(ids, pairs):
        _restore_tensors(opt, p, tensors.get(pid, {}), saved_g.get("compression_chunk"), group, pid)
    if changed:
        warnings.warn(
            "DeMo: resuming with settings that differ from the checkpoint's (the requested ones are used; momentum "
            "re-planned where the chunk changed): " + "; ".join(changed),
            stacklevel=3,
        )
    opt.counters = saved.counters
    _load_policy(opt, saved)
    rank, world = opt.identity()[:2]
    opt.land_in_flight(
        None if saved.pending is None else PendingExchange.from_state(saved.pending, rank, world, opt.device())
    )
    opt.comm_stats.load(saved.comm)
    opt.saved_world = (saved.rank, saved.world_size, saved.rank_scope)
    if dist.is_available() and dist.is_initialized():  # else at the first step, once the group exists
        opt.check_saved_world()
    _restore_own_parameters(opt, ids, [p for p, _, _ in pairs], saved.local_params)


def refuse_unfit(opt, saved: SavedState) -> None:
    """Refuse, before anything is loaded, a state this run could only resume wrongly."""
    if saved.pending is not None and opt.settings.sync_every > 1:
        raise DeMoStateError(
            "this optimizer state holds an exchange still in flight (saved with overlap=True), which local steps "
            "(sync_every > 1) cannot apply: resume it with the settings it was saved with, call "
            "optimizer.flush(), save again, and resume that checkpoint with the new settings"
        )
    if not saved.counters.unsynced or saved.world_size <= 1:  # one rank: its parameters are everybody's
        return
    saved_every = saved.tier_spec[2]
    found = saved_tier(opt, saved)
    tier = found if found is not None else min(int(saved.policy.get("tier", 0)), len(opt.tiers) - 1)
    if opt.tiers[tier].sync_every > 1:
        return
    raise DeMoStateError(
        f"this optimizer state was saved inside a local phase (optimizer step {saved.counters.steps}, synchronising "
        f"every {saved_every} steps): each rank's parameters are still its own, and this run has no local "
        "steps (sync_every=1), so its first exchange would find the ranks apart and copy rank 0's parameters "
        f"over the others'. Resume it with the settings it was saved with (sync_every={saved_every}), call "
        "optimizer.flush() on every rank (end_local_phase='average' averages the ranks), save again, and "
        "resume that checkpoint with the new settings"
    )


def saved_tier(opt, saved: SavedState) -> int | None:
    """The index among this run's tiers of the saved tier, found by what it is (format, top-k divisor,
    sync_every), not by its number; None when this run has no such tier."""
    tier = policies.Tier(*saved.tier_spec)
    return opt.tiers.index(tier) if tier in opt.tiers else None


def _load_policy(opt, saved: SavedState) -> None:
    # the figures of an exchange this optimizer ran before the load (torch's DCP state-dict helpers take a step to
    # create the state they load into) are not the resumed run's: it starts without a last exchange, as a fresh one
    opt.clock = policies.Clock()
    found = saved_tier(opt, saved)
    opt.policy.load_state_dict({k: v for k, v in saved.policy.items() if k != "tier_spec"})
    if found is not None:
        opt.policy.tier = found
        return
    tier = min(opt.policy.tier, len(opt.tiers) - 1)
    warnings.warn(
        f"DeMo: the checkpoint's communication tier ({list(saved.tier_spec)}) is not among this run's tiers (other "
        f"settings); continuing in tier {tier} {astuple(opt.tiers[tier])}",
        stacklevel=4,
    )
    opt.policy.tier = tier


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


def own_parameters(opt):
    """(position, parameter) of each parameter whose value is this rank's own, which a checkpoint's model file
    (rank 0's) does not hold: inside a local phase, those moved away from their anchor (the parameters at the
    last synchronisation)."""
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        anchor = opt.state[p].get("anchor") if p in opt.state else None
        if anchor is not None and not torch.equal(local(p).detach(), anchor):
            yield i, p


def _restore_own_parameters(opt, ids, params, own: dict) -> None:
    """Mid local phase: this rank's own parameters, not the checkpoint's model weights (rank 0's, or the ranks'
    mean when written through averaged_parameters); one that had not moved is its anchor."""
    with torch.no_grad():
        for pid, p in zip(ids, params):
            if pid in own:
                local(p).copy_(own[pid])
            elif opt.unsynced and "anchor" in opt.state.get(p, {}):
                local(p).copy_(opt.state[p]["anchor"])
