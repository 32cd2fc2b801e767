"""``overlap=True``: the exchange a step starts runs while the next step computes; its update lands one step late.

The exchange in flight is a :class:`~hf_demo.optim.state.PendingExchange`. The next step finishes it in its
``inspect`` part (:func:`finish`): a rank that refuses what it received says so in that step's header, so every
rank refuses it alike; otherwise its update lands in that step's transaction (:func:`stage_late`), decoded with
the coding it was sent with and applied to the parameters it was computed for.
"""

from __future__ import annotations

import torch

from hf_demo import compression as F
from hf_demo.errors import DeMoPayloadError, DeMoStateError
from hf_demo.exchange import transport as exchanges
from hf_demo.exchange.transport import Traffic
from hf_demo.optim.state import PendingExchange
from hf_demo.optim.transaction import Transaction
from hf_demo.topology.dtensor import local, local_shape
from hf_demo.wire import agreement, codec


def pending_from(view, tier, chosen, in_flight) -> PendingExchange | None:
    """The exchange this step started (``in_flight``, None: none), with what it takes to apply it later: the
    settings and tier it was coded with, the items it updates (``chosen``) and their learning rates."""
    if in_flight is None:
        return None
    return PendingExchange(
        in_flight,
        view.settings.exchange,
        view.settings.reduce_positions,
        view.settings.index_coding,
        tier.value_format,
        chosen.layouts,
        [(g["lr"], g["weight_decay"]) for g in chosen.groups],
        view.positions(chosen.params),
    )


def targets(view, pending: PendingExchange) -> list[tuple[torch.Tensor, object]]:
    """(parameter, layout) of each coefficient set of the exchange in flight: the parameters it was computed for
    (by position among all parameters, so freezing or unfreezing one since changes nothing)."""
    everything = view.everything()
    chosen = [everything[i] for i in pending.params] if max(pending.params, default=-1) < len(everything) else []
    shapes = [local_shape(p) for p in chosen]
    if len(chosen) != len(pending.params) or [layout.shape for layout in pending.layouts] != shapes:
        raise DeMoStateError(
            f"the exchange in flight (overlap=True, optimizer step {pending.step}) updates parameters of shapes "
            f"{[layout.shape for layout in pending.layouts]}, this optimizer has {shapes}: the model or its "
            "trainable parameters changed since the checkpoint; resume with the same ones"
        )
    return list(zip(chosen, pending.layouts))


def finish(view, traffic: Traffic) -> list[torch.Tensor] | None:
    """Wait for the exchange in flight (``view.pending``), validate it and average it (nothing committed; None for
    a skipped step's, which lands nothing); raises
    :class:`DeMoPayloadError` where what this rank received fails its checks."""
    pending = view.pending
    targets(view, pending)  # the parameters are still there
    started = pending.in_flight
    if started.refused is None and codec.flagged(started.headers, codec.FLAG_NONFINITE | codec.FLAG_NONFINITE_PARAMS):
        started.wait(traffic)  # the exchange of a step every rank skipped: zeros and stale rows, nothing lands
        return None
    spec = view.exchange_spec(
        pending.layouts,
        pending.value_format,
        pending.in_flight.world,
        index_coding=pending.index_coding,
        positions=pending.reduce_positions,
    )
    # no workspace: this update lands beside the step's own, whose averaged coefficients take its buffer
    return exchanges.build(pending.exchange, spec).finish(pending.in_flight, traffic)


def stage_late(view, tx: Transaction, updates, stepping) -> None:
    """The update of the exchange in flight (``view.pending``), applied at the commit with the learning rates it
    was computed with (stochastic rounding seeded by the step that started it); ``stepping``: the transport of the
    step that lands it (where a rule gathers whole matrices)."""
    if updates is None:
        return
    pending = view.pending
    generator = F.rounding_noise(view.settings.param_rounding, pending.step)
    params = [p for p, _ in targets(view, pending)]
    groups = [view.group_of(p) for p in params]
    matrices = view.topology.matrices(params, view.whole_matrix_params(view.rule), stepping)
    views = [local(p) for p in params]
    directions, rule_states = view.directions(params, groups, updates, pending.layouts, matrices, views)
    for p, rule_state in zip(params, rule_states):
        tx.update(view.state[p], rule_state)
    lrs, wds = [lr for lr, _ in pending.lr], [wd for _, wd in pending.lr]
    tx.stage(lambda: F.apply_steps(views, directions, lrs, wds, generator))


def count_arrived(pending, stats) -> None:
    """The exchange in flight (``pending``), where it arrived during a step that keeps nothing, counted in
    ``stats`` once (it happened on the wire)."""
    arrived = pending.in_flight.arrived if pending is not None else None
    if arrived is not None and not pending.counted:
        stats.record(arrived.sent, arrived.received, arrived.waited)
        pending.counted = True


def flush(view, transport, device, stats, landed) -> None:
    """Land the exchange in flight now (after the last step, on every rank): validated, voted, applied. ``view``:
    the optimizer's (``DeMo.step_view()``), ``transport`` its transport at its step, ``device`` where its buffers
    live, ``stats`` its traffic totals; ``landed``: its transition once the exchange in flight is applied
    (``DeMo.land_in_flight``)."""
    try:
        updates, refusal = finish(view, transport.traffic), None
    except DeMoPayloadError as exc:
        updates, refusal = None, exc
    if transport.world > 1 and view.settings.commit_vote != "off":
        agreement.vote(transport, refusal, device, view.sealer, view.secret)
    elif refusal is not None:
        raise refusal
    tx = Transaction()
    stage_late(view, tx, updates, transport)
    tx.stage(lambda: landed(None))
    tx.commit()
    stats.add(transport.traffic)


def to_state(opt) -> dict | None:
    """The exchange in flight for a checkpoint: finished here (every rank started it: no new collective) and
    checked, so that no checkpoint keeps rows that can never be applied."""
    if opt.pending is None:
        return None
    traffic = Traffic()
    try:
        finish(opt.step_view(), traffic)
    except DeMoPayloadError as exc:
        raise DeMoPayloadError(
            f"{exc}. This is the exchange in flight (overlap=True): a checkpoint of this state could never be "
            "resumed, so none is written; resume every rank from the last checkpoint"
        ) from exc
    finally:
        opt.comm_stats.add(traffic)
    return opt.pending.to_state(Traffic())
