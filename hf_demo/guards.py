"""What the step checks before it commits: non-finite values, replicas that drifted apart, gradients that DDP
still averages. Local findings become header flags (:func:`inspect`), so every rank judges from the same facts
and takes the same decision (:func:`judge`).

The sections below: checks over many tensors (non-finite values, exact fingerprints), the DDP guard, and the
verdicts of a step.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from dataclasses import replace
from itertools import compress

import torch
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn.parallel import DistributedDataParallel

from hf_demo.errors import DDP_ALLREDUCES, DeMoNonFiniteError, DeMoSetupError, DeMoSyncError
from hf_demo.exchange import liveness, teardown
from hf_demo.optim.records import Findings, Verdict
from hf_demo.refusals import refuse
from hf_demo.wire import codec
from hf_demo.wire.agreement import pack_words, unpack_words

# ---- checks --------------------------------------------------------------------------------------

# Checks over many tensors with one read back to the host per device: non-finite values, exact fingerprints.


def any_nonfinite(tensors: list[torch.Tensor]) -> bool:
    """Any NaN/Inf element (element-wise: a finite 1e30 is finite): :func:`nonfinite_or_zero`'s first answer."""
    return nonfinite_or_zero(tensors)[0]


def nonfinite_or_zero(tensors: list[torch.Tensor]) -> tuple[bool, bool]:
    """(any NaN/Inf element, every element zero) of ``tensors``, with one read back to the host per device.

    Fast path: a tensor's 2-norm is finite only when every element is (a NaN or an Inf makes it NaN or Inf), and
    zero only when every element is; ``torch._foreach_norm`` takes it for every tensor of a dtype at once, in one
    pass over each (as fast as a sum on a CPU, where ``isfinite().all()`` makes three). Only a tensor whose norm is
    not finite (a NaN/Inf, or finite values whose squares overflow) is checked element by element. No tensors (or
    only empty ones): (False, False).
    """
    tensors = [t for t in tensors if t.numel()]
    if any(t.is_sparse for t in tensors):
        refuse("sparse_gradients")
    by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
    for t in tensors:
        by_device.setdefault(t.device, {}).setdefault(t.dtype, []).append(t)
    nonfinite, zero = False, bool(tensors)
    for by_dtype in by_device.values():
        group = [t for ts in by_dtype.values() for t in ts]
        with torch.no_grad():
            norms = torch.cat([torch.stack(torch._foreach_norm(ts)).float() for ts in by_dtype.values()])
            bad = ~norms.isfinite()
            any_bad, all_zero = torch.stack([bad.any(), norms.eq(0).all()]).tolist()  # one read back
        zero = zero and all_zero
        if any_bad and any(not bool(group[i].isfinite().all()) for i in bad.nonzero().flatten().tolist()):
            nonfinite = True
    return nonfinite, zero


def gradient_fingerprint(signals: list[torch.Tensor | None]) -> int:
    """A non-zero fingerprint of the local gradients, or 0 when there are none or all are zero."""
    present = [s for s in signals if s is not None]
    if not present or not any(bool(s.detach().ne(0).any()) for s in present):
        return 0
    return fingerprint(present) or 1


FINGERPRINT_PERIOD = 65521  # the position weights of the fingerprint repeat with this period (a prime)


def fingerprint(params: list[torch.Tensor]) -> int:
    """An exact, order-sensitive fingerprint of the parameters' bits (integer sums: deterministic).

    Per parameter: the sum of its bits as integers, and their sum weighted by ``1 + position % 65521``. The
    weighted sum is taken over column sums (the bits laid out in rows of 65521), so no 64-bit copy or weight
    vector longer than one period is made, and the weights once per device."""
    int_of = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    period = FINGERPRINT_PERIOD
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


# ---- the DDP guard -------------------------------------------------------------------------------

# The DDP guard: finding DistributedDataParallel wrappers that could be averaging the gradients of DeMo's parameters.
#
# Python sees that a wrapper exists and has no no-op comm hook, not whether its reducer still runs: an earlier
# baseline's wrapper may be alive and unused. So a suspicion is settled by the gradients themselves: a wrapper
# that averages makes the gradients of the parameters it holds bitwise the same on the ranks it averages over.
# :func:`averaging_ranks` reads that from one fingerprint per rank.


