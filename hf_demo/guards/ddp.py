"""The DDP guard: finding DistributedDataParallel wrappers that could be averaging the gradients of DeMo's parameters.

Python sees that a wrapper exists and has no no-op comm hook, not whether its reducer still runs: an earlier
baseline's wrapper may be alive and unused. So a suspicion is settled by the gradients themselves: a wrapper
that averages makes the gradients of the parameters it holds bitwise the same on the ranks it averages over.
:func:`averaging_ranks` reads that from one fingerprint per rank.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from itertools import compress

import torch
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn.parallel import DistributedDataParallel

from hf_demo.errors import DDP_ALLREDUCES, DeMoSetupError
from hf_demo.exchange import liveness, teardown
from hf_demo.guards.checks import gradient_fingerprint
from hf_demo.wire import codec
from hf_demo.wire.agreement import pack_words, unpack_words


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
