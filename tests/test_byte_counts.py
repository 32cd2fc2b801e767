"""Byte figures that say what they count, on real gloo ranks: a step's own traffic per step, what ``confirm()`` sends
outside a step (a checkpoint's settling row) and the dense averaging of a local phase as their own series, and
HSDP's traffic inside a replica (the shard group) apart from DeMo's bytes across the replicas."""

import pytest
import torch

from dist_utils import expect_ok
from hf_demo.hf.metrics import CommMetrics
from models import loss_and_backward, small_demo, tiny_mlp

pytestmark = pytest.mark.ranks


def _checkpoint_between_steps(rank, world, kw):
    """3 steps, a log row, a checkpoint's confirm() (DeMoTrainer and save_state call it), a 4th step, a row."""
    model = tiny_mlp()
    opt = small_demo(model, **kw)
    metrics = CommMetrics()
    for step in range(3):
        loss_and_backward(model, rank, step)
        opt.step()
    first = metrics(opt)
    last_step = opt.comm_stats.bytes_sent
    opt.confirm()
    after_confirm = opt.comm_stats.bytes_sent
    loss_and_backward(model, rank, 3)
    opt.step()
    return first, metrics(opt), last_step, after_confirm, opt.comm_stats.bytes_sent


def test_a_checkpoints_settling_row_is_its_own_series_not_the_next_steps(gloo):
    """The settling all-gathers a checkpoint's confirm() runs (three rounds, as docs/reference/metrics.md says)
    each carry a steady step's whole row (payload included): they were counted in the next row's
    demo/bytes_sent_per_step (2x). They are now demo/settle_bytes_sent, the per-step figure is the step's own, and
    the last step's comm_stats are not changed by them."""
    for rank, (first, second, last_step, after_confirm, step4) in enumerate(
        expect_ok(gloo(_checkpoint_between_steps, 2, {}, timeout=120))
    ):
        assert after_confirm == last_step, rank  # the last step's figures are the step's own
        assert second["demo/bytes_sent_per_step"] == step4 > 0, (rank, second, step4)
        assert second["demo/settle_bytes_sent"] == 3 * step4, (rank, second)  # 3 rounds of a steady step's row
        assert first["demo/settle_bytes_sent"] == 0
        assert second["demo/total_settle_bytes_sent"] == second["demo/settle_bytes_sent"]
        total = first["demo/total_bytes_sent"] + second["demo/settle_bytes_sent"] + step4
        assert second["demo/total_bytes_sent"] == total, rank  # the total still counts everything sent


def _average_inside_a_local_phase(rank, world):
    """sync_every=4: 2 local steps, a row, the ranks' mean shown (a checkpoint inside a local phase writes the
    model through averaged_parameters()), a 3rd local step, a row."""
    model = tiny_mlp()
    opt = small_demo(model, sync_every=4)
    metrics = CommMetrics()
    for step in range(2):
        loss_and_backward(model, rank, step)
        opt.step()
    metrics(opt)
    with opt.averaged_parameters():
        pass
    loss_and_backward(model, rank, 2)
    opt.step()
    return metrics(opt), sum(p.numel() for p in model.parameters())


def test_a_checkpoints_dense_averaging_inside_a_local_phase_is_its_own_series(gloo):
    """A checkpoint inside a local phase averages the parameters densely (an fp32 all-reduce of the whole model):
    it was counted, without a word, as the next steps' bytes. It is now demo/averaging_bytes_sent."""
    for rank, (row, numel) in enumerate(expect_ok(gloo(_average_inside_a_local_phase, 2, timeout=120))):
        assert row["demo/bytes_sent_per_step"] == 0, (rank, row)  # a local step sends nothing
        assert row["demo/averaging_bytes_sent"] == 4 * numel, (rank, row, numel)  # ring all-reduce, 2 ranks
        assert row["demo/total_averaging_bytes_sent"] == 4 * numel


def _hsdp_orthogonal(rank, world):
    """HSDP (2 replicas x 2 shards) with update_rule='orthogonal' (Newton-Schulz on whole matrices, gathered over
    the shard group); each step's comm_stats against what DeMo's collective hook saw, inside and across nodes."""
    import hf_demo
    from hf_demo import fsdp
    from hf_demo.exchange import transport
    from hf_demo.ops.monitor import INSIDE_NODE

    mesh = fsdp.hsdp_mesh(shard=2)
    model = tiny_mlp()
    fsdp.shard_model(model, mesh, layers=[model[0], model[2]])
    opt = hf_demo.DeMo(model.parameters(), device_mesh=mesh, update_rule="orthogonal", compression_topk=4,
                       compression_chunk=8)  # fmt: skip
    seen = []
    handle = transport.register_collective_hook(lambda name, nbytes: seen.append((name, nbytes)))
    out = []
    for step in range(3):
        seen.clear()
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank // 2 * 100 + step))
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        across = sum(n for name, n in seen if name not in INSIDE_NODE and name != "ddp_check")
        inside = sum(n for name, n in seen if name in INSIDE_NODE)
        stats = opt.comm_stats
        out.append((across, inside, stats.bytes_sent, stats.intra_bytes_sent))
    handle.remove()
    return out


def test_hsdp_reports_the_shard_groups_traffic_apart_from_demos_bytes_across_replicas(gloo):
    """On HSDP comm_stats added the shard group's traffic (the whole-matrix gathers of orthogonal, the node
    header and vote) to DeMo's payload across the replicas. bytes_sent is now what crossed the replicas alone,
    intra_bytes_sent the shard group's."""
    ranks = expect_ok(gloo(_hsdp_orthogonal, 4, timeout=240))
    for rank, steps in enumerate(ranks):
        for step, (across, inside, sent, intra) in enumerate(steps[1:], start=1):  # (step 0: set-up checks)
            assert inside > 0 and across > 0, (rank, step, steps)
            assert sent == across and intra == inside, (rank, step, steps)
    _planned_as_sent(ranks)


def _planned_as_sent(ranks) -> None:
    """The planner's HSDP figures split as comm_stats splits them: its rank_bytes (the bytes across the replicas)
    left out the shard group's Newton-Schulz gathers, node header and vote, and FSDP2's own collectives, which it
    counted in; rank_bytes("shard") is the shard group's (intra_bytes_sent). Per step, the mean over the ranks, less
    what runs every N steps (the drift check), amortised in the plan."""
    from hf_demo.ops.links import sent_bytes
    from hf_demo.ops.methods import Estimate
    from hf_demo.ops.traffic import demo_collectives
    from hf_demo.settings import DeMoSettings

    settings = DeMoSettings(update_rule="orthogonal", compression_topk=4, compression_chunk=8)
    shapes = [tuple(p.shape) for p in tiny_mlp().parameters()]
    plan = Estimate("demo-hsdp", "HSDP", demo_collectives(shapes, settings, 2, 2, layout="hsdp"), 0.0, 0.0, 0.0, 0)

    def per_step(group: str) -> float:
        periodic = sum(sent_bytes(c.kind, c.nbytes, c.world) / c.every for c in plan.collectives
                       if c.group == group and c.every > 1)  # fmt: skip
        return plan.rank_bytes(group) - periodic

    for step in (1, 2):
        sent = sum(steps[step][2] for steps in ranks) / len(ranks)
        intra = sum(steps[step][3] for steps in ranks) / len(ranks)
        assert per_step("replicas") == pytest.approx(sent), (step, per_step("replicas"), sent)
        assert per_step("shard") == pytest.approx(intra), (step, per_step("shard"), intra)
    assert plan.rank_bytes("fsdp") > 0
