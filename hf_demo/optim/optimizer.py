"""``hf_demo.DeMo``: Decoupled Momentum Optimization as a ``torch.optim.Optimizer``.

A thin class over the step's phases: :meth:`DeMo.prepare_step` runs them (:func:`hf_demo.optim.phases.run_step`)
and hands back a :class:`StagedStep`, whose ``commit()`` applies the step's transaction and
``discard()`` drops it; :meth:`DeMo.step` is the two together. An error raised anywhere in a step (a bad payload, a
timeout, a disagreeing rank) leaves the optimizer, the parameters and the counters exactly as they were: the step
can be retried or the run resumed.

With ``HF_DEMO_SECRET`` set in the environment, every payload carries an HMAC-SHA256 tag and payloads without the
right tag are refused; with ``HF_DEMO_ENCRYPT=1`` beside it, every header and payload travels encrypted and bound
to its sender instead (AES-256-GCM, :mod:`hf_demo.wire.sealing`; see SECURITY.md).

DeMo owns its state: one frozen record (:class:`~hf_demo.optim.state.RunState`, ``run_state``), replaced whole by
one of its methods, a transition named for what happened (the commit, with what the step changed: the ``record``
of its :class:`~hf_demo.optim.records.Outcome`; ``loaded`` at a load; ``settled``, ``land_in_flight``,
``reset_peers``, ``run_by``, ...); no other module assigns an attribute of a DeMo
(``tests/test_state_ownership.py``). A tentative commit's undo puts back the record the commit replaced.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_demo import compression
from hf_demo import guards as ddp
from hf_demo.exchange import transport as exchanges
from hf_demo.exchange.transport import CommStats
from hf_demo.hf.launch_env import refuse_fsdp_on_cpu
from hf_demo.optim import checkpointing, groups, local_phase, overlap, phases, settle
from hf_demo.optim import policy as policies
from hf_demo.optim import view as views
from hf_demo.optim.phases import run_step
from hf_demo.optim.state import RunState, forgotten_peers
from hf_demo.refusals import refuse
from hf_demo.settings import DeMoSettings, with_sign_update
from hf_demo.topology import choose as choose_topology
from hf_demo.wire import sealing

logger = logging.getLogger(__name__)
SECRET_ENV = "HF_DEMO_SECRET"
__all__ = ["DeMo", "StagedStep"]


def _counter(name: str) -> property:
    """One of :class:`~hf_demo.optim.state.Counters` as an attribute of the optimizer (read only)."""
    return property(lambda self: getattr(self.run_state.counters, name))


def _field(name: str, of: str = "run_state") -> property:
    """A field of the optimizer's :class:`~hf_demo.optim.state.RunState` (or of ``of``) as its attribute (read only)."""
    return property(lambda self: getattr(getattr(self, of), name))


_READ = ("counters", "policy", "clock", "pending", "unsettled", "first_checked", "wire_agreed", "context", "run_id")
_READ += ("saved_world", "saved_identity")


def _header_timings(opt, started: float) -> dict:
    """``DeMo.header_timings``: this rank's figures for the policy, as its header carries them (exchange_ms,
    elapsed_ms), from the policy's :class:`~hf_demo.optim.policy.Clock` of the last exchange."""
    clock = opt.run_state.clock
    elapsed = (started - clock.last_comm_start) * 1000.0 if clock.last_comm_start is not None else 0.0
    return {"exchange_ms": round(clock.last_exchange_ms), "elapsed_ms": round(elapsed)}


def _params(opt) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _initialised() -> bool:
    return dist.is_available() and dist.is_initialized()


