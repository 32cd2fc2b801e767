"""Less frequent synchronisation (``sync_every = H > 1``): local steps between syncs, DeMo on the change.

Between synchronisations every rank trains on its own: an *inner step* per call, ``m_in <- beta*m_in +
(1-beta)*grad`` (``beta`` = :data:`INNER_BETA`), then the ``inner_rule`` on ``m_in`` (``adam`` by default:
local Adam steps, as DiLoCo's and SparseLoCo's inner AdamW), decoupled weight decay and the step. Every
H-th call is a synchronisation: the rank's accumulated change since the last synchronisation, the
*pseudo-gradient* ``anchor - param``, goes through DeMo's own machinery: error feedback ``e <- beta*e +
DCT(anchor - param)`` with ``beta`` from :func:`feedback_decay` (0.70 for top-96 of a 64x64 block by
default: what top-k has not sent fades instead of piling up behind the agreed model, SparseLoCo's decayed
error feedback), top-k, the exchange, and the mean over **every** rank (a rank that did not pick a
coefficient counts zero). Every rank sets ``param = anchor - outer_lr * mean update`` (:func:`outer_factor`:
the ``outer_lr`` setting, times sqrt(W/2) with ``outer_lr_scaling="sqrt_world"``): the replicas are identical
again and the anchor moves there. Traffic is one DeMo payload per H steps.

State per parameter: ``anchor`` (the parameters at the last synchronisation, the parameter's dtype),
``inner_momentum`` (fp32) and the inner rule's own state under ``inner_`` keys (adam: ``inner_exp_avg_sq``,
4 bytes, and a step counter), apart from the every-step rule's (a budget's policy switches between both).
"""

from __future__ import annotations

import math

import torch

from hf_demo import compression as F
from hf_demo.optim.update_rules import STATE_KEYS

INNER_BETA = 0.9


OUTER_LR_SCALINGS = ("none", "sqrt_world", "fourth_root_world")  # the outer_lr_scaling setting's values (outer_factor)


def outer_factor(outer_lr: float, scaling: str, world: int) -> float:
    """What a synchronisation multiplies the ranks' mean change by: ``outer_lr``, times ``sqrt(world / 2)`` with
    ``scaling="sqrt_world"`` (1 at 2 ranks, 2 at 8) or ``(world / 2) ** 0.25`` with ``"fourth_root_world"`` (1 at
    2 ranks, 1.41 at 8); ``world`` is the number of ranks the change is averaged over.

    Each rank's local change is mostly its own noise (the ranks' changes are nearly orthogonal), so the mean of
    ``world`` of them is about ``sqrt(world)`` times shorter than one: ``sqrt_world`` gives the applied change the
    size it has at 2 ranks, where the presets' learning rate was chosen; ``fourth_root_world`` makes up half of that
    shrinking (in log scale), for a mean whose direction is less sure the more ranks' noise it holds."""
    if scaling not in OUTER_LR_SCALINGS:
        raise ValueError(f"DeMo: invalid outer_lr_scaling={scaling!r}; expected one of {', '.join(OUTER_LR_SCALINGS)}")
    if scaling == "none":
        return outer_lr
    return outer_lr * (math.sqrt(world / 2) if scaling == "sqrt_world" else (world / 2) ** 0.25)


def feedback_decay(sync_decay: float, layout) -> float:
    """The error-feedback decay of one synchronisation: ``sync_decay`` per 1% of the block's coefficients sent.

    A block that sends few coefficients drains its buffer slowly and must keep its residue longer (top-4 of
    4096 keeps 0.985 of it per synchronisation with the default 0.86), one that sends many can forget it
    sooner (top-96: 0.70). The per-block decays that train well (sign values every 8 steps) are about 0.7 at
    top-96, 0.9 at top-32 and 0.95-0.985 at top-4; 0.7 at top-4 all but stops training.
    """
    return sync_decay ** (100.0 * layout.k / layout.bsize)


def is_sync_step(sync_every: int, step: int) -> bool:
    return sync_every <= 1 or (step + 1) % sync_every == 0


INNER = "inner_"  # the inner rule's state keys: inner_exp_avg_sq, inner_rule_step, ...


