"""Less frequent synchronisation (``sync_every = H > 1``): local steps between syncs, DeMo on the change.

Between synchronisations every rank trains on its own: an *inner step* per call, ``m_in <- beta*m_in +
(1-beta)*grad`` (``beta`` = :data:`INNER_BETA`), then the configured update rule on ``m_in``, decoupled weight
decay and the step. Every H-th call is a synchronisation: the rank's accumulated change since the last
synchronisation, the *pseudo-gradient* ``anchor - param`` (DiLoCo, SparseLoCo), goes through DeMo's own
machinery (DCT, top-k, error feedback, the exchange), and every rank sets ``param = anchor - mean update``:
the replicas are identical again and the anchor moves there. Traffic is one DeMo payload per H steps.

State per parameter: ``anchor`` (the parameters at the last synchronisation, the parameter's dtype) and
``inner_momentum`` (fp32): 4 bytes + one parameter copy more than every-step DeMo.
"""

from __future__ import annotations

import torch

from . import functional as F
from .update_rules import STATE_KEYS

INNER_BETA = 0.9


def is_sync_step(sync_every: int, step: int) -> bool:
    return sync_every <= 1 or (step + 1) % sync_every == 0


def anchor(state: dict, param: torch.Tensor) -> torch.Tensor:
    """The parameters at the last synchronisation (created from the parameters the first time)."""
    if "anchor" not in state:
        state["anchor"] = param.detach().clone()
    return state["anchor"]


def inner_step(param, grad, state: dict, rule, lr: float, weight_decay: float, generator):
    """One local step on copies: (new parameter value, new inner momentum, new rule state); nothing committed."""
    m_in = state.get("inner_momentum")
    m_in = torch.zeros(param.shape, dtype=torch.float32, device=param.device) if m_in is None else m_in.clone()
    if grad is not None:
        m_in.mul_(INNER_BETA).add_(grad.float(), alpha=1.0 - INNER_BETA)
    rule_state = {k: v.clone() for k, v in state.items() if k in STATE_KEYS}
    direction = rule.direction(param, m_in.clone(), rule_state)
    after = param.detach().clone()
    F.apply_step(after, direction, lr, weight_decay, generator)
    return after, m_in, rule_state


def commit_inner(param, state: dict, after, m_in, rule_state) -> None:
    param.copy_(after)
    state["inner_momentum"] = m_in
    state.update(rule_state)


def pseudo_gradient(anchor_value: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    return anchor_value.float() - after.float()


def commit_sync(param, state: dict, update: torch.Tensor, m_in, rule_state) -> None:
    """``param = anchor - update`` (identical on every rank), and the anchor moves there."""
    state["anchor"].copy_((state["anchor"].float() - update).to(param.dtype))
    param.copy_(state["anchor"])
    state["inner_momentum"] = m_in
    state.update(rule_state)
