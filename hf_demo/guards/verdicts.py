"""The guards of a step: local findings become header flags (:func:`inspect`); the headers of every rank become
one verdict, the same on every rank (:func:`judge`): go on, skip the step, copy rank 0's replicas, or raise."""

from __future__ import annotations

import warnings

from hf_demo.errors import DeMoNonFiniteError, DeMoSetupError, DeMoSyncError
from hf_demo.guards.checks import any_nonfinite, fingerprint, gradient_fingerprint, nonfinite_or_zero
from hf_demo.guards.ddp import check_gradients_differ
from hf_demo.wire import codec

FLAG_REFUSED = codec.FLAG_REFUSED
AGREED_FLAGS = codec.FLAG_NONFINITE | codec.FLAG_NONFINITE_PARAMS | FLAG_REFUSED  # decide the whole model's step

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


def inspect(ctx, first_checked: bool, ddp_suspects) -> None:
    """Set ``ctx.flags`` (and the fingerprints the header carries) from this rank's own tensors."""
    s, world, step = ctx.settings, ctx.transport.world, ctx.transport.step
    ctx.first = not first_checked and world > 1
    bad_grads, zero_grads = nonfinite_or_zero([g for g in ctx.signals if g is not None])
    if zero_grads and any(g["lr"] for g in ctx.opt.param_groups):  # torch's DCP helpers step once at lr 0
        ctx.tx.stage(lambda: warnings.warn(zero_gradients(step), stacklevel=4))
    bad_params = any_nonfinite(ctx.replicas)
    ctx.check_drift = (due(s.check_every, step) or ctx.first) and world > 1
    # a DDP wrapper taken for an unused one at the first step (guards.ddp.first_step_check): still?
    ctx.suspects = ddp_suspects() if ctx.check_drift and not ctx.first else []
    if ctx.suspects:
        ctx.grad_print = gradient_fingerprint([p.grad for p in ctx.suspects])
    elif ctx.first and s.identical_gradients == "raise":
        ctx.grad_print = gradient_fingerprint(ctx.signals)
    flags = (codec.FLAG_NONFINITE if bad_grads else 0) | (codec.FLAG_NONFINITE_PARAMS if bad_params else 0)
    flags |= codec.FLAG_FINGERPRINT if ctx.check_drift else 0
    flags |= codec.FLAG_GRAD_FINGERPRINT if ctx.grad_print else 0
    flags |= codec.FLAG_DDP_SUSPECT if ctx.suspects else 0
    flags |= FLAG_REFUSED if ctx.late_refusal is not None else 0
    ctx.flags = flags
    ctx.replica_print = fingerprint(ctx.replicas) if ctx.check_drift else 0


def judge(ctx) -> None:
    """Raise (every rank alike), or set ``ctx.resync`` / ``ctx.skip`` from every rank's header."""
    headers, s, step = ctx.headers, ctx.settings, ctx.transport.step
    _refused_in_flight(ctx)
    if ctx.first or codec.flagged(headers, codec.FLAG_DDP_SUSPECT):
        try:
            check_gradients_differ(headers, step, ctx.first, ctx.opt.context)
        except DeMoSetupError:
            ctx.opt.ddp_checked = False  # the first-step guard scans again: the fix (disable, del) may follow
            raise
    ctx.drifted = ctx.check_drift and len({h.fingerprint for h in headers}) > 1
    if ctx.check_drift:  # sharded parameters: drift in any shard is the whole model's (every shard decides alike)
        ctx.drifted = bool(ctx.opt.topology.agree(ctx, int(ctx.drifted), "node_drift"))
    ctx.bad_param_ranks = codec.flagged(headers, codec.FLAG_NONFINITE_PARAMS)
    ctx.resync = due(s.full_sync_every, step) and ctx.transport.world > 1
    if ctx.drifted or ctx.bad_param_ranks:
        if s.drift == "raise" or 0 in ctx.bad_param_ranks:
            why = (
                f"non-finite parameters on rank(s) {ctx.bad_param_ranks}"
                if ctx.bad_param_ranks
                else f"parameter fingerprints differ: {[h.fingerprint for h in headers]}"
            )
            raise DeMoSyncError(
                f"replicas {'started' if ctx.first else 'drifted'} apart at optimizer step {step}: {why} "
                f"(drift={s.drift!r}); no state was changed"
                + (f". {UNSYNCED_START}" if ctx.first and ctx.drifted else "")
            )
        ctx.resync = True
    nonfinite = codec.flagged(headers, codec.FLAG_NONFINITE)
    ctx.skip = bool(nonfinite or ctx.bad_param_ranks)
    if nonfinite and not ctx.bad_param_ranks and s.nonfinite == "raise":
        raise DeMoNonFiniteError(
            f"non-finite gradients on rank(s) {nonfinite} at optimizer step {step}; "
            "no state was changed (nonfinite='raise')"
        )


def _refused_in_flight(ctx) -> None:
    """Overlap: a rank refused the exchange the last step started; every rank raises, none applies it."""
    refusing = codec.flagged(ctx.headers, FLAG_REFUSED)
    if not refusing:
        return
    what = f"{ctx.late_refusal}; " if ctx.late_refusal is not None else ""
    raise DeMoSyncError(
        f"{what}rank(s) {[ctx.transport.global_rank(r) for r in refusing]} refused the exchange still in flight "
        f"(overlap=True) from optimizer step {ctx.transport.step - 1}: no rank applied it and it cannot be sent "
        "again. Resume every rank from the last checkpoint"
    )
