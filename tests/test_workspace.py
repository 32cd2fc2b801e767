"""The step's scratch buffers (hf_demo.compression.Workspace): a steady step writes its per-bucket temporaries into
buffers the optimizer keeps, not into new tensors, with the same bits; the buffers are the optimizer's own and are
not state."""

from __future__ import annotations

import io

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import hf_demo
from hf_demo import compression as F

# 64 x 64 blocks as the defaults make; one-row blocks; a padded layout; a block size whose runs start unaligned
SHAPES = [(256, 128), (128,), (256, 128), (100, 70), (192, 64), (12,), (40,), (3, 7, 9), ()]


def _model() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s)) for s in [(512, 512), (512, 512), (1024, 256), (512,)]]


def _large_allocations(fn, least: int = 1 << 16) -> list[int]:
    """The bytes of every allocation of at least ``least`` bytes made while ``fn`` runs (the profiler's count)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage >= least]


def test_a_steady_step_allocates_only_the_new_momenta_and_the_decoded_updates():
    params = _model()
    opt = hf_demo.DeMo(params, lr=1e-3, compression_chunk=64, compression_topk=8)
    for p in params:
        p.grad = torch.randn(p.shape)
    coefficients = 4 * sum(p.numel() for p in params)  # fp32 coefficients of every block (no padding here)
    opt.step()
    for _ in range(2):  # the stacked blocks, the transforms' products, top-k's magnitudes, the averaged
        allocated = _large_allocations(opt.step)  # coefficients: all in the workspace (before it, 11x)
        assert sum(allocated) <= 2 * coefficients, allocated  # the new momenta (state) and the decoded updates


def test_the_workspace_is_reused_from_step_to_step_owned_by_one_optimizer_and_not_saved():
    params = _model()
    opts = [hf_demo.DeMo(params, lr=1e-3, compression_chunk=64, compression_topk=8) for _ in range(2)]
    for p in params:
        p.grad = torch.randn(p.shape)
    seen = []
    for _ in range(3):
        opts[0].step()
        seen.append({key: t.data_ptr() for key, t in opts[0].run_state.workspace.buffers.items()})
    assert seen[0] and seen[0] == seen[1] == seen[2]  # the same buffers every step
    opts[1].step()
    mine, theirs = (o.run_state.workspace.buffers for o in opts)
    assert not {t.data_ptr() for t in mine.values()} & {t.data_ptr() for t in theirs.values()}
    state = opts[0].state_dict()
    storages = {t.untyped_storage().data_ptr() for t in mine.values()}
    saved = [v for s in state["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert saved and not {t.untyped_storage().data_ptr() for t in saved} & storages
    buffer = io.BytesIO()
    torch.save(state, buffer)  # the checkpoint holds the momenta, not the workspace's buffers
    assert buffer.tell() < 4 * sum(p.numel() for p in params) * 2


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("transform", ["dct", "identity"])
@pytest.mark.parametrize("chunk", [8, 64])
def test_the_workspace_gives_the_bits_of_new_tensors(transform, chunk, device):
    torch.manual_seed(0)
    t, ws = F.get_transform(transform), F.Workspace()
    layouts = [F.plan(s, chunk, 4) for s in SHAPES]
    momenta = [torch.randn(lay.nblocks, lay.bsize, device=device) for lay in layouts]
    signals = [torch.randn(lay.shape, device=device) for lay in layouts]
    signals[1] = None  # a parameter without a signal counts zero
    factors = [(0.9, 1e-2)] * len(layouts)
    factors[2] = (0.5, 1.0)  # another group's decay and scale in a bucket
    for _ in range(2):  # the second time on buffers holding the first time's numbers
        new = F.accumulate_many(momenta, signals, layouts, factors, t)
        reused = F.accumulate_many(momenta, signals, layouts, factors, t, ws)
        assert all(torch.equal(a, b) for a, b in zip(new, reused))
        for m, b in zip(new.buckets, F.plan_buckets(tuple(layouts)).buckets):
            (scratch,) = F.take(ws, "a", [m.shape], m.device)
            assert all(torch.equal(x, y) for x, y in zip(F.select(m, b.k), F.select(m, b.k, scratch)))
        decoded = F.decode_many(new, layouts, t)
        again = F.decode_many(new, layouts, t, ws)
        assert all(torch.equal(a, b) for a, b in zip(decoded, again))
        assert all(x.untyped_storage().data_ptr() not in _storages(ws) for x in again)  # outlive the call


def _storages(ws: F.Workspace) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in ws.buffers.values()}


def test_a_buffer_grows_to_the_largest_size_asked_and_parts_start_aligned():
    ws = F.Workspace()
    parts = F.take(ws, "dense", [(3, 5), (2,), (4, 4)], torch.device("cpu"))
    assert [p.shape for p in parts] == [(3, 5), (2,), (4, 4)]
    assert all(p.is_contiguous() and (p.data_ptr() - parts[0].data_ptr()) % (4 * F.ALIGNMENT) == 0 for p in parts)
    (small,) = F.take(ws, "dense", [(4,)], torch.device("cpu"))
    assert small.data_ptr() == parts[0].data_ptr()  # the same buffer, not a new one


def test_off_the_cpu_the_workspace_hands_out_new_tensors_and_keeps_none():
    ws = F.Workspace()  # an accelerator's caching allocator reuses the blocks; kept, they would hold its memory
    first, second = (F.take(ws, "a", [(4, 4)], torch.device("meta"))[0] for _ in range(2))
    assert first.shape == second.shape == (4, 4) and first is not second and not ws.buffers


def test_take_gives_the_pair_from_two_buffers_and_without_a_workspace_what_stands_for_new_tensors():
    ws, cpu = F.Workspace(), torch.device("cpu")
    a, b = F.take(ws, "pair", [(3, 4)], cpu)
    assert a.shape == b.shape == (3, 4) and set(ws.buffers) == {("a", cpu), ("b", cpu)}
    assert a.data_ptr() == ws.buffers["a", cpu].data_ptr() and b.data_ptr() == ws.buffers["b", cpu].data_ptr()
    assert F.take(None, "pair", [(3, 4)], cpu) is None  # transform_blocks' into: new tensors
    assert F.take(None, "dense", [(3, 5), (2,)], cpu) == [None, None]  # an out= each: new tensors
    assert F.take(None, "a", [(4, 4)], cpu) == [None]
