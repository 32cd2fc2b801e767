"""Collectives, then ``hf_demo.shutdown()`` at once, with gloo's worker threads starved of CPU (test_launch.py).

A gloo worker thread that completed a collective frees it (and its tensors) when it next runs. Freeing a
tensor Python has dropped needs the interpreter lock; if the interpreter is finalising by then, the thread is
made to exit inside a destructor and the process aborts ("terminate called without an active exception").
Here the worker threads are pinned to CPU 0 at the lowest priority (nice 19) beside a busy process, the
main thread runs on CPU 1, and the default group stays referenced (as DDP's reducer holds it), so destroying
it does not join its threads. With ``--no-shutdown`` the script exits without hf_demo's teardown.
"""

import os
import sys

import torch
import torch.distributed as dist

import hf_demo

dist.init_process_group("gloo")
held = dist.group.WORLD  # as DistributedDataParallel's reducer holds the default group
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/comm") as f:
        if f.read().strip() == hf_demo.exchange.teardown.WORKER_THREAD:
            os.sched_setaffinity(int(tid), {0})
            os.setpriority(os.PRIO_PROCESS, int(tid), 19)
os.sched_setaffinity(0, {1})
for _ in range(20):
    out = [torch.zeros(1000) for _ in range(2)]
    dist.all_gather(out, torch.ones(1000))
del out
if "--no-shutdown" not in sys.argv:
    hf_demo.shutdown()
print("done", flush=True)
