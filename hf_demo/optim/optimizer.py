"""``hf_demo.DeMo``: Decoupled Momentum Optimization as a ``torch.optim.Optimizer``.

A thin class over the step's phases: :meth:`DeMo.prepare_step` runs them (:func:`hf_demo.optim.phases.run_step`)
and hands back a :class:`~hf_demo.optim.staged.StagedStep`, whose ``commit()`` applies the step's transaction and
``discard()`` drops it; :meth:`DeMo.step` is the two together. An error raised anywhere in a step (a bad payload, a
timeout, a disagreeing rank) leaves the optimizer, the parameters and the counters exactly as they were: the step
can be retried or the run resumed.

With ``HF_DEMO_SECRET`` set in the environment, every payload carries an HMAC-SHA256 tag and payloads without the
right tag are refused; with ``HF_DEMO_ENCRYPT=1`` beside it, every header and payload travels encrypted and bound
to its sender instead (AES-256-GCM, :mod:`hf_demo.wire.sealing`; see SECURITY.md).

DeMo owns its state: no other module assigns its attributes (``tests/test_state_ownership.py``). What changes it
is one of its methods, a transition named for what happened (``settled``, ``unsettle``, ``run_by``, the load, the
commit), which assigns what the module functions it calls return.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable

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
from hf_demo.optim.staged import StagedStep
from hf_demo.optim.state import Counters, forgotten_peers, fresh
from hf_demo.optim.transaction import keep_fields
from hf_demo.refusals import refuse
from hf_demo.settings import DeMoSettings, with_sign_update
from hf_demo.topology import choose as choose_topology
from hf_demo.wire import sealing

logger = logging.getLogger(__name__)
SECRET_ENV = "HF_DEMO_SECRET"
__all__ = ["DeMo", "StagedStep"]


def _counter(name: str) -> property:
    """One of :class:`~hf_demo.optim.state.Counters` as an attribute of the optimizer (read only)."""
    return property(lambda self: getattr(self.counters, name))


def _kept(opt, *names: str):
    """A ``before`` for the step's transaction: what puts these attributes of ``opt`` back (its undo log's)."""

    def before():
        old = {n: getattr(opt, n) for n in names}
        return lambda: [setattr(opt, n, v) for n, v in old.items()]

    return before


_OUTCOME = ("pending", "first_checked", "policy", "clock", "wire_agreed", "counters")  # what a step's outcome sets


def _taken(outcome, stats) -> dict:
    """What the optimizer keeps of a step's :class:`~hf_demo.optim.records.Outcome` (at the commit, after the
    step's traffic is counted in ``stats``): each of :data:`_OUTCOME` the step changed."""
    took = {"counters": outcome.counters}
    if outcome.landed is not None:  # overlap: the exchange this step started
        took["pending"] = outcome.landed.pending
    if outcome.exchanged:
        took["first_checked"] = True
        took["clock"] = policies.Clock(stats.seconds * 1000.0, outcome.started, outcome.tier_index)
    if outcome.exchanged or outcome.policy is not None:  # (or moved down into a local phase)
        took["policy"] = outcome.policy
    if outcome.wire_agreed is not None:  # what the payload takes on the wire, agreed: it rides from now on
        took["wire_agreed"] = outcome.wire_agreed
    return took


