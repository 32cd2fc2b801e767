"""``hf_demo.DeMo``: Decoupled Momentum Optimization as a ``torch.optim.Optimizer``.

A thin class over the step's phases: :meth:`DeMo.prepare_step` runs them (:func:`hf_demo.optim.phases.run_step`)
and hands back a :class:`StagedStep`, whose ``commit()`` applies the step's transaction and ``discard()`` drops it;
:meth:`DeMo.step` is the two together. An error raised anywhere in a step (a bad payload, a timeout, a
disagreeing rank) leaves the optimizer, the parameters and the counters exactly as they were: the step can be
retried or the run resumed.
"""

from __future__ import annotations

import logging
import os
import warnings
import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist

from hf_demo.compression import transforms
from hf_demo.errors import DeMoStateError
from hf_demo.exchange import exchanges, liveness, teardown
from hf_demo.exchange.transport import CommStats
from hf_demo.guards import ddp
from hf_demo.hf.launch_env import refuse_fsdp_on_cpu
from hf_demo.optim import checkpointing, groups, local_phase, overlap, phases, settle
from hf_demo.optim import policy as policies
from hf_demo.optim import view as views
from hf_demo.optim.phases import run_step
from hf_demo.optim.state import Counters
from hf_demo.optim.transaction import keep_attributes, keep_fields
from hf_demo.refusals import refuse
from hf_demo.settings import DeMoSettings, refuse_retired
from hf_demo.topology import choose as choose_topology
from hf_demo.wire import sealing

logger = logging.getLogger(__name__)
SECRET_ENV = "HF_DEMO_SECRET"


