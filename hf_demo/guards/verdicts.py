"""The guards of a step: local findings become header flags (:func:`inspect`); the headers of every rank become
one verdict, the same on every rank (:func:`judge`): go on, skip the step, copy rank 0's replicas, or raise."""

from __future__ import annotations

import warnings
from dataclasses import replace

from hf_demo.errors import DeMoNonFiniteError, DeMoSetupError, DeMoSyncError
from hf_demo.guards.checks import any_nonfinite, fingerprint, gradient_fingerprint, nonfinite_or_zero
from hf_demo.guards.ddp import check_gradients_differ
from hf_demo.optim.records import Findings, Verdict
from hf_demo.wire import codec

FLAG_REFUSED = codec.FLAG_REFUSED
AGREED_FLAGS = codec.FLAG_NONFINITE | codec.FLAG_NONFINITE_PARAMS | FLAG_REFUSED  # decide the whole model's step
STEADY_FLAGS = codec.FLAG_AUTH | codec.FLAG_FINGERPRINT  # header flags that ask for nothing beyond the steady path

UNSYNCED_START = (
    "The initial weights were never synchronised: a model initialised differently on each rank (e.g. PEFT "
    "adapters, or a seed that depends on the rank) that DDP never broadcast, for instance because "
    "trainer.evaluate() ran before trainer.train() (hf_demo.DeMoTrainer handles that; in a custom loop wrap "
    "the model with hf_demo.prepare before evaluating)"
)


def due(every: int, step: int) -> bool:
    return bool(every) and (step + 1) % every == 0


def zero_gradients(step: int) -> str:
    return (
        f"DeMo: every gradient of this rank was zero at optimizer step {step}: the step moves on DeMo's momentum "
        "alone. Gradient clipping zeroes every gradient when their norm is not finite: a gradient spike whose "
        "square overflows (about 1e19 in fp32) gives an infinite norm (Trainer logs grad_norm inf). Find the batch "
        "or the loss that spikes, or lower the learning rate"
    )


def inspect(step, signal, late_refused: bool) -> Findings:
    """This rank's header flags and fingerprints from its own tensors (``signal``: what enters the momentum and
    the replicas); ``late_refused``: this rank refused the exchange in flight (overlap)."""
    view, s, world, number = step.view, step.settings, step.transport.world, step.transport.step
    first = not view.first_checked and world > 1
    bad_grads, zero_grads = nonfinite_or_zero([g for g in signal.signals if g is not None])
    if zero_grads and any(g["lr"] for g in view.param_groups):  # torch's DCP helpers step once at lr 0
        step.tx.stage(lambda: warnings.warn(zero_gradients(number), stacklevel=5), keeps_nothing=True)
    bad_params = any_nonfinite(signal.replicas)
    check_drift = (due(s.check_every, number) or first) and world > 1
    # a DDP wrapper taken for an unused one at the first step (guards.ddp.first_step_check): still?
    suspects = view.ddp_suspects() if check_drift and not first else []
    grad_print = 0
    if suspects:
        grad_print = gradient_fingerprint([p.grad for p in suspects])
    elif first and s.identical_gradients == "raise":
        grad_print = gradient_fingerprint(signal.signals)
    flags = (codec.FLAG_NONFINITE if bad_grads else 0) | (codec.FLAG_NONFINITE_PARAMS if bad_params else 0)
    flags |= codec.FLAG_FINGERPRINT if check_drift else 0
    flags |= codec.FLAG_GRAD_FINGERPRINT if grad_print else 0
    flags |= codec.FLAG_DDP_SUSPECT if suspects else 0
    flags |= FLAG_REFUSED if late_refused else 0
    replica_print = fingerprint(signal.replicas) if check_drift else 0
    return Findings(flags, first, check_drift, grad_print, replica_print, suspects)


