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
piece of a DTensor, so every rank resumes its own, bit for bit, on the same mesh.
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
    ``get_state_dict`` of both, and the mesh DeMo's state is placed on."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
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
