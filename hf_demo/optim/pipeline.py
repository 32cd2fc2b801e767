"""One optimizer step as a pipeline of parts, each with one job, run top to bottom; each hands the next a record.

    plan -> topology -> signal -> inspect -> momentum -> prepare -> agreement -> communicate -> vote
         -> policy -> judge -> land -> update -> commit                  (then DeMo.step takes the outcome, commits)

A part is an object with a ``name`` and ``run(step, <records>)``: it is given the :class:`~hf_demo.optim.records.Step`
(the optimizer's narrow view :class:`~hf_demo.optim.view.OptimizerView`, this step's transport, its transaction) and,
by parameter name, the records of :mod:`hf_demo.optim.records` it reads; it returns the one record it makes
(``makes``; none for ``update``, which stages writes only). The records, and the part that
makes each:

    ========== ===================== =============================================================================
    record     type                  made by
    ========== ===================== =============================================================================
    plan       StepPlan              ``plan``: the tier, every trainable (param, group, layout), the checksums
    chosen     Chosen                ``topology``: what this rank steps, with which gradient
    signal     Signalled             ``signal``: what enters the momentum; replicas; a local step's inner steps
    found      Findings              ``inspect``: header flags, fingerprints; overlap: the exchange in flight
    momenta    Momenta               ``momentum``: the working momenta
    prepared   Prepared              ``prepare``: the exchange and this rank's payload
    agreed     Agreed                ``agreement``: every rank's header (and payload, where it rode)
    exchanged  Exchanged             ``communicate``: the averaged coefficients, or this rank's refusal
    settled    Settled               ``vote``: a tentative commit (its verdict settles in the next exchange)
    decision   Decision              ``policy``: the budget policy, a move down
    verdict    Verdict               ``judge``: skip, resync
    landed     Landed                ``land``: the exchange left in flight (overlap)
    outcome    Outcome               ``commit``: what the optimizer takes at the commit
    ========== ===================== =============================================================================

No part writes to the optimizer, the parameters or the counters: a part stages its writes in ``step.tx``
(:mod:`hf_demo.optim.transaction`), and :meth:`hf_demo.DeMo.step` stages the outcome last and commits once the
whole step has succeeded on every rank. Which part does a job is chosen from a registry: the topology by the
parameters (:mod:`hf_demo.topology`), the signal by the tier's ``sync_every`` (:mod:`hf_demo.optim.signals`), the
transform by ``transform`` (:mod:`hf_demo.compression.transforms`), the exchange by ``exchange``
(:mod:`hf_demo.exchange.exchanges`), the update rule by ``update_rule`` (:mod:`hf_demo.optim.update_rules`).
``docs/DESIGN.md`` shows how to add one.

Traces: the step is a ``torch.profiler.record_function`` range ``DeMo.step``, each part one named
``DeMo.<part>`` (:data:`TRACE_NAMES`: ``prepare`` is ``DeMo.compress``), and ``DeMo.exchange`` spans the parts of
the exchange (:data:`EXCHANGE`: ``agreement``, whose all-gather carries the payload in steady state, and
``communicate``, the exchange's own collectives), so the step's exchange collectives sit inside it; the PyTorch
profiler, TensorBoard and Perfetto show them; on CUDA the same names are NVTX ranges too (Nsight).
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from hf_demo.optim.records import MADE_BY, Step
from hf_demo.optim.transaction import Transaction

TRACE_NAMES = {"prepare": "compress"}  # a part's name in traces, where it differs
EXCHANGE = ("agreement", "communicate")  # the first and the last part inside the range DeMo.exchange


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


def reads(part) -> list[str]:
    """The records ``part.run`` reads: its parameters after the step, each named as :data:`MADE_BY` names one."""
    return list(inspect.signature(part.run).parameters)[1:]


class Pipeline:
    """The parts of a step, in order. A part reads the records its ``run`` names (None for one that a left-out
    part would have made) and returns the record it ``makes``. A step whose ``signal`` does not communicate (a
    local step) leaves out the parts of the exchange (those whose ``exchanging`` is true, the default); a
    ``decision`` with a ``retry`` ends this try (the policy's move down: :func:`run_step` runs the step again)."""

    def __init__(self, parts):
        self.parts = list(parts)
        self.reads = [reads(part) for part in self.parts]  # read once: the signatures do not change
        made: list[str] = []
        for part, names in zip(self.parts, self.reads):
            unknown = [name for name in names if name not in made]
            if unknown:
                raise ValueError(f"part {part.name!r} reads {unknown}, which no part before it makes")
            if part.makes is not None:
                maker = MADE_BY[part.makes][1]
                if maker != part.name:
                    raise ValueError(f"part {part.name!r} makes {part.makes!r}, the record of part {maker!r}")
                made.append(part.makes)

    def run(self, step: Step, cuda: bool = False) -> dict:
        """{record name: record} of one try of the step."""
        made: dict = {}
        with contextlib.ExitStack() as exchange:  # the range DeMo.exchange, from EXCHANGE[0] to EXCHANGE[-1]
            for part, names in zip(self.parts, self.reads):
                signal = made.get("signal")
                if signal is not None and not signal.communicates and getattr(part, "exchanging", True):
                    continue  # a local step: no exchange this time
                if part.name == EXCHANGE[0]:
                    exchange.enter_context(traced("DeMo.exchange", cuda))
                with traced(f"DeMo.{TRACE_NAMES.get(part.name, part.name)}", cuda):
                    record = part.run(step, *(made.get(name) for name in names))
                if part.name == EXCHANGE[-1]:
                    exchange.close()
                if part.makes is not None:
                    made[part.makes] = record
                if part.makes == "decision" and record.retry is not None:
                    break
        return made

    def names(self) -> list[str]:
        return [part.name for part in self.parts]


def run_step(view, pipeline: Pipeline, transport, cuda: bool = False) -> tuple[Step, dict]:
    """The step, again in a lower tier as long as the policy moves down at its headers (a loop, not recursion):
    every try's traffic is counted (the step's one transport), nothing else of a try that moved down is kept (a
    fresh transaction). Returns the last try's step (its transaction holds the step's writes) and records."""
    with traced("DeMo.step", cuda):
        step = Step(view, transport, Transaction())
        made = pipeline.run(step, cuda)
        while made.get("decision") is not None and made["decision"].retry is not None:
            step = Step(view, transport, Transaction(), decided=made["decision"].retry)
            made = pipeline.run(step, cuda)
    return step, made
