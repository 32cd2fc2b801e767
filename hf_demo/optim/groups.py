"""Parameter groups: their validation, the step's plan (every trainable parameter's blocks) and its checksums."""

from __future__ import annotations

import math

import torch

from hf_demo.compression import plan
from hf_demo.errors import DeMoStateError
from hf_demo.refusals import refuse
from hf_demo.settings import DeMoSettings, check_blocks
from hf_demo.topology.dtensor import local_shape
from hf_demo.wire import codec

GROUP_KEYS = ("lr", "weight_decay") + DeMoSettings.per_group_names()


def plan_items(param_groups, settings: DeMoSettings, secret: bytes | None, tier):
    """([(param, group, layout)] of every trainable parameter, layout checksum, settings checksum) for a tier."""
    items, layout_key = [], []
    for group in param_groups:
        validate_group(group)
        for p in group["params"]:
            if not p.requires_grad or 0 in local_shape(p):  # an FSDP2 shard may hold no rows of a small tensor
                continue
            layout = plan(
                local_shape(p), group["compression_chunk"], max(1, group["compression_topk"] // tier.topk_divisor)
            )
            items.append((p, group, layout))
            layout_key.append((layout, str(p.dtype)))
    view = settings_view(param_groups, settings, secret, tier)
    return items, codec.checksum(tuple(layout_key)), codec.checksum(tuple(view.items()))


def settings_view(param_groups, settings: DeMoSettings, secret: bytes | None, tier) -> dict[str, str]:
    """Every setting the ranks must share, by name, with its value (what the settings checksum covers): DeMo's
    settings, whether payloads are signed, the tier, and each group's learning rate, weight decay and per-group
    settings. Ranks whose checksums differ compare these to name what differs."""
    view = {k: repr(v) for k, v in sorted(settings.as_dict().items())}
    view["signed payloads (HF_DEMO_SECRET)"] = repr(secret is not None)
    view["tier"] = repr(tier)
    for i, group in enumerate(param_groups):
        for k in GROUP_KEYS:
            view[f"param_groups[{i}].{k}"] = repr(group[k] if isinstance(group[k], str) else float(group[k]))
    return view


def bytes_by_tier(items, tiers, index_coding: str) -> list[float]:
    """Payload bytes per step of every tier (amortised over its sync_every), for the policy's predictions."""
    return [
        sum(
            codec.segment_bytes(
                plan(local_shape(p), g["compression_chunk"], max(1, g["compression_topk"] // t.topk_divisor)),
                t.value_format,
                index_coding,
            )
            for p, g, _ in items
        )
        / t.sync_every
        for t in tiers
    ]


def check_param(p: torch.Tensor) -> None:
    if p.is_complex():
        refuse("complex_parameters", shape=tuple(p.shape))
    if p.numel() == 0:
        raise ValueError(
            f"DeMo cannot optimise an empty parameter of shape {tuple(p.shape)}: leave it out of the optimizer"
        )


def replan_momentum(
    pid, momentum: torch.Tensor, p: torch.Tensor, saved_chunk: int, chunk: int, transform
) -> torch.Tensor:
    shape = local_shape(p)
    old, new = plan(shape, saved_chunk, 1), plan(shape, chunk, 1)
    if tuple(momentum.shape) != (old.nblocks, old.bsize):
        raise DeMoStateError(
            f"saved momentum of parameter {pid} has shape {tuple(momentum.shape)}, this model "
            f"needs {(old.nblocks, old.bsize)} (parameter shape {shape}, chunk {saved_chunk}): "
            "a different model?"
        )
    if saved_chunk == chunk:
        return momentum
    return transform.encode(transform.decode(momentum, old), new)


def group_of(param_groups: list[dict], p: torch.Tensor) -> dict:
    """The parameter group that holds ``p``."""
    return next(g for g in param_groups if any(q is p for q in g["params"]))


def check_added(group: dict, settings: DeMoSettings) -> None:
    """A parameter group just added to the optimizer (its defaults filled in): its values, the optimizer-wide
    settings' view of them, and each of its parameters, checked."""
    validate_group(group)
    settings.check_group(group)
    for p in group["params"]:
        check_param(p)


def validate_group(group: dict) -> None:
    def bad(name, why):
        raise ValueError(f"DeMo: invalid {name}={group[name]!r}: {why}")

    lr, wd, decay = group["lr"], group["weight_decay"], group["compression_decay"]
    chunk, topk = group["compression_chunk"], group["compression_topk"]
    if isinstance(lr, torch.Tensor):
        bad("lr", "a tensor learning rate is not supported; pass a float")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
        bad("lr", "must be a finite number >= 0")
    if not (isinstance(wd, (int, float)) and math.isfinite(wd) and wd >= 0):
        bad("weight_decay", "must be a finite number >= 0")
    if not (isinstance(decay, (int, float)) and 0.0 <= decay <= 1.0):
        bad("compression_decay", "must be in [0, 1]")
    check_blocks(chunk, topk)