LOCAL_KEYS = ("anchor", "inner_momentum", *(INNER + k for k in STATE_KEYS))  # a local phase's state


def forget(state: dict) -> None:
    """Drop the local phase's state (anchor, inner momentum, inner rule state): the next one starts afresh."""
    for key in LOCAL_KEYS:
        state.pop(key, None)


def inner_step(param, grad, state: dict, rule, lr: float, weight_decay: float, generator):
    """One local step on copies: (new parameter value, new inner momentum, new rule state); nothing committed.
    The definition, one parameter at a time: :func:`inner_steps` takes the step of many at once, bit for bit."""
    m_in = state.get("inner_momentum")
    m_in = torch.zeros(param.shape, dtype=torch.float32, device=param.device) if m_in is None else m_in.clone()
    if grad is not None:
        m_in.mul_(INNER_BETA).add_(grad.float(), alpha=1.0 - INNER_BETA)
    rule_state = {k: state[INNER + k].clone() for k in STATE_KEYS if INNER + k in state}
    direction = rule.direction(param, m_in.clone(), rule_state)
    after = param.detach().clone()
    F.apply_step(after, direction, lr, weight_decay, generator)
    return after, m_in, rule_state


def inner_steps(
    params: list, grads: list, states: list[dict], rules: list, lrs: list, weight_decays: list, generator, matrices
):
    """:func:`inner_step` of every parameter, on copies, the same bits: the inner momenta with
    ``torch._foreach_*``, each inner rule's :meth:`~hf_demo.optim.update_rules.Rule.directions` once for all the
    parameters it steps (on whole matrices where the rule needs them: ``matrices``, the topology's view of the
    parameters, :func:`~hf_demo.optim.update_rules.directions_of`), the steps once per (learning rate, weight
    decay) (``functional.apply_steps``)."""
    momenta = [
        s["inner_momentum"].clone()
        if "inner_momentum" in s
        else torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        for p, s in zip(params, states)
    ]
    fed = [i for i, g in enumerate(grads) if g is not None]
    if fed:
        torch._foreach_mul_([momenta[i] for i in fed], INNER_BETA)
        torch._foreach_add_([momenta[i] for i in fed], [grads[i].float() for i in fed], alpha=1.0 - INNER_BETA)
    by_rule: dict[str, list[int]] = {}
    for i, rule in enumerate(rules):
        by_rule.setdefault(rule.name, []).append(i)
    directions, rule_states = [None] * len(params), [None] * len(params)
    for members in by_rule.values():
        own = [{k: states[i][INNER + k] for k in STATE_KEYS if INNER + k in states[i]} for i in members]
        rule = rules[members[0]]
        found, new = matrices.directions(
            rule, members, [params[i] for i in members], [momenta[i].clone() for i in members], own
        )
        for i, direction, state in zip(members, found, new):
            directions[i], rule_states[i] = direction, state
    afters = [p.detach().clone() for p in params]
    F.apply_steps(afters, directions, lrs, weight_decays, generator)
    return list(zip(afters, momenta, rule_states))


def _keep(state: dict, m_in, rule_state: dict) -> None:
    state["inner_momentum"] = m_in
    state.update({INNER + k: v for k, v in rule_state.items()})


def commit_inner(param, state: dict, after, m_in, rule_state) -> None:
    param.copy_(after)
    _keep(state, m_in, rule_state)


def pseudo_gradient(anchor_value: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    return anchor_value.float() - after.float()


def synchronised(anchor: torch.Tensor, update: torch.Tensor, outer_lr: float, dtype: torch.dtype) -> torch.Tensor:
    """``anchor - outer_lr * update`` in the parameter's dtype: the parameters of every rank after a
    synchronisation (at ``outer_lr`` 1 the update is applied as it is, not multiplied)."""
    applied = update if outer_lr == 1.0 else update * outer_lr
    return (anchor.float() - applied).to(dtype)


def commit_sync(param, state: dict, update: torch.Tensor, outer_lr: float, m_in, rule_state) -> None:
    """``param = anchor - outer_lr * update`` (identical on every rank), and the anchor moves there."""
    state["anchor"].copy_(synchronised(state["anchor"], update, outer_lr, param.dtype))
    param.copy_(state["anchor"])
    _keep(state, m_in, rule_state)
