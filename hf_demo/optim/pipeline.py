"""One optimizer step as a pipeline of parts, each with one job, run top to bottom on a :class:`StepContext`.

    plan -> topology.select -> signal -> inspect -> momentum -> prepare -> agreement -> communicate -> vote
         -> policy -> judge -> land -> update                                   (then DeMo.step commits)

Every part reads what the parts before it left in the context and adds its own results; none writes to the
optimizer, the parameters or the counters: it stages its writes in ``ctx.tx`` (:mod:`hf_demo.optim.transaction`),
which :meth:`hf_demo.DeMo.step` commits once the whole step has succeeded on every rank. Which part does a job
is chosen from a registry: the topology by the parameters (:mod:`hf_demo.topology`), the signal by
the tier's ``sync_every`` (:mod:`hf_demo.optim.signals`), the transform by ``transform``
(:mod:`hf_demo.compression.transforms`), the exchange by ``exchange`` (:mod:`hf_demo.exchange.exchanges`), the
update rule by ``update_rule`` (:mod:`hf_demo.optim.update_rules`). ``docs/DESIGN.md`` shows how to add one.

Traces: the step is a ``torch.profiler.record_function`` range ``DeMo.step``, each part one named
``DeMo.<part>`` (:data:`TRACE_NAMES`: ``prepare`` is ``DeMo.compress``, ``communicate`` ``DeMo.exchange``), so
the PyTorch profiler, TensorBoard and Perfetto show them; on CUDA the same names are NVTX ranges too (Nsight).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from hf_demo.exchange.transport import StepTransport
from hf_demo.optim import policy as policies
from hf_demo.optim.transaction import Transaction


@dataclass
class StepContext:
    """Everything one step computes, part by part (nothing here is the optimizer's state until committed)."""

    opt: object  # the DeMo being stepped
    transport: StepTransport  # this step's collectives (and their traffic) in the optimizer's exchange group
    tx: Transaction = field(default_factory=Transaction)
    decided: policies.BudgetPolicy | None = None  # the policy's move down, when this is the step again
    started: float = field(default_factory=time.monotonic)
    # plan
    tier_index: int = 0
    tier: policies.Tier | None = None
    all_items: list = field(default_factory=list)  # every trainable (param, group, layout), in order
    layout_ck: int = 0
    settings_ck: int = 0
    generator: torch.Generator | None = None
    # topology
    items: list = field(default_factory=list)  # the (param, group, layout) this rank steps
    grads: list = field(default_factory=list)  # the gradient of each item this rank uses
    # signal
    local: bool = False  # a tier with local steps (sync_every > 1)
    communicates: bool = True  # False: a local step that exchanges nothing
    anchors: list | None = None
    inner: list | None = None  # local steps: (value after, inner momentum, rule state) per item
    signals: list = field(default_factory=list)  # what enters the momentum
    replicas: list = field(default_factory=list)  # what must be identical on every rank
    # inspect
    first: bool = False
    check_drift: bool = False
    flags: int = 0
    grad_print: int = 0
    suspects: list = field(default_factory=list)
    late: list | None = None  # overlap: the updates of the exchange that the last step started
    late_refusal: Exception | None = None
    # momentum, prepare, agreement, policy
    exchange: object = None
    working: list = field(default_factory=list)
    payload: torch.Tensor | None = None
    headers: list = field(default_factory=list)
    header_refusal: Exception | None = None  # a header this rank could not trust (raised through the vote)
    arrived: torch.Tensor | None = None  # every rank's payload, where it rode with the headers
    wire_bytes: int | None = None  # this step's payload bytes on the wire (agreed once the step commits)
    policy: policies.BudgetPolicy | None = None
    retry: policies.BudgetPolicy | None = None  # a move down: the step goes again in the lower tier
    # judge, communicate, vote, update
    replica_print: int = 0
    resync: bool = False
    resynced: bool = False  # the resync's copies are staged
    skip: bool = False
    drifted: bool = False
    bad_param_ranks: list = field(default_factory=list)
    fresh: list | None = None  # rank 0's replicas (a resync)
    updates: list | None = None  # the averaged coefficients of each item
    in_flight: object = None  # overlap: the exchange started by this step
    refusal: Exception | None = None  # what this rank found wrong in what it received

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for p, _, _ in self.items]

    @property
    def layouts(self) -> list:
        return [layout for _, _, layout in self.items]

    @property
    def settings(self):
        return self.opt.settings

    @property
    def device(self) -> torch.device:
        return self.items[0][0].device if self.items else torch.device("cpu")

    def again(self, decided: policies.BudgetPolicy) -> StepContext:
        """A fresh context for this step in a lower tier: the traffic so far stays counted, nothing else."""
        return StepContext(self.opt, self.transport, decided=decided)


TRACE_NAMES = {"prepare": "compress", "communicate": "exchange"}  # a part's name in traces, where it differs


@contextlib.contextmanager
def traced(name: str, cuda: bool):
    """A ``record_function`` range named ``name`` (and an NVTX range on CUDA)."""
    with torch.profiler.record_function(name):
        if cuda:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if cuda:
                torch.cuda.nvtx.range_pop()


def _on_cuda(opt) -> bool:
    return any(p.is_cuda for group in opt.param_groups for p in group["params"][:1])


class Pipeline:
    """The parts of a step, in order. A part that sets ``ctx.communicates`` False (a local step) leaves out the
    parts of the exchange (those whose ``exchanging`` is true, the default); one that sets ``ctx.retry`` ends
    this try (the policy's move down: :func:`run_step` runs the step again)."""

    def __init__(self, parts):
        self.parts = list(parts)

    def run(self, ctx: StepContext, cuda: bool = False) -> StepContext:
        for part in self.parts:
            if not ctx.communicates and getattr(part, "exchanging", True):
                continue  # a local step: no exchange this time
            with traced(f"DeMo.{TRACE_NAMES.get(part.name, part.name)}", cuda):
                part.run(ctx)
            if ctx.retry is not None:
                break
        return ctx

    def names(self) -> list[str]:
        return [part.name for part in self.parts]


def run_step(opt, pipeline: Pipeline, transport: StepTransport) -> StepContext:
    """The step, again in a lower tier as long as the policy moves down at its headers (a loop, not recursion):
    every try's traffic is counted; the returned context's transaction holds the step's writes."""
    cuda = _on_cuda(opt)
    with traced("DeMo.step", cuda):
        ctx = pipeline.run(StepContext(opt, transport), cuda)
        while ctx.retry is not None:
            ctx = pipeline.run(ctx.again(ctx.retry), cuda)
    return ctx
