"""How the averaged, decoded update becomes a parameter step (after decoupled weight decay).

Every rank holds the same averaged update, so every rule runs identically on every rank: the replicas stay
bitwise identical and no rule costs communication. A rule is a small object whose ``direction(param, update, state)``
returns the step direction (``param <- param - lr * direction``, applied by
:func:`hf_demo.compression.functional.apply_step`); its per-parameter state (if any) lives in the optimizer's
``state[param]`` and is saved and resumed with it. Add a rule by writing one class here and listing it in :data:`RULES`.
"""

from __future__ import annotations

import torch

from hf_demo.errors import lookup


def sign_step(update: torch.Tensor) -> torch.Tensor:
    """The paper's rule: ``sign(update)`` (in place)."""
    return update.sign_()


def second_moment_denominator(
    update: torch.Tensor, exp_avg_sq: torch.Tensor, step: int, beta2: float, eps: float
) -> torch.Tensor:
    """``sqrt(v / (1 - beta2**t)) + eps`` after ``v <- beta2*v + (1-beta2)*u^2`` (``exp_avg_sq`` in place)."""
    exp_avg_sq.mul_(beta2).addcmul_(update, update, value=1.0 - beta2)
    return (exp_avg_sq / (1.0 - beta2**step)).sqrt_().add_(eps)


def adam_step(update: torch.Tensor, exp_avg_sq: torch.Tensor, step: int, beta2: float, eps: float) -> torch.Tensor:
    """Second-moment normalisation of the averaged update: ``u / (sqrt(v / (1 - beta2**t)) + eps)``.

    ``exp_avg_sq`` (fp32, the parameter's shape) is updated in place; ``step`` counts from 1.
    """
    return update.div_(second_moment_denominator(update, exp_avg_sq, step, beta2, eps))


def adamw_step(
    update: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    beta1: float,
    beta2: float,
    eps: float,
) -> torch.Tensor:
    """Adam's two moments of the averaged update: ``m_hat / (sqrt(v_hat) + eps)``.

    ``exp_avg`` and ``exp_avg_sq`` (fp32, the parameter's shape) are updated in place; ``step`` counts from 1.
    """
    exp_avg.mul_(beta1).add_(update, alpha=1.0 - beta1)
    denom = second_moment_denominator(update, exp_avg_sq, step, beta2, eps)
    return (exp_avg / (1.0 - beta1**step)).div_(denom)


def next_step(state: dict, param: torch.Tensor, *moments: str) -> int:
    """Create the rule's fp32 moment buffers the first time, count this step (a host counter: no device sync)."""
    for key in moments:
        if key not in state:
            state[key] = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
    if "rule_step" not in state:
        state["rule_step"] = torch.zeros((), dtype=torch.int64, device="cpu")
    state["rule_step"] += 1
    return int(state["rule_step"])


class SignRule:
    name = "sign"

    def direction(self, param: torch.Tensor, update: torch.Tensor, state: dict) -> torch.Tensor:
        return sign_step(update)


class RawRule:
    name = "raw"

    def direction(self, param: torch.Tensor, update: torch.Tensor, state: dict) -> torch.Tensor:
        return update


class AdamRule:
    """Adam-style normalisation of the averaged update (state ``exp_avg_sq``: 4 bytes per parameter)."""

    name = "adam"
    beta2 = 0.999
    eps = 1e-8

    def direction(self, param: torch.Tensor, update: torch.Tensor, state: dict) -> torch.Tensor:
        step = next_step(state, param, "exp_avg_sq")
        return adam_step(update.float(), state["exp_avg_sq"], step, self.beta2, self.eps)


class AdamWRule:
    """AdamW's moments on the averaged update (DeToNATION's DeToAdamW idea): a first moment smooths the
    fast components DeMo sends, the second normalises them (state ``exp_avg`` + ``exp_avg_sq``: 8 bytes per
    parameter). The betas are AdamW's of the benchmarks' baseline."""

    name = "adamw"
    beta1 = 0.9
    beta2 = 0.95
    eps = 1e-8

    def direction(self, param: torch.Tensor, update: torch.Tensor, state: dict) -> torch.Tensor:
        step = next_step(state, param, "exp_avg", "exp_avg_sq")
        return adamw_step(update.float(), state["exp_avg"], state["exp_avg_sq"], step, self.beta1, self.beta2, self.eps)


STATE_KEYS = ("exp_avg", "exp_avg_sq", "rule_step")  # every key a rule keeps in the optimizer's per-parameter state

RULES = {rule.name: rule for rule in (SignRule, RawRule, AdamRule, AdamWRule)}
UPDATE_RULES = tuple(RULES)


def get(name: str):
    return lookup(RULES, "update rule", name)()
