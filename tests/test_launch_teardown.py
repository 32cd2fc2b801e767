"""The exit handler and hf_demo.launch's environment checks, on 2 forked gloo ranks (no launcher: fast tier)."""

import threading
import time

import torch
import torch.distributed as dist

import hf_demo
from dist_utils import expect_ok, run_ranks
from hf_demo import teardown


def _exit_handler(rank, world):
    model = torch.nn.Linear(8, 8)
    opt = hf_demo.DeMo(model.parameters(), lr=1e-3, compression_topk=2, compression_chunk=4)
    torch.manual_seed(rank)  # each rank its own batch (forked ranks share the random state)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()  # the first step installs the handler and remembers the optimizer
    installed_again = teardown.install_exit_handler()
    opt._pending = object()  # an overlapped exchange still in flight: the handler keeps its hands off
    teardown._at_exit()
    kept_while_in_flight = dist.is_initialized()
    opt._pending = None
    teardown._at_exit()  # as atexit would
    return installed_again, kept_while_in_flight, dist.is_initialized(), hf_demo.shutdown()


def test_exit_handler_destroys_the_group_once_and_only_when_safe():
    for installed_again, kept_while_in_flight, still_initialised, shutdown_again in expect_ok(
        run_ranks(_exit_handler, 2)
    ):
        assert not installed_again  # DeMo's first step already installed it
        assert kept_while_in_flight and not still_initialised and not shutdown_again


def _step_guard(rank, world):
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(torch.nn.Linear(8, 8))
    opt = hf_demo.DeMo(model.parameters(), lr=1e-3, compression_topk=2, compression_chunk=4)
    torch.manual_seed(rank)  # each rank its own batch (forked ranks share the random state)
    model(torch.randn(4, 8)).sum().backward()
    try:
        opt.step()
    except hf_demo.DeMoSetupError as exc:
        refused = str(exc)
    hf_demo.disable_gradient_allreduce(model)  # the fix the message names
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return refused, opt.steps


def test_demo_under_an_allreducing_ddp_stops_at_the_first_step():
    for refused, steps in expect_ok(run_ranks(_step_guard, 2)):
        assert "still all-reduces gradients" in refused and "hf_demo.DeMoTrainer" in refused
        assert steps == 1  # the refused step changed nothing; the fixed one ran


def _fake_thread(task_dir, tid, name, state):
    folder = task_dir / str(tid)
    folder.mkdir(exist_ok=True)
    (folder / "stat").write_text(f"{tid} ({name}) {state} 1 2 3 4\n")


def test_quiesce_waits_until_the_gloo_workers_are_idle(tmp_path):
    """Only pt_gloo_runloop threads count; running (R) or in I/O (D) is busy; a vanished thread is skipped."""
    _fake_thread(tmp_path, 1, "python", "R")
    _fake_thread(tmp_path, 2, "gloo_tcp_loop", "R")
    _fake_thread(tmp_path, 3, "pt_gloo_runloop", "S")
    _fake_thread(tmp_path, 4, "pt_gloo_runloop", "R")
    (tmp_path / "5").mkdir()  # ended between listing and reading
    assert teardown.busy_workers(str(tmp_path)) == [4]
    assert teardown.busy_workers(str(tmp_path / "missing")) is None

    t0 = time.monotonic()
    assert teardown.quiesce(timeout=0.2, task_dir=str(tmp_path)) is False  # busy throughout: gives up
    assert 0.2 <= time.monotonic() - t0 < 2.0

    timer = threading.Timer(0.3, _fake_thread, (tmp_path, 4, "pt_gloo_runloop", "S"))  # the worker finishes
    timer.start()
    t0 = time.monotonic()
    assert teardown.quiesce(timeout=10.0, settle=3, interval=0.01, task_dir=str(tmp_path)) is True
    assert 0.3 <= time.monotonic() - t0 < 5.0
    timer.join()


def test_the_step_guard_knows_every_class_derived_from_ddp():
    """The guard picks DDP wrappers out by class, from DDP's class tree: a subclass of a subclass counts."""
    from torch.nn.parallel import DistributedDataParallel

    from hf_demo.accelerate_utils import _subclasses

    class Wrapped(DistributedDataParallel):
        pass

    class WrappedAgain(Wrapped):
        pass

    found = _subclasses(DistributedDataParallel)
    assert {DistributedDataParallel, Wrapped, WrappedAgain} <= found
    assert torch.nn.Module not in found and _subclasses(WrappedAgain) == {WrappedAgain}
