"""A clean end for multi-process runs: the process group is torn down while the interpreter is still whole.

A run that never calls ``torch.distributed.destroy_process_group()`` leaves gloo's worker threads holding
work objects (with tensors) when the interpreter finalises; some exits then abort with ``terminate called
without an active exception`` (SIGABRT) and the launcher reports failure although training finished.

* :func:`shutdown` is for entry points: call it (or ``trainer.end()``) at the very end of a script.
* :func:`install_exit_handler` registers an ``atexit`` handler that does the same for users who forget.
  ``DeMoTrainer`` installs it at construction, and DeMo at its first step in a multi-process run. It only
  acts when that is safe: the group is initialised and not destroyed yet, no DeMo has an exchange in
  flight (``overlap=True`` without a final ``flush()``), and the interpreter is not exiting on an uncaught
  exception (a peer may then still be inside a collective with us; the launcher ends the job anyway).
  ``atexit`` runs before the interpreter finalises, and after everything the script did, so ``evaluate()``
  after ``train()`` keeps working (``DeMoTrainer`` does not tear down at the end of ``train()`` for that).
"""

from __future__ import annotations

import atexit
import sys
import threading
import weakref

import torch.distributed as dist

_installed = False
_uncaught = False
_lock = threading.Lock()
_optimizers: weakref.WeakSet = weakref.WeakSet()  # DeMo instances that communicated


def track(optimizer) -> None:
    """Remember a DeMo that communicates, so the exit handler can see an exchange still in flight."""
    _optimizers.add(optimizer)


def _in_flight() -> bool:
    # an overlapped step's exchange stays in flight until the next step or flush()
    return any(getattr(opt, "in_flight", False) for opt in list(_optimizers))


def shutdown() -> bool:
    """Destroy the default process group (and every group made from it) if one is initialised.

    Safe to call more than once and without ``torch.distributed``. Every collective the script wanted
    must be done: after this call, no process of the group can communicate. Returns True when a group
    was destroyed now.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    dist.destroy_process_group()
    return True


def _at_exit() -> None:
    if _uncaught:  # exiting on an error: a peer may still wait in a collective, don't touch the group
        return
    if _in_flight():
        print(
            "hf_demo: a DeMo exchange is still in flight at exit (overlap=True: call optimizer.flush() after "
            "the last step); the process group is left as it is",
            file=sys.stderr,
        )
        return
    try:
        shutdown()
    except Exception as exc:  # noqa: BLE001 - never turn a finished run into a failure at exit
        print(f"hf_demo: could not destroy the process group at exit: {exc}", file=sys.stderr)


def install_exit_handler() -> bool:
    """Register the ``atexit`` teardown once per process. Returns True when registered now."""
    global _installed
    with _lock:
        if _installed:
            return False
        _installed = True
        previous = sys.excepthook

        def excepthook(exc_type, exc, tb):
            global _uncaught
            _uncaught = True
            previous(exc_type, exc, tb)

        sys.excepthook = excepthook
        atexit.register(_at_exit)
        return True
