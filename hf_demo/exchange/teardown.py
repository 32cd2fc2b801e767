"""A clean end for multi-process runs: the process group is torn down while the interpreter is still whole.

A run that never calls ``torch.distributed.destroy_process_group()`` leaves gloo's worker threads holding
work objects (with tensors) when the interpreter finalises; some exits then abort with ``terminate called
without an active exception`` (SIGABRT) and the launcher reports failure although training finished.

A second exit abort has the same message and a different cause: a gloo worker thread that completed a
collective still holds it, with its tensors, and frees them only when the operating system runs it again.
Freeing a tensor that Python has dropped needs the interpreter lock; once the interpreter is finalising,
the thread is made to exit inside that destructor, which aborts the process. On a loaded machine a
worker can wait hundreds of milliseconds for a CPU, longer than the rest of a script takes after its last
collective (Trainer's last one is at the end of ``train()``). :func:`quiesce` waits, with the lock
released, until every worker thread is idle; :func:`shutdown` calls it before and after destroying the
groups, since a group that something still holds (DDP's reducer holds the default one) keeps its threads
until the interpreter finalises.

* :func:`shutdown` is for entry points: call it (or ``trainer.end()``) at the very end of a script.
* :func:`install_exit_handler` registers an ``atexit`` handler that does the same for users who forget.
  ``DeMoTrainer`` installs it at construction, and DeMo at its first step in a multi-process run. It only
  acts when that is safe: the group is initialised and not destroyed yet, no DeMo has an exchange in
  flight (``overlap=True`` without a final ``flush()``), and the interpreter is not exiting on an uncaught
  exception (a peer may then still be inside a collective with us; the launcher ends the job anyway).
  ``atexit`` runs before the interpreter finalises, and after everything the script did, so ``evaluate()``
  after ``train()`` keeps working (``DeMoTrainer`` does not tear down at the end of ``train()`` for that).

A third end is an error every rank agreed to raise (a checkpoint refused on every rank): the error ends each
process, and where the process group made the rendezvous store, global rank 0's process holds it. A rank 0 that
raised first would take the store with it while a slower peer still reads the agreement from it, and that peer
would see a raw ``DistNetworkError`` instead of the agreed error. :func:`leave_together` makes rank 0 leave last.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import sys
import threading
import time
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
    # an overlapped step's exchange stays in flight until the next step or flush(); so does the settling row of a
    # rank that refused the last step (hf_demo.optim.settle) until the next step or confirm()
    return any(getattr(opt, "in_flight", False) or getattr(opt, "settling", False) for opt in list(_optimizers))


def _unconfirmed() -> bool:
    # the last step committed tentatively and its verdict never read: flush() (or confirm()) was not called
    return any(getattr(opt, "unconfirmed", False) for opt in list(_optimizers))


WORKER_THREAD = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads


def busy_workers(task_dir: str = "/proc/self/task") -> list[int] | None:
    """Thread ids of gloo worker threads that are running or waiting for a CPU (state R or D).

    None where the process's threads cannot be read (not Linux).
    """
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    busy = []
    for tid in tids:
        try:
            with open(os.path.join(task_dir, tid, "stat")) as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name, rest = stat[stat.find("(") + 1 : stat.rfind(")")], stat[stat.rfind(")") + 2 :]
        if name == WORKER_THREAD and rest[:1] in ("R", "D"):
            busy.append(int(tid))
    return busy


def quiesce(timeout: float = 10.0, settle: int = 3, interval: float = 0.01, task_dir: str = "/proc/self/task") -> bool:
    """Wait, with the interpreter lock released, until no gloo worker thread has work left.

    Idle means ``settle`` polls in a row, ``interval`` seconds apart, find no worker thread running or
    runnable. A worker waiting for the lock gets it while this sleeps, and shows as running. Returns True
    when the workers went idle, False after ``timeout`` seconds (or, where threads cannot be read, after
    one fixed pause).
    """
    gc.collect()  # tensors kept by reference cycles are freed now, by this thread, with the lock held
    deadline = time.monotonic() + timeout
    quiet = 0
    while True:
        busy = busy_workers(task_dir)
        if busy is None:
            time.sleep(min(timeout, 0.5))
            return False
        quiet = 0 if busy else quiet + 1
        if quiet >= settle:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def shutdown() -> bool:
    """Destroy the default process group (and every group made from it) if one is initialised.

    Safe to call more than once and without ``torch.distributed``. Every collective the script wanted
    must be done: after this call, no process of the group can communicate. Waits for gloo's worker
    threads to finish before and after (:func:`quiesce`). Returns True when a group was destroyed now.
    """
    initialised = dist.is_available() and dist.is_initialized()
    quiesce()
    if initialised:
        dist.destroy_process_group()
        quiesce()
    return initialised


def _at_exit() -> None:
    if _uncaught:  # exiting on an error: a peer may still wait in a collective, don't touch the group
        return
    if _in_flight():
        print(
            "hf_demo: a DeMo exchange is still in flight at exit (call optimizer.flush() on every rank after the "
            "last step); the process group is left as it is",
            file=sys.stderr,
        )
        return
    if _unconfirmed():
        print(
            "hf_demo: the last DeMo step's verdict was never read (call optimizer.flush() on every rank after the "
            "last step: a rank that refused that step waits for it until comm_timeout)",
            file=sys.stderr,
        )
    try:
        shutdown()
    except Exception as exc:  # noqa: BLE001 - never turn a finished run into a failure at exit
        print(f"hf_demo: could not destroy the process group at exit: {exc}", file=sys.stderr)


def leave_together(tag: str, ranks: list[int], timeout_s: float) -> None:
    """Called by every rank of ``ranks`` (global ranks) that read an agreement it is about to raise on, under one
    ``tag`` per agreement: each other rank says so in the rendezvous store, and global rank 0 (the store's host,
    unless a launcher's agent holds it) returns only once they all did, or after ``timeout_s`` (a peer that
    vanished is not waited for longer). Its error, which may end its process and the store with it, then
    reaches no peer still inside the agreement. Nothing is raised here: the caller raises the agreed error."""
    me = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    try:
        if me != 0:
            store.set(f"{tag}/left/{me}", "1")
        elif len(ranks) > 1:
            store.wait([f"{tag}/left/{r}" for r in ranks if r != 0], datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - a peer or the store already gone: the agreed error is raised all the same
        pass


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
