"""What a step's phases read of the optimizer: :class:`OptimizerView`, taken once per step by
:func:`of_optimizer` (``DeMo.step_view``), instead of the optimizer itself; and what the step makes of its
parameter groups: the plan (every trainable parameter's blocks, each group checked), the settings the ranks compare,
and the update rules' directions.

The view holds the settings, the secret and sealer, the topology, the policy's figures, the counters, the exchange
in flight and the per-parameter state (read; a phase writes it only through the step's transaction). It has no
setter: what the step changes in the optimizer is the :class:`~hf_demo.optim.records.Outcome` the optimizer takes
at the commit. The writes it allows outside the transaction are :attr:`OptimizerView.rescan_ddp` and
:attr:`OptimizerView.settle_prior` (see ``docs/DESIGN.md``, "The transaction").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hf_demo import compression as F
from hf_demo.exchange import transport as exchanges
from hf_demo.optim import update_rules
from hf_demo.settings import DeMoSettings, check_blocks
from hf_demo.topology.dtensor import local_shape
from hf_demo.wire import codec

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


GROUP_KEYS = ("lr", "weight_decay") + DeMoSettings.per_group_names()


def plan_items(param_groups, settings: DeMoSettings, secret: bytes | None, tier, sharded: bool = True):
    """([(param, group, layout)] of every trainable parameter, layout checksum, the settings view, settings checksum,
    the trainable parameters whose update rule needs the whole matrix: :meth:`OptimizerView.whole_matrix_params`) for
    a tier, each group checked. The settings view: every setting the ranks must share, by name, with its value (what
    the settings checksum covers): DeMo's settings, whether payloads are signed, the tier, and each group's learning
    rate, weight decay and per-group settings; ranks whose checksums differ compare these to name what differs.
    ``sharded`` False (the flat topology): every parameter is a plain tensor, its own local shard."""
    items, layout_key, whole = [], [], []
    view = dict(settings.reprs)
    view["signed payloads (HF_DEMO_SECRET)"] = repr(secret is not None)
    view["tier"] = repr(tier)
    for i, group in enumerate(param_groups):
        validate_group(group)
        if update_rules.get(group["update_rule"]).whole_matrix:
            whole += [p for p in group["params"] if p.requires_grad]
        for p in group["params"]:
            shape = local_shape(p) if sharded else tuple(p.shape)
            if not p.requires_grad or 0 in shape:  # an FSDP2 shard may hold no rows of a small tensor
                continue
            layout = F.plan(shape, group["compression_chunk"], max(1, group["compression_topk"] // tier.topk_divisor))
            items.append((p, group, layout))
            layout_key.append((layout, str(p.dtype)))
        for k in GROUP_KEYS:
            view[f"param_groups[{i}].{k}"] = repr(group[k] if isinstance(group[k], str) else float(group[k]))
    return items, codec.checksum(tuple(layout_key)), view, codec.checksum(tuple(view.items())), whole


def bytes_by_tier(items, tiers, index_coding: str) -> list[float]:
    """Payload bytes per step of every tier (amortised over its sync_every), for the policy's predictions."""
    return [
        sum(
            codec.segment_bytes(
                F.plan(local_shape(p), g["compression_chunk"], max(1, g["compression_topk"] // t.topk_divisor)),
                t.value_format,
                index_coding,
            )
            for p, g, _ in items
        )
        / t.sync_every
        for t in tiers
    ]


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
    if type(chunk) is not int or type(topk) is not int or (chunk, topk) not in _BLOCKS_CHECKED:
        check_blocks(chunk, topk)  # (each pair once: a pair of ints that passed passes again)
        _BLOCKS_CHECKED.add((chunk, topk))


_BLOCKS_CHECKED: set[tuple[int, int]] = set()  # (compression_chunk, compression_topk) pairs check_blocks passed


@dataclass(frozen=True)
class OptimizerView:
    settings: DeMoSettings
    secret: bytes | None
    sealer: Sealer | None
    transform: object
    spec: exchanges.ExchangeSpec  # the exchange's settings (exchange_spec, once): a step's spec is made from it
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
    workspace: F.Workspace | None = None  # the buffers the per-bucket math writes into (this optimizer's own)

    def plan(self, tier):
        return plan_items(self.param_groups, self.settings, self.secret, tier, self.topology.sharded)

    def bytes_by_tier(self, items) -> list[float]:
        return bytes_by_tier(items, self.tiers, self.settings.index_coding)

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

    def directions(self, params, groups, updates, layouts, matrices, views):
        """(each parameter's direction for its decoded update, its rule's new state), nothing written: the inverse
        transform once per bucket, each rule once for all the parameters it steps (on whole matrices where the rule
        needs them: ``matrices``, the topology's view of ``params``; ``views``: each one's local tensor)."""
        decoded = F.decode_many(updates, layouts, self.transform, self.workspace)
        by_rule: dict[str, list[int]] = {}
        for i, g in enumerate(groups):
            by_rule.setdefault(g["update_rule"], []).append(i)
        directions: list = [None] * len(params)
        states: list = [None] * len(params)
        for name, members in by_rule.items():
            ps = [params[i] for i in members]
            own, states_of = [views[i] for i in members], [self.state[p] for p in ps]
            found, new = matrices.directions(
                update_rules.get(name), members, own, [decoded[i] for i in members], states_of
            )
            for i, direction, state in zip(members, found, new):
                directions[i], states[i] = direction, state
        return directions, states


def of_optimizer(opt, elastic: bool = False) -> OptimizerView:
    """What the step's phases read of ``opt`` (a :class:`hf_demo.DeMo`), taken now (``DeMo.step_view``);
    ``elastic``: a wrapper decides the commit (``DeMo.prepare_step``)."""
    return OptimizerView(
        settings=opt.settings,
        secret=opt.secret,
        sealer=opt.sealer,
        transform=opt.transform,
        spec=opt.spec,
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
        workspace=opt.run_state.workspace,
    )
