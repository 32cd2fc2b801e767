"""The exit handler and hf_demo.launch's environment checks, on 2 forked gloo ranks (no launcher: fast tier)."""

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
