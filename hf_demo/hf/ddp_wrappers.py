"""Finding DistributedDataParallel wrappers that could be averaging the gradients of DeMo's parameters.

Python sees that a wrapper exists and has no no-op comm hook, not whether its reducer still runs: an earlier
baseline's wrapper may be alive and unused. So a suspicion is settled by the gradients themselves: a wrapper
that averages makes the gradients of the parameters it holds bitwise the same on the ranks it averages over.
:func:`averaging_ranks` reads that from one fingerprint per rank.
"""

from __future__ import annotations

import gc
from itertools import compress

import torch
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn.parallel import DistributedDataParallel


def _subclasses(kind: type) -> set[type]:
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
    # DDP's classes from the class tree, then the objects of those classes, picked out in C: a transformers
    # process holds ~4*10^5 objects, and a Python loop (or issubclass) over each of them is slower
    ddp_types = _subclasses(DistributedDataParallel)
    wrappers = compress(objects, map(ddp_types.__contains__, map(type, objects)))
    return [w for w in wrappers if allreducing(w) and any(id(p) in ids for p in w.module.parameters())]


def held_params(wrappers, params) -> list[torch.Tensor]:
    """Those of ``params`` that any of ``wrappers`` (still all-reducing) holds, in the order of ``params``."""
    held = {id(p) for w in wrappers if allreducing(w) for p in w.module.parameters()}
    return [p for p in params if id(p) in held]


def averaging_ranks(flags: list[bool], prints: list[int]) -> list[int]:
    """The ranks whose wrapped gradients some other flagged rank matches bitwise: a wrapper averaged them.

    ``flags[r]``: rank r holds a wrapper; ``prints[r]``: the fingerprint of its wrapped gradients (0: none, or
    all zero, which tells nothing). Any two equal non-zero prints mean averaging, over the world or a subgroup."""
    seen: dict[int, list[int]] = {}
    for rank, (flag, value) in enumerate(zip(flags, prints)):
        if flag and value:
            seen.setdefault(value, []).append(rank)
    return sorted(r for ranks in seen.values() if len(ranks) > 1 for r in ranks)
