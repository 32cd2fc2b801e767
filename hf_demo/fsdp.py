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

import torch
import torch.distributed as dist

MESH_DIMS = ("replicate", "shard")


def hsdp_mesh(shard: int | None = None, device_type: str | None = None):
    """A (replicate, shard) DeviceMesh over every rank: ``shard`` ranks per shard group (default: the processes
    per node, ``LOCAL_WORLD_SIZE`` as torchrun and accelerate launch set it), ``world // shard`` replicas."""
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
    if shard < 1 or world % shard:
        raise ValueError(f"hsdp_mesh: shard={shard} must divide the world size {world}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (world // shard, shard), mesh_dim_names=MESH_DIMS)


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

    shard_mesh = mesh[MESH_DIMS[1]] if mesh.ndim == 2 else mesh
    for layer in layer_modules(model) if layers is None else layers:
        fully_shard(layer, mesh=shard_mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=shard_mesh, **fully_shard_kwargs)
    return model


def is_fsdp2(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    inner = getattr(model, "_orig_mod", model)
    return isinstance(inner, FSDPModule)
