"""The optimizer state of FSDP2-sharded DeMo as ``torch.distributed.checkpoint`` (DCP) saves and loads it.

:func:`to_checkpoint` places every state tensor as a DTensor: the state computed from the averaged update like its
parameter (one copy per shard), each rank's own state (momentum, error feedback) in the one format of
:mod:`hf_demo.optim.own_state`, its pieces as the ``Shard(0)`` DTensor over every rank. :func:`from_checkpoint` is
its inverse (the pieces themselves: :func:`hf_demo.optim.own_state.load_own_state` shapes them, as for a rank's
file). :mod:`hf_demo.optim.checkpointing` calls both for the ``sharded`` topology; every DTensor is built or read
through :mod:`hf_demo.topology.dtensor`.
"""

from __future__ import annotations

import torch

from hf_demo.optim.groups import group_of
from hf_demo.optim.own_state import entry_shape, own_key, own_state
from hf_demo.optim.update_rules import FACTS
from hf_demo.refusals import refuse
from hf_demo.topology.dtensor import is_sharded, local, local_shape, pieces_over, placed_like, shard_shapes

# computed from the averaged update (the rules' agreed tensors, the local phase's anchor): placed like the parameter
SAME_ON_REPLICAS = (
    *sorted({e.key for f in FACTS.values() for e in f.state if e.agreed and e.bytes_per_param}),
    "anchor",
)


def own_numel(p, key: str, shards: int, chunk: int) -> list[int]:
    """The length of this rank-owned state entry on each rank of the shard group (0 where the shard is empty)."""
    return [
        0 if 0 in shape else torch.Size(entry_shape(shape, key, chunk)).numel() for shape in shard_shapes(p, shards)
    ]


def params_by_id(sd: dict, param_groups: list[dict]) -> dict:
    """{position in ``sd``'s parameter groups: the optimizer's parameter} (``param_groups``: the optimizer's)."""
    ids = (i for g in sd["param_groups"] for i in g["params"])
    return dict(zip(ids, (p for g in param_groups for p in g["params"])))


def check_saveable(in_flight: bool, holds_own: bool, steps: int) -> None:
    """Refuse a state a sharded checkpoint cannot hold, before anything is written: an exchange in flight, or a
    parameter of this rank's own (``holds_own``: inside a local phase); ``steps``: the optimizer step, named."""
    if in_flight or holds_own:
        refuse("sharded_save_own_state", step=steps)


def to_checkpoint(sd: dict, param_groups: list[dict], world_mesh, shards: int) -> dict:
    """``sd`` as DCP saves it: every tensor a DTensor placed where it belongs (``world_mesh``: a 1-D mesh over every
    rank, where each rank's own state is placed; ``shards``: the size of the shard group; ``param_groups``: the
    optimizer's). The ``"demo"`` entry rides in the first parameter group (what ``get_optimizer_state_dict`` keeps),
    the same on every rank."""
    sd["state"] = {pid: dict(entry) for pid, entry in sd["state"].items()}  # torch's entries are opt.state's own dicts
    by_id = params_by_id(sd, param_groups)
    chunk = {pid: group_of(param_groups, p)["compression_chunk"] for pid, p in by_id.items()}
    steps = sd["demo"]["steps"]
    for pid, entry in sd["state"].items():
        p = by_id[pid]
        if "momentum" not in entry and 0 not in local_shape(p):  # none yet (a local phase's first steps) is zero
            # momentum, saved so that a fresh optimizer's state (the template a load fills) always asks for it
            entry["momentum"] = torch.zeros(entry_shape(local_shape(p), "momentum", chunk[pid]), device=p.device)
    for pid, p in by_id.items():  # a shard with no rows here: zeros in this rank's piece, so the pieces fill
        if p.requires_grad and 0 in local_shape(p) and steps:
            keys = _own_keys_of_group(param_groups, p, sd, by_id)
            sd["state"][pid] = {k: torch.zeros(0, device=p.device) for k in keys}
    width = lambda pid, key: max(own_numel(by_id[pid], key, shards, chunk[pid]))  # noqa: E731 - the widest rank's
    pieces = own_state(sd["state"], width)
    for pid, entry in sd["state"].items():
        for key, value in entry.items():
            if not (torch.is_tensor(value) and value.dim() > 0):  # a counter (the same on every rank)
                continue
            entry[key] = pieces_over(world_mesh, pieces[pid][key]) if own_key(key) else placed_like(by_id[pid], value)
    sd["param_groups"] = [dict(g) for g in sd["param_groups"]]
    sd["param_groups"][0]["demo"] = sd.pop("demo")
    return sd


def _own_keys_of_group(param_groups, p, sd, by_id) -> list[str]:
    """The rank-owned keys a parameter of ``p``'s group holds on this rank (the group's rules and tiers make them
    the same for every parameter of the group); momentum alone when no other parameter of it has a shard here."""
    group = group_of(param_groups, p)
    for pid, entry in sd["state"].items():
        q = by_id[pid]
        if q is not p and 0 not in local_shape(q) and any(q is r for r in group["params"]):
            return [k for k, v in entry.items() if own_key(k) and getattr(v, "dim", lambda: 0)() > 0]
    return ["momentum"]


def from_checkpoint(sd: dict, param_groups: list[dict]) -> dict:
    """The inverse of :func:`to_checkpoint` (``param_groups``: the optimizer's): this rank's local tensors, its own
    entries as their pieces (read by :func:`hf_demo.optim.own_state.load_own_state`, as a rank's file is)."""
    sd = dict(sd)
    sd["param_groups"] = [dict(g) for g in sd["param_groups"]]
    if "demo" in sd["param_groups"][0]:
        sd["demo"] = sd["param_groups"][0].pop("demo")
    params = params_by_id(sd, param_groups)
    state = {}
    for pid, entry in sd["state"].items():
        if 0 in local_shape(params[pid]):  # no rows of it here: this rank's zeros kept the saved pieces whole
            continue
        state[pid] = {key: local(value) if is_sharded(value) else value for key, value in entry.items()}
    sd["state"] = state
    return sd
