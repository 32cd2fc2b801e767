"""The optimizer state of FSDP2-sharded DeMo as ``torch.distributed.checkpoint`` (DCP) saves and loads it.

:func:`to_checkpoint` places every state tensor as a DTensor: the state computed from the averaged update like its
parameter (one copy per shard), each rank's own state (momentum, error feedback) as its piece of a DTensor over
every rank. :func:`from_checkpoint` is its inverse. :mod:`hf_demo.optim.checkpointing` calls both for the
``sharded`` topology; every DTensor is built or read through :mod:`hf_demo.topology.dtensor`.
"""

from __future__ import annotations

import torch

from hf_demo.optim.groups import group_of
from hf_demo.optim.update_rules import FACTS
from hf_demo.refusals import refuse
from hf_demo.topology.dtensor import is_sharded, local, local_shape, pieces_over, placed_like, shard_shapes

# computed from the averaged update (the rules' agreed tensors, the local phase's anchor): placed like the parameter
SAME_ON_REPLICAS = (
    *sorted({e.key for f in FACTS.values() for e in f.state if e.agreed and e.bytes_per_param}),
    "anchor",
)


def entry_shape(shard: tuple[int, ...], key: str, chunk: int) -> tuple[int, ...]:
    """The shape of a state entry of a parameter shard: the momentum is blocked (nblocks, block size), the rest has
    the shard's shape."""
    from hf_demo.compression import plan

    if key != "momentum":
        return shard
    layout = plan(shard, chunk, 1)
    return (layout.nblocks, layout.bsize)


def own_numel(p, key: str, shards: int, chunk: int) -> list[int]:
    """The length of this rank-owned state entry on each rank of the shard group (0 where the shard is empty)."""
    return [
        0 if 0 in shape else torch.Size(entry_shape(shape, key, chunk)).numel() for shape in shard_shapes(p, shards)
    ]


def params_by_id(sd: dict, opt) -> dict:
    """{position in ``sd``'s parameter groups: the optimizer's parameter}."""
    ids = (i for g in sd["param_groups"] for i in g["params"])
    return dict(zip(ids, (p for g in opt.param_groups for p in g["params"])))


def to_checkpoint(opt, sd: dict, world_mesh, shards: int, holds_own: bool) -> dict:
    """``sd`` as DCP saves it: every tensor a DTensor placed where it belongs (``world_mesh``: a 1-D mesh over every
    rank, where each rank's own state is placed; ``shards``: the size of the shard group). The ``"demo"`` entry rides
    in the first parameter group (what ``get_optimizer_state_dict`` keeps), the same on every rank. ``holds_own``:
    some parameter is this rank's own (inside a local phase), which a sharded checkpoint cannot hold."""
    if opt.pending is not None or holds_own:
        refuse("sharded_save_own_state", step=opt.steps)
    sd["state"] = {pid: dict(entry) for pid, entry in sd["state"].items()}  # torch's entries are opt.state's own dicts
    by_id = params_by_id(sd, opt)
    for pid, entry in sd["state"].items():
        p = by_id[pid]
        chunk = group_of(opt.param_groups, p)["compression_chunk"]
        if "momentum" not in entry and 0 not in local_shape(p):  # none yet (a local phase's first steps) is zero
            # momentum, saved so that a fresh optimizer's state (the template a load fills) always asks for it
            entry["momentum"] = torch.zeros(entry_shape(local_shape(p), "momentum", chunk), device=p.device)
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0:  # not a counter (the same on every rank)
                entry[key] = _placed(p, key, value, shards, chunk, world_mesh)
    for pid, p in by_id.items():  # a shard with no rows here: zeros in this rank's piece, so the pieces fill
        if p.requires_grad and 0 in local_shape(p) and opt.steps:
            keys = _own_keys_of_group(opt, p, sd, by_id)
            chunk = group_of(opt.param_groups, p)["compression_chunk"]
            sd["state"][pid] = {
                k: _placed(p, k, torch.zeros(0, device=p.device), shards, chunk, world_mesh) for k in keys
            }
    sd["param_groups"] = [dict(g) for g in sd["param_groups"]]
    sd["param_groups"][0]["demo"] = sd.pop("demo")
    return sd


def _own_keys_of_group(opt, p, sd, by_id) -> list[str]:
    """The rank-owned keys a parameter of ``p``'s group holds on this rank (the group's rules and tiers make them
    the same for every parameter of the group); momentum alone when no other parameter of it has a shard here."""
    group = group_of(opt.param_groups, p)
    for pid, entry in sd["state"].items():
        q = by_id[pid]
        if q is not p and 0 not in local_shape(q) and any(q is r for r in group["params"]):
            return [k for k, v in entry.items() if k not in SAME_ON_REPLICAS and getattr(v, "dim", lambda: 0)() > 0]
    return ["momentum"]


def _placed(p, key: str, value: torch.Tensor, shards: int, chunk: int, world_mesh):
    """``value`` (``p``'s state entry ``key`` on this rank) as the DTensor DCP saves."""
    if key in SAME_ON_REPLICAS:
        return placed_like(p, value)
    width = max(own_numel(p, key, shards, chunk))
    flat = torch.zeros(width, dtype=value.dtype, device=value.device)
    flat[: value.numel()] = value.reshape(-1)
    return pieces_over(world_mesh, flat)


def from_checkpoint(opt, sd: dict) -> dict:
    """The inverse of :func:`to_checkpoint`: local tensors of the shapes this rank's shards need."""
    sd = dict(sd)
    sd["param_groups"] = [dict(g) for g in sd["param_groups"]]
    if "demo" in sd["param_groups"][0]:
        sd["demo"] = sd["param_groups"][0].pop("demo")
    params = params_by_id(sd, opt)
    chunks = {i: g.get("compression_chunk") for g in sd["param_groups"] for i in g["params"]}
    state = {}
    for pid, entry in sd["state"].items():
        entry, p = dict(entry), params[pid]
        if 0 in local_shape(p):  # no rows of it here: this rank's zeros kept the saved pieces whole
            continue
        for key, value in entry.items():
            if not is_sharded(value):
                continue
            mine = local(value)
            if key in SAME_ON_REPLICAS:
                entry[key] = mine
                continue
            shape = entry_shape(local_shape(p), key, chunks[pid] or group_of(opt.param_groups, p)["compression_chunk"])
            entry[key] = mine[: torch.Size(shape).numel()].view(shape)
        state[pid] = entry
    sd["state"] = state
    return sd