class DeMo(torch.optim.Optimizer):
    """Decoupled Momentum Optimization (Peng, Quesnelle & Kingma, 2024).

    Args:
        params: parameters or parameter groups. Groups may override ``lr``, ``weight_decay``,
            ``compression_decay``, ``compression_topk``, ``compression_chunk``, ``update_rule`` and
            ``inner_rule`` (``hf_demo.muon_style_groups(model)``: Muon-style groups for the orthogonal rule).
            Parameters with ``requires_grad=False`` are left untouched (no decay, no momentum, not sent).
        lr: learning rate; also scales the gradient into the momentum, as in the reference.
        weight_decay: decoupled weight decay, ``p *= 1 - lr*weight_decay``.
        process_group: the group to communicate in; default the world group when ``torch.distributed`` is
            initialised, otherwise a world of one.
        device_mesh: for parameters sharded by FSDP2 on the ``shard`` dimension of a (replicate, shard) mesh
            (HSDP, :func:`hf_demo.fsdp.shard_model`): that 2-D mesh; DeMo then exchanges each shard across the
            replicate dimension only (:mod:`hf_demo.topology.sharded`). Not needed for pure FSDP (one dimension).
        sign_update: the reference's switch, kept for compatibility: ``False`` means ``update_rule="raw"``.
        preset: a named starting point (:data:`hf_demo.settings.PRESETS`); settings given by name win over it.
        **settings: every other setting, by name: see :class:`hf_demo.settings.DeMoSettings`.

    Traffic signed or sealed: see the module's docstring (``HF_DEMO_SECRET``, ``HF_DEMO_ENCRYPT``).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, weight_decay: float = 0.0, process_group=None, *,
                 device_mesh=None, sign_update: bool | None = None, preset: str | None = None,
                 **settings):  # fmt: skip
        refuse_fsdp_on_cpu()  # an FSDP launch on the CPU: refused at first use, before Accelerate's own errors
        self.settings = DeMoSettings.resolve(preset, **with_sign_update(sign_update, settings))
        if process_group is not None and device_mesh is not None:
            refuse("mesh_and_group")
        self.process_group, self.device_mesh = process_group, device_mesh  # given here only
        self.transform = compression.get_transform(self.settings.transform)
        self.secret = os.environ.get(SECRET_ENV, "").encode() or None
        self.sealer = sealing.from_env(self.secret, self.settings)  # HF_DEMO_ENCRYPT=1: encrypted traffic
        self.comm_stats, s = CommStats(), self.settings  # (traffic totals, counted in place)
        self.run_state = RunState(policies.BudgetPolicy(s.comm_budget, s.policy_patience))  # what it keeps
        self.tiers = policies.tiers(s.value_format, s.exchange, s.sync_every, s.policy_sync_every)
        defaults = dict(lr=lr, weight_decay=weight_decay)
        defaults.update({k: getattr(self.settings, k) for k in DeMoSettings.per_group_names()})
        super().__init__(params, defaults)
        # the exchange's settings, from which every step's spec is made (views.exchange_spec): its refusals now
        self.spec = views.exchange_spec(self.settings, self.secret, self.sealer, [], self.settings.value_format)
        exchanges.build(self.settings.exchange, self.spec)

    steps, skipped_steps, resyncs = _counter("steps"), _counter("skipped_steps"), _counter("resyncs")
    consecutive_skips, unsynced = _counter("consecutive_skips"), _counter("unsynced")
    counters, policy, clock, pending, unsettled, first_checked, wire_agreed, context, run_id, *_ = map(_field, _READ)
    saved_world, saved_identity = map(_field, _READ[-2:])
    value_format, nonfinite = (_field(k, "settings") for k in ("value_format", "nonfinite"))
    tier = property(lambda self: self.policy.tier, doc="The communication tier in use (0: the settings; policy.py).")
    in_flight = property(lambda self: self.pending is not None, doc="An overlapped exchange still runs (flush()).")
    unconfirmed = property(lambda self: self.unsettled is not None, doc="The last step's verdict is not read yet.")
    settling = property(lambda self: self.unsettled is not None and self.unsettled.posted is not None,
                        doc="Its settling row still travels: this rank refused the last step.")  # fmt: skip

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        groups.check_added(self.param_groups[-1], self.settings)

    @property
    def topology(self):
        """The topology part (:mod:`hf_demo.topology`), built with its groups once the process group exists."""
        if self.run_state.peers is not None:  # given by reset_peers (hf_demo.elastic: this quorum's torchft group)
            return self.run_state.peers
        built, ready = self.run_state.topology, dist.is_available() and dist.is_initialized()
        if built is not None and (built.transport.world > 1 or built.name != "flat") == ready:
            return built
        kind, timeout = choose_topology(self.param_groups), self.settings.comm_timeout if ready else 0
        self._put(topology=kind.build(self.param_groups, self.process_group, self.device_mesh, ready, timeout))
        return self.run_state.topology

    transport = property(lambda self: self.topology.transport, doc="What DeMo exchanges over (the replicate group).")
    rule = staticmethod(views.rule)  # a parameter group's update rule (``update_rule`` is a per-group setting)
    inner_rule = staticmethod(views.inner_rule)  # its local steps' rule (``inner_rule``, per group)
    step_view = views.of_optimizer  # what the step's phases read of this optimizer, taken now
    header_timings = _header_timings  # this rank's figures for the policy, as its header carries them

    def identity(self) -> tuple[int, int, str]:
        """(rank, world size, scope) that a saved state belongs to."""
        return self.topology.identity() if _initialised() else (0, 1, "group")

    def device(self) -> torch.device:
        """Where the step's buffers live: the first trainable parameter's device."""
        trainable = (p.device for g in self.param_groups for p in g["params"] if p.requires_grad)
        return next(trainable, torch.device("cpu"))

    def run_by(self, context: str) -> None:
        """Where DeMo runs, for the fixes its errors name: ``"trainer"`` (DeMoTrainer) or ``"loop"``."""
        self._put(context=context)

    def _put(self, **fields) -> None:
        """The record replaced by one with ``fields`` changed (what every transition of DeMo's does)."""
        self.run_state = dataclasses.replace(self.run_state, **fields)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step on every rank: :meth:`prepare_step` and its :meth:`StagedStep.commit`. Refused where a
        wrapper gave DeMo its peers (:meth:`reset_peers`): the wrapper's ``step()`` steps it then."""
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        self._commit(self.prepare_step())
        return loss

    @torch.no_grad()
    def prepare_step(self, *, elastic: bool = False) -> StagedStep:
        """Every phase of a step (:func:`hf_demo.optim.phases.run_step`), nothing applied until
        :meth:`StagedStep.commit` (or :meth:`StagedStep.discard`): call one of the two, on every rank alike. An error
        raised here changes nothing. ``elastic``: a wrapper decides whether the step commits (its verdict is read
        within the step: :class:`hf_demo.elastic.Elastic`); required where a wrapper gave DeMo its peers."""
        if self.run_state.peers is not None and not elastic:
            refuse("wrapped_step")
        transport = self.transport.at(self.steps)
        if self.saved_world is not None or not self.run_id:  # a loaded state checked, this run's identity: once
            self.check_saved_world(), self.establish_run_id()  # (the store hands rank 0's to every rank)
        if not self.run_state.ddp_checked and _initialised():  # DeMo's first step in a process group: the guards
            self._put(ddp_wrappers=ddp.first_step_guard(self, _params(self), transport), ddp_checked=True)
        if self.settling:
            self.confirm(final=False)  # this rank refused the last step: it raises now, with every rank
        try:
            on_cuda, view = any(p.is_cuda for g in self.param_groups for p in g["params"][:1]), self.step_view(elastic)
            stepped, settled, outcome = run_step(view, transport, on_cuda)
        except settle.Deferred as exc:  # refused here; raised at the next step or confirm, with every rank
            self._put(unsettled=settle.deferred(self.unsettled, exc))
            return StagedStep(self, transport)
        except BaseException as exc:
            if getattr(exc, "undo_unsettled", False):
                settle.undo(self.settled())  # another rank refused the last step, committed here tentatively
            overlap.count_arrived(self.pending, self.comm_stats)
            raise
        if settled is not None and settled.owes is not None:  # a verdict this rank could not trust: settled later
            self._put(unsettled=settle.owe(view, transport, settled.owes, outcome, self.device()))
            return StagedStep(self, transport)
        return StagedStep(self, transport, stepped.tx, settled, outcome)

    def _commit(self, staged: StagedStep) -> None:
        """:meth:`StagedStep.commit`: the step's outcome staged last (its traffic counted, the record replaced by
        what the step changed, ``outcome.record``), and its transaction committed; tentatively, with an undo log
        (which puts the record and the traffic totals back), where its verdict settles later."""
        tx, outcome, settled = staged.close("committed"), staged.outcome, staged.settled
        if tx is None:
            return
        if outcome.warn_skips:
            tx.stage(lambda: phases.warn_skips(self.settings, outcome.record["counters"]), keeps_nothing=True)
        spare = self.run_state.undo_spare  # the last undo log's copies, reused
        self._put(undo_spare={})
        stats, state, totals = self.comm_stats, self.run_state, dict(vars(self.comm_stats))  # (the undo's pre-image)
        tx.stage(lambda: (stats.commit_step(outcome.dense, outcome.traffic), self._put(**outcome.record)),
                 before=lambda: lambda: (setattr(self, "run_state", state), vars(stats).update(totals)))  # fmt: skip
        tentative, row_bytes = settled is not None and settled.tentative, getattr(settled, "row_bytes", 0)
        if settled is not None and settled.again:  # a non-steady step every verdict of which was read whole
            s, world = self.run_state, staged.transport.world
            tentative, row_bytes = settle.keeps_undo(s.policy, s.wire_agreed, self.tiers, tx, outcome, world)
        undo = tx.commit(undo=tentative, spare=spare)  # (here: the warnings it stages name the caller)
        if tentative:
            self._put(unsettled=settle.Unsettled(staged.transport.step, row_bytes, undo=undo))

    def _discard(self, staged: StagedStep) -> None:
        """:meth:`StagedStep.discard`: nothing of the step is applied; what happened on the wire stays counted."""
        if staged.close("discarded") is not None:
            overlap.count_arrived(self.pending, self.comm_stats)

    # ------------------------------------------------------------------ transitions outside a step's transaction
    def settled(self) -> settle.Unsettled | None:
        """The last step's verdict is read (or it is undone): it is no longer unsettled. Returns it."""
        u = self.run_state.unsettled
        self._put(unsettled=None)
        return u

    def _settle_prior(self) -> None:
        """Every rank received the step committed tentatively whole (its verdicts read): its undo log goes."""
        if self.unsettled is not None and self.unsettled.posted is None:  # its copies take the next pre-images:
            self._put(unsettled=None, undo_spare=self.unsettled.undo.spare())  # (as settled() would, and the spare)

    def confirm(self, final: bool = True) -> None:
        """The last step's verdict read on every rank (three all-gathers), where it is not (:func:`settle.confirm`)."""
        if self.unsettled is not None:  # (else no collective)
            keys = (self.secret, self.sealer, self.device())
            settle.confirm(self.unsettled, self.transport, *keys, self.comm_stats, self.settled, final)

    def _rescan_ddp(self) -> None:
        """The first-step DDP guard runs again at the next step (a write outside the transaction: docs/DESIGN.md)."""
        self._put(ddp_checked=False)

    def ddp_suspects(self) -> list[torch.Tensor]:
        """The parameters that the watched wrappers (alive and still all-reducing) hold."""
        return ddp.suspects(self.run_state.ddp_wrappers, _params(self))

    def land_in_flight(self, pending) -> None:
        self._put(pending=pending)

    def reset_peers(self, topology=None) -> None:
        """The peers changed (an elastic quorum): what DeMo learnt of the last ones goes (``state.forgotten_peers``); it
        exchanges over ``topology`` from now on, stepped by the wrapper that gave it (None: its own group)."""
        self._put(**forgotten_peers(), peers=topology)

    # ------------------------------------------------------------------ after the last step; local phases
    flush = local_phase.flush  # the last step's verdict read, the exchange in flight landed, a local phase ended
    in_local_phase = local_phase.in_local_phase
    averaged_parameters = local_phase.averaged

    @torch.no_grad()
    def end_local_phase(self) -> int:
        """End a local phase now, on every rank (:func:`hf_demo.optim.local_phase.end`: each anchored parameter
        becomes the ranks' mean). Returns the number of parameters averaged."""
        if not self.in_local_phase():
            return 0
        averaged = local_phase.end(self.topology, self.steps, self.param_groups, self.state, self.comm_stats)
        self._put(counters=dataclasses.replace(self.counters, unsynced=False))
        return averaged

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """This rank's state (no collective). A step committed tentatively is saved as committed: a checkpoint
        holds it on every rank only if every rank received it whole (a rank that refused it raises here)."""
        settle.state_check(self.unsettled)
        return checkpointing.save(self, super().state_dict())

    def load_peer_state(self, state_dict: dict) -> None:
        """A live peer's agreed state (an elastic replica's recovery): loaded as :meth:`load_state_dict` loads a
        checkpoint, but the rank, world and step it was saved at are the peer's, not checked against this one's."""
        self.load_state_dict(state_dict, resume=False)

    def load_state_dict(self, state_dict: dict, *, resume: bool = True) -> None:
        """The saved state replaces this one (and the step whose verdict was pending, on every rank); ``resume``: a
        checkpoint of this run, checked to be this rank's, of this world, at every rank's step (with the group)."""
        settle.state_check(self.unsettled, "loaded")  # its settling row still travels: collectives would not pair
        state_dict, saved, requested = checkpointing.unpacked(self, state_dict, resume)
        super().load_state_dict(state_dict)
        self.loaded(checkpointing.restored(self, state_dict, saved, requested, resume))
        self.comm_stats.load(saved.comm)
        if resume and _initialised():  # else at the first step, once the group exists
            self.check_saved_world()
        checkpointing.restore_own_parameters(self, state_dict, saved)
        self.settled()  # the step whose verdict was pending is gone with the state it followed

    def loaded(self, saved: dict) -> None:
        """The load's transition: the record takes what a loaded state holds (``checkpointing.restored``)."""
        self._put(**saved)

    def establish_run_id(self) -> str:
        """This run's identity, the same on every rank (a resumed run keeps the one it resumed)."""
        if not self.run_id:
            self._put(run_id=checkpointing.agreed_run_id())
        return self.run_id

    def check_saved_world(self) -> None:
        """A loaded state must be this rank's, of this world, run and step as every rank's (once the group exists)."""
        if self.saved_world is not None:
            checkpointing.check_saved_world(self, self.saved_world)
            self._put(saved_world=None)


@dataclass(eq=False)
class StagedStep:
    """A step that :meth:`DeMo.prepare_step` ran to its end, with its writes staged (its transaction) and nothing
    applied. ``commit()`` applies it (as :meth:`DeMo.step` does), ``discard()`` drops it: the parameters, the
    optimizer state and the counters stay bitwise as they were (what happened on the wire stays counted). One of
    the two, once, on every rank alike. A step this rank refused to keep (its verdict settles later) has
    nothing staged: both do nothing then (:attr:`empty`)."""

    _opt: DeMo
    transport: object
    _tx: object = None
    settled: object = None  # the vote's record (hf_demo.optim.records.Settled)
    outcome: object = None  # what the step concluded (hf_demo.optim.records.Outcome)
    closed: str | None = None  # "committed" or "discarded", once

    @property
    def empty(self) -> bool:
        """Nothing staged to apply: this rank keeps nothing of the step (refused here, settled later)."""
        return self._tx is None

    def commit(self) -> None:
        """Apply the step (its transaction, then its outcome: counters, policy, traffic)."""
        self._opt._commit(self)

    def discard(self) -> None:
        """Drop the step: nothing of it is applied."""
        self._opt._discard(self)

    def close(self, how: str):
        """Mark the step ``how`` (committed, discarded) and hand over its transaction (None: nothing staged)."""
        if self.closed is not None:
            raise RuntimeError(f"DeMo: this prepared step was already {self.closed}: commit() or discard() it once")
        self.closed = how
        return self._tx
