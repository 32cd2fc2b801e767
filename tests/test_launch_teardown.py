"""The exit handler and hf_demo.hf.launch_env's environment checks, on 2 forked gloo ranks (no launcher: fast tier)."""

import threading
import time

import torch
import torch.distributed as dist

import hf_demo
from dist_utils import expect_ok
from hf_demo.exchange import teardown


def _exit_handler(rank, world):
    model = torch.nn.Linear(8, 8)
    opt = hf_demo.DeMo(model.parameters(), lr=1e-3, compression_topk=2, compression_chunk=4)
    torch.manual_seed(rank)  # each rank its own batch (forked ranks share the random state)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()  # the first step installs the handler and remembers the optimizer
    installed_again = teardown.install_exit_handler()
    opt.land_in_flight(object())  # an overlapped exchange still in flight: the handler keeps its hands off
    teardown._at_exit()
    kept_while_in_flight = dist.is_initialized()
    opt.land_in_flight(None)
    teardown._at_exit()  # as atexit would
    return installed_again, kept_while_in_flight, dist.is_initialized(), hf_demo.shutdown()


def test_exit_handler_destroys_the_group_once_and_only_when_safe(gloo):
    for installed_again, kept_while_in_flight, still_initialised, shutdown_again in expect_ok(gloo(_exit_handler, 2)):
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


def test_demo_under_an_allreducing_ddp_stops_at_the_first_step(gloo):
    for refused, steps in expect_ok(gloo(_step_guard, 2)):
        assert "still all-reduces gradients" in refused and "hf_demo.DeMoTrainer" in refused
        assert steps == 1  # the refused step changed nothing; the fixed one ran


def _nested_ddp(rank, world):
    """A model the user wrapped in DDP, wrapped again (as Accelerate does with an already wrapped model)."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    inner = DistributedDataParallel(torch.nn.Linear(8, 8))
    outer = DistributedDataParallel(inner)
    opt = hf_demo.DeMo(outer.parameters(), lr=1e-3, compression_topk=2, compression_chunk=4)
    registered = hf_demo.disable_gradient_allreduce(outer)
    torch.manual_seed(rank)
    outer(torch.randn(4, 8)).sum().backward()
    grads = [p.grad.clone() for p in outer.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    return registered, hf_demo.disable_gradient_allreduce(outer), grads, [str(w.message) for w in caught]


def test_every_wrapper_of_a_nested_ddp_model_keeps_the_local_gradient(gloo):
    """The inner wrapper of DDP(DDP(model)) all-reduced every gradient densely, uncounted, before the outer
    one's no-op hook, and DeMo called it a wrapper "no longer in use"."""
    results = expect_ok(gloo(_nested_ddp, 2))
    for registered, again, _, caught in results:
        assert registered and not again
        assert not any("DistributedDataParallel" in message for message in caught)
    assert not torch.equal(results[0][2][0], results[1][2][0])  # each rank's own weight gradient


def _opt(params, **kw):
    return hf_demo.DeMo(params, lr=1e-3, compression_topk=2, compression_chunk=4, **kw)


