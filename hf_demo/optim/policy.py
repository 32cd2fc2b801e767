"""A communication budget: tiers of fewer bytes when the network slows down, back up when it recovers.

With ``comm_budget = b > 0`` the optimizer keeps the time spent waiting on DeMo's exchange at most a
fraction ``b`` of the training time. The tiers, ordered by bytes (:func:`tiers`):

====  ===============================================  ===============================================
tier  exchange="all_gather"                            exchange="all_reduce"
====  ===============================================  ===============================================
0     the configured settings (e.g. bf16, top-32)       the configured settings
1     sign values                                      top-k / 2
2     sign values, top-k / 2                           top-k / 4
3     sign values, top-k / 4                           synchronising every ``policy_sync_every`` (H)
4     sign values, synchronising every H (8) steps     top-k / 2, every H
5     sign values, top-k / 2, every H                  top-k / 4, every H
6     sign values, top-k / 4, every H                  top-k / 8, every H
7     sign values, top-k / 8, every H
====  ===============================================  ===============================================

Each tier roughly halves the bytes of the one above it (tier 4 sends ~0.4x tier 3's), so a link that slows
down is met by the smallest cut that fits. Below top-k / 4 every step, local steps cost less loss than
fewer coefficients at about the same bytes (sign top-96 of 64x64 every 8 steps against sign top-4 every
step; top-32 every 8 steps against top-4 every 2), so the local-step tiers keep ``policy_sync_every`` and
halve their coefficients instead. Tiers that repeat the configured settings (e.g. sign values already, or
``sync_every`` already 8) are left out.

Every rank takes the same decision at the same step: the figures come from the headers (each rank's
exchange time and its time between communicating steps; the policy uses the largest of each), never from
a local clock alone. A decision is taken at each communicating step, from the headers that open it. A move
down applies to that very step: every rank prepares it again in the lower tier (one more header, 144
bytes), so a link that collapses costs the one exchange that revealed it and no more. A move up holds from
the next step (nothing is urgent, and a local phase ends on its synchronisation):

- down after ``policy_patience`` consecutive steps over budget, to the first lower tier predicted to fit
  the budget (the last tier if none does): a link that drops 100x is answered in one move, not three. A
  step more than :data:`SEVERE` times over budget (e.g. 60% of the time waiting with a budget of 15%)
  moves at once, without waiting for the patience: a collapsed link costs one slow step, not
  ``policy_patience`` + 1 (each of them seconds long);
- up one tier after ``policy_patience`` consecutive steps where the upper tier is predicted to stay under
  70% of the budget (the hysteresis that keeps the policy from flapping).

A prediction scales the exchange time by the tier's bytes and keeps the computing time:
``e * r / (elapsed - e + e * r)`` for an exchange time ``e`` and a byte ratio ``r`` (the tier's bytes over
those of the tier ``e`` was measured in).

The tier, and the counts of moves, are in ``state_dict()``: a resume continues in the same tier.
"""

from __future__ import annotations

from dataclasses import dataclass

HYSTERESIS = 0.7
SEVERE = 4.0  # a step this many times over budget moves down at once


@dataclass(frozen=True)
class Tier:
    value_format: str
    topk_divisor: int
    sync_every: int


def tiers(value_format: str, exchange: str, sync_every: int, policy_sync_every: int) -> list[Tier]:
    base = Tier(value_format, 1, sync_every)
    fmt = value_format if exchange == "all_reduce" else "sign"  # all_reduce sums values: its format stays
    fewer = [Tier(fmt, d, sync_every) for d in ((2, 4) if exchange == "all_reduce" else (1, 2, 4))]
    slowest = max(sync_every, policy_sync_every)
    # the local-step tiers, each sending less than the last every-sync_every tier (bytes ~ 1 / (divisor * H))
    last = fewer[-1].topk_divisor * sync_every
    slower = [Tier(fmt, d, slowest) for d in (1, 2, 4, 8) if d * slowest > last]
    return list(dict.fromkeys([base, *fewer, *slower]))  # ordered by bytes, no tier twice


@dataclass
class BudgetPolicy:
    budget: float
    patience: int
    tier: int = 0
    over: int = 0
    under: int = 0
    moves_down: int = 0
    moves_up: int = 0

    def decide(
        self, exchange_ms: float, elapsed_ms: float, bytes_by_tier: list[float], measured_in: int | None = None
    ) -> BudgetPolicy:
        """The policy after one observation (a new object: the optimizer commits it with the step).

        ``measured_in``: the tier the exchange ran in (default: the current one). It differs from the current
        tier after a move up (the next step's headers report the last exchange of the tier below) and after
        a move down into a local phase: the figures are scaled from the tier they were measured in.
        """
        nxt = BudgetPolicy(**vars(self))
        if self.budget <= 0 or elapsed_ms <= 0:
            return nxt
        exchange_ms = min(exchange_ms, elapsed_ms)
        measured = self.tier if measured_in is None else measured_in

        def predicted(tier: int) -> float:
            scaled = exchange_ms * bytes_by_tier[tier] / bytes_by_tier[measured]
            return scaled / (elapsed_ms - exchange_ms + scaled)

        fraction = predicted(self.tier)  # exchange_ms / elapsed_ms when measured in the current tier

        nxt.over = self.over + 1 if fraction > self.budget else 0
        up = self.tier - 1
        nxt.under = self.under + 1 if up >= 0 and predicted(up) < HYSTERESIS * self.budget else 0
        severe = fraction > SEVERE * self.budget
        if (nxt.over >= self.patience or severe) and self.tier + 1 < len(bytes_by_tier):
            lower = range(self.tier + 1, len(bytes_by_tier))
            down = next((t for t in lower if predicted(t) <= self.budget), len(bytes_by_tier) - 1)
            nxt.tier, nxt.over, nxt.under, nxt.moves_down = down, 0, 0, self.moves_down + 1
        elif nxt.under >= self.patience and up >= 0:
            nxt.tier, nxt.over, nxt.under, nxt.moves_up = up, 0, 0, self.moves_up + 1
        return nxt

    def state_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k not in ("budget", "patience")}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, int(v))


@dataclass
class Clock:
    """The figures a rank's header carries for the policy: its last exchange's time, the time since its last
    exchange started, and the tier that exchange ran in (the policy scales its predictions from it)."""

    last_exchange_ms: float = 0.0
    last_comm_start: float | None = None
    last_exchange_tier: int | None = None
