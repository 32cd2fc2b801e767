"""Between synchronisations (``sync_every > 1``, or a policy's local-step tier) each rank's parameters are its own:
what ends such a phase, and what shows the ranks' mean without ending it."""

from __future__ import annotations

import contextlib

import torch

from hf_demo.errors import DeMoNonFiniteError
from hf_demo.exchange.transport import Traffic
from hf_demo.guards.checks import any_nonfinite
from hf_demo.topology.dtensor import local


def in_local_phase(opt) -> bool:
    """A local step ran since the last committed synchronisation (the same answer on every rank)."""
    return opt.unsynced and opt.transport.world > 1


def phase_means(opt, name: str) -> tuple[dict, Traffic]:
    """Every anchored parameter's mean over every rank (nothing changed), and the traffic it took."""
    transport = opt.transport.at(opt.steps)
    everything = [p for g in opt.param_groups for p in g["params"]]
    anchored = [p for p in everything if "anchor" in opt.state.get(p, {})]
    means = opt.topology.mean_over_ranks(anchored, transport, name)
    return means, transport.traffic


def end(opt) -> int:
    """Every anchored parameter becomes the mean of every rank's and its anchor moves there; raises
    :class:`DeMoNonFiniteError` (every rank, nothing changed) when the mean is not finite."""
    if not in_local_phase(opt):
        return 0
    means, traffic = phase_means(opt, "end_local_phase")
    opt.comm_stats.add(traffic, "averaging")
    if any_nonfinite(list(means.values())):
        raise DeMoNonFiniteError(
            f"DeMo: the mean of the ranks' parameters at the end of the local phase (optimizer step {opt.steps}) "
            "is not finite: a rank's parameters hold NaN/Inf. Nothing was changed; resume from a checkpoint"
        )
    with torch.no_grad():
        for p, mean in means.items():
            local(p).copy_(mean.to(p.dtype))
            if "anchor" in opt.state.get(p, {}):
                opt.state[p]["anchor"].copy_(local(p))
    opt.counters.unsynced = False
    return len(means)


@contextlib.contextmanager
def averaged(opt):
    """The ranks' mean in the parameters while the block runs, then this rank's own again, bit for bit."""
    if not in_local_phase(opt):
        yield
        return
    with torch.no_grad():
        means, traffic = phase_means(opt, "averaged_parameters")
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
