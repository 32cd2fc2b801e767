"""DeMo with PyTorch's FSDP2: models larger than one device's memory, HSDP with DeMo across the replicate dimension.

Layouts (``docs/guides/large-models.md``):

- **HSDP-DeMo**: a (replicate, shard) mesh, the model sharded on ``shard`` (usually the processes of one node,
  over the fast link), DeMo across ``replicate`` (between nodes, over the slow link)::

      mesh = hf_demo.fsdp.hsdp_mesh()                  # (nodes, processes per node) from the launcher
      hf_demo.fsdp.shard_model(model, mesh)            # FSDP2 on mesh["shard"]: gradients reduce-scattered inside
      opt = hf_demo.DeMo(model.parameters(), lr=..., device_mesh=mesh)

- **FSDP-DeMo**: one dimension over every rank (``hsdp_mesh(shard=world)``): no replica, nothing to exchange;
  DeMo is a local optimizer over shards (FSDP2's reduce-scatter averages every gradient).

Checkpoints go through ``torch.distributed.checkpoint`` (:func:`save_checkpoint`, :func:`load_checkpoint`, or
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` directly): each rank's momentum is saved as its
piece of a DTensor, so every rank resumes its own, bit for bit, on the same mesh. :func:`save_checkpoint` and
:func:`load_checkpoint` take a flat DeMo too (the pieces of :mod:`hf_demo.optim.own_state`, as its rank files).
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

MESH_DIMS = ("replicate", "shard")


def hsdp_mesh(shard: int | None = None, device_type: str | None = None):
    """A (replicate, shard) DeviceMesh over every rank: ``shard`` ranks per shard group (default: the processes
    per node, ``LOCAL_WORLD_SIZE`` as torchrun and accelerate launch set it), ``world // shard`` replicas.

    On one node the default is one shard group of every rank (1 x world: pure FSDP, nothing for DeMo to exchange);
    rank 0 warns, naming the ``shard=`` that gives replicas on one machine (``shard=2`` on 4 processes: 2 x 2)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise ValueError("hsdp_mesh needs torch.distributed initialised (launch with torchrun or accelerate launch)")
    world = dist.get_world_size()
    if shard is None:
        raw = os.environ.get("LOCAL_WORLD_SIZE", "")
        if not raw.isdigit():
            raise ValueError(
                "hsdp_mesh(shard=None) takes the processes per node from LOCAL_WORLD_SIZE, which is not set: launch "
                "with torchrun/accelerate launch, or pass shard=<ranks per shard group>"
            )
        shard = int(raw)
        if shard == world > 1 and dist.get_rank() == 0:
            warnings.warn(one_node_message(world), stacklevel=2)
    if shard < 1 or world % shard:
        raise ValueError(f"hsdp_mesh: shard={shard} must divide the world size {world}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (world // shard, shard), mesh_dim_names=MESH_DIMS)


def one_node_message(world: int) -> str:
    """What :func:`hsdp_mesh` says when every rank is on one node (``LOCAL_WORLD_SIZE`` = world size)."""
    try_shard = next((d for d in range(world // 2, 0, -1) if world % d == 0 and d < world), 1)
    return (
        f"hsdp_mesh(): all {world} processes are on one node (LOCAL_WORLD_SIZE = world size {world}), so the mesh "
        f"is 1 x {world}: no replicate dimension, DeMo exchanges nothing, this is pure FSDP. To try HSDP-DeMo on one "
        f"machine pass shard=<processes per shard group>, e.g. hsdp_mesh(shard={try_shard}) for "
        f"{world // try_shard} x {try_shard}; hsdp_mesh(shard={world}) says pure FSDP is meant (no warning)"
    )


def layer_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks FSDP2 shards one by one: the model's ``_no_split_modules`` classes (every transformers model
    names its decoder layer there), else the children of its first ``ModuleList``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(lists[0]) if lists else []


def shard_model(model: torch.nn.Module, mesh, layers: list[torch.nn.Module] | None = None, **fully_shard_kwargs):
    """FSDP2 (``fully_shard``) on the shard dimension of ``mesh``: every layer (``layers``, default
    :func:`layer_modules`), then the root. Gradients are reduce-scattered inside the shard group only; nothing
    crosses the replicate dimension until DeMo (``DeMo(..., device_mesh=mesh)``) exchanges. Returns ``model``."""
    from torch.distributed.fsdp import fully_shard

    shard_mesh = mesh[mesh.mesh_dim_names[-1]] if mesh.ndim == 2 else mesh  # (replicate, shard): the second
    for layer in layer_modules(model) if layers is None else layers:
        fully_shard(layer, mesh=shard_mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=shard_mesh, **fully_shard_kwargs)
    return model


def shard_with_accelerate(model: torch.nn.Module, accelerator):
    """:func:`shard_model` on Accelerate's mesh (``parallelism_config``: ``dp_replicate`` x ``dp_shard``) with its
    FSDP plugin's mixed precision and resharding; returns the (replicate, shard) mesh DeMo needs for HSDP, the
    shard mesh alone for pure FSDP (nothing to exchange)."""
    from torch.distributed.device_mesh import init_device_mesh

    plugin = accelerator.state.fsdp_plugin
    # Accelerate resolves its auto-wrap policy from the model's layer class names when it prepares the model; after
    # fully_shard those classes are FSDP subclasses (FSDPLlamaDecoderLayer), so resolve it now, on the plain model
    plugin.set_auto_wrap_policy(model)
    kwargs = {"reshard_after_forward": plugin.reshard_after_forward}
    if plugin.mixed_precision_policy is not None:
        kwargs["mp_policy"] = plugin.mixed_precision_policy
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is None:
        mesh = init_device_mesh(accelerator.device.type, (dist.get_world_size(),), mesh_dim_names=("dp_shard_cp",))
    else:
        dims = tuple(accelerator.parallelism_config.fsdp_dim_names)
        mesh = mesh[dims] if len(dims) > 1 else mesh[dims[0]]
    shard_model(model, mesh, **kwargs)
    return mesh


def is_fsdp2(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    inner = getattr(model, "_orig_mod", model)
    return isinstance(inner, FSDPModule)


LAYOUT_KEY = "hf_demo_layout"  # beside "model" and "optimizer" in a checkpoint: the mesh the optimizer was saved on


def layout_of(optimizer) -> str:
    """The mesh DeMo's state is placed on, e.g. ``"mesh 2x2"`` (replicate x shard); ``"flat"`` for DDP-DeMo."""
    topology = optimizer.topology
    return topology.identity()[2] if topology.name == "sharded" else "flat"


def save_checkpoint(path, model: torch.nn.Module, optimizer=None) -> None:
    """The model's and DeMo's sharded state through ``torch.distributed.checkpoint`` (every rank calls it):
    ``get_state_dict`` of both, and the mesh DeMo's state is placed on. A flat DeMo (each rank a whole replica) is
    saved too: each rank's own state as its pieces over every rank (:func:`flat_to_dcp`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
        return
    if layout_of(optimizer) == "flat":
        state = {"model": get_model_state_dict(model), "optimizer": flat_to_dcp(optimizer.state_dict())}
        dcp.save({**state, LAYOUT_KEY: "flat"}, checkpoint_id=path)
        return
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd, LAYOUT_KEY: layout_of(optimizer)}, checkpoint_id=path)


def load_checkpoint(path, model: torch.nn.Module, optimizer=None) -> None:
    """Restore what :func:`save_checkpoint` wrote, on every rank; DeMo resumes bit for bit on the same mesh. On a
    mesh of another shape it stops first, naming both: each rank's momentum is blocked on its own shard.
    ``optimizer=None`` loads the model only (then start DeMo afresh)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

    from hf_demo.refusals import refuse

    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
        return
    saved = {LAYOUT_KEY: ""}
    dcp.load(saved, checkpoint_id=path)
    now = layout_of(optimizer)
    if saved[LAYOUT_KEY] != now:
        refuse("resume_dcp_other_mesh", saved=saved[LAYOUT_KEY], now=now)
    if now == "flat":
        state = {"model": get_model_state_dict(model), "optimizer": flat_template(path)}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
        optimizer.load_state_dict(flat_from_dcp(state["optimizer"]))
        return
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    unasked = _unasked(path, model, optim_sd)
    if unasked:
        entries = ", ".join(unasked[:4]) + (", ..." if len(unasked) > 4 else "")
        refuse("resume_dcp_other_settings", entries=entries)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _unasked(path, model, optim_sd: dict) -> list[str]:
    """The per-parameter entries of the checkpoint that a load into ``optim_sd`` would leave behind (for the
    parameters with rows on this rank)."""
    import torch.distributed.checkpoint as dcp

    from hf_demo.topology.dtensor import local_shape

    held = {name for name, p in model.named_parameters() if 0 not in local_shape(p)}
    wanted = {f"optimizer.state.{fqn}.{key}" for fqn, entry in optim_sd["state"].items() for key in entry}
    prefixes = tuple(f"optimizer.state.{fqn}." for fqn in held)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return sorted(k for k in saved if k.startswith(prefixes) and k not in wanted)


# flat DeMo (each rank a whole replica) through DCP: each rank's own state as its pieces of DTensors over every rank
# (hf_demo.optim.own_state, the pieces its rank file holds), the rest of its state_dict() (the same on every rank
# but for its identity) as one object under its own rank's key
OWN, RANK = "own", "rank{}"


def _world_mesh():
    from torch.distributed.device_mesh import DeviceMesh

    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    return DeviceMesh.from_group(dist.group.WORLD, device)


def flat_to_dcp(sd: dict) -> dict:
    """A flat DeMo's ``state_dict()`` as DCP saves it: ``own`` (each rank's pieces placed over every rank, one
    DTensor per parameter and entry) and this rank's remaining state, serialised under ``rank<r>``."""
    import io

    from hf_demo.optim.own_state import own_key, own_state
    from hf_demo.topology.dtensor import pieces_over

    mesh, pieces = _world_mesh(), own_state(sd["state"])
    own = {
        str(pid): {k: pieces_over(mesh, v) for k, v in entry.items() if v.dim() > 0} for pid, entry in pieces.items()
    }
    kept = lambda k, v: not (own_key(k) and v.dim() > 0)  # noqa: E731 - what is not a piece
    rest = {**sd, "state": {pid: {k: v for k, v in e.items() if kept(k, v)} for pid, e in sd["state"].items()}}
    blob = io.BytesIO()
    torch.save(rest, blob)
    blob.seek(0)
    return {OWN: own, RANK.format(dist.get_rank()): blob}


def flat_template(path) -> dict:
    """What :func:`flat_to_dcp` saved, as the template ``dcp.load`` fills on this rank: its own pieces (zeros of the
    saved width) and its own object."""
    import io

    import torch.distributed.checkpoint as dcp

    from hf_demo.refusals import refuse
    from hf_demo.topology.dtensor import pieces_over

    mesh, own = _world_mesh(), {}
    prefix, saved = f"optimizer.{OWN}.", dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    ranks = sum(1 for fqn in saved if fqn.startswith("optimizer." + RANK.format("")))
    if ranks != mesh.size():
        refuse("resume_other_world", saved_world=ranks, world=mesh.size())
    for fqn, meta in saved.items():
        if fqn.startswith(prefix):
            pid, key = fqn[len(prefix) :].split(".", 1)
            width = meta.size[0] // mesh.size()
            own.setdefault(pid, {})[key] = pieces_over(mesh, torch.zeros(width, dtype=meta.properties.dtype))
    return {OWN: own, RANK.format(dist.get_rank()): io.BytesIO()}


def flat_from_dcp(saved: dict) -> dict:
    """The inverse of :func:`flat_to_dcp` once loaded: this rank's ``state_dict()``, its own entries the pieces."""
    from hf_demo.topology.dtensor import local

    blob = saved[RANK.format(dist.get_rank())]
    blob.seek(0)
    sd = torch.load(blob, map_location="cpu", weights_only=True)
    for pid, entry in saved[OWN].items():
        sd["state"].setdefault(int(pid), {}).update({k: local(v).clone() for k, v in entry.items()})
    return sd