def subclasses(kind: type) -> set[type]:
    """``kind`` and every class derived from it, at any depth."""
    found, todo = {kind}, [kind]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def allreducing(wrapper) -> bool:
    """Whether a DDP wrapper would all-reduce gradients (it has no no-op comm hook)."""
    return not any(hook is noop_hook for hook, _ in getattr(wrapper, "_comm_hooks", []))


def live_wrappers(params) -> list[DistributedDataParallel]:
    """Every live DDP wrapper that holds any of ``params`` and would all-reduce their gradients."""
    ids = {id(p) for p in params}
    objects = gc.get_objects()
    # DDP's classes from the class tree, then the objects of those classes, picked out in C: a Python loop over
    # every object (~4*10^5 in a transformers process) costs a first step several times as long
    ddp_types = subclasses(DistributedDataParallel)
    wrappers = compress(objects, map(ddp_types.__contains__, map(type, objects)))
    return [w for w in wrappers if allreducing(w) and any(id(p) in ids for p in w.module.parameters())]


def held_params(wrappers, params) -> list[torch.Tensor]:
    """Those of ``params`` that any of ``wrappers`` (still all-reducing) holds, in the order of ``params``."""
    held = {id(p) for w in wrappers if allreducing(w) for p in w.module.parameters()}
    return [p for p in params if id(p) in held]


def first_step_guard(opt, params: list[torch.Tensor], transport) -> list[weakref.ref]:
    """At DeMo's first step in a process group: the exit handler (:mod:`hf_demo.exchange.teardown`), the liveness
    guard (a frozen peer caught outside DeMo's collectives too), and a loud error if DDP still averages
    (:func:`first_step_check`); returns the wrappers to watch (:func:`watched`)."""
    teardown.install_exit_handler()
    liveness.guard(opt.settings.comm_timeout)
    teardown.track(opt)
    return watched(first_step_check(params, transport), opt.steps)


def watched(wrappers: list[DistributedDataParallel], step: int) -> list[weakref.ref]:
    """DDP wrappers of the optimizer's parameters that did not average their gradients at its first step (optimizer
    step ``step``): warned about, and returned as weak references for the optimizer to check again at every
    ``check_every`` step (:func:`suspects`)."""
    if wrappers:
        warnings.warn(
            f"DeMo: {len(wrappers)} DistributedDataParallel wrapper(s) hold some of DeMo's parameters but did not "
            f"average their gradients at optimizer step {step} (they differ between ranks): taken for "
            "wrappers no longer in use. DeMo checks them again at every check_every step; "
            "hf_demo.disable_gradient_allreduce(wrapper) or `del wrapper` silences this.",
            stacklevel=4,
        )
    return [weakref.ref(w) for w in wrappers]