def _counter(name: str) -> property:
    """One of :class:`~hf_demo.optim.state.Counters` as an attribute of the optimizer."""
    return property(lambda self: getattr(self.counters, name), lambda self, v: setattr(self.counters, name, v))


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

    With ``HF_DEMO_SECRET`` set in the environment, every payload carries an HMAC-SHA256 tag and payloads
    without the right tag are refused; with ``HF_DEMO_ENCRYPT=1`` beside it, every header and payload travels
    encrypted and bound to its sender instead (AES-256-GCM, :mod:`hf_demo.wire.sealing`; see SECURITY.md).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, weight_decay: float = 0.0, process_group=None, *,
                 device_mesh=None, sign_update: bool | None = None, preset: str | None = None,
                 **settings):  # fmt: skip
        refuse_fsdp_on_cpu()  # an FSDP launch on the CPU: refused at first use, before Accelerate's own errors
        self.settings = DeMoSettings.resolve(preset, **_with_sign_update(sign_update, settings))
        if process_group is not None and device_mesh is not None:
            refuse("mesh_and_group")
        self.process_group, self.device_mesh = process_group, device_mesh
        self.transform = transforms.get(self.settings.transform)
        secret = os.environ.get(SECRET_ENV)
        self.secret = secret.encode() if secret else None
        self.sealer = sealing.from_env(self.secret, self.settings)  # HF_DEMO_ENCRYPT=1: encrypted traffic
        self.comm_stats = CommStats()
        self.counters = Counters()
        self.policy = policies.BudgetPolicy(self.settings.comm_budget, self.settings.policy_patience)
        s = self.settings
        self.tiers = policies.tiers(s.value_format, s.exchange, s.sync_every, s.policy_sync_every)
        self.clock = policies.Clock()
        self.context = "loop"  # where DeMo runs, for the fixes its errors name: "trainer" (DeMoTrainer) or "loop"
        self.pending = None  # overlap: the exchange started by the last step (state.PendingExchange)
        self.saved_world: tuple[int, int, str] | None = None  # (rank, world, scope) of a loaded state
        self.run_id: str | None = None  # this run's identity, saved with the state (checkpointing.agreed_run_id)
        self.saved_identity: tuple = (None, None, None)  # (run, optimizer step, parameter fingerprint) loaded
        self.first_checked = False  # this process's first exchange compares the replicas and the gradients
        self.unsettled: settle.Unsettled | None = None  # the last step, its verdict not read yet (hf_demo.optim.settle)
        self._undo_spare: dict = {}  # the copies of the last undo log no longer needed, for the next one
        # {(world, tier): payload bytes on the wire} of the last committed exchange there: where a payload rides
        self.wire_agreed: dict[tuple[int, int], int] = {}
        self.ddp_checked = False  # the first-step DDP guard ran (again if False)
        self._ddp_wrappers: list[weakref.ref] = []  # live DDP wrappers of its parameters, taken for unused ones
        self._topology = None
        self._peers = None  # the topology a wrapper gave (reset_peers: an elastic quorum's), which then steps DeMo
        defaults = dict(lr=lr, weight_decay=weight_decay)
        defaults.update({k: getattr(self.settings, k) for k in DeMoSettings.per_group_names()})
        super().__init__(params, defaults)
        exchanges.build(self.settings.exchange, self.exchange_spec([], self.settings.value_format))  # refusals now

    # ------------------------------------------------------------------ counters, as they always were named
    steps = _counter("steps")
    skipped_steps = _counter("skipped_steps")
    consecutive_skips = _counter("consecutive_skips")
    resyncs = _counter("resyncs")
    unsynced = _counter("unsynced")
    value_format = property(lambda self: self.settings.value_format)
    nonfinite = property(lambda self: self.settings.nonfinite)

    @property
    def tier(self) -> int:
        """The communication tier in use (0 = the configured settings; see :mod:`hf_demo.optim.policy`)."""
        return self.policy.tier

    @property
    def in_flight(self) -> bool:
        """Whether an overlapped exchange is still running (finished by the next step() or flush())."""
        return self.pending is not None

    # ------------------------------------------------------------------ configuration
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        groups.validate_group(group)
        self.settings.check_group(group)
        for p in group["params"]:
            groups.check_param(p)

    def exchange_spec(self, layouts, value_format: str, world: int = 1, average=None, index_coding=None,
                      positions=None) -> exchanges.ExchangeSpec:  # fmt: skip
        """A step's :class:`~hf_demo.exchange.exchanges.ExchangeSpec` from the settings (the tier's value format)."""
        return views.exchange_spec(
            self.settings, self.secret, self.sealer, layouts, value_format, world, average, index_coding, positions
        )

    @property
    def topology(self):
        """The topology part (:mod:`hf_demo.topology`), built with its groups once the process group exists."""
        if self._peers is not None:  # given by reset_peers (hf_demo.elastic: this quorum's torchft group)
            return self._peers
        initialised = dist.is_available() and dist.is_initialized()
        built = self._topology
        if built is not None and (built.transport.world > 1 or built.name != "flat") == initialised:
            return built
        timeout = self.settings.comm_timeout if initialised else 0
        self._topology = choose_topology(self).build(self, initialised, timeout)
        return self._topology

    @property
    def transport(self):
        """The transport DeMo exchanges over (the replicate group of sharded parameters)."""
        return self.topology.transport

    def plan(self, tier: policies.Tier):
        return groups.plan_items(self.param_groups, self.settings, self.secret, tier)

    def bytes_by_tier(self, items) -> list[float]:
        return groups.bytes_by_tier(items, self.tiers, self.settings.index_coding)

    rule = staticmethod(views.rule)  # a parameter group's update rule (``update_rule`` is a per-group setting)
    inner_rule = staticmethod(views.inner_rule)  # its local steps' rule (``inner_rule``, per group)

    def header_timings(self, started: float) -> dict:
        """This rank's figures for the policy, as its header carries them (exchange_ms, elapsed_ms)."""
        return self.clock.header_fields(started)

    def group_of(self, p: torch.Tensor) -> dict:
        return next(g for g in self.param_groups if any(q is p for q in g["params"]))

    def step_view(self, elastic: bool = False) -> views.OptimizerView:
        """What the step's phases read of this optimizer (:class:`~hf_demo.optim.view.OptimizerView`), taken now;
        ``elastic``: a wrapper decides the commit (:meth:`prepare_step`)."""
        return views.OptimizerView(
            settings=self.settings,
            secret=self.secret,
            sealer=self.sealer,
            transform=self.transform,
            topology=self.topology,
            tiers=self.tiers,
            policy=self.policy,
            clock=self.clock,
            counters=self.counters,
            wire_agreed=self.wire_agreed,
            first_checked=self.first_checked,
            pending=self.pending,
            context=self.context,
            param_groups=self.param_groups,
            state=self.state,
            rule=self.rule,
            inner_rule=self.inner_rule,
            header_timings=self.header_timings,
            ddp_suspects=self.ddp_suspects,
            rescan_ddp=self._rescan_ddp,
            elastic=elastic,
            unsettled=self.unsettled,
            settle_prior=self._settle_prior,
        )

    def identity(self) -> tuple[int, int, str]:
        """(rank, world size, scope) that a saved state belongs to."""
        if not (dist.is_available() and dist.is_initialized()):
            return 0, 1, "group"
        return self.topology.identity()

    def device(self) -> torch.device:
        """Where the step's buffers live: the first trainable parameter's device."""
        trainable = (p.device for g in self.param_groups for p in g["params"] if p.requires_grad)
        return next(trainable, torch.device("cpu"))

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step on every rank: :meth:`prepare_step` and its :meth:`StagedStep.commit`. Refused where a
        wrapper gave DeMo its peers (:meth:`reset_peers`): the wrapper's ``step()`` steps it then."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
        self._first_step_guard(transport)
        if self.unsettled is not None and self.unsettled.posted is not None:
            settle.confirm(self, final=False)  # this rank refused the last step: it raises now, with every rank
        try:
            stepped, settled, outcome = run_step(self.step_view(elastic), transport, self._on_cuda())
        except settle.Deferred as exc:  # refused here; raised at the next step or confirm, with every rank
            settle.deferred(self, exc)
            return StagedStep(self, transport)
        except BaseException as exc:
            if getattr(exc, "undo_unsettled", False):
                settle.undo(self)  # another rank refused the last step, committed here tentatively
            self._count_arrived()
            raise
        if settled is not None and settled.owes is not None:  # a verdict this rank could not trust: settled later
            settle.owe(self, transport, settled.owes, outcome)
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
        # its verdict settles in the next exchange: tentatively, with an undo log
        tentative, row_bytes = settle.keeps_undo(self, tx, staged.settled, outcome, transport.world)
        spare, self._undo_spare = self._undo_spare, {}  # the last undo log's copies, reused
        undo = tx.commit(undo=tentative, spare=spare)  # (here: the warnings it stages name the caller)
        if tentative:
            self.unsettled = settle.Unsettled(transport.step, row_bytes, undo=undo)

    def _discard(self, staged: StagedStep) -> None:
        """:meth:`StagedStep.discard`: nothing of the step is applied; what happened on the wire stays counted
        (an exchange in flight that arrived)."""
        if staged.close("discarded") is None:
            return
        self._count_arrived()

    def _count_arrived(self) -> None:
        """Overlap: the exchange in flight, where it arrived during a step that keeps nothing, is counted (it
        happened on the wire), once."""
        arrived = self.pending.in_flight.arrived if self.pending is not None else None
        if arrived is not None and not self.pending.counted:
            self.comm_stats.record(arrived.sent, arrived.received, arrived.waited)
            self.pending.counted = True

    def _settle_prior(self) -> None:
        """Every rank received the step committed tentatively whole (its verdicts read): its undo log goes."""
        if self.unsettled is not None and self.unsettled.posted is None:
            self._undo_spare = self.unsettled.undo.spare()  # its copies take the next step's pre-images
            self.unsettled = None

    @property
    def unconfirmed(self) -> bool:
        """Whether the last step's verdict has not been read yet (it settles in the next step or confirm())."""
        return self.unsettled is not None

    @property
    def settling(self) -> bool:
        """Whether this rank refused the last step and its settling row is still on its way (an all-gather in
        flight until the next step or confirm())."""
        return self.unsettled is not None and self.unsettled.posted is not None

    @torch.no_grad()
    def confirm(self) -> None:
        """Read every rank's verdict on the last step where it has not been read (three all-gathers: the
        verdicts, then every rank's finding on them, twice; nothing where it has). With ``commit_vote="on"`` a
        steady step commits tentatively and its verdict travels with the next step; after the last step, and before
        saving a checkpoint, call this on every rank (``flush()`` and ``DeMoTrainer`` do): where any rank refused the
        step, or could not trust a verdict on it, every rank undoes it and raises the same
        :class:`~hf_demo.errors.DeMoPayloadError`."""
        settle.confirm(self)

    def _on_cuda(self) -> bool:
        return any(p.is_cuda for group in self.param_groups for p in group["params"][:1])

    def _stage_outcome(self, tx, outcome) -> None:
        """What the step concluded (:class:`~hf_demo.optim.records.Outcome`), staged after every other write."""
        if outcome.landed is not None:
            tx.stage(lambda: setattr(self, "pending", outcome.landed.pending), before=keep_attributes(self, "pending"))
        stats = self.comm_stats
        tx.stage(lambda: stats.commit_step(outcome.dense, outcome.traffic), before=keep_fields(stats))
        if outcome.exchanged:
            kept = keep_attributes(self, "first_checked", "policy", "clock")
            tx.stage(lambda: self._exchanged(outcome), before=kept)
        elif outcome.policy is not None:  # moved down into a local phase: this step communicates no more
            tx.stage(lambda: setattr(self, "policy", outcome.policy), before=keep_attributes(self, "policy"))
        if outcome.wire_agreed is not None:  # what the payload takes on the wire, agreed: it rides from now on
            kept = keep_attributes(self, "wire_agreed")
            tx.stage(lambda: setattr(self, "wire_agreed", outcome.wire_agreed), before=kept)
        if outcome.warn_skips:
            tx.stage(lambda: phases.warn_skips(self.settings, outcome.counters), keeps_nothing=True)
        tx.stage(lambda: setattr(self, "counters", outcome.counters), before=keep_attributes(self, "counters"))

    def _exchanged(self, outcome) -> None:
        self.first_checked = True
        self.policy = outcome.policy
        self.clock = policies.Clock(self.comm_stats.seconds * 1000.0, outcome.started, outcome.tier_index)

    def _rescan_ddp(self) -> None:
        """The first-step DDP guard runs again at the next step (a write outside the transaction: docs/DESIGN.md)."""
        self.ddp_checked = False

    def _first_step_guard(self, transport) -> None:
        """At DeMo's first step in a process group: the exit handler, and a loud error if DDP still averages."""
        if self.ddp_checked or not (dist.is_available() and dist.is_initialized()):
            return
        teardown.install_exit_handler()
        liveness.guard(self.settings.comm_timeout)  # a frozen peer caught outside DeMo's collectives too
        teardown.track(self)
        self.watch_ddp_wrappers(ddp.first_step_check([p for g in self.param_groups for p in g["params"]], transport))
        self.ddp_checked = True

    def watch_ddp_wrappers(self, wrappers) -> None:
        """DDP wrappers of this optimizer's parameters that did not average their gradients at the first step:
        warn, and check them again at every ``check_every`` step."""
        self._ddp_wrappers = [weakref.ref(w) for w in wrappers]
        if wrappers:
            warnings.warn(
                f"DeMo: {len(wrappers)} DistributedDataParallel wrapper(s) hold some of DeMo's parameters but did not "
                f"average their gradients at optimizer step {self.steps} (they differ between ranks): taken for "
                "wrappers no longer in use. DeMo checks them again at every check_every step; "
                "hf_demo.disable_gradient_allreduce(wrapper) or `del wrapper` silences this.",
                stacklevel=4,
            )

    def ddp_suspects(self) -> list[torch.Tensor]:
        """The parameters that the watched wrappers (alive and still all-reducing) hold."""
        if not self._ddp_wrappers:
            return []
        alive = [w for ref in self._ddp_wrappers if (w := ref()) is not None]  # read only: a step writes nothing
        return ddp.held_params(alive, [p for g in self.param_groups for p in g["params"]])

    def land_in_flight(self, pending) -> None:
        self.pending = pending

    def reset_peers(self, topology=None) -> None:
        """The peers DeMo exchanges with changed (hf_demo.elastic: a new torchft quorum, on every replica of it at
        the same step): what it learnt of the last ones is forgotten. The first exchange compares every rank again
        (a joiner's recovered state checked against the survivors'), the first-step DDP guard runs again, and no
        payload rides with the headers until the new peers have agreed its size on the wire (a joiner has none of
        these: a rank that kept them would meet it with another collective). With ``overlap=True`` the exchange in
        flight, over the last peers' group, is dropped (one step's update, lost alike everywhere). The budget
        policy's figures of the last exchange are forgotten too, so every rank decides its next tier from the same
        (none); the tier itself is kept.

        ``topology``: the new peers' group (:mod:`hf_demo.topology`), which DeMo exchanges over from now on (steps,
        :meth:`flush`, :meth:`confirm`, :meth:`end_local_phase`, the identity a state is saved with) in place of its
        own from ``torch.distributed``; the wrapper that gave it steps DeMo (:meth:`prepare_step` with
        ``elastic=True``), and a plain :meth:`step` is refused. None: DeMo's own group again."""
        self.clock = policies.Clock()
        self.first_checked = False
        self.ddp_checked = False
        self.wire_agreed = {}
        self.pending = None
        self._peers = topology

    @torch.no_grad()
    def flush(self) -> None:
        """After the last step, on every rank. The last step's verdict is read where it has not been
        (:meth:`confirm`). Overlap: apply the update of the exchange still in flight. Inside
        a local phase (``sync_every > 1``, or a policy's local-step tier) the ranks' parameters are their own
        until the next synchronisation: ``end_local_phase='average'`` ends the phase now
        (:meth:`end_local_phase`), ``'warn'`` leaves them apart and warns (a model saved from rank 0 holds
        rank 0's)."""
        settle.confirm(self)
        if self.pending is not None:
            overlap.flush(self)
        if not self.in_local_phase():
            return
        every = self.tiers[self.policy.tier].sync_every
        where = f"training ended inside a local phase (optimizer step {self.steps}, sync_every={every})"
        if self.settings.end_local_phase == "average":
            logger.info("DeMo: %s: %d parameters averaged over every rank", where, self.end_local_phase())
            return
        message = (
            f"DeMo: {where}: each rank's parameters are still its own and a model saved from rank 0 holds rank "
            f"0's. End on a synchronisation (max_steps a multiple of {every}), resume from a checkpoint, which "
            "keeps each rank's parameters in its optimizer state, or set end_local_phase='average'"
        )
        logger.warning(message)
        warnings.warn(message, stacklevel=2)

    # ------------------------------------------------------------------ local phases
    def in_local_phase(self) -> bool:
        """Whether the ranks are between synchronisations: a local step ran since the last committed one (a
        skipped synchronisation included). The same answer on every rank."""
        return local_phase.in_local_phase(self)

    @torch.no_grad()
    def end_local_phase(self) -> int:
        """End a local phase now, on every rank: each parameter with an anchor becomes the mean of every rank's
        value (dense all-reduces in fp32, or the parameter's dtype where wider, counted in ``comm_stats``) and its
        anchor moves there; the error feedback and the inner state are kept. Raises :class:`DeMoNonFiniteError`
        (every rank, nothing changed) when the mean is not finite. Returns the number of parameters averaged."""
        return local_phase.end(self)

    def averaged_parameters(self):
        """Inside a local phase, the parameters hold the mean of every rank's while the ``with`` block runs, then
        this rank's own again, bit for bit; the optimizer state is not touched. Use it for what should see the
        model and not one rank's part of it: an evaluation, the model file of a checkpoint (DeMoTrainer does both).
        Outside a local phase it does nothing. Inside one it is a collective (every rank enters it) and its dense
        all-reduces are counted in ``comm_stats``."""
        return local_phase.averaged(self)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """This rank's state (no collective). A step committed tentatively is saved as committed: a checkpoint
        holds it on every rank only if every rank received it whole (a rank that refused it raises here)."""
        settle.state_check(self)
        return checkpointing.save(self, super().state_dict())

    def load_state_dict(self, state_dict: dict) -> None:
        settle.state_check(self, "loaded")  # its settling row still travels: the next collectives would not pair
        checkpointing.load(self, state_dict)
        self.unsettled = None  # the loaded state replaces the step whose verdict was pending (on every rank)

    def load_peer_state(self, state_dict: dict) -> None:
        """A live peer's agreed state (an elastic replica's recovery, :mod:`hf_demo.elastic`): loaded as
        :meth:`load_state_dict` loads a checkpoint, but the rank, the world and the step it was saved at are the
        peer's and are not checked against this replica's (it joins the peer's quorum at the peer's step)."""
        settle.state_check(self, "loaded")
        checkpointing.load(self, state_dict, resume=False)
        self.unsettled = None

    def establish_run_id(self) -> str:
        """This run's identity, the same on every rank (a resumed run keeps the one it resumed)."""
        if self.run_id is None:
            self.run_id = checkpointing.agreed_run_id()
        return self.run_id

    def check_saved_world(self) -> None:
        """A loaded state must be this rank's, saved with this many ranks, by the run and at the step of every
        other rank's (checked once the group exists)."""
        if self.saved_world is None:
            return
        checkpointing.compare_resumed(self, self.settings.comm_timeout or 300.0)
        saved_rank, saved_world, scope = self.saved_world
        rank, world, now = self.identity()
        if scope != now and "mesh" in (scope + now):
            refuse(
                "resume_other_mesh",
                saved=scope if "mesh" in scope else "flat layout",
                now=now if "mesh" in now else "flat layout",
            )
        if saved_world != world:
            refuse("resume_other_world", saved_world=saved_world, world=world)
        if saved_rank != rank:
            raise DeMoStateError(
                f"rank {rank} loaded the optimizer state saved by rank {saved_rank}; each rank must load its own state"
            )
        self.saved_world = None


