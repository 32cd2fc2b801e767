"""hf_demo.DeMo on real gloo process groups: agreement across ranks and clear errors on every rank."""

import dataclasses
import io
import os
import time

import pytest
import torch

import hf_demo
from dist_utils import RankError, corrupt_indices, expect_ok, run_ranks
from models import loss_and_backward, small_demo, tiny_mlp

pytestmark = pytest.mark.ranks  # real gloo ranks in forked processes


def _hundred_steps(rank, world, fmt):
    model = tiny_mlp()
    opt = small_demo(model, value_format=fmt)
    losses = []
    for step in range(100):
        losses.append(loss_and_backward(model, rank, step % 10))
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return (
        [p.detach().clone() for p in model.parameters()],
        grads,
        [s["momentum"].clone() for s in opt.state.values()],
        losses,
        opt.comm_stats.as_dict(),
    )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fmt", ["bf16", "sign"])
def test_ranks_end_bitwise_identical(world, fmt):
    results = expect_ok(run_ranks(_hundred_steps, world, fmt))
    params0, grads0, momenta0, losses0, stats0 = results[0]
    for params, grads, momenta, _, _ in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(params0, params))  # bitwise identical
        assert not all(torch.equal(a, b) for a, b in zip(grads0, grads))  # from different data
        assert not all(torch.equal(a, b) for a, b in zip(momenta0, momenta))  # each rank its own momentum
    assert sum(losses0[-10:]) < sum(losses0[:10])
    # one round trip a step once the payload's size is agreed (the verdict settles in the next step's all-gather;
    # the first step: the header alone, the payload, the settling all-gather), bytes counted from the buffers
    # handed to torch.distributed
    assert stats0["collectives"] == 1 and stats0["total_collectives"] == 3 + 99
    assert stats0["bytes_received"] == (world - 1) * stats0["bytes_sent"]
    assert 0 < stats0["ratio_to_dense"] < 1


def _missing_grad_on_one_rank(rank, world):
    model = tiny_mlp()
    opt = small_demo(model)
    for step in range(10):
        loss_and_backward(model, rank, step)
        if rank == 1:
            model[2].weight.grad = None  # e.g. a branch this rank's batch never used
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_missing_gradient_on_one_rank_keeps_ranks_in_sync():
    results = expect_ok(run_ranks(_missing_grad_on_one_rank, 2))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def _expect_error_everywhere(results, type_name, match, started):
    assert time.monotonic() - started < 60, "the error took too long to surface"
    for rank, r in enumerate(results):
        assert isinstance(r, RankError), f"rank {rank} did not raise, returned {r!r}"
        assert r.type == type_name, r.traceback
        assert match in r.message, r.message


def _mismatch(rank, world, what):
    hidden = 32 if (what != "layout" or rank == 0) else 40
    model = tiny_mlp(hidden=hidden)
    opt = small_demo(model, lr=3e-3 if (what != "settings" or rank == 0) else 1e-3)
    loss_and_backward(model, rank, 0)
    if what == "step":
        opt.step()
        if rank == 1:
            older = dataclasses.replace(opt.counters, steps=opt.steps - 1)  # as if rank 1 resumed an older checkpoint
            opt.run_state = dataclasses.replace(opt.run_state, counters=older)
        loss_and_backward(model, rank, 1)
    opt.step()
    return "no error"


@pytest.mark.parametrize(
    "what,match",
    [
        ("layout", "different parameter layout"),
        ("settings", "different optimizer settings"),
        ("step", "optimizer step"),
    ],
)
def test_mismatch_across_ranks_raises_on_every_rank(what, match):
    started = time.monotonic()
    kind = "DeMoSettingsError" if what == "settings" else "DeMoSyncError"  # a DeMoSyncError naming the settings
    _expect_error_everywhere(run_ranks(_mismatch, 2, what), kind, match, started)