def _set(opt, **values) -> None:
    """Assign ``values`` to ``opt``'s attributes (what a :class:`DeMo` method took from a module function)."""
    for name, value in values.items():
        setattr(opt, name, value)


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
        self.comm_stats, self.counters = CommStats(), Counters()
        self.policy = policies.BudgetPolicy(self.settings.comm_budget, self.settings.policy_patience)
        s = self.settings
        self.tiers = policies.tiers(s.value_format, s.exchange, s.sync_every, s.policy_sync_every)
        _set(self, **fresh())  # the rest of what it keeps between steps, each described there
        defaults = dict(lr=lr, weight_decay=weight_decay)
        defaults.update({k: getattr(self.settings, k) for k in DeMoSettings.per_group_names()})
        super().__init__(params, defaults)
        spec = views.exchange_spec(self.settings, self.secret, self.sealer, [], self.settings.value_format)
        exchanges.build(self.settings.exchange, spec)  # its refusals now

    # ------------------------------------------------------------------ counters, as they always were named
    steps, skipped_steps, resyncs = _counter("steps"), _counter("skipped_steps"), _counter("resyncs")
    consecutive_skips, unsynced = _counter("consecutive_skips"), _counter("unsynced")
    value_format = property(lambda self: self.settings.value_format)
    nonfinite = property(lambda self: self.settings.nonfinite)
    tier = property(lambda self: self.policy.tier, doc="The communication tier in use (0: the settings; policy.py).")
    in_flight = property(lambda self: self.pending is not None, doc="An overlapped exchange still runs (flush()).")
    unconfirmed = property(lambda self: self.unsettled is not None, doc="The last step's verdict is not read yet.")
    settling = property(lambda self: self.unsettled is not None and self.unsettled.posted is not None,
                        doc="Its settling row still travels: this rank refused the last step.")  # fmt: skip

    # ------------------------------------------------------------------ configuration
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        groups.check_added(self.param_groups[-1], self.settings)

    @property
    def topology(self):
        """The topology part (:mod:`hf_demo.topology`), built with its groups once the process group exists."""
        if self._peers is not None:  # given by reset_peers (hf_demo.elastic: this quorum's torchft group)
            return self._peers
        built = self._topology
        if built is not None and (built.transport.world > 1 or built.name != "flat") == _initialised():
            return built
        timeout = self.settings.comm_timeout if _initialised() else 0
        self._topology = choose_topology(self).build(self, _initialised(), timeout)
        return self._topology

    transport = property(lambda self: self.topology.transport, doc="What DeMo exchanges over (the replicate group).")
    rule = staticmethod(views.rule)  # a parameter group's update rule (``update_rule`` is a per-group setting)
    inner_rule = staticmethod(views.inner_rule)  # its local steps' rule (``inner_rule``, per group)
    step_view = views.of_optimizer  # what the step's phases read of this optimizer, taken now

    def header_timings(self, started: float) -> dict:
        """This rank's figures for the policy, as its header carries them (exchange_ms, elapsed_ms)."""
        return self.clock.header_fields(started)

    def identity(self) -> tuple[int, int, str]:
        """(rank, world size, scope) that a saved state belongs to."""
        return self.topology.identity() if _initialised() else (0, 1, "group")

    def device(self) -> torch.device:
        """Where the step's buffers live: the first trainable parameter's device."""
        trainable = (p.device for g in self.param_groups for p in g["params"] if p.requires_grad)
        return next(trainable, torch.device("cpu"))

    def run_by(self, context: str) -> None:
        """Where DeMo runs, for the fixes its errors name: ``"trainer"`` (DeMoTrainer) or ``"loop"``."""
        self.context = context

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
        """Every phase of a step (:func:`hf_demo.optim.phases.run_step`: its collectives, checks and verdicts, on
        every rank) with nothing applied: the parameters, the optimizer state and the counters are as they were
        until :meth:`StagedStep.commit`; :meth:`StagedStep.discard` drops the step. Call it, and then the same one of
        the two, on every rank. An error raised here changes nothing (as a failed :meth:`step`). ``elastic``: a
        wrapper decides whether the step commits (:class:`hf_demo.elastic.Elastic`, torchft's ``should_commit``), so
        its verdict is read within the step, never settled later; required where a wrapper gave DeMo its peers."""
        if self._peers is not None and not elastic:
            refuse("wrapped_step")
        transport = self.transport.at(self.steps)
        self.check_saved_world()
        self.establish_run_id()  # once: the store hands rank 0's to every rank (no collective)
        if not self.ddp_checked and _initialised():  # DeMo's first step in a process group: the guards
            self._ddp_wrappers, self.ddp_checked = ddp.first_step_guard(self, _params(self), transport), True
        if self.settling:
            settle.confirm(self, final=False)  # this rank refused the last step: it raises now, with every rank
        try:
            on_cuda = any(p.is_cuda for g in self.param_groups for p in g["params"][:1])
            stepped, settled, outcome = run_step(self.step_view(elastic), transport, on_cuda)
        except settle.Deferred as exc:  # refused here; raised at the next step or confirm, with every rank
            self.unsettled = settle.deferred(self.unsettled, exc)
            return StagedStep(self, transport)
        except BaseException as exc:
            if getattr(exc, "undo_unsettled", False):
                settle.undo(self.settled())  # another rank refused the last step, committed here tentatively
            overlap.count_arrived(self.pending, self.comm_stats)
            raise
        if settled is not None and settled.owes is not None:  # a verdict this rank could not trust: settled later
            self.unsettled = settle.owe(self, transport, settled.owes, outcome)
            return StagedStep(self, transport)
        return StagedStep(self, transport, stepped.tx, settled, outcome)

    def _commit(self, staged: StagedStep) -> None:
        """:meth:`StagedStep.commit`: the step's outcome staged last, and its transaction committed; tentatively,
        with an undo log, where its verdict settles later."""
        tx = staged.close("committed")
        if tx is None:
            return
        outcome, transport = staged.outcome, staged.transport
        self._stage_outcome(tx, outcome)
        tentative, row_bytes = settle.keeps_undo(self, tx, staged.settled, outcome, transport.world)  # an undo log
        spare, self._undo_spare = self._undo_spare, {}  # the last undo log's copies, reused
        undo = tx.commit(undo=tentative, spare=spare)  # (here: the warnings it stages name the caller)
        if tentative:
            self.unsettled = settle.Unsettled(transport.step, row_bytes, undo=undo)

    def _discard(self, staged: StagedStep) -> None:
        """:meth:`StagedStep.discard`: nothing of the step is applied; what happened on the wire stays counted
        (an exchange in flight that arrived)."""
        if staged.close("discarded") is None:
            return
        overlap.count_arrived(self.pending, self.comm_stats)

    def _stage_outcome(self, tx, outcome) -> None:
        """What the step concluded (:class:`~hf_demo.optim.records.Outcome`), staged after every other write."""
        stats = self.comm_stats
        tx.stage(lambda: stats.commit_step(outcome.dense, outcome.traffic), before=keep_fields(stats))
        if outcome.warn_skips:
            tx.stage(lambda: phases.warn_skips(self.settings, outcome.counters), keeps_nothing=True)
        tx.stage(lambda: _set(self, **_taken(outcome, stats)), before=_kept(self, *_OUTCOME))

    # ------------------------------------------------------------------ transitions outside a step's transaction
    def settled(self) -> settle.Unsettled | None:
        """The last step's verdict is read (or it is undone): it is no longer unsettled. Returns it."""
        u, self.unsettled = self.unsettled, None
        return u

    def _settle_prior(self) -> None:
        """Every rank received the step committed tentatively whole (its verdicts read): its undo log goes."""
        if self.unsettled is not None and self.unsettled.posted is None:
            self._undo_spare = self.settled().undo.spare()  # its copies take the next step's pre-images

    confirm = settle.confirm  # the last step's verdict read on every rank (three all-gathers), where it is not

    def _rescan_ddp(self) -> None:
        """The first-step DDP guard runs again at the next step (a write outside the transaction: docs/DESIGN.md)."""
        self.ddp_checked = False

    def ddp_suspects(self) -> list[torch.Tensor]:
        """The parameters that the watched wrappers (alive and still all-reducing) hold."""
        return ddp.suspects(self._ddp_wrappers, _params(self))

    def land_in_flight(self, pending) -> None:
        self.pending = pending

    def reset_peers(self, topology=None) -> None:
        """The peers changed (an elastic quorum): what DeMo learnt of the last ones goes (``state.forgotten_peers``),
        and it exchanges over ``topology`` (:mod:`hf_demo.topology`) from now on, stepped by the wrapper that gave
        it (:meth:`prepare_step` with ``elastic=True``; a plain :meth:`step` is refused). None: its own group."""
        _set(self, **forgotten_peers(), _peers=topology)

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
        averaged = local_phase.end(self)
        self.counters = dataclasses.replace(self.counters, unsynced=False)
        return averaged

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """This rank's state (no collective). A step committed tentatively is saved as committed: a checkpoint
        holds it on every rank only if every rank received it whole (a rank that refused it raises here)."""
        settle.state_check(self.unsettled)
        return checkpointing.save(self, super().state_dict())

    def load_peer_state(self, state_dict: dict) -> None:
        """A live peer's agreed state (an elastic replica's recovery, :mod:`hf_demo.elastic`): loaded as
        :meth:`load_state_dict` loads a checkpoint, but the rank, the world and the step it was saved at are the
        peer's and are not checked against this replica's (it joins the peer's quorum at the peer's step)."""
        self.load_state_dict(state_dict, resume=False)

    def load_state_dict(self, state_dict: dict, *, resume: bool = True) -> None:
        """The saved state replaces this one (and the step whose verdict was pending, on every rank); ``resume``: a
        checkpoint of this run, checked to be this rank's, of this world, at every rank's step (now where the group
        exists, else at the first step)."""
        settle.state_check(self.unsettled, "loaded")  # its settling row still travels: collectives would not pair
        state_dict, saved, requested = checkpointing.unpacked(self, state_dict, resume)
        super().load_state_dict(state_dict)
        _set(self, **checkpointing.restored(self, state_dict, saved, requested, resume))
        self.comm_stats.load(saved.comm)
        if resume and _initialised():  # else at the first step, once the group exists
            self.check_saved_world()
        checkpointing.restore_own_parameters(self, state_dict, saved)
        self.unsettled = None

    def establish_run_id(self) -> str:
        """This run's identity, the same on every rank (a resumed run keeps the one it resumed)."""
        self.run_id = self.run_id or checkpointing.agreed_run_id()
        return self.run_id

    def check_saved_world(self) -> None:
        """A loaded state must be this rank's, saved with this many ranks, by the run and at the step of every
        other rank's (checked once the group exists)."""
        if self.saved_world is not None:
            checkpointing.check_saved_world(self, self.saved_world)
            self.saved_world = None