def suspects(watched: list[weakref.ref], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Those of ``params`` that the watched wrappers (alive and still all-reducing) hold (read only: a step writes
    nothing)."""
    if not watched:
        return []
    return held_params([w for ref in watched if (w := ref()) is not None], params)


def averaging_ranks(flags: list[bool], prints: list[int]) -> list[int]:
    """The ranks whose wrapped gradients some other flagged rank matches bitwise: a wrapper averaged them.

    ``flags[r]``: rank r holds a wrapper; ``prints[r]``: the fingerprint of its wrapped gradients (0: none, or
    all zero, which tells nothing). Any two equal non-zero prints mean averaging, over the world or a subgroup."""
    seen: dict[int, list[int]] = {}
    for rank, (flag, value) in enumerate(zip(flags, prints)):
        if flag and value:
            seen.setdefault(value, []).append(rank)
    return sorted(r for ranks in seen.values() if len(ranks) > 1 for r in ranks)


SAME_BATCHES_FIX = {  # where the launch switch that makes every process train together lives
    "trainer": "launch with ACCELERATE_USE_CPU=1 or --use_cpu true so Trainer sees every process",
    "loop": "launch with ACCELERATE_USE_CPU=1 or build Accelerator(cpu=True) so Accelerate sees every process",
}


def first_step_check(params: list[torch.Tensor], transport) -> list[DistributedDataParallel]:
    """Stop DeMo when DDP all-reduces the gradients of its parameters (DeMo's first step, every rank).

    DeMo needs each rank's own gradient; DDP's mean would make every rank's momentum the same and DeMo's
    exchange redundant: a different, silently slower optimizer. A live wrapper that holds DeMo's parameters is
    only a suspicion (an earlier baseline's may be alive and unused), settled by the gradients: every rank sends
    (holds a wrapper, fingerprint of the wrapped gradients) in one 16-byte all-gather (a set-up check, left out
    of the traffic), and every rank raises :class:`DeMoSetupError` before any state changed when two ranks'
    wrapped gradients are bitwise the same (a wrapper averaged them, over the world or a subgroup). Otherwise
    returns the wrappers, taken for unused ones (the optimizer checks them again at every ``check_every`` step).
    With no other rank to compare with, a wrapper raises at once. ``transport``: a step's transport.
    """
    wrappers = live_wrappers(params)
    if transport.world <= 1:
        if wrappers:
            raise DeMoSetupError(DDP_ALLREDUCES)
        return []
    held = held_params(wrappers, params)
    mine = pack_words([int(bool(held)), gradient_fingerprint([p.grad for p in held]) if held else 0])
    device = params[0].device if params else torch.device("cpu")
    flags, prints = zip(*unpack_words(transport.all_gather(mine.to(device), "ddp_check", count=False), 2))
    averaged = averaging_ranks([bool(f) for f in flags], list(prints))
    if averaged:
        raise DeMoSetupError(
            f"{DDP_ALLREDUCES} Found at optimizer step {transport.step}: the gradients of the parameters such a "
            f"wrapper holds are bitwise identical on ranks {averaged} (it averages them; or those ranks read the "
            "same batches). No state was changed."
        )
    return wrappers


def check_gradients_differ(headers: list[codec.Header], step: int, identical_check: bool, context: str) -> None:
    """Raise :class:`DeMoSetupError` when the ranks' local gradients are bitwise the same.

    Ranks that flagged a DDP suspicion sent the fingerprint of the wrapped parameters' gradients: two of them
    equal (and non-zero) means a wrapper averages them. Otherwise, with ``identical_check`` (a process's first
    exchange), every rank having sent the same non-zero fingerprint raises. ``context``: where DeMo runs
    (``"trainer"`` or ``"loop"``), for the fix the message names."""
    prints = [h.grad_fingerprint if h.flags & codec.FLAG_GRAD_FINGERPRINT else None for h in headers]
    suspects = [bool(h.flags & codec.FLAG_DDP_SUSPECT) for h in headers]
    if any(suspects):
        averaged = averaging_ranks(suspects, [p or 0 for p in prints])
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
        f"machine without GPU {SAME_BATCHES_FIX[context]}. "
        "No state was changed; identical_gradients='allow' turns this check off."
    )


# ---- verdicts ------------------------------------------------------------------------------------

# The guards of a step: local findings become header flags (:func:`inspect`); the headers of every rank become
# one verdict, the same on every rank (:func:`judge`): go on, skip the step, copy rank 0's replicas, or raise.

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
    bad_params = nonfinite_or_zero(signal.replicas)[0]
    check_drift = (due(s.check_every, number) or first) and world > 1
    # a DDP wrapper taken for an unused one at the first step (first_step_check): still?
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
    if codec.flagged(headers, FLAG_REFUSED):
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
    what = f"{found.late_refusal}; " if found.late_refusal is not None else ""
    raise DeMoSyncError(
        f"{what}rank(s) {[transport.global_rank(r) for r in refusing]} refused the exchange still in flight "
        f"(overlap=True) from optimizer step {transport.step - 1}: no rank applied it and it cannot be sent "
        "again. Resume every rank from the last checkpoint"
    )
