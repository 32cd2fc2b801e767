"""Parameter groups: a group added to the optimizer checked, a parameter refused, the momentum re-planned on resume
(the step's plan of the groups and their per-step check: :mod:`hf_demo.optim.view`)."""

from __future__ import annotations

import torch

from hf_demo.compression import plan
from hf_demo.errors import DeMoStateError
from hf_demo.optim.view import validate_group
from hf_demo.refusals import refuse
from hf_demo.settings import DeMoSettings
from hf_demo.topology.dtensor import local_shape


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