def _settings_differ(rank, world):
    model = tiny_mlp()
    opt = small_demo(model, lr=3e-3 if rank == 0 else 1e-3, nonfinite="skip" if rank == 0 else "raise")
    loss_and_backward(model, rank, 0)
    opt.step()
    return "no error"


def test_settings_mismatch_names_each_setting_with_every_ranks_value():
    """The error used to list what might differ; it names what does, with each rank's value (issue 44, item 6)."""
    started = time.monotonic()
    results = run_ranks(_settings_differ, 2)
    _expect_error_everywhere(results, "DeMoSettingsError", "different optimizer settings", started)
    assert (
        results[0].message.split("(seen by")[1].split("\n", 1)[1]
        == results[1].message.split("(seen by")[1].split("\n", 1)[1]
    )
    message = results[0].message
    assert "nonfinite: rank 0 'skip', rank 1 'raise'" in message, message
    assert "param_groups[0].lr: rank 0 0.003, rank 1 0.001" in message, message
    assert "weight_decay:" not in message


def _corrupt_payload(rank, world, what):
    from hf_demo.wire import codec

    model = tiny_mlp()
    opt = small_demo(model, value_format="fp32")
    if rank == world - 1:
        if what == "index":
            corrupt_indices(codec.index_coding(opt.settings.index_coding))
        else:
            fmt = codec.value_format("fp32")
            real = fmt.encode_rows  # a bucket's values (the step encodes per bucket)

            def nan_values(values, bucket):
                sent, _ = real(values, bucket)
                return sent, [torch.full_like(sent, float("nan")).view(torch.uint8).reshape(-1)]

            fmt.encode_rows = nan_values
    before = [p.detach().clone() for p in model.parameters()]
    loss_and_backward(model, rank, 0)
    try:
        opt.step()
        opt.confirm()  # a rank that refused the step raises at its next step or here, with every rank
    finally:
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert unchanged, "parameters changed before the bad payload was detected"
    return "no error"


@pytest.mark.parametrize("what,match", [("index", "out-of-range indices"), ("nan", "NaN/Inf coefficients")])
def test_corrupted_payload_raises_on_every_rank(what, match):
    started = time.monotonic()
    results = run_ranks(_corrupt_payload, 4, what)
    _expect_error_everywhere(results, "DeMoPayloadError", match, started)  # a DeMoSyncError
    assert "rank(s) [3]" in results[0].message


def _nan_gradient(rank, world, policy):
    model = tiny_mlp()
    opt = small_demo(model, nonfinite=policy)
    loss_and_backward(model, rank, 0)
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    momenta = [s["momentum"].clone() for s in opt.state.values()]
    loss_and_backward(model, rank, 1)
    if rank == 1:
        model[0].weight.grad[0, 0] = float("nan")
    opt.step()
    return (
        [torch.equal(a, b) for a, b in zip(before, model.parameters())],
        [torch.equal(a, s["momentum"]) for a, s in zip(momenta, opt.state.values())],
        opt.steps,
        opt.skipped_steps,
    )


def test_nonfinite_gradient_skips_the_step_on_every_rank():
    for params_same, momenta_same, steps, skipped in expect_ok(run_ranks(_nan_gradient, 2, "skip")):
        assert all(params_same) and all(momenta_same)
        assert (steps, skipped) == (2, 1)


def test_nonfinite_gradient_raises_on_every_rank_with_policy_raise():
    started = time.monotonic()
    _expect_error_everywhere(run_ranks(_nan_gradient, 2, "raise"), "DeMoNonFiniteError", "rank(s) [1]", started)


def _save_state(rank, world, folder):
    model = tiny_mlp()
    opt = small_demo(model)
    loss_and_backward(model, rank, 0)
    opt.step()
    torch.save(opt.state_dict(), os.path.join(folder, f"rank{rank}.pt"))  # no collective inside
    return opt.state_dict()["demo"]