def _stale_wrapper(rank, world):
    """A DDP wrapper of the model, alive but unused (an earlier baseline's), then used again at step 2."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Linear(8, 8)
    old = DistributedDataParallel(model)  # holds DeMo's parameters; its reducer would average their gradients
    opt = _opt(model.parameters(), check_every=1)
    torch.manual_seed(rank)  # each rank its own batch (forked ranks share the random state)
    model(torch.randn(4, 8)).sum().backward()  # the model itself: the wrapper averages nothing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    opt.zero_grad()
    weights = model.weight.detach().clone()
    old(torch.randn(4, 8)).sum().backward()  # through the wrapper after all: now it averages
    try:
        opt.step()
        refused = None
    except hf_demo.DeMoSetupError as exc:
        refused = str(exc)
    return [str(w.message) for w in caught], opt.steps, refused, torch.equal(weights, model.weight)


def test_a_stale_ddp_wrapper_is_cleared_by_the_gradients_and_caught_when_it_averages_again(gloo):
    results = expect_ok(gloo(_stale_wrapper, 2))
    for caught, steps, refused, unchanged in results:
        assert any("no longer in use" in w for w in caught), caught  # step 1 ran, with a warning, not an error
        assert steps == 1 and unchanged  # step 2 changed nothing
        assert "still all-reduces gradients" in refused and "bitwise identical on ranks [0, 1]" in refused
        assert "optimizer step 1" in refused and "does now" in refused


def _partial_wrapper(rank, world):
    """A live DDP around the first layer only: the gradients of the second still differ between ranks."""
    from torch.nn.parallel import DistributedDataParallel

    first, second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    wrapped = DistributedDataParallel(first)
    opt = _opt([*first.parameters(), *second.parameters()])
    torch.manual_seed(rank)
    second(wrapped(torch.randn(4, 8))).sum().backward()
    try:
        opt.step()
    except hf_demo.DeMoSetupError as exc:
        return str(exc), opt.steps
    return None, opt.steps


def test_a_ddp_wrapper_averaging_some_of_demos_parameters_is_caught(gloo):
    for refused, steps in expect_ok(gloo(_partial_wrapper, 2)):
        assert refused and "still all-reduces gradients" in refused and "bitwise identical" in refused
        assert steps == 0


def _odd_wrappers(rank, world, case):
    """Wrappers that average nothing across DeMo's ranks, and one that averages within pairs of ranks."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    body, head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else None  # every rank, same order
    settings = {}
    if case == "one_rank":  # only rank 0 holds one, over a group of its own
        solo = dist.new_group([0])
        keep = DistributedDataParallel(body, process_group=solo) if rank == 0 else None
    elif case == "no_gradient":  # an earlier phase's wrapper of the head; this phase trains the body only
        keep = DistributedDataParallel(head)
    elif case == "local_first":  # an unused wrapper, and a local step before the first exchange
        keep, settings = DistributedDataParallel(body), {"sync_every": 4, "exchange": "all_reduce"}
    else:  # "pairs": a live wrapper over each pair of ranks, DeMo over all four
        keep = DistributedDataParallel(body, process_group=pairs[rank // 2])
    opt = _opt([*body.parameters(), *head.parameters()], **settings)
    torch.manual_seed(rank)
    x = torch.randn(4, 8)
    out = keep(x) if case == "pairs" else body(x)
    (out if case == "no_gradient" else head(out)).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            opt.step()
            refused = None
        except hf_demo.DeMoSetupError as exc:
            refused = str(exc)
    assert keep is not None or rank != 0  # alive through the step
    return refused, opt.steps, [str(w.message) for w in caught], body.weight.detach().clone()


def test_ddp_wrappers_that_average_nothing_across_ranks_do_not_stop_demo(gloo):
    for case in ("one_rank", "no_gradient", "local_first"):
        results = expect_ok(gloo(_odd_wrappers, 2, case))
        for rank, (refused, steps, caught, _) in enumerate(results):
            assert refused is None and steps == 1, (case, refused)
            warned = any("no longer in use" in w for w in caught)
            assert warned == (case != "one_rank" or rank == 0), (case, rank, caught)
        if case != "local_first":  # a local step leaves each rank its own weights
            assert torch.equal(results[0][3], results[1][3]), case


def test_a_ddp_wrapper_averaging_within_subgroups_stops_every_rank(gloo):
    for refused, steps, _, _ in expect_ok(gloo(_odd_wrappers, 4, "pairs")):
        assert refused and "bitwise identical on ranks [0, 1, 2, 3]" in refused and steps == 0


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
    assert 0.2 <= time.monotonic() - t0 < 8.0  # gives up, not hangs (the bound leaves room for a loaded machine)

    timer = threading.Timer(0.3, _fake_thread, (tmp_path, 4, "pt_gloo_runloop", "S"))  # the worker finishes
    timer.start()
    t0 = time.monotonic()
    assert teardown.quiesce(timeout=10.0, settle=3, interval=0.01, task_dir=str(tmp_path)) is True
    assert 0.3 <= time.monotonic() - t0 < 10.0  # True: it saw the worker finish, before its timeout
    timer.join()


def test_the_step_guard_knows_every_class_derived_from_ddp():
    """The guard picks DDP wrappers out by class, from DDP's class tree: a subclass of a subclass counts."""
    from torch.nn.parallel import DistributedDataParallel

    from hf_demo.guards import subclasses

    class Wrapped(DistributedDataParallel):
        pass

    class WrappedAgain(Wrapped):
        pass

    found = subclasses(DistributedDataParallel)
    assert {DistributedDataParallel, Wrapped, WrappedAgain} <= found
    assert torch.nn.Module not in found and subclasses(WrappedAgain) == {WrappedAgain}
