"""What one phase of a step hands the next: small frozen records, one per phase (:mod:`hf_demo.optim.phases`).

A phase takes the :class:`Step` (what every phase is given) and the records it reads, as its arguments; it returns
the one record it makes (each record's docstring names its phase). Nothing here is the optimizer's state: the
writes a phase computes are staged in ``step.tx`` and the optimizer takes the :class:`Outcome` at the commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hf_demo.wire import codec

if TYPE_CHECKING:
    from hf_demo.exchange.transport import StepTransport, Traffic
    from hf_demo.optim.policy import BudgetPolicy, Tier
    from hf_demo.optim.state import PendingExchange
    from hf_demo.optim.transaction import Transaction

SKIPPING_FLAGS = codec.FLAG_NONFINITE | codec.FLAG_NONFINITE_PARAMS  # every rank skips: nothing is computed


@dataclass(frozen=True)
class Step:
    """What every phase is given: the optimizer's narrow view (:class:`~hf_demo.optim.view.OptimizerView`), this
    step's transport (its collectives and their traffic), its transaction, and the policy's move down when this
    is the step again in a lower tier; ``settings``: the view's, at hand."""

    view: object  # hf_demo.optim.view.OptimizerView (not imported here: the view's modules import these records)
    transport: StepTransport
    tx: Transaction
    decided: BudgetPolicy | None = None
    settings: object = None  # hf_demo.settings.DeMoSettings: view.settings


@dataclass(frozen=True)
class StepPlan:
    """``plan``: the tier, every trainable (param, group, layout) in order, the checksums the ranks compare (and the
    settings the second covers, by name), the step's rounding noise, and the parameters whose rule needs whole
    matrices."""

    tier_index: int
    tier: Tier
    items: list
    layout_ck: int
    settings_view: dict  # every setting the ranks must share, by name: its value's repr (view.plan_items)
    settings_ck: int
    generator: torch.Generator | None
    whole: list = ()  # the trainable parameters whose update rule needs the whole matrix (a topology's matrices)


@dataclass(frozen=True)
class Chosen:
    """``topology``: the (param, group, layout) this rank steps and the gradient of each it uses; its params,
    groups and layouts apart, the local tensor of each param (a DTensor's shard, else the param), and the device of
    its buffers (taken once, by the topology that makes it: :func:`hf_demo.topology.flat.chosen`)."""

    items: list
    grads: list
    params: list
    groups: list
    layouts: list
    views: list
    device: torch.device


@dataclass(frozen=True)
class Signalled:
    """``signal``: what enters the momentum and what must be identical on every rank. Local steps: the anchors,
    each item's inner step on copies ((value after, inner momentum, rule state)), whether this step communicates
    (a local step does not), and a local step's own skip."""

    local: bool
    signals: list
    replicas: list
    communicates: bool = True
    anchors: list | None = None
    inner: list | None = None
    skip: bool = False


@dataclass(frozen=True)
class Findings:
    """``inspect``: this rank's header flags and fingerprints, when the step started, and (overlap) the updates
    of the exchange the last step started or this rank's refusal of it; a shard's header refused (sharded)."""

    flags: int
    first: bool
    check_drift: bool
    grad_print: int
    replica_print: int
    suspects: list
    started: float = 0.0
    late: list | None = None
    late_refusal: Exception | None = None
    header_refusal: Exception | None = None

    @property
    def skipping(self) -> bool:
        """Non-finite gradients or parameters here: this rank computes nothing and sends zeros."""
        return bool(self.flags & SKIPPING_FLAGS)


@dataclass(frozen=True)
class Momenta:
    """``momentum``: the working momenta (copies; committed with the step), empty where the rank skips."""

    working: list


@dataclass(frozen=True)
class Prepared:
    """``compress``: the step's exchange and this rank's payload."""

    exchange: object
    payload: torch.Tensor


@dataclass(frozen=True)
class Agreed:
    """``agreement``: every rank's header, every rank's payload where it rode with the headers (else None), a
    header this rank could not trust (raised through the vote), and this step's payload bytes on the wire."""

    headers: list
    arrived: torch.Tensor | None
    header_refusal: Exception | None
    wire_bytes: int | None
    row_bytes: int = 0  # each rank's row in the headers' all-gather


@dataclass(frozen=True)
class Exchanged:
    """``communicate``: the averaged coefficients of each item (None on a skip, overlap, or a refusal), and what
    this rank found wrong in what it received."""

    updates: list | None = None
    refusal: Exception | None = None


@dataclass(frozen=True)
class Settled:
    """``vote``: whether the step commits tentatively (its verdict settles in the next exchange:
    :mod:`hf_demo.optim.settle`), and the size of its header rows (what the collective after them has)."""

    tentative: bool = False
    row_bytes: int = 0
    again: bool = False  # a non-steady step whose every verdict was read whole: it may commit tentatively too
    owes: Exception | None = None  # a verdict of it failed this rank's checks: it keeps nothing, settles it later


@dataclass(frozen=True)
class Decision:
    """``policy``: the budget policy after this step, and a move down that makes the step go again."""

    policy: BudgetPolicy
    retry: BudgetPolicy | None = None


@dataclass(frozen=True)
class Verdict:
    """``judge`` (read by :func:`hf_demo.guards.decide`): skip the step, whether rank 0's replicas are
    copied (staged) and why, and whether the step is steady (its verdict may settle in the next exchange)."""

    skip: bool
    resynced: bool
    drifted: bool
    bad_param_ranks: list
    steady: bool = False


@dataclass(frozen=True)
class Landed:
    """``land`` (overlap, or an exchange in flight to land): the exchange this step leaves in flight (None: none)."""

    pending: PendingExchange | None


@dataclass(frozen=True)
class Outcome:
    """``commit``: what the optimizer takes at the commit, after every other staged write: the step's traffic
    (``dense`` bytes of a dense exchange to compare with), then ``record``, the fields of the optimizer's
    :class:`~hf_demo.optim.state.RunState` the step replaces: always the counters; the exchange left in flight
    (``pending``, where the step landed one); the policy (where the step exchanged or moved down into a local
    phase); the clock and first-exchange mark (where it ``exchanged``); the payload bytes agreed on the wire
    (``wire_agreed``, where they changed). ``warn_skips``: the step was skipped."""

    dense: int
    traffic: Traffic
    record: dict
    exchanged: bool = False
    warn_skips: bool = False