def _load_state(rank, world, folder):
    model = tiny_mlp()
    opt = small_demo(model)
    opt.load_state_dict(torch.load(os.path.join(folder, f"rank{rank % 2}.pt"), weights_only=True))
    return "no error"


def test_resume_on_a_different_world_size_is_detected(tmp_path):
    meta = expect_ok(run_ranks(_save_state, 2, str(tmp_path)))
    assert [(m["rank"], m["world_size"]) for m in meta] == [(0, 2), (1, 2)]
    started = time.monotonic()
    _expect_error_everywhere(
        run_ranks(_load_state, 4, str(tmp_path)),
        "DeMoStateError",
        "saved with 2 process(es) but this run has 4",
        started,
    )
    # a single process (torch.distributed not initialised) is caught at its first step
    model = tiny_mlp()
    opt = small_demo(model)
    opt.load_state_dict(torch.load(tmp_path / "rank0.pt", weights_only=True))
    loss_and_backward(model, 0, 0)
    with pytest.raises(hf_demo.DeMoStateError, match="saved with 2 process"):
        opt.step()


def _state_dict_on_rank0_only(rank, world):
    model = tiny_mlp()
    opt = small_demo(model)
    loss_and_backward(model, rank, 0)
    opt.step()
    if rank == 0:
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)  # would hang if state_dict() called a collective
    return "ok"


def test_state_dict_calls_no_collective():
    assert expect_ok(run_ranks(_state_dict_on_rank0_only, 2, timeout=60)) == ["ok", "ok"]


def _save_run(rank, world, folder, steps):
    """One run (its own run identity): its states after each of ``steps`` optimizer steps."""
    model = tiny_mlp(seed=len(folder))
    opt = small_demo(model)
    for step in range(max(steps)):
        loss_and_backward(model, rank, step)
        opt.step()
        if step + 1 in steps:
            torch.save(opt.state_dict(), os.path.join(folder, f"rank{rank}.step{step + 1}.pt"))
    return opt.run_id


def _load_files(rank, world, files):
    model = tiny_mlp()
    opt = small_demo(model)
    started = time.monotonic()
    try:
        opt.load_state_dict(torch.load(files[rank], weights_only=True))
    except hf_demo.DeMoStateError as exc:
        return str(exc), time.monotonic() - started
    return "no error", time.monotonic() - started


@pytest.mark.parametrize("mix", ["another run", "another step"])
def test_rank_files_of_another_run_or_step_are_named_on_every_rank(tmp_path, mix):
    """A checkpoint whose rank 1 file comes from another run with the same settings (or another step), as one
    vouched for with write_manifest may hold, resumed silently before: every rank now raises, naming rank 1."""
    run_a, run_b = tmp_path / "a", tmp_path / "bb"
    run_a.mkdir(), run_b.mkdir()
    ids_a = expect_ok(run_ranks(_save_run, 2, str(run_a), (1, 2)))
    ids_b = expect_ok(run_ranks(_save_run, 2, str(run_b), (2,)))
    assert ids_a[0] == ids_a[1] and ids_b[0] == ids_b[1] and ids_a[0] != ids_b[0]  # one identity per run
    other = run_b / "rank1.step2.pt" if mix == "another run" else run_a / "rank1.step1.pt"
    results = expect_ok(run_ranks(_load_files, 2, [str(run_a / "rank0.step2.pt"), str(other)]))
    for message, seconds in results:
        assert "do not belong together: rank 1's state is " + mix in message, message
        assert f"rank 0's: run {ids_a[0]} at step 2" in message, message
        assert seconds < 30, seconds
    same = expect_ok(run_ranks(_load_files, 2, [str(run_a / "rank0.step2.pt"), str(run_a / "rank1.step2.pt")]))
    assert [m for m, _ in same] == ["no error", "no error"]


