"""Between synchronisations (``sync_every > 1``, or a policy's local-step tier) each rank's parameters are its own:
what ends such a phase, and what shows the ranks' mean without ending it."""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch

from hf_demo.errors import DeMoNonFiniteError
from hf_demo.exchange.transport import Traffic
from hf_demo.guards import any_nonfinite
from hf_demo.optim import overlap
from hf_demo.topology.dtensor import local

logger = logging.getLogger("hf_demo.optim.optimizer")  # the optimizer's log, as before


def in_local_phase(opt) -> bool:
    """``DeMo.in_local_phase()``: whether the ranks are between synchronisations: a local step ran since the last
    committed one (a skipped synchronisation included). The same answer on every rank."""
    return opt.unsynced and opt.transport.world > 1


def phase_means(topology, steps: int, param_groups, state, name: str) -> tuple[dict, Traffic]:
    """Every anchored parameter's mean over every rank (nothing changed), and the traffic it took: the optimizer's
    ``topology`` at its step ``steps``, its ``param_groups`` and per-parameter ``state``."""
    transport = topology.transport.at(steps)
    everything = [p for g in param_groups for p in g["params"]]
    anchored = [p for p in everything if "anchor" in state.get(p, {})]
    means = topology.mean_over_ranks(anchored, transport, name)
    return means, transport.traffic


def end(topology, steps: int, param_groups, state, stats) -> int:
    """``DeMo.end_local_phase()`` inside a local phase, on every rank: each parameter with an anchor becomes the mean
    of every rank's value (dense all-reduces in fp32, or the parameter's dtype where wider, counted in
    ``comm_stats``) and its anchor moves there; the error feedback and the inner state are kept (the optimizer then
    marks its counters synchronised). Raises :class:`DeMoNonFiniteError` (every rank, nothing changed) when the
    mean is not finite. Returns the number of parameters averaged. (The optimizer's topology, step, groups, state
    and traffic totals: :func:`phase_means`.)"""
    means, traffic = phase_means(topology, steps, param_groups, state, "end_local_phase")
    stats.add(traffic, "averaging")
    if any_nonfinite(list(means.values())):
        raise DeMoNonFiniteError(
            f"DeMo: the mean of the ranks' parameters at the end of the local phase (optimizer step {steps}) "
            "is not finite: a rank's parameters hold NaN/Inf. Nothing was changed; resume from a checkpoint"
        )
    with torch.no_grad():
        for p, mean in means.items():
            local(p).copy_(mean.to(p.dtype))
            if "anchor" in state.get(p, {}):
                state[p]["anchor"].copy_(local(p))
    return len(means)


@torch.no_grad()
def flush(opt) -> None:
    """``DeMo.flush()``: after the last step, on every rank. The last step's verdict is read where it has not been
    (``confirm()``). Overlap: apply the update of the exchange still in flight. Inside a local phase
    (``sync_every > 1``, or a policy's local-step tier) the ranks' parameters are their own until the next
    synchronisation: ``end_local_phase='average'`` ends the phase now (``end_local_phase()``), ``'warn'`` leaves
    them apart and warns (a model saved from rank 0 holds rank 0's)."""
    opt.confirm()
    if opt.pending is not None:
        overlap.flush(opt.step_view(), opt.transport.at(opt.steps), opt.device(), opt.comm_stats, opt.land_in_flight)
    if in_local_phase(opt):
        ended_inside(
            opt.tiers[opt.policy.tier].sync_every, opt.steps, opt.settings.end_local_phase, opt.end_local_phase
        )


def ended_inside(every: int, steps: int, how: str, end) -> None:
    """``flush()`` inside a local phase (its tier's ``sync_every`` ``every``, at optimizer step ``steps``):
    ``end_local_phase='average'`` (``how``) ends it now (``end``: ``DeMo.end_local_phase``), ``'warn'`` leaves the
    ranks' parameters apart and warns."""
    where = f"training ended inside a local phase (optimizer step {steps}, sync_every={every})"
    if how == "average":
        logger.info("DeMo: %s: %d parameters averaged over every rank", where, end())
        return
    message = (
        f"DeMo: {where}: each rank's parameters are still its own and a model saved from rank 0 holds rank "
        f"0's. End on a synchronisation (max_steps a multiple of {every}), resume from a checkpoint, which "
        "keeps each rank's parameters in its optimizer state, or set end_local_phase='average'"
    )
    logger.warning(message)
    warnings.warn(message, stacklevel=3)


@contextlib.contextmanager
def averaged(opt):
    """``DeMo.averaged_parameters()``: inside a local phase, the parameters hold the mean of every rank's while the
    ``with`` block runs, then this rank's own again, bit for bit; the optimizer state is not touched. Use it for what
    should see the model and not one rank's part of it: an evaluation, the model file of a checkpoint (DeMoTrainer
    does both). Outside a local phase it does nothing. Inside one it is a collective (every rank enters it) and its
    dense all-reduces are counted in ``comm_stats``."""
    if not in_local_phase(opt):
        yield
        return
    with torch.no_grad():
        means, traffic = phase_means(opt.topology, opt.steps, opt.param_groups, opt.state, "averaged_parameters")
        opt.comm_stats.add(traffic, "averaging")
        own = {p: local(p).detach().clone() for p in means}
        for p, mean in means.items():
            local(p).copy_(mean.to(p.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value in own.items():
                local(p).copy_(value)