class StagedStep:
    """A step that :meth:`DeMo.prepare_step` ran to its end, with its writes staged (its transaction) and nothing
    applied. ``commit()`` applies it (as :meth:`DeMo.step` does), ``discard()`` drops it: the parameters, the
    optimizer state and the counters stay bitwise as they were (what happened on the wire stays counted). One of
    the two, once, on every rank alike. A step this rank refused to keep (its verdict settles later) has nothing
    staged: both do nothing then (:attr:`empty`)."""

    def __init__(self, opt: DeMo, transport, tx=None, settled=None, outcome=None):
        self._opt, self.transport, self._tx = opt, transport, tx
        self.settled, self.outcome = settled, outcome
        self.closed: str | None = None  # "committed" or "discarded", once

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


def _with_sign_update(sign_update, settings: dict) -> dict:
    """The reference's ``sign_update`` switch as ``update_rule``; unknown settings refused with the known ones."""
    if sign_update is not None:
        if not isinstance(sign_update, bool):
            raise ValueError(f"DeMo: invalid sign_update={sign_update!r}: must be True or False")
        rule = "sign" if sign_update else "raw"
        if settings.setdefault("update_rule", rule) != rule:
            refuse("sign_update_contradicts", sign_update=sign_update, rule=settings["update_rule"])
    refuse_retired(settings)
    unknown = set(settings) - set(DeMoSettings.names())
    if unknown:
        raise ValueError(
            f"unknown DeMo setting(s) {sorted(unknown)}; known settings: {', '.join(DeMoSettings.names())}"
        )
    return settings
