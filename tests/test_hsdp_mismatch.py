"""HSDP (2 replicas x 2 shard ranks, real gloo): a setting that differs is named on every rank of both replicas,
with the setting, every value and the global rank numbers, at once (no rank waits for a peer's timeout)."""

import time

import pytest
import torch

import hf_demo
from dist_utils import expect_ok, run_ranks
from hf_demo import fsdp

pytestmark = pytest.mark.ranks  # real gloo ranks in forked processes

LR = 3e-3
TIMEOUT = 20.0


def _model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 20), torch.nn.Tanh(), torch.nn.Linear(20, 5))


def _step_with(rank, world, lr_of):
    """One DeMo step on a (2, 2) HSDP mesh, rank ``r`` with learning rate ``lr_of[r]``: (its error, its class,
    seconds, DeMo's steps)."""
    mesh = fsdp.hsdp_mesh(shard=2)
    model = _model()
    fsdp.shard_model(model, mesh, layers=[model[0], model[2]])
    opt = hf_demo.DeMo(model.parameters(), device_mesh=mesh, lr=lr_of[rank], compression_topk=4, compression_chunk=8,
                       comm_timeout=TIMEOUT)  # fmt: skip
    g = torch.Generator().manual_seed(rank)
    model(torch.randn(4, 13, generator=g)).square().mean().backward()
    started = time.monotonic()
    try:
        opt.step()
        error, kind = None, None
    except hf_demo.DeMoSyncError as exc:
        error, kind = str(exc), type(exc).__name__
    return error, kind, time.monotonic() - started, opt.steps


def _check_named_everywhere(results, values: dict[int, float]):
    for rank, (error, kind, seconds, steps) in enumerate(results):
        assert error is not None and steps == 0, (rank, error)
        assert kind == "DeMoSettingsError", (rank, kind, error)
        assert "param_groups[0].lr" in error, (rank, error)
        for r, value in values.items():  # every rank's value, by its global rank
            assert f"rank {r} {value!r}" in error, (rank, r, error)
        assert seconds < TIMEOUT / 2, (rank, seconds)  # told at once, not by a peer's timeout


def test_an_lr_on_one_shard_rank_is_named_on_every_rank_of_both_replicas():
    """Rank 1 (replica 0's second shard) has another lr: ranks 0 and 1 (its shard group), and ranks 2 and 3 (the
    other replica, whose headers agree among themselves), all raise naming the setting, every rank's value and the
    global rank numbers; no rank hears that a peer is dead."""
    lrs = [LR, 2 * LR, LR, LR]
    results = expect_ok(run_ranks(_step_with, 4, lrs, timeout=120))
    _check_named_everywhere(results, {0: LR, 1: 2 * LR, 2: LR, 3: LR})
    for error, *_ in results:
        assert "did not answer" not in error and "timed out" not in error, error


def test_an_lr_on_a_whole_replica_is_named_with_global_ranks_on_every_rank():
    """Replica 1 (ranks 2 and 3) has another lr: every replicate group sees it; the names are global ranks."""
    lrs = [LR, LR, 2 * LR, 2 * LR]
    results = expect_ok(run_ranks(_step_with, 4, lrs, timeout=120))
    _check_named_everywhere(results, {0: LR, 1: LR, 2: 2 * LR, 3: 2 * LR})
