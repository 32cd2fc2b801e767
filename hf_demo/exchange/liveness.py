"""A frozen or lost peer is caught within ``comm_timeout`` wherever the process is blocked, not only inside DeMo's
own collectives; and a rank does not outlive its launcher.

**The default group's timeout.** DeMo's collectives wait at most ``comm_timeout`` (:mod:`hf_demo.exchange.transport`).
The other collectives of a step are not DeMo's: Trainer's logging gather (``nested_gather``), its
``_get_num_items_in_batch``, DDP's broadcasts, the barriers around a checkpoint. They run on the default group,
whose timeout is what ``init_process_group`` was given; transformers' CPU path gives none, so gloo's 30 minutes
apply and a stopped peer leaves the others blocked for half an hour. :func:`bound_default_group` shortens the
default group's timeout to ``comm_timeout`` (never lengthens it): ``DeMoTrainer`` (and trainers made by
``with_demo``) at construction, :func:`hf_demo.prepare`, and DeMo at its first step in a process group call it.
A collective blocked on a peer then raises in the blocked thread itself (gloo's timeout error), the process
exits with it and the launcher ends the job.

Why this and not a watchdog thread (or torchft's heartbeats): the blocked call itself raises, in the thread
that made it, with nothing polling and no second thread deciding from outside what "blocked too long" means
(a watchdog could only kill the process, and would have to tell a slow evaluation from a dead peer). The cost is
the same bound on every collective of the default group: an operation on one rank that the others wait for at a
barrier (saving a very large checkpoint, evaluating on rank 0 only) must finish within ``comm_timeout``; raise
``comm_timeout`` for such runs (0 leaves the group's timeout as it is).

**The launcher's death.** A stopped (SIGSTOP) or blocked rank survives a launcher that is killed (torchrun's
workers run in their own process group). Under torchrun (``TORCHELASTIC_RUN_ID`` set), :func:`die_with_parent`
asks Linux to send the rank SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``, which also reaches a
stopped process); elsewhere (a rank started from a thread of a long-lived parent, other systems) nothing is set.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import sys

import torch.distributed as dist

PR_SET_PDEATHSIG = 1


def bound_default_group(comm_timeout: float) -> bool:
    """Shorten the default process group's timeout to ``comm_timeout`` seconds (0: leave it); True when set."""
    if not comm_timeout or not (dist.is_available() and dist.is_initialized()):
        return False
    group = dist.distributed_c10d._get_default_group()
    wanted = datetime.timedelta(seconds=comm_timeout)
    current = _group_timeout(group)
    if current is not None and current <= wanted:
        return False
    try:
        dist.distributed_c10d._set_pg_timeout(wanted, group)
    except (RuntimeError, ValueError, AttributeError):  # a backend without a settable timeout: DeMo's own bound stays
        return False
    return True


def _group_timeout(group) -> datetime.timedelta | None:
    """The timeout the group's collectives get now (None when torch does not say: then it is shortened)."""
    try:
        timeouts = [group._get_backend(device).options._timeout for device in group._device_types]
    except (AttributeError, RuntimeError):
        return None
    return min(timeouts) if timeouts else None


def die_with_parent() -> bool:
    """Under torchrun on Linux: SIGKILL this process when its launcher dies; True when set."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() == 1:  # the launcher died before the request: do what it would have done
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def guard(comm_timeout: float) -> None:
    """Both: the default group bounded by ``comm_timeout``, and this rank tied to its launcher."""
    bound_default_group(comm_timeout)
    die_with_parent()