def _round_trips(rank, world, kw):
    from hf_demo.exchange.transport import register_collective_hook

    kw = dict(kw)
    os.environ.update(kw.pop("env", {}))
    model = tiny_mlp()
    opt = small_demo(model, **kw)
    named = []
    handle = register_collective_hook(lambda name, nbytes: named.append((name, nbytes)))
    seen = []
    for step in range(4):
        loss_and_backward(model, rank, step)
        named.clear()
        opt.step()
        seen.append([(name, n) for name, n in named if name != "ddp_check"])  # the first step's DDP guard
    named.clear()
    opt.confirm()
    seen.append(list(named))
    handle.remove()
    return seen, opt.settings, [tuple(p.shape) for p in model.parameters()]


SECRET = {"env": {"HF_DEMO_SECRET": "s3cret"}}
SEALED = {"env": {"HF_DEMO_SECRET": "s3cret", "HF_DEMO_ENCRYPT": "1"}}


@pytest.mark.parametrize(
    "kw,first,steady,confirm",
    [
        ({}, ["header", "sealing", "payload", "settle"], ["payload"], ["settle", "settle", "settle"]),
        (SECRET, ["header", "sealing", "payload", "settle"], ["payload"], ["settle", "settle", "settle"]),
        (SEALED, ["header", "sealing", "payload", "settle"], ["payload"], ["settle", "settle", "settle"]),
        ({"commit_vote": "separate"}, ["header", "sealing", "payload", "vote"], ["payload", "vote"], []),
        ({"commit_vote": "off"}, ["header", "sealing", "payload"], ["payload"], []),
        ({"overlap": True}, ["header", "sealing", "payload"], ["header", "payload"], []),
        (
            {"exchange": "all_reduce"},
            ["header", "sealing", "positions", "values", "vote"],
            ["positions", "values", "vote"],
            [],
        ),
    ],
    ids=["defaults", "secret", "sealed", "vote_separate", "vote_off", "overlap", "all_reduce"],
)
def test_round_trips_and_bytes_of_a_step(kw, first, steady, confirm):
    """The header rides with the payload once its size is agreed (the first step sends it alone first). With the
    defaults (and a secret, and sealed traffic) a steady step is one round trip: its verdict settles in the next
    step's all-gather, and confirm() settles the last one (three all-gathers of the row's size: the verdicts, every
    rank's finding on them, and those findings passed on); the first step
    settles at once (not steady). commit_vote='separate' votes in an all-gather of its own (two round trips);
    overlap sends its header alone (the payload goes in the background, the verdict rides in the next header,
    confirm() has nothing to settle); all_reduce's union nominations ride with the header, its values follow, the vote
    is its own. A process's first exchange agrees that every rank seals its headers or none in a round of its own
    ("sealing", hf_demo.wire.uniform) before any payload-sized collective. Bytes: the planner's."""
    from hf_demo.ops.traffic import demo_payload
    from hf_demo.wire import agreement, codec, sealing

    if kw is SEALED:
        pytest.importorskip("cryptography")
    seen, settings, shapes = expect_ok(run_ranks(_round_trips, 2, kw))[0]
    assert [[name for name, _ in step] for step in seen[1:4]] == [steady] * 3, seen
    assert [name for name, _ in seen[0]] == first, seen[0]
    assert [name for name, _ in seen[4]] == confirm, seen[4]
    rides = not kw.get("overlap")
    size = demo_payload(shapes, settings, 2)
    payload = size.index_nbytes if kw.get("exchange") else size.payload_nbytes
    tags = sealing.TAG_BYTES if kw is SEALED else 0
    expected = {"payload": payload + tags, "positions": payload, "vote": agreement.VOTE_ROW_BYTES}
    expected["settle"] = codec.HEADER_BYTES + payload + tags
    for name, sent in seen[-2] + seen[-1]:
        if name in expected and name != "settle":
            assert sent == expected[name] + (codec.HEADER_BYTES if name == steady[0] and rides else 0), seen[-2]
        if name == "settle":
            assert sent == expected["settle"], seen[-1]  # the size of the steady rows it settles
