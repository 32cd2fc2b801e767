"""``hf_demo.DeMo``: Decoupled Momentum Optimization as a ``torch.optim.Optimizer``.

One step, top to bottom; every stage is a function or small object of its own module:

1. local checks: NaN/Inf in gradients and parameters (element-wise), the drift fingerprint when due;
2. momentum: ``working = decay*momentum + lr*DCT(grad)`` on copies (:mod:`hf_demo.compression.functional`);
3. the exchange prepares: top-k selection, encoding, error feedback (:mod:`hf_demo.exchange.exchanges`,
   :mod:`hf_demo.wire.codec`);
4. headers: every rank learns every rank's step, layout, settings, flags and payload CRC (collective 1,
   checked by :func:`hf_demo.wire.codec.check_headers`);
5. the exchange communicates: payload collectives, validation, the averaged coefficients;
6. commit: momenta, drift resync, inverse DCT, the update rule's direction (:mod:`hf_demo.optim.update_rules`),
   decoupled weight decay and the step (rounded stochastically for bf16 parameters if asked).

Nothing before step 6 changes the optimizer's state, the parameters or the counters: an error raised by
``step()`` (a bad payload, a timeout, a disagreeing rank) leaves everything exactly as it was, so the
step can be retried or the run resumed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import os
import time
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import astuple

import torch
import torch.distributed as dist

from hf_demo.compression import functional as F
from hf_demo.compression.blocks import MAX_BLOCK_SIZE, BlockLayout, decode, encode, plan
from hf_demo.errors import DDP_ALLREDUCES, DeMoNonFiniteError, DeMoSetupError, DeMoStateError, DeMoSyncError
from hf_demo.exchange import exchanges
from hf_demo.exchange.transport import CommStats, Transport
from hf_demo.hf import ddp_wrappers
from hf_demo.optim import local_steps, update_rules
from hf_demo.optim import policy as policies
from hf_demo.settings import DeMoSettings
from hf_demo.topology import node as hierarchy
from hf_demo.wire import codec

logger = logging.getLogger(__name__)
SECRET_ENV = "HF_DEMO_SECRET"
GROUP_KEYS = ("lr", "weight_decay") + DeMoSettings.per_group_names()


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
        sign_update: the reference's switch, kept for compatibility: ``False`` means
            ``update_rule="raw"``.
        preset: a named starting point (``balanced``, ``lean``, ``extreme``: :data:`hf_demo.settings.PRESETS`);
            settings given by name win over it.
        **settings: every other setting, by name: see :class:`hf_demo.settings.DeMoSettings`
            (``compression_decay``, ``compression_topk``, ``compression_chunk``, ``value_format``,
            ``exchange``, ``update_rule``, ``nonfinite``, ``comm_timeout``, ``check_every``, ``drift``, ...).

    With ``HF_DEMO_SECRET`` set in the environment, every payload carries an HMAC-SHA256 tag and payloads
    without the right tag are refused (see SECURITY.md).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        process_group=None,
        *,
        sign_update: bool | None = None,
        preset: str | None = None,
        **settings,
    ):
        if sign_update is not None:
            if not isinstance(sign_update, bool):
                raise ValueError(f"DeMo: invalid sign_update={sign_update!r}: must be True or False")
            rule = "sign" if sign_update else "raw"
            if settings.setdefault("update_rule", rule) != rule:
                raise ValueError(f"sign_update={sign_update} contradicts update_rule={settings['update_rule']!r}")
        unknown = set(settings) - set(DeMoSettings.names())
        if unknown:
            raise ValueError(
                f"unknown DeMo setting(s) {sorted(unknown)}; known settings: {', '.join(DeMoSettings.names())}"
            )
        self.settings = DeMoSettings.resolve(preset, **settings)
        self.process_group = process_group
        secret = os.environ.get(SECRET_ENV)
        self.secret = secret.encode() if secret else None
        self.comm_stats = CommStats()
        self.steps = 0  # optimizer steps taken in lockstep, skipped ones included
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.resyncs = 0
        self.unsynced = False  # a local step since the last committed synchronisation (lockstep: same on every rank)
        self.policy = policies.BudgetPolicy(self.settings.comm_budget, self.settings.policy_patience)
        self.tiers = policies.tiers(
            self.settings.value_format,
            self.settings.exchange,
            self.settings.sync_every,
            self.settings.policy_sync_every,
        )
        self._last_exchange_ms = 0.0
        self._last_exchange_tier: int | None = None  # the tier that exchange ran in (the policy scales from it)
        self._last_comm_start: float | None = None
        self._transport: Transport | None = None
        self._node: tuple[hierarchy.Topology, Transport] | None = None
        self._pending: dict | None = None  # overlap: the exchange started by the last step
        self._saved_world: tuple[int, int, str] | None = None  # (rank, world, scope) of a loaded state
        self._first_checked = False  # the first exchange of this process compares parameters and gradients
        self._hf_demo_checked = False  # the step guard (accelerate_utils) has scanned for DDP wrappers; again if False
        self._ddp_wrappers: list[weakref.ref] = []  # live DDP wrappers of its parameters, taken for unused ones
        defaults = dict(lr=lr, weight_decay=weight_decay)
        defaults.update({k: getattr(self.settings, k) for k in DeMoSettings.per_group_names()})
        super().__init__(params, defaults)
        exchanges.build(self.settings.exchange, self._exchange_spec([], self.settings.value_format))  # refusals now

    def _exchange_spec(self, layouts, value_format: str, world: int = 1, average=None, index_coding=None):
        """This step's :class:`~hf_demo.exchange.exchanges.ExchangeSpec` from the settings (the tier's value format)."""
        return exchanges.ExchangeSpec(
            layouts,
            value_format,
            index_coding or self.settings.index_coding,
            self.secret,
            average,
            world,
            self.settings.reduce_positions,
        )

    @property
    def value_format(self) -> str:
        return self.settings.value_format

    @property
    def tier(self) -> int:
        """The communication tier in use (0 = the configured settings; see :mod:`hf_demo.optim.policy`)."""
        return self.policy.tier

    @property
    def in_flight(self) -> bool:
        """Whether an overlapped exchange is still running (finished by the next step() or flush())."""
        return self._pending is not None

    @property
    def nonfinite(self) -> str:
        return self.settings.nonfinite

    # ------------------------------------------------------------------ configuration
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _validate_group(group)
        self.settings.check_group(group)
        for p in group["params"]:
            if p.is_complex():
                raise ValueError(
                    f"DeMo does not support complex parameters (shape {tuple(p.shape)}): "
                    "view them as real (torch.view_as_real) or optimise them with another optimizer"
                )
            if p.numel() == 0:
                raise ValueError(
                    f"DeMo cannot optimise an empty parameter of shape {tuple(p.shape)}: leave it out of the optimizer"
                )

    def watch_ddp_wrappers(self, wrappers) -> None:
        """DDP wrappers of this optimizer's parameters that did not average their gradients at the first step
        (accelerate_utils.check_local_gradients): warn, and check them again at every ``check_every`` step."""
        self._ddp_wrappers = [weakref.ref(w) for w in wrappers]
        if wrappers:
            warnings.warn(
                f"DeMo: {len(wrappers)} DistributedDataParallel wrapper(s) hold some of DeMo's parameters but did not "
                f"average their gradients at optimizer step {self.steps} (they differ between ranks): taken for "
                "wrappers no longer in use. DeMo checks them again at every check_every step; "
                "hf_demo.disable_gradient_allreduce(wrapper) or `del wrapper` silences this.",
                stacklevel=4,
            )

    def _ddp_suspects(self) -> list[torch.Tensor]:
        """The parameters that the watched wrappers (alive and still all-reducing) hold."""
        alive = [w for ref in self._ddp_wrappers if (w := ref()) is not None]
        self._ddp_wrappers = [weakref.ref(w) for w in alive]
        return ddp_wrappers.held_params(alive, [p for g in self.param_groups for p in g["params"]])

    def _transport_now(self) -> Transport:
        initialised = dist.is_available() and dist.is_initialized()
        if self._transport is not None and (self._transport.world > 1 or self._node) == initialised:
            return self._transport
        timeout = self.settings.comm_timeout if initialised else 0
        if initialised and self.settings.hierarchy == "node":
            if self.process_group is not None:
                raise ValueError("hierarchy='node' builds its groups from the whole world: pass no process_group")
            hierarchy.check_agreement(Transport(None, timeout, self.comm_stats))  # the same LOCAL_WORLD_SIZE, first
            topo = hierarchy.topology(dist.get_world_size(), dist.get_rank())
            node_group, peer_group = hierarchy.groups(topo, timeout, dist.get_backend())
            self._node = (topo, Transport(node_group, timeout, self.comm_stats))
            self._transport = Transport(peer_group, timeout, self.comm_stats)
        else:
            self._transport = Transport(self.process_group if initialised else None, timeout, self.comm_stats)
        return self._transport

    def _plan(self, tier: policies.Tier):
        """([(param, group, layout)], layout checksum, settings checksum) for this step's tier."""
        items, layout_key = [], []
        settings_key = [sorted(self.settings.as_dict().items()), self.secret is not None, tier]
        for group in self.param_groups:
            _validate_group(group)
            settings_key.append(tuple(group[k] if isinstance(group[k], str) else float(group[k]) for k in GROUP_KEYS))
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                topk = max(1, group["compression_topk"] // tier.topk_divisor)
                layout = plan(tuple(p.shape), group["compression_chunk"], topk)
                items.append((p, group, layout))
                layout_key.append((layout, str(p.dtype)))
        return items, codec.checksum(tuple(layout_key)), codec.checksum(tuple(settings_key))

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        transport = self._transport_now()
        self._check_saved_world(transport)
        before = (
            self.steps,
            self.skipped_steps,
            self.consecutive_skips,
            self.resyncs,
            copy.copy(self.comm_stats),
            self.policy,
        )
        in_flight = (
            self._pending["rows"] if self._pending is not None and hasattr(self._pending["rows"], "wait") else None
        )
        try:
            self._step(transport)
        except BaseException:
            self.steps, self.skipped_steps, self.consecutive_skips, self.resyncs, stats, self.policy = before
            self.comm_stats.__dict__.update(stats.__dict__)
            if in_flight is not None and in_flight.work is None:  # the overlapped exchange arrived during this
                self.comm_stats.record(in_flight.sent, in_flight.received, in_flight.waited)  # try: it stays counted
            raise
        return loss

    def _step(self, transport: Transport, decided: policies.BudgetPolicy | None = None) -> None:
        """One step; ``decided``: this step again, in the lower tier the policy chose from its headers."""
        tier_index = (decided or self.policy).tier
        tier = self.tiers[tier_index]
        items, layout_ck, settings_ck = self._plan(tier)
        all_items, node_grads, all_node_grads, owner_of = items, None, None, None
        if self._node is not None:  # hierarchy: the node's mean gradient; this rank's shard of the parameters
            topo, node = self._node
            node.step = self.steps
            here = codec.Header(self.steps, layout_ck, settings_ck, 0, node.world, 0)
            device = items[0][0].device if items else torch.device("cpu")
            hierarchy.check_node(node, here, device, topo.node, self.secret)
            all_node_grads = hierarchy.node_mean([p.grad for p, _, _ in items], [p for p, _, _ in items], node)
            owner_of = hierarchy.owners(self._indices([p for p, _, _ in all_items]), topo)
            items = [x for x, owner in zip(all_items, owner_of) if owner == topo.local_rank]
            node_grads = [g for g, owner in zip(all_node_grads, owner_of) if owner == topo.local_rank]
        params = [p for p, _, _ in items]
        layouts = [layout for _, _, layout in items]
        if decided is None:
            self.comm_stats.start_step(4 * sum(layout.numel for layout in layouts))
        transport.step = self.steps
        generator = None
        if self.settings.param_rounding == "stochastic":  # the same noise on every rank: replicas stay identical
            generator = torch.Generator().manual_seed(0x5EED0000 + self.steps)

        # 0. less frequent synchronisation: a local step on copies; DeMo then moves the pseudo-gradient
        local = tier.sync_every > 1
        if not local:
            for p in params:  # a tier without local steps: a later local phase starts afresh
                local_steps.forget(self.state[p])
        if local:
            anchors = [local_steps.anchor(self.state[p], p) for p in params]  # the parameters at the last sync
            inner = [
                local_steps.inner_step(
                    p, p.grad, self.state[p], update_rules.get(g["inner_rule"]), g["lr"], g["weight_decay"], generator
                )
                for p, g, _ in items
            ]
            if not local_steps.is_sync_step(tier.sync_every, self.steps):
                self.unsynced = True  # skipped or not: the ranks stay apart until a synchronisation commits
                if decided is not None:  # moved down into a local phase: this step communicates no more
                    self.policy = decided
                if _nonfinite([after for after, _, _ in inner]):
                    self._skipped()
                    return
                for p, step_state in zip(params, inner):
                    local_steps.commit_inner(p, self.state[p], *step_state)
                self.steps += 1
                return
            signals = [local_steps.pseudo_gradient(a, after) for a, (after, _, _) in zip(anchors, inner)]
        else:
            signals = node_grads if node_grads is not None else [p.grad for p in params]
        replicas = anchors if local else params  # what must be identical on every rank
        # hierarchy='node': every node-mean gradient is checked, not only this rank's shard. They are the same on
        # every local rank of a node (one all-reduce), so all local ranks raise the same flag and every inter-node
        # group (one local rank of every node) skips alike. Parameters stay checked per shard: a local rank's
        # copy of a parameter it does not own is overwritten by the owner's share at every step
        checked_signals = all_node_grads if self._node is not None else signals
        average = "world" if local else None  # a synchronisation averages over every rank
        exchange = exchanges.build(
            self.settings.exchange, self._exchange_spec(layouts, tier.value_format, transport.world, average)
        )
        late = self._finish_pending(items) if self._pending is not None else None  # overlap: last step's update
        started = time.monotonic()

        # 1. local checks (at this process's first exchange also: are the replicas and the data really apart?)
        first = not self._first_checked and transport.world > 1
        bad_grads = _nonfinite([s for s in checked_signals if s is not None])
        bad_params = _nonfinite(replicas)
        check_drift = (_due(self.settings.check_every, self.steps) or first) and transport.world > 1
        # a DDP wrapper taken for an unused one at the first step (accelerate_utils.check_local_gradients): still?
        suspects = self._ddp_suspects() if check_drift and not first and self._ddp_wrappers else []
        if suspects:
            grad_print = _gradient_fingerprint([p.grad for p in suspects])
        else:
            grad_print = _gradient_fingerprint(signals) if first and self.settings.identical_gradients == "raise" else 0
        flags = (codec.FLAG_NONFINITE if bad_grads else 0) | (codec.FLAG_NONFINITE_PARAMS if bad_params else 0)
        flags |= codec.FLAG_FINGERPRINT if check_drift else 0
        flags |= codec.FLAG_GRAD_FINGERPRINT if grad_print else 0
        flags |= codec.FLAG_DDP_SUSPECT if suspects else 0

        # 2-3. momentum on copies, then the exchange's local part (select, encode, error feedback)
        working, payload = [], torch.empty(0, dtype=torch.uint8, device="cpu")
        if not flags & (codec.FLAG_NONFINITE | codec.FLAG_NONFINITE_PARAMS):
            for (p, g, layout), signal in zip(items, signals):
                if local:  # the pseudo-gradient, into an error feedback that fades as fast as top-k drains it
                    decay, scale = local_steps.feedback_decay(self.settings.sync_decay, layout), 1.0
                else:
                    decay, scale = g["compression_decay"], g["lr"]
                m = F.accumulate(self._momentum(p, layout), signal, layout, decay, scale)
                working.append(m)
            payload = exchange.prepare(working)

        # 4. headers
        header = codec.Header(
            step=self.steps,
            layout_checksum=layout_ck,
            settings_checksum=settings_ck,
            flags=flags,
            world_size=transport.world,
            payload_bytes=exchange.payload_nbytes,
            fingerprint=_fingerprint(replicas) if check_drift else 0,
            grad_fingerprint=grad_print,
            **self._timings(started),
        )
        header = codec.sign(header, payload, self.secret)
        device = params[0].device if params else torch.device("cpu")
        rows = transport.all_gather(header.to_bytes().to(device), "header")
        headers = [codec.Header.from_bytes(row) for row in rows]
        codec.verify_headers(headers, self.secret, transport.rank, self.steps)
        codec.check_headers(headers, transport.rank)
        policy = decided or self.policy
        if self.settings.comm_budget and decided is None:
            policy = self.policy.decide(
                max(h.exchange_ms for h in headers),
                max(h.elapsed_ms for h in headers),
                self._bytes_by_tier(items),
                self._last_exchange_tier,
            )
            if policy.tier > self.policy.tier:  # down: this very step goes again in the lower tier
                return self._step(transport, decided=policy)

        if first or codec.flagged(headers, codec.FLAG_DDP_SUSPECT):
            try:
                _check_gradients_differ(headers, self.steps, identical_check=first)
            except DeMoSetupError:
                self._hf_demo_checked = False  # the step guard scans again: the fix (disable_gradient_allreduce, del)
                raise
        drifted = check_drift and len({h.fingerprint for h in headers}) > 1
        bad_param_ranks = codec.flagged(headers, codec.FLAG_NONFINITE_PARAMS)
        resync = _due(self.settings.full_sync_every, self.steps) and transport.world > 1
        if drifted or bad_param_ranks:
            if self.settings.drift == "raise" or 0 in bad_param_ranks:
                why = (
                    f"non-finite parameters on rank(s) {bad_param_ranks}"
                    if bad_param_ranks
                    else f"parameter fingerprints differ: {[h.fingerprint for h in headers]}"
                )
                raise DeMoSyncError(
                    f"replicas {'started' if first else 'drifted'} apart at optimizer step {self.steps}: {why} "
                    f"(drift={self.settings.drift!r}); no state was changed"
                    + (f". {UNSYNCED_START}" if first and drifted else "")
                )
            resync = True
        fresh = self._fetch_rank0(replicas, transport) if resync else None

        skip = codec.flagged(headers, codec.FLAG_NONFINITE) or bad_param_ranks
        if skip and not bad_param_ranks and self.settings.nonfinite == "raise":
            raise DeMoNonFiniteError(
                f"non-finite gradients on rank(s) {skip} at optimizer step {self.steps}; "
                "no state was changed (nonfinite='raise')"
            )
        # 5. the exchange's collectives (overlap: started now, finished by the next step)
        pending = updates = None
        if not skip and self.settings.overlap:
            pending = {
                "rows": transport.start_all_gather(payload, "payload"),
                "headers": headers,
                "step": self.steps,
                "lr": [(g["lr"], g["weight_decay"]) for _, g, _ in items],
                "index_coding": self.settings.index_coding,  # how its rows are coded, whatever a resume sets
                "layouts": layouts,  # and with which blocks and top-k: a resume may change them
                "value_format": tier.value_format,
                "params": self._indices(params),  # which parameters it updates, whatever is trainable later
            }
        elif not skip:
            updates = exchange.communicate(transport, headers, payload, working)
        shared = None
        if self._node is not None and not skip:  # hierarchy: owners' new values to every rank of the node
            bases = dict(zip(map(id, replicas), fresh)) if fresh is not None else {}  # a resync's values first
            shared, rule_states = self._share_in_node(items, all_items, owner_of, updates, generator, bases)

        # 6. commit: nothing below raises on purpose
        self._first_checked = True
        if fresh is not None:
            for r, value in zip(replicas, fresh):
                r.copy_(value)
            self.resyncs += 1
            cause = "drift" if drifted else "non-finite parameters" if bad_param_ranks else "full_sync_every"
            if first and drifted:
                cause = f"the replicas differed at this process's first exchange. {UNSYNCED_START}"
            message = f"DeMo: copied rank 0's parameters to every rank at optimizer step {self.steps} ({cause})"
            logger.warning(message)
            warnings.warn(message, stacklevel=3)
        if not self.settings.comm_budget and policy.tier:  # a budget's tier resumed without a budget: back to
            policy = dataclasses.replace(policy, tier=0, over=0, under=0)  # the settings
        self.policy = policy
        self._last_exchange_ms, self._last_comm_start = self.comm_stats.seconds * 1000.0, started
        self._last_exchange_tier = tier_index
        if self.settings.overlap or late is not None:  # overlap off: a resumed in-flight exchange lands here
            self._apply_late(items, late)
            self._pending = pending
        if self.settings.overlap:
            if not skip:
                for (p, _, _), m in zip(items, working):
                    self.state[p]["momentum"] = m
        if skip:
            self._skipped()
            return
        self.steps += 1
        self.consecutive_skips = 0
        self.unsynced = False  # a communicating step committed: the replicas agree
        if self.settings.overlap:
            return
        if shared is not None:
            for (p, _, _), m, rule_state in zip(items, working, rule_states):
                self.state[p]["momentum"] = m
                self.state[p].update(rule_state)
            for (p, _, _), value in zip(all_items, shared):
                p.copy_(value)
            return
        for i, ((p, g, layout), m, update) in enumerate(zip(items, working, updates)):
            self.state[p]["momentum"] = m
            if local:
                local_steps.commit_sync(p, self.state[p], decode(update, layout), *inner[i][1:])
                continue
            direction = update_rules.get(g["update_rule"]).direction(p, decode(update, layout), self.state[p])
            F.apply_step(p, direction, g["lr"], g["weight_decay"], generator)

    @torch.no_grad()
    def flush(self) -> None:
        """After the last step, on every rank. Overlap: apply the update of the exchange still in flight. Inside
        a local phase (``sync_every > 1``, or a policy's local-step tier) the ranks' parameters are their own
        until the next synchronisation: ``end_local_phase='average'`` ends the phase now
        (:meth:`end_local_phase`), ``'warn'`` leaves them apart and warns (a model saved from rank 0 holds
        rank 0's)."""
        if self._pending is not None:
            items = self._plan(self.tiers[self.policy.tier])[0]
            self._apply_late(items, self._finish_pending(items))
            self._pending = None
        if not self.in_local_phase():
            return
        every = self.tiers[self.policy.tier].sync_every
        where = f"training ended inside a local phase (optimizer step {self.steps}, sync_every={every})"
        if self.settings.end_local_phase == "average":
            moved = self.end_local_phase()
            logger.info("DeMo: %s: %d parameters averaged over every rank", where, moved)
            return
        message = (
            f"DeMo: {where}: each rank's parameters are still its own and a model saved from rank 0 holds rank "
            f"0's. End on a synchronisation (max_steps a multiple of {every}), resume from a checkpoint, which "
            "keeps each rank's parameters in its optimizer state, or set end_local_phase='average'"
        )
        logger.warning(message)
        warnings.warn(message, stacklevel=2)

    def in_local_phase(self) -> bool:
        """Whether the ranks are between synchronisations: a local step ran since the last committed one (a
        skipped synchronisation included). The same answer on every rank."""
        return self.unsynced and self._transport_now().world > 1

    @torch.no_grad()
    def end_local_phase(self) -> int:
        """End a local phase now, on every rank: each parameter with an anchor becomes the mean of every rank's
        value (dense all-reduces in fp32, or the parameter's dtype where wider, counted in ``comm_stats``) and its
        anchor moves there, so the replicas are identical again; the error feedback and the inner state are kept.
        Raises :class:`DeMoNonFiniteError` (every rank, nothing changed) when the mean is not finite. Returns the
        number of parameters averaged."""
        if not self.in_local_phase():
            return 0
        means = self._phase_means("end_local_phase")
        if _nonfinite(list(means.values())):
            raise DeMoNonFiniteError(
                f"DeMo: the mean of the ranks' parameters at the end of the local phase (optimizer step {self.steps}) "
                "is not finite: a rank's parameters hold NaN/Inf. Nothing was changed; resume from a checkpoint"
            )
        for p, mean in means.items():
            p.copy_(mean.to(p.dtype))
            self.state[p]["anchor"].copy_(p)
        self.unsynced = False
        return len(means)

    @contextlib.contextmanager
    def averaged_parameters(self):
        """Inside a local phase, the parameters hold the mean of every rank's while the ``with`` block runs, then
        this rank's own again, bit for bit; the optimizer state is not touched. Use it for what should see the
        model and not one rank's part of it: an evaluation, the model file of a checkpoint (DeMoTrainer does both).
        Outside a local phase it does nothing. Inside one it is a collective (every rank enters it) and its dense
        all-reduces are counted in ``comm_stats``."""
        if not self.in_local_phase():
            yield
            return
        with torch.no_grad():
            means = self._phase_means("averaged_parameters")
            own = {p: p.detach().clone() for p in means}
            for p, mean in means.items():
                p.copy_(mean.to(p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, value in own.items():
                    p.copy_(value)

    def _phase_means(self, name: str) -> dict:
        """Every anchored parameter's mean over every rank (nothing changed): dense all-reduces grouped by device
        and dtype, in fp32 or the parameter's dtype where wider."""
        anchored = [p for g in self.param_groups for p in g["params"] if "anchor" in self.state.get(p, {})]
        transport = self._transport_now()
        transport.step = self.steps
        means = {}
        for key in sorted({(str(p.device), str(p.dtype)) for p in anchored}):  # the same order on every rank
            part = [p for p in anchored if (str(p.device), str(p.dtype)) == key]
            wide = hierarchy.wide_dtype(part)
            flat = torch.cat([p.detach().reshape(-1).to(wide) for p in part])
            transport.all_reduce(flat, name)
            flat /= transport.world
            start = 0
            for p in part:
                means[p] = flat[start : start + p.numel()].view(p.shape)
                start += p.numel()
        return {p: means[p] for p in anchored}

    def _finish_pending(self, items) -> list[torch.Tensor]:
        """Overlap: wait for the exchange the last step started, validate and average it (nothing committed).

        Decoded with the layouts, value format and index code it was sent with (a resume may have changed the
        settings since); overlap exchanges are all-gathers whatever ``exchange`` says now."""
        pending, transport = self._pending, self._transport or self._transport_now()  # flush() right after a resume
        rows = pending["rows"].wait() if hasattr(pending["rows"], "wait") else pending["rows"]
        pending["rows"] = rows  # done: a failure below does not wait twice
        layouts = [layout for _, layout in self._pending_targets(items)]
        fmt = pending.get("value_format") or self.tiers[self.policy.tier].value_format
        spec = self._exchange_spec(layouts, fmt, transport.world, index_coding=pending["index_coding"])
        exchange = exchanges.build("all_gather", spec)
        try:
            return exchange.finish(rows, pending["headers"], transport.rank, pending["step"])
        except DeMoSyncError as exc:
            raise DeMoSyncError(
                f"{exc}. This was the exchange still in flight (overlap=True) from optimizer step "
                f"{pending['step']}: it cannot be sent again, and the ranks that received it intact have applied "
                "it. Resume every rank from the last checkpoint"
            ) from exc

    def _indices(self, params) -> list[int]:
        """The positions of ``params`` among all of this optimizer's parameters (trainable or not)."""
        where = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        return [where[id(p)] for p in params]

    def _pending_targets(self, items) -> list[tuple[torch.Tensor, BlockLayout]]:
        """(parameter, layout) of each coefficient set of the exchange in flight: the parameters it was computed
        for (by position among all parameters, so freezing or unfreezing one since changes nothing), with the
        layouts it was coded with. A state saved before these were recorded: the trainable ones, current layouts."""
        pending = self._pending
        layouts = pending.get("layouts") or [layout for _, _, layout in items]
        everything = [p for g in self.param_groups for p in g["params"]]
        if pending.get("params") is not None and max(pending["params"], default=-1) < len(everything):
            targets = [everything[i] for i in pending["params"]]
        else:
            targets = [p for p, _, _ in items]
        shapes = [tuple(p.shape) for p in targets]
        if [layout.shape for layout in layouts] != shapes:
            raise DeMoStateError(
                f"the exchange in flight (overlap=True, optimizer step {self._pending['step']}) updates parameters "
                f"of shapes {[layout.shape for layout in layouts]}, this optimizer has {shapes}: the model or its "
                "trainable parameters changed since the checkpoint; resume with the same ones"
            )
        return list(zip(targets, layouts))

    def _apply_late(self, items, updates) -> None:
        if updates is None:
            return
        pending = self._pending
        generator = None
        if self.settings.param_rounding == "stochastic":
            generator = torch.Generator().manual_seed(0x5EED0000 + pending["step"])
        rule_of = {id(q): g["update_rule"] for g in self.param_groups for q in g["params"]}
        for (p, layout), update, (lr, wd) in zip(self._pending_targets(items), updates, pending["lr"]):
            direction = update_rules.get(rule_of[id(p)]).direction(p, decode(update, layout), self.state[p])
            F.apply_step(p, direction, lr, wd, generator)

    def _share_in_node(self, items, all_items, owner_of, updates, generator, bases):
        """(every parameter's new value, this shard's new rule states), nothing committed; ``owner_of``: each of
        ``all_items``' owner (hierarchy.owners); ``bases``: id(param) -> the value the step starts from where a
        resync replaced it."""
        topo, node = self._node
        mine = [j for j, owner in enumerate(owner_of) if owner == topo.local_rank]  # items' places in all_items
        values, rule_states = {}, []
        for j, ((p, g, layout), update) in zip(mine, zip(items, updates)):
            rule_state = {k: v.clone() for k, v in self.state[p].items() if k in update_rules.STATE_KEYS}
            direction = update_rules.get(g["update_rule"]).direction(p, decode(update, layout), rule_state)
            value = bases.get(id(p), p.detach()).clone()
            F.apply_step(value, direction, g["lr"], g["weight_decay"], generator)
            values[j] = value
            rule_states.append(rule_state)
        return hierarchy.share(values, [p for p, _, _ in all_items], owner_of, topo, node), rule_states

    def _timings(self, started: float) -> dict:
        """This rank's figures for the policy: its last exchange time and the time since its last exchange."""
        elapsed = (started - self._last_comm_start) * 1000.0 if self._last_comm_start is not None else 0.0
        return {"exchange_ms": round(self._last_exchange_ms), "elapsed_ms": round(elapsed)}

    def _bytes_by_tier(self, items) -> list[float]:
        """Payload bytes per step of every tier (amortised over its sync_every), for the policy's predictions."""
        return [
            sum(
                codec.segment_bytes(
                    plan(tuple(p.shape), g["compression_chunk"], max(1, g["compression_topk"] // t.topk_divisor)),
                    t.value_format,
                    self.settings.index_coding,
                )
                for p, g, _ in items
            )
            / t.sync_every
            for t in self.tiers
        ]

    def _skipped(self) -> None:
        self.steps += 1
        self.skipped_steps += 1
        self.consecutive_skips += 1
        if self.consecutive_skips == self.settings.nonfinite_patience:
            warnings.warn(
                f"DeMo skipped the last {self.consecutive_skips} optimizer steps for NaN/Inf "
                "gradients: the loss has likely diverged (lower the learning rate, check the data)",
                stacklevel=4,
            )

    def _momentum(self, p: torch.Tensor, layout) -> torch.Tensor:
        state = self.state[p]
        if "momentum" not in state:
            state["momentum"] = torch.zeros(layout.nblocks, layout.bsize, dtype=torch.float32, device=p.device)
        if state["momentum"].shape != (layout.nblocks, layout.bsize):
            raise DeMoStateError(
                f"the momentum of a parameter of shape {tuple(p.shape)} is blocked as {tuple(state['momentum'].shape)} "
                f"but compression_chunk now asks for {(layout.nblocks, layout.bsize)}: compression_chunk was changed "
                "during training. Change it across a checkpoint instead (save, then resume with the new chunk: the "
                "momentum is re-planned); nothing was changed"
            )
        return state["momentum"]

    def _fetch_rank0(self, params, transport: Transport) -> list[torch.Tensor]:
        """Rank 0's parameters, into copies (committed only when the step succeeds)."""
        out = []
        for p in params:
            buf = p.detach().clone().contiguous()
            transport.broadcast(buf, 0, "resync")
            out.append(buf)
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        transport = self._transport_now() if dist.is_available() and dist.is_initialized() else None
        sd = super().state_dict()
        sd["demo"] = {
            "format_version": codec.FORMAT_VERSION,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
            "resyncs": self.resyncs,
            "unsynced": self.unsynced,
            **dict(zip(("rank", "world_size", "rank_scope"), self._identity(transport))),
            "settings": self.settings.as_dict(),
            "policy": {**self.policy.state_dict(), "tier_spec": list(astuple(self.tiers[self.policy.tier]))},
            "pending": self._pending_state(),
            "comm": {k: v for k, v in self.comm_stats.as_dict().items() if k.startswith("total_") or k == "steps"},
            "local_params": self._local_params(sd["param_groups"]),
        }
        if self._node is not None:  # which local rank owns which parameter's state (hierarchy.owners)
            sd["demo"]["shards"] = "all_parameters"
        return sd

    def _moved_from_anchor(self):
        """(position, parameter) of each parameter a local phase (sync_every > 1, a policy's local-step tier) has
        moved away from its anchor, the parameters at the last synchronisation: they are this rank's own."""
        for i, p in enumerate(p for g in self.param_groups for p in g["params"]):
            anchor = self.state[p].get("anchor") if p in self.state else None
            if anchor is not None and not torch.equal(p.detach(), anchor):
                yield i, p

    def _local_params(self, saved_groups) -> dict:
        """This rank's own parameters inside a local phase, by saved id: a checkpoint's model weights (written by
        rank 0 only) do not hold them, so each rank's optimizer state does."""
        ids = [pid for g in saved_groups for pid in g["params"]]
        return {ids[i]: p.detach().clone() for i, p in self._moved_from_anchor()}

    def _saved_tier(self, saved: dict) -> int | None:
        """The index among this run's tiers of a saved policy's tier, found by what it is (its format, top-k
        divisor and sync_every), not by its number; None when this run has no such tier."""
        spec = saved.get("tier_spec")
        if spec is not None and (tier := policies.Tier(spec[0], int(spec[1]), int(spec[2]))) in self.tiers:
            return self.tiers.index(tier)
        return None

    def _load_policy(self, saved: dict) -> None:
        """The saved tier (:meth:`_saved_tier`); else the nearest number, with a warning."""
        found = self._saved_tier(saved)
        spec = saved.pop("tier_spec", None)
        self.policy.load_state_dict(saved)
        if found is not None:
            self.policy.tier = found
            return
        if spec is not None or self.policy.tier >= len(self.tiers):
            tier = min(self.policy.tier, len(self.tiers) - 1)
            warnings.warn(
                f"DeMo: the checkpoint's communication tier ({spec or self.policy.tier}) is not among this run's "
                f"tiers (other settings); continuing in tier {tier} {astuple(self.tiers[tier])}",
                stacklevel=3,
            )
            self.policy.tier = tier

    def _pending_state(self) -> dict | None:
        """Overlap: the exchange in flight, finished here (it was started by every rank: no new collective)."""
        if self._pending is None:
            return None
        pending = self._pending
        if hasattr(pending["rows"], "wait"):
            pending["rows"] = pending["rows"].wait()
        transport = self._transport or self._transport_now()
        try:  # a checkpoint must not keep rows that can never be applied
            codec.verify_rows(pending["headers"], pending["rows"], self.secret, transport.rank, pending["step"])
        except DeMoSyncError as exc:
            raise DeMoSyncError(
                f"{exc}. This is the exchange in flight (overlap=True): a checkpoint of this state could never be "
                "resumed, so none is written; resume every rank from the last checkpoint"
            ) from exc
        layouts = pending.get("layouts")
        return {
            "rows": pending["rows"].clone(),
            "step": pending["step"],
            "lr": [list(x) for x in pending["lr"]],
            "index_coding": pending["index_coding"],
            "headers": torch.stack([h.to_bytes() for h in pending["headers"]]),
            **(_layouts_state(layouts, pending["value_format"]) if layouts else {}),
            **({"params": list(pending["params"])} if pending.get("params") is not None else {}),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("demo", None)
        if extra is None:
            raise DeMoStateError("this optimizer state was not saved by hf_demo.DeMo (no 'demo' entry)")
        if extra.get("format_version") not in (1, 2, codec.FORMAT_VERSION):
            raise DeMoStateError(
                f"optimizer state has format version {extra.get('format_version')}, "
                f"this hf_demo reads {codec.FORMAT_VERSION}"
            )
        if extra.get("pending") is not None and (self.settings.sync_every > 1 or self.settings.hierarchy != "flat"):
            raise DeMoStateError(  # before anything is loaded: the optimizer stays as it was
                "this optimizer state holds an exchange still in flight (saved with overlap=True), which local steps "
                "(sync_every > 1) and hierarchy='node' cannot apply: resume it with the settings it was saved with, "
                "call optimizer.flush(), save again, and resume that checkpoint with the new settings"
            )
        self._refuse_an_unending_local_phase(extra)
        requested = [{k: g[k] for k in DeMoSettings.per_group_names()} for g in self.param_groups]
        saved_groups = state_dict["param_groups"]
        # torch casts floating state to the parameter dtype (and integer state too, rule_step: a bf16 counter
        # stops at 256); DeMo's state stays fp32 on the parameter's device, its counters int64 on the host
        saved_tensors = {
            pid: {k: v for k, v in s.items() if torch.is_tensor(v)} for pid, s in state_dict.get("state", {}).items()
        }
        super().load_state_dict(state_dict)
        changed = []
        for group, req, saved in zip(self.param_groups, requested, saved_groups):
            for k, v in req.items():
                if saved.get(k, v) != v:
                    changed.append(f"{k}: saved {saved[k]!r}, requested {v!r}")
            group.update(req)  # the requested settings win over the checkpoint's
        saved_settings = extra.get("settings", {})
        if saved_settings.get("exchange") == "all_reduce" and "reduce_positions" not in saved_settings:
            # saved before reduce_positions existed: that all_reduce ran the rotating leader
            saved_settings = {**saved_settings, "reduce_positions": "leader"}
        changed += [
            f"{k}: saved {saved_settings[k]!r}, requested {v!r}"
            for k, v in self.settings.as_dict().items()
            if k in saved_settings and saved_settings[k] != v
        ]
        ids = [pid for g in saved_groups for pid in g["params"]]
        pairs = [(p, g, saved_g) for g, saved_g in zip(self.param_groups, saved_groups) for p in g["params"]]
        for pid, (p, group, saved_g) in zip(ids, pairs):
            for key, value in saved_tensors.get(pid, {}).items():
                if not value.is_floating_point():
                    self.state[p][key] = value.to(device="cpu", copy=True)
                    continue
                value = value.to(device=p.device, dtype=torch.float32, copy=True)
                if key == "momentum":
                    value = _replan_momentum(
                        pid,
                        value,
                        p,
                        saved_g.get("compression_chunk", group["compression_chunk"]),
                        group["compression_chunk"],
                    )
                self.state[p][key] = value
        if changed:
            warnings.warn(
                "DeMo: resuming with settings that differ from the checkpoint's (the requested ones "
                "are used; momentum re-planned where the chunk changed): " + "; ".join(changed),
                stacklevel=2,
            )
        self.steps = int(extra["steps"])
        self.skipped_steps = int(extra["skipped_steps"])
        self.consecutive_skips = int(extra.get("consecutive_skips", 0))
        self.resyncs = int(extra.get("resyncs", 0))
        self._load_policy(dict(extra.get("policy", {})))
        every = self.tiers[self.policy.tier].sync_every  # a state saved before it recorded: from the step count
        self.unsynced = bool(extra.get("unsynced", every > 1 and self.steps % every != 0))
        pending = extra.get("pending")
        self._pending = (
            None
            if pending is None
            else {
                "rows": pending["rows"].to(self._device(), copy=True),  # saved from the device, loaded to the host
                "step": int(pending["step"]),
                "lr": [tuple(x) for x in pending["lr"]],
                "headers": [codec.Header.from_bytes(row) for row in pending["headers"]],
                "index_coding": pending.get("index_coding", "uint16"),  # the only code before it was recorded
                "layouts": [_layout(x) for x in pending["layouts"]] if "layouts" in pending else None,
                "value_format": pending.get("value_format"),
                "params": [int(i) for i in pending["params"]] if "params" in pending else None,
            }
        )
        self.comm_stats.load(extra.get("comm", {}))
        frozen = any(not p.requires_grad for g in self.param_groups for p in g["params"])
        if extra.get("settings", {}).get("hierarchy") == "node" and "shards" not in extra and frozen:
            warnings.warn(
                "DeMo: this hierarchy='node' state was saved by an hf_demo that gave parameters to local ranks by "
                "their position among the trainable ones; they now go by their position among all parameters, so "
                "with frozen parameters some momenta start afresh on a new owner",
                stacklevel=2,
            )
        # "group": the rank in the optimizer's own group (and saved by a hierarchy before it recorded a scope)
        self._saved_world = (int(extra["rank"]), int(extra["world_size"]), extra.get("rank_scope", "group"))
        if dist.is_available() and dist.is_initialized():
            self._check_saved_world(self._transport_now())
        local = extra.get("local_params") or {}
        with torch.no_grad():  # mid local phase: this rank's own parameters, not the checkpoint's model weights
            for pid, (p, _, _) in zip(ids, pairs):
                if pid in local:
                    p.copy_(local[pid])
                elif self.unsynced and "anchor" in self.state.get(p, {}):
                    # not moved since the synchronisation on this rank: its own value is the anchor (a model file
                    # written through averaged_parameters holds the ranks' mean, which another rank moved)
                    p.copy_(self.state[p]["anchor"])

    def _refuse_an_unending_local_phase(self, extra: dict) -> None:
        """A state saved inside a local phase holds each rank's own parameters; resumed into a tier without local
        steps, the next exchange would find the ranks apart and copy rank 0's over the others' (their local
        steps lost, blamed on unsynchronised initial weights). Refused before anything is loaded."""
        saved_policy = extra.get("policy", {})
        spec = saved_policy.get("tier_spec")
        saved_every = int(spec[2]) if spec else int(extra.get("settings", {}).get("sync_every", 1))
        unsynced = extra.get("unsynced", saved_every > 1 and int(extra["steps"]) % saved_every != 0)
        if not unsynced or int(extra.get("world_size", 1)) <= 1:  # one rank: its parameters are everybody's
            return
        found = self._saved_tier(saved_policy)
        tier = found if found is not None else min(int(saved_policy.get("tier", 0)), len(self.tiers) - 1)
        if self.tiers[tier].sync_every > 1:
            return
        raise DeMoStateError(
            f"this optimizer state was saved inside a local phase (optimizer step {extra['steps']}, synchronising "
            f"every {saved_every} steps): each rank's parameters are still its own, and this run has no local "
            "steps (sync_every=1), so its first exchange would find the ranks apart and copy rank 0's parameters "
            f"over the others'. Resume it with the settings it was saved with (sync_every={saved_every}), call "
            "optimizer.flush() on every rank (end_local_phase='average' averages the ranks), save again, and "
            "resume that checkpoint with the new settings"
        )

    def _device(self) -> torch.device:
        """Where the step's buffers live: the first trainable parameter's device."""
        trainable = (p.device for g in self.param_groups for p in g["params"] if p.requires_grad)
        return next(trainable, torch.device("cpu"))

    def _identity(self, transport: Transport | None) -> tuple[int, int, str]:
        """(rank, world size, scope) that a saved state belongs to. With hierarchy='node' the optimizer's
        transport is the inter-node group, whose rank is the node's number: two local ranks of a node would
        share it, so the state records the rank in the whole world."""
        if transport is None:
            return 0, 1, "group"
        if self._node is not None:
            return dist.get_rank(), dist.get_world_size(), "world"
        return transport.rank, transport.world, "group"

    def _check_saved_world(self, transport: Transport) -> None:
        if self._saved_world is None:
            return
        saved_rank, saved_world, scope = self._saved_world
        rank, world, _ = self._identity(transport)
        if scope == "group" and self._node is not None:  # saved before the scope was recorded: the node's number
            rank, world = transport.rank, transport.world
        if saved_world != world:
            raise DeMoStateError(
                f"optimizer state was saved with {saved_world} process(es) but this run has "
                f"{world}: each rank's momentum is its own, resume with {saved_world} processes "
                "(or start the optimizer afresh)"
            )
        if saved_rank != rank:
            raise DeMoStateError(
                f"rank {rank} loaded the optimizer state saved by rank {saved_rank}; each rank must load its own state"
            )
        self._saved_world = None


# ---------------------------------------------------------------------- helpers
def _due(every: int, step: int) -> bool:
    return bool(every) and (step + 1) % every == 0


def _nonfinite(tensors: list[torch.Tensor]) -> bool:
    """Any NaN/Inf element (element-wise: a finite 1e30 is finite).

    Fast path: a tensor's sum is finite only when every element is (a NaN or an Inf makes the sum NaN or
    Inf), and a sum reads the tensor once where ``isfinite().all()`` makes three passes (30x slower on a
    CPU). Only a tensor whose sum is not finite (a NaN/Inf, or finite values whose sum overflows) is checked
    element by element.
    """
    tensors = [t for t in tensors if t.numel()]
    if any(t.is_sparse for t in tensors):
        raise ValueError("DeMo does not support sparse gradients")
    by_device: dict[torch.device, list[torch.Tensor]] = {}  # one host sync per device, not one per tensor
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for group in by_device.values():
        sums = torch.stack([t.detach().sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
                            for t in group])  # fmt: skip
        suspects = (~sums.isfinite()).nonzero().flatten().tolist()
        if any(not bool(group[i].isfinite().all()) for i in suspects):
            return True
    return False


UNSYNCED_START = (
    "The initial weights were never synchronised: a model initialised differently on each rank (e.g. PEFT "
    "adapters, or a seed that depends on the rank) that DDP never broadcast, for instance because "
    "trainer.evaluate() ran before trainer.train() (hf_demo.DeMoTrainer handles that; in a custom loop wrap "
    "the model with hf_demo.prepare before evaluating)"
)


def _check_gradients_differ(headers: list[codec.Header], step: int, identical_check: bool) -> None:
    """Raise :class:`DeMoSetupError` when the ranks' local gradients are bitwise the same.

    Ranks that flagged a DDP suspicion sent the fingerprint of the wrapped parameters' gradients: two of them
    equal (and non-zero) means a wrapper averages them. Otherwise, with ``identical_check`` (a process's first
    exchange), every rank having sent the same non-zero fingerprint raises."""
    prints = [h.grad_fingerprint if h.flags & codec.FLAG_GRAD_FINGERPRINT else None for h in headers]
    suspects = [bool(h.flags & codec.FLAG_DDP_SUSPECT) for h in headers]
    if any(suspects):
        averaged = ddp_wrappers.averaging_ranks(suspects, [p or 0 for p in prints])
        if averaged:
            raise DeMoSetupError(
                f"{DDP_ALLREDUCES} Found at optimizer step {step}: a wrapper that did not average at the first step "
                f"does now (the gradients of the parameters it holds are bitwise identical on ranks {averaged}). "
                "No state was changed."
            )
        return
    if not identical_check or not prints or None in prints or len(set(prints)) > 1:
        return
    raise DeMoSetupError(
        f"the local gradients are bitwise identical on all {len(headers)} ranks at optimizer step {step}: DeMo "
        "needs each rank's own gradient. The two usual causes: (1) DDP still averages the gradients: use "
        "hf_demo.DeMoTrainer (or a trainer class made by hf_demo.with_demo), hf_demo.prepare(accelerator, model, "
        "optimizer) in a custom loop, or hf_demo.disable_gradient_allreduce(ddp_model); (2) every rank reads the "
        "same batches: shard the data per rank (a DistributedSampler, accelerator.prepare(dataloader)), and on a "
        "machine without GPU launch with ACCELERATE_USE_CPU=1 or --use_cpu true so Trainer sees every process. "
        "No state was changed; identical_gradients='allow' turns this check off."
    )


def _gradient_fingerprint(signals: list[torch.Tensor | None]) -> int:
    """A non-zero fingerprint of the local gradients, or 0 when there are none or all are zero."""
    present = [s for s in signals if s is not None]
    if not present or not any(bool(s.detach().ne(0).any()) for s in present):
        return 0
    return _fingerprint(present) or 1


_FINGERPRINT_PERIOD = 65521  # the position weights of the fingerprint repeat with this period (a prime)


def _fingerprint(params: list[torch.Tensor]) -> int:
    """An exact, order-sensitive fingerprint of the parameters' bits (integer sums: deterministic).

    Per parameter: the sum of its bits as integers, and their sum weighted by ``1 + position % 65521``. The
    weighted sum is taken over column sums (the bits laid out in rows of 65521), so no 64-bit copy or weight
    vector longer than one period is made, and the weights once per device."""
    int_of = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    period = _FINGERPRINT_PERIOD
    weights: dict[torch.device, torch.Tensor] = {}  # 1..period, once per device
    sums = []  # integer sums: the same on every device; read back to the host at once
    for p in params:
        bits = p.detach().contiguous().view(int_of[p.element_size()]).reshape(-1)
        if bits.numel() <= period:  # one row: the bits are their own column sums
            columns = bits.to(torch.int64)
        else:
            full = bits.numel() - bits.numel() % period
            columns = bits[:full].view(-1, period).sum(0, dtype=torch.int64)
            columns[: bits.numel() - full] += bits[full:].to(torch.int64)
        if bits.device not in weights:
            weights[bits.device] = torch.arange(1, period + 1, dtype=torch.int64, device=bits.device)
        sums.append(torch.stack([columns.sum(), (columns * weights[bits.device][: columns.numel()]).sum()]))
    host = torch.stack(sums).tolist() if len({s.device for s in sums}) == 1 else [s.tolist() for s in sums]
    total = 0
    for plain, weighted in host:
        total = (total * 1_000_003 + plain * 31 + weighted) & ((1 << 62) - 1)
    return total


def _layouts_state(layouts: list[BlockLayout], value_format: str) -> dict:
    """What a checkpoint keeps of how an exchange in flight was coded."""
    return {"layouts": [list(astuple(x)) for x in layouts], "value_format": value_format}


def _layout(saved) -> BlockLayout:
    """A :class:`~hf_demo.compression.blocks.BlockLayout` from its saved fields (shape, rows, cols, b0, b1, k)."""
    shape, *rest = saved
    return BlockLayout(tuple(int(x) for x in shape), *(int(x) for x in rest))


def _replan_momentum(pid, momentum: torch.Tensor, p: torch.Tensor, saved_chunk: int, chunk: int) -> torch.Tensor:
    shape = tuple(p.shape)
    old, new = plan(shape, saved_chunk, 1), plan(shape, chunk, 1)
    if tuple(momentum.shape) != (old.nblocks, old.bsize):
        raise DeMoStateError(
            f"saved momentum of parameter {pid} has shape {tuple(momentum.shape)}, this model "
            f"needs {(old.nblocks, old.bsize)} (parameter shape {shape}, chunk {saved_chunk}): "
            "a different model?"
        )
    if saved_chunk == chunk:
        return momentum
    return encode(decode(momentum, old), new)


def _validate_group(group: dict) -> None:
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
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk * chunk <= MAX_BLOCK_SIZE:
        bad("compression_chunk", "must be an integer in [1, 256] (positions inside a block fit 16 bits)")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        bad("compression_topk", "must be an integer >= 1")
    if topk > chunk * chunk:
        bad("compression_topk", f"cannot exceed the block size chunk*chunk = {chunk * chunk}")
