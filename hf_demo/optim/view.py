"""What a step's phases read of the optimizer: :class:`OptimizerView`, taken once per step by
:func:`of_optimizer` (``DeMo.step_view``), instead of the optimizer itself.

The view holds the settings, the secret and sealer, the topology, the policy's figures, the counters, the exchange
in flight and the per-parameter state (read; a phase writes it only through the step's transaction). It has no
setter: what the step changes in the optimizer is the :class:`~hf_demo.optim.records.Outcome` the optimizer takes
at the commit. The writes it allows outside the transaction are :attr:`OptimizerView.rescan_ddp` and
:attr:`OptimizerView.settle_prior` (see ``docs/DESIGN.md``, "The transaction").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hf_demo.errors import DeMoStateError
from hf_demo.exchange import transport as exchanges
from hf_demo.optim import groups, update_rules

if TYPE_CHECKING:
    from hf_demo.optim.policy import BudgetPolicy, Clock
    from hf_demo.optim.state import Counters, PendingExchange
    from hf_demo.settings import DeMoSettings
    from hf_demo.wire.sealing import Sealer


def exchange_spec(settings, secret, sealer, layouts, value_format: str, world: int = 1, average=None,
                  index_coding=None, positions=None) -> exchanges.ExchangeSpec:  # fmt: skip
    """A step's :class:`~hf_demo.exchange.transport.ExchangeSpec` from the settings (the tier's value format)."""
    coding, positions = index_coding or settings.index_coding, positions or settings.reduce_positions
    secret = None if sealer is not None else secret  # sealed: the AEAD tag replaces the HMAC
    return exchanges.ExchangeSpec(layouts, value_format, coding, secret, average, world, positions, sealer)


def rule(group: dict):
    """The update rule of a parameter group (``update_rule`` is a per-group setting)."""
    return update_rules.get(group["update_rule"])


def inner_rule(group: dict):
    """The local steps' rule of a parameter group (``inner_rule``, per group)."""
    return update_rules.get(group["inner_rule"])


@dataclass(frozen=True)
class OptimizerView:
    settings: DeMoSettings
    secret: bytes | None
    sealer: Sealer | None
    transform: object
    topology: object  # hf_demo.topology: flat or sharded
    tiers: list
    policy: BudgetPolicy
    clock: Clock
    counters: Counters
    wire_agreed: dict  # {(world, tier): payload bytes on the wire} of the last committed exchange there
    first_checked: bool  # this process's first exchange has been committed
    pending: PendingExchange | None  # the exchange in flight (overlap)
    context: str  # "trainer" or "loop", for the fixes errors name
    param_groups: list
    state: dict  # {param: its state}; written only through the step's transaction
    rule: Callable[[dict], object]  # a parameter group's update rule (:func:`rule`)
    inner_rule: Callable[[dict], object]  # a parameter group's local steps' rule (:func:`inner_rule`)
    header_timings: Callable[[float], dict]  # this rank's figures for the policy (exchange_ms, elapsed_ms)
    ddp_suspects: Callable[[], list]  # the parameters that DDP wrappers still all-reducing hold
    rescan_ddp: Callable[[], None]  # the first-step guard scans again at the next step (outside the transaction)
    elastic: bool = False  # torchft says whom DeMo exchanges with and whether a step commits
    unsettled: object = None  # hf_demo.optim.settle.Unsettled: the last step, committed tentatively (or None)
    settle_prior: Callable[[], None] = lambda: None  # every rank received that step whole: its undo log goes

    def plan(self, tier):
        return groups.plan_items(self.param_groups, self.settings, self.secret, tier)

    def settings_view(self, tier) -> dict[str, str]:
        return groups.settings_view(self.param_groups, self.settings, self.secret, tier)

    def bytes_by_tier(self, items) -> list[float]:
        return groups.bytes_by_tier(items, self.tiers, self.settings.index_coding)

    def exchange_spec(self, layouts, value_format: str, world: int = 1, average=None, index_coding=None,
                      positions=None) -> exchanges.ExchangeSpec:  # fmt: skip
        return exchange_spec(
            self.settings, self.secret, self.sealer, layouts, value_format, world, average, index_coding, positions
        )

    def everything(self) -> list[torch.Tensor]:
        """Every parameter of the optimizer, trainable or not, in its order."""
        return [p for g in self.param_groups for p in g["params"]]

    def positions(self, params) -> list[int]:
        """The positions of ``params`` among all of this optimizer's parameters (trainable or not)."""
        where = {id(p): i for i, p in enumerate(self.everything())}
        return [where[id(p)] for p in params]

    def group_of(self, p: torch.Tensor) -> dict:
        return next(g for g in self.param_groups if any(q is p for q in g["params"]))

    def whole_matrix_params(self, rule_of) -> list:
        """Every trainable parameter, in the optimizer's order (the same on every rank), whose rule (``rule_of`` its
        group: :func:`rule` or :func:`inner_rule`) needs the whole matrix."""
        return [p for g in self.param_groups if rule_of(g).whole_matrix for p in g["params"] if p.requires_grad]

    def momentum(self, p: torch.Tensor, layout) -> torch.Tensor:
        """``p``'s momentum (zeros before its first step); raises where its blocks no longer match ``layout``."""
        state = self.state[p]
        if "momentum" not in state:
            return torch.zeros(layout.nblocks, layout.bsize, dtype=torch.float32, device=p.device)
        if state["momentum"].shape != (layout.nblocks, layout.bsize):
            raise DeMoStateError(
                f"the momentum of a parameter of shape {tuple(p.shape)} is blocked as {tuple(state['momentum'].shape)} "
                f"but compression_chunk now asks for {(layout.nblocks, layout.bsize)}: compression_chunk was changed "
                "during training. Change it across a checkpoint instead (save, then resume with the new chunk: the "
                "momentum is re-planned); nothing was changed"
            )
        return state["momentum"]


def of_optimizer(opt, elastic: bool = False) -> OptimizerView:
    """What the step's phases read of ``opt`` (a :class:`hf_demo.DeMo`), taken now (``DeMo.step_view``);
    ``elastic``: a wrapper decides the commit (``DeMo.prepare_step``)."""
    return OptimizerView(
        settings=opt.settings,
        secret=opt.secret,
        sealer=opt.sealer,
        transform=opt.transform,
        topology=opt.topology,
        tiers=opt.tiers,
        policy=opt.policy,
        clock=opt.clock,
        counters=opt.counters,
        wire_agreed=opt.wire_agreed,
        first_checked=opt.first_checked,
        pending=opt.pending,
        context=opt.context,
        param_groups=opt.param_groups,
        state=opt.state,
        rule=opt.rule,
        inner_rule=opt.inner_rule,
        header_timings=opt.header_timings,
        ddp_suspects=opt.ddp_suspects,
        rescan_ddp=opt._rescan_ddp,
        elastic=elastic,
        unsettled=opt.unsettled,
        settle_prior=opt._settle_prior,
    )
