"""A frozen (SIGSTOP) peer is caught within comm_timeout wherever the survivor is blocked, and a rank does not
outlive its launcher (:mod:`hf_demo.exchange.liveness`).

The ranks start with the default group's timeout at 30 minutes, as transformers' CPU path leaves it; DeMo's
first step bounds it by ``comm_timeout``. Rank 1 then stops itself at one point of a step; rank 0 must raise
within ``comm_timeout`` (plus generous slack for a loaded machine), then wakes rank 1 so the test ends."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import expect_ok, process_alive, run_ranks
from models import loss_and_backward, small_demo, tiny_mlp

TIMEOUT = 6.0


def _stopped(rank, world, where):
    from hf_demo.exchange import transport as comm
    from hf_demo.wire import codec

    model = tiny_mlp()
    opt = small_demo(model, comm_timeout=TIMEOUT)
    loss_and_backward(model, rank, 0)
    dist.barrier()  # both ranks start the first step together, however loaded the machine (the 30-minute group)
    opt.step()  # DeMo's first step in the group: the default group is bounded by comm_timeout from now on
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        if where == "exchange":  # stopped inside DeMo's exchange, after the headers, before the payload
            real = comm._all_gather

            def stopping_gather(out, buf, group=None):
                if buf.numel() != codec.HEADER_BYTES:
                    os.kill(os.getpid(), signal.SIGSTOP)
                return real(out, buf, group=group)

            comm._all_gather = stopping_gather
            loss_and_backward(model, rank, 1)
            try:
                opt.step()
            except Exception:  # noqa: BLE001 - woken up to a peer that gave up
                pass
        else:  # stopped in the data loader, or before Trainer's logging gather
            os.kill(os.getpid(), signal.SIGSTOP)
        return "woken"
    started = time.monotonic()
    try:
        if where == "logging gather":  # Trainer's nested_gather / _get_num_items_in_batch: not DeMo's
            dist.all_reduce(torch.ones(1))
        else:  # rank 0 steps (DeMo's collectives) while rank 1 is stopped in the exchange or its data loader
            loss_and_backward(model, rank, 1)
            opt.step()
        outcome = "no error"
    except Exception as exc:  # noqa: BLE001 - what rank 0 raised, reported
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - started
    os.kill(pids[1], signal.SIGCONT)
    return outcome, seconds


@pytest.mark.ranks
@pytest.mark.parametrize("where", ["exchange", "data loader", "logging gather"])
def test_a_stopped_peer_is_caught_within_comm_timeout_wherever_the_survivor_waits(where):
    results = expect_ok(run_ranks(_stopped, 2, where, collective_timeout=1800.0, timeout=150))
    outcome, seconds = results[0]
    assert outcome != "no error", outcome
    assert seconds < TIMEOUT + 40, (outcome, seconds)  # not gloo's 30 minutes
    if where != "logging gather":  # DeMo's own collectives name the step and the silent rank
        assert "DeMoSyncError" in outcome or "DeMoPayloadError" in outcome, outcome
    assert results[1] == "woken"


def _timeouts(rank, world):
    from hf_demo.exchange import liveness

    group = dist.distributed_c10d._get_default_group()
    before = liveness._group_timeout(group).total_seconds()
    longer = liveness.bound_default_group(before + 100)
    shorter = liveness.bound_default_group(7.0)
    now = liveness._group_timeout(group).total_seconds()
    return before, longer, shorter, now, liveness.bound_default_group(0)


def test_default_group_timeout_is_shortened_never_lengthened(gloo):
    before, longer, shorter, now, unset = expect_ok(gloo(_timeouts, 1, collective_timeout=1800.0))[0]
    assert before == 1800.0 and longer is False  # never longer
    assert shorter is True and now == 7.0
    assert unset is False  # comm_timeout=0: left as it is


CHILD = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    if sys.argv[1] == "launcher":
        rank = subprocess.Popen([sys.executable, __file__, "rank"], env={**os.environ, "TORCHELASTIC_RUN_ID": "t"})
        print(rank.pid, flush=True)
        time.sleep(600)
    else:
        from hf_demo.exchange import liveness
        assert liveness.die_with_parent()
        os.kill(os.getpid(), signal.SIGSTOP)  # a stopped rank
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_stopped_rank_dies_with_its_launcher(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    launcher = subprocess.Popen([sys.executable, str(script), "launcher"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        rank = int(launcher.stdout.readline())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait until the rank has stopped itself
            with open(f"/proc/{rank}/stat") as f:
                if f.read().split(") ")[1][0] == "T":
                    break
            time.sleep(0.1)
        launcher.kill()  # the launcher dies (SIGKILL: nothing of its own runs)
        launcher.wait()
        deadline = time.monotonic() + 30
        while process_alive(rank) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not process_alive(rank), "the stopped rank outlived its launcher"
    finally:
        launcher.kill()