def decide(settings, number: int, world: int, found: Findings, headers: list) -> Verdict:
    """What every rank's header says about step ``number``, read alike on every rank that trusted them all, by the
    vote (:func:`hf_demo.optim.settle.vote`) and the judge (:func:`judge`): skip (non-finite gradients or
    parameters somewhere), drift (the replicas' fingerprints differ), resync (due by ``full_sync_every``, or for
    drift or non-finite parameters), and steady (no header flag beyond :data:`STEADY_FLAGS`, no resync, not a
    process's first exchange; where the policy may move, the vote asks :func:`policy_after` too). It raises
    nothing and runs no collective: the judge raises from it, and agrees the drift over a shard group."""
    drifted = found.check_drift and len({h.fingerprint for h in headers}) > 1
    bad_param_ranks = codec.flagged(headers, codec.FLAG_NONFINITE_PARAMS)
    resync = (due(settings.full_sync_every, number) and world > 1) or drifted or bool(bad_param_ranks)
    skip = bool(bad_param_ranks) or bool(codec.flagged(headers, codec.FLAG_NONFINITE))
    plain = not any(h.flags & ~STEADY_FLAGS for h in headers)
    return Verdict(skip, resync, drifted, bad_param_ranks, steady=plain and not (resync or found.first))


def policy_after(step, chosen, headers: list):
    """The budget policy after this step's headers (the slowest exchange and step; the figures are the whole
    model's, agreed over the shard group where it is sharded): the tier it moves to, for the policy phase and the
    vote alike."""
    view = step.view
    figures = view.topology.agree_figures(
        step.transport,
        chosen.device,
        max(h.exchange_ms for h in headers),
        max(h.elapsed_ms for h in headers),
        view.bytes_by_tier(chosen.items),
    )
    return view.policy.decide(*figures, view.clock.last_exchange_tier)


def judge(step, device, found: Findings, headers: list) -> Verdict:
    """Raise (every rank alike), or the verdict from every rank's header (:func:`decide`): skip, resync from
    rank 0."""
    s, number, topology = step.settings, step.transport.step, step.view.topology
    _refused_in_flight(step.transport, found, headers)
    if found.first or codec.flagged(headers, codec.FLAG_DDP_SUSPECT):
        try:
            check_gradients_differ(headers, number, found.first, step.view.context)
        except DeMoSetupError:
            step.view.rescan_ddp()  # the first-step guard scans again: the fix (disable, del) may follow
            raise
    read = decide(s, number, step.transport.world, found, headers)
    drifted, bad_param_ranks = read.drifted, read.bad_param_ranks
    if found.check_drift:  # sharded parameters: drift in any shard is the whole model's (every shard decides alike)
        drifted = bool(topology.agree(step.transport, device, int(drifted), "node_drift"))
    if (drifted or bad_param_ranks) and (s.drift == "raise" or 0 in bad_param_ranks):
        why = (
            f"non-finite parameters on rank(s) {bad_param_ranks}"
            if bad_param_ranks
            else f"parameter fingerprints differ: {[h.fingerprint for h in headers]}"
        )
        raise DeMoSyncError(
            f"replicas {'started' if found.first else 'drifted'} apart at optimizer step {number}: {why} "
            f"(drift={s.drift!r}); no state was changed" + (f". {UNSYNCED_START}" if found.first and drifted else "")
        )
    nonfinite = codec.flagged(headers, codec.FLAG_NONFINITE)
    if nonfinite and not bad_param_ranks and s.nonfinite == "raise":
        raise DeMoNonFiniteError(
            f"non-finite gradients on rank(s) {nonfinite} at optimizer step {number}; "
            "no state was changed (nonfinite='raise')"
        )
    return replace(read, resynced=read.resynced or drifted, drifted=drifted, steady=read.steady and not drifted)


def _refused_in_flight(transport, found: Findings, headers: list) -> None:
    """Overlap: a rank refused the exchange the last step started; every rank raises, none applies it."""
    refusing = codec.flagged(headers, FLAG_REFUSED)
    if not refusing:
        return
    what = f"{found.late_refusal}; " if found.late_refusal is not None else ""
    raise DeMoSyncError(
        f"{what}rank(s) {[transport.global_rank(r) for r in refusing]} refused the exchange still in flight "
        f"(overlap=True) from optimizer step {transport.step - 1}: no rank applied it and it cannot be sent "
        "again. Resume every rank from the last checkpoint"
    )
