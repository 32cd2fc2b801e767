"""Faults that must end in the library's own error on every rank, with nothing moved: finite coefficients too
large to average and transform, damaged checkpoint files, an older rank file, a wrong-typed state entry.

Each test injects the fault as a user or an on-path writer would meet it and checks what every rank raised and
what every rank's parameters are afterwards.
"""

import pytest
import torch

from dist_utils import RankError, expect_ok
from models import loss_and_backward, small_demo, tiny_mlp

NEAR_FP32_MAX = 3.0e38  # finite in fp32 and bf16; two of them summed, or one through the inverse DCT, are not
HUGE = {"sign": 3.0e37, "2bit": 3.0e37}  # what these formats' per-block scales still carry finite


def _huge_values_on_second_step(rank, world, kw):
    """Rank ``world - 1`` sends finite coefficients near the fp32 maximum at the second step (its row is
    otherwise well formed: its CRC32 is computed over them). Returns (error, parameters before, after)."""
    from hf_demo.wire import codec

    model = tiny_mlp()
    opt = small_demo(model, comm_timeout=10.0, **kw)
    loss_and_backward(model, rank, 0)
    opt.step()
    loss_and_backward(model, rank, 1)
    before = [p.detach().clone() for p in model.parameters()]
    if rank == world - 1 and kw.get("exchange") == "all_reduce":  # the values travel as they are, summed
        from hf_demo.exchange import transport

        real_reduce = transport.Transport._reduce

        def huge_sum(self, wire, async_op=False):
            if wire.is_floating_point():
                wire.copy_(torch.where(wire < 0, -NEAR_FP32_MAX, NEAR_FP32_MAX))
            return real_reduce(self, wire, async_op)

        transport.Transport._reduce = huge_sum
    elif rank == world - 1:
        name = kw.get("value_format", "bf16")
        fmt, value = codec.value_format(name), HUGE.get(name, NEAR_FP32_MAX)
        real_encode = fmt.encode_rows

        def huge(values, bucket):
            return real_encode(torch.where(values < 0, -value, value), bucket)

        fmt.encode_rows = huge
    error = "no error"
    try:
        opt.step()
        opt.confirm()
    except Exception as exc:  # noqa: BLE001 - reported with the parameters
        error = RankError(exc)
    return error, before, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "kw",
    [
        {"update_rule": "raw", "value_format": "fp32"},
        {"update_rule": "raw", "value_format": "bf16"},
        {"update_rule": "sign", "value_format": "sign"},
        {"update_rule": "adam", "value_format": "2bit"},
        {"update_rule": "raw", "value_format": "fp32", "exchange": "all_reduce"},
        {"update_rule": "raw", "value_format": "fp32", "commit_vote": "separate"},
        {"inner_rule": "adamw", "value_format": "fp32", "sync_every": 2},  # a synchronisation's outer step
    ],
    ids=["raw-fp32", "raw-bf16", "sign-sign", "adam-2bit", "raw-all_reduce", "raw-separate_vote", "sync_every-adamw"],
)
def test_finite_coefficients_too_large_to_average_are_refused_on_every_rank(gloo, kw):
    """Finite values near the fp32 maximum in a well-formed row overflowed the inverse DCT, and with
    update_rule='raw' both ranks' parameters became non-finite with no error. Every rank now refuses the step
    (a DeMoPayloadError naming the sender) and every rank's parameters are unchanged and finite."""
    results = expect_ok(gloo(_huge_values_on_second_step, 2, kw, timeout=120))
    for rank, (error, before, after) in enumerate(results):
        assert isinstance(error, RankError) and error.type == "DeMoPayloadError", f"rank {rank}: {error}"
        assert all(torch.isfinite(p).all() for p in after), f"rank {rank}: non-finite parameters"
        assert all(torch.equal(a, b) for a, b in zip(before, after)), f"rank {rank}: parameters moved"
        if rank == 1 or kw.get("exchange") == "all_reduce":
            assert "too large" in error.message, error.message


def _demo_state():
    model = tiny_mlp()
    opt = small_demo(model)
    loss_and_backward(model, 0, 0)
    opt.step()
    return opt.state_dict()


def _set(state: dict, path: str, value) -> dict:
    """``state`` with its entry at ``path`` ("demo", "demo.policy.tier_spec", ...) replaced by ``value``."""
    *parents, last = path.split(".")
    node = state
    for key in parents:
        node = node[key]
    node[last] = value
    return state


@pytest.mark.parametrize(
    "path,value",
    [
        ("demo", "not a dict"),
        ("demo", [1, 2]),
        ("demo.steps", None),
        ("demo.policy", 5),
        ("demo.policy.tier_spec", []),
        ("demo.comm", [1]),
        ("demo.local_params", []),
        ("demo.settings", None),
    ],
)
def test_a_wrong_typed_demo_entry_is_refused_with_the_library_error(path, value):
    """load_state_dict with a wrong-typed ``demo`` entry raised AttributeError, TypeError, IndexError or
    ValueError from deep inside the load; it now raises DeMoStateError naming the entry, before anything is
    loaded."""
    import hf_demo

    state = _set(_demo_state(), path, value)
    model = tiny_mlp(seed=3)
    opt = small_demo(model)
    with pytest.raises(hf_demo.DeMoStateError, match="malformed") as info:
        opt.load_state_dict(state)
    assert path in str(info.value) or path == "demo.policy.tier_spec" and "tier_spec" in str(info.value)
    assert not opt.state and opt.counters.steps == 0  # nothing was loaded


def _one_rank_loads_a_malformed_state(rank, world, folder, bad=1, slow=None):
    """Every rank saves after a step; rank ``bad``'s file then has a wrong-typed entry; every rank loads its own.
    Rank ``slow`` (if any) is slow reading the comparison. Returns (message, seconds) on every rank."""
    import os
    import time

    import hf_demo

    model = tiny_mlp()
    opt = small_demo(model, comm_timeout=60.0)
    loss_and_backward(model, rank, 0)
    opt.step()
    state = opt.state_dict()
    if rank == bad:
        state["demo"]["policy"] = 5
    if rank == slow:
        _slow_after_each_store_wait(2.0)
    torch.save(state, os.path.join(folder, f"rank{rank}.pt"))
    started = time.monotonic()
    try:
        small_demo(model, comm_timeout=60.0).load_state_dict(torch.load(os.path.join(folder, f"rank{rank}.pt")))
    except hf_demo.DeMoStateError as exc:
        return str(exc), time.monotonic() - started
    return "no error", time.monotonic() - started


def test_a_malformed_state_on_one_rank_stops_every_rank_at_once(gloo, tmp_path):
    """Rank 1's file has a wrong-typed entry: rank 1 refuses it before loading, and rank 0, whose state loads,
    heard of it only after comm_timeout (waiting for rank 1's run identity). It now raises at once, naming rank 1
    and the entry."""
    (message0, seconds0), (message1, _) = expect_ok(gloo(_one_rank_loads_a_malformed_state, 2, str(tmp_path)))
    assert "malformed 'demo.policy' entry" in message1, message1
    assert "rank 1 refused its own: optimizer state has a malformed 'demo.policy' entry" in message0, message0
    assert seconds0 < 30, seconds0  # comm_timeout is 60 s


def _save_then_resume_older(rank, world, folder):
    """Both ranks save after 2 steps; rank 1's file is then made an older hf_demo's (no run identity, no
    parameter fingerprint); every rank loads its file and steps. Returns (error type, message, seconds)."""
    import os
    import time

    model = tiny_mlp()
    opt = small_demo(model, comm_timeout=20.0)
    for step in range(2):
        loss_and_backward(model, rank, step)
        opt.step()
    state = opt.state_dict()
    if rank == 1:
        state["demo"].pop("run_id"), state["demo"].pop("params_print")
    torch.save(state, os.path.join(folder, f"rank{rank}.pt"))
    fresh = small_demo(model, comm_timeout=20.0)
    started = time.monotonic()
    try:
        fresh.load_state_dict(torch.load(os.path.join(folder, f"rank{rank}.pt"), weights_only=True))
        loss_and_backward(model, rank, 2)
        fresh.step()
        fresh.confirm()
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc), time.monotonic() - started
    return "no error", "", time.monotonic() - started


def test_an_older_rank_file_without_run_identity_is_named_on_every_rank(gloo, tmp_path):
    """A checkpoint whose rank 1 file an older hf_demo wrote (no run identity): rank 1 skipped the comparison
    of run identities and went on into the step, rank 0 waited for it, and the run ended in a raw gloo timeout
    after comm_timeout (20 s). Every rank now raises the same DeMoStateError naming rank 1's file at once."""
    results = expect_ok(gloo(_save_then_resume_older, 2, str(tmp_path), timeout=120))
    for rank, (kind, message, seconds) in enumerate(results):
        assert kind == "DeMoStateError", f"rank {rank}: {kind}: {message}"
        assert "rank 1's state is an older hf_demo's, without a run identity" in message, message
        assert seconds < 15, seconds
    assert results[0][1] == results[1][1]


def _slow_after_each_store_wait(seconds):
    """From now on, this process's reads of the rendezvous store (the resume comparison's) take ``seconds`` more
    after each wait: a rank the scheduler leaves without a CPU just when its peers have what they need."""
    import time

    import torch.distributed as dist

    real = dist.distributed_c10d._get_default_store

    class Slow:
        def __init__(self, store):
            self._store = store

        def __getattr__(self, name):
            return getattr(self._store, name)

        def wait(self, *args):
            out = self._store.wait(*args)
            time.sleep(seconds)
            return out

    dist.distributed_c10d._get_default_store = lambda: Slow(real())


def _save_then_resume_older_rank1_slow(rank, world, folder):
    if rank == 1:
        _slow_after_each_store_wait(2.0)
    return _save_then_resume_older(rank, world, folder)


def test_an_older_rank_file_is_named_on_a_slow_rank_too(gloo, tmp_path):
    """As above, with rank 1 slow between waiting for every rank's resumed state and reading them (under load, one
    failure in many runs): rank 0 raised and its process ended, taking the rendezvous store it holds with it, and
    rank 1 read a raw ``DistNetworkError`` (connection closed or reset). Rank 0 now raises once rank 1 read."""
    results = expect_ok(gloo(_save_then_resume_older_rank1_slow, 2, str(tmp_path), timeout=120))
    for rank, (kind, message, _) in enumerate(results):
        assert kind == "DeMoStateError", f"rank {rank}: {kind}: {message}"
        assert "rank 1's state is an older hf_demo's, without a run identity" in message, message
    assert results[0][1] == results[1][1]


def test_a_malformed_state_on_rank_0_is_named_on_a_slow_peer(gloo, tmp_path):
    """Rank 0 refused its malformed file, published why and raised at once; its process ended with the
    rendezvous store it holds, so rank 1, slow to read the comparison, got a raw ``DistNetworkError``. Rank 0 now
    raises once rank 1 read its refusal, and rank 1 names it."""
    (message0, _), (message1, _) = expect_ok(gloo(_one_rank_loads_a_malformed_state, 2, str(tmp_path), 0, 1))
    assert "malformed 'demo.policy' entry" in message0, message0
    assert "rank 0 refused its own: optimizer state has a malformed 'demo.policy' entry" in message1, message1


def _agree_without_rank_1(rank, world):
    """Rank 1 stops before the agreement (its process ends); rank 0 gathers every rank's finding."""
    from hf_demo.errors import DeMoStateError
    from hf_demo.hf.checkpoint import agree_on_every_rank

    if rank == 1:
        return "left"
    try:
        agree_on_every_rank(None, DeMoStateError, "a hint")
    except DeMoStateError as exc:
        return str(exc)
    return "no error"


def test_a_peer_gone_before_the_agreement_is_named_in_the_library_error(gloo):
    """A rank that stopped before the all-ranks agreement of a checkpoint check left the others with the backend's
    raw error (gloo's "Connection closed by peer"); they now raise the check's own error, which says so."""
    message0, _ = expect_ok(gloo(_agree_without_rank_1, 2, timeout=60, collective_timeout=20.0))
    assert message0.startswith("rank 0: not every rank took part in the check"), message0


def _agree_on_own_messages(rank, world):
    """Every rank found its own problem, in a message that names its rank (check_model's)."""
    from hf_demo.errors import DeMoStateError
    from hf_demo.hf.checkpoint import agree_on_every_rank

    try:
        agree_on_every_rank(f"rank {rank}: the model's parameters differ", DeMoStateError, "a hint")
    except DeMoStateError as exc:
        return str(exc)
    return "no error"


def test_a_message_naming_its_rank_is_not_prefixed_twice(gloo):
    """DeMoTrainer's model check names the rank ("rank 0: the model's parameters ..."); where the ranks' messages
    differed, the agreement prefixed the first one's rank again: "rank 0: rank 0: ..."."""
    messages = expect_ok(gloo(_agree_on_own_messages, 2, timeout=60))
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("rank 0: the model's parameters differ (ranks [0, 1] of 2"), messages[0]


def _vouched_copy(src, dst, damage):
    """``src`` copied to ``dst``, ``damage(dst)`` done to it, and the damage vouched for with ``write_manifest``
    (what the incomplete-checkpoint error suggests, done after the files changed)."""
    import json
    import shutil

    from hf_demo.hf.checkpoint import MANIFEST, write_manifest

    shutil.copytree(src, dst)
    damage(dst)
    step = json.loads((dst / MANIFEST).read_text())["global_step"]
    (dst / MANIFEST).unlink()
    write_manifest(str(dst), 2, step)
    return dst


def _truncate(name):
    def damage(folder):
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: len(data) // 2])

    return damage


def _other_model(folder):
    """model.safetensors as another run's (same shapes, other weights)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.launch
@pytest.mark.timeout(900)
def test_load_state_refuses_another_runs_model_and_damaged_files_on_every_rank(tmp_path):
    """A custom Accelerate loop (accelerate's checkpointing.py shape): ``accelerator.load_state`` of a folder whose
    model file is another run's (vouched for) trained on silently; a truncated optimizer file raised torch's raw
    PytorchStreamReader error on one rank (and the launcher killed the other); a truncated model raised a raw
    SafetensorError. Every rank now raises the same hf_demo error, and the intact checkpoint resumes after them."""
    from launch_utils import ROOT, accelerate_launch, load_records

    script = ROOT / "tests" / "scripts" / "accelerate_checkpoint_loop.py"
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    accelerate_launch(script, "--out", full)
    ckpt = full / "step_5"
    broken = [
        _vouched_copy(ckpt, tmp_path / "other_model", _other_model),
        _vouched_copy(ckpt, tmp_path / "short_rank1", _truncate("optimizer.rank1.bin")),
        _vouched_copy(ckpt, tmp_path / "short_rank0", _truncate("optimizer.bin")),
        _vouched_copy(ckpt, tmp_path / "short_model", _truncate("model.safetensors")),
    ]
    accelerate_launch(script, "--out", resumed, "--resume", ckpt, "--broken", *broken)
    (f0, _), (r0, r1) = load_records(full, 2), load_records(resumed, 2)
    assert r0["errors"] == r1["errors"]  # one message, the same on every rank
    other, short1, short0, short_model = r0["errors"]
    assert other.startswith("DeMoStateError") and "not those its optimizer state was saved with" in other, other
    assert "rank 0: rank 0:" not in other, other
    assert short1.startswith("CheckpointError") and "optimizer.rank1.bin cannot be read" in short1, short1
    assert short0.startswith("CheckpointError") and "optimizer.bin cannot be read" in short0, short0
    assert short_model.startswith("CheckpointError") and "model.safetensors cannot be read" in short_model
    assert f0["params"] == r0["params"] == r1["params"]  # the intact checkpoint still resumes bit for bit


def _errors(stdout: str, kind: str) -> list[str]:
    return [line.split(f"{kind}:", 1)[1].strip() for line in stdout.splitlines() if f"{kind}: " in line]


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_demotrainer_names_a_truncated_vouched_file_on_every_rank(tmp_path):
    """DeMoTrainer resuming a checkpoint whose optimizer.rank1.pt (or model.safetensors) was truncated and then
    vouched for with write_manifest: rank 1 raised torch's raw PytorchStreamReader error and torchrun killed
    rank 0 (a raw SafetensorError on every rank for the model). Every rank now raises the library's error naming
    the file."""
    from launch_utils import ROOT, accelerate_launch

    script = ROOT / "tests" / "scripts" / "train_tiny_llama.py"
    common = ["--optim", "demo", "--per_device_train_batch_size", "8", "--learning_rate", "3e-3", "--max_steps",
              "10", "--save_steps", "10", "--seed", "1", "--disable_tqdm", "true", "--report_to", "none", "--use_cpu",
              "true"]  # fmt: skip

    def train(name, *extra, check=True):
        out = ["--output_dir", tmp_path / name / "out", "--record_dir", tmp_path / name / "rec"]
        return accelerate_launch(script, *out, *common, *extra, check=check)

    train("straight")
    ckpt = tmp_path / "straight" / "out" / "checkpoint-10"
    for name in ("optimizer.rank1.pt", "model.safetensors"):
        broken = _vouched_copy(ckpt, tmp_path / f"short_{name}", _truncate(name))
        proc = train(f"from_{name}", "--max_steps", "12", "--resume_from_checkpoint", broken, check=False)
        assert proc.returncode != 0
        messages = _errors(proc.stdout, "CheckpointError")
        assert len(messages) == 2 and len(set(messages)) == 1, proc.stdout[-3000:]
        assert f"{name} cannot be read" in messages[0], messages[0]


HUGE_UPDATE = 1.0e30  # within the coefficient bound (codec.coefficient_bound), its square far past fp32's range
RULE_CASES = [(rule, fmt) for rule in ("adam", "adamw") for fmt in ("fp32", "bf16", "sign", "2bit", "inner")]
FAST_CASES = [("adam", "fp32"), ("adamw", "inner")]  # the default run; every rule and format in the slow tier


def _moments(opt) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for k, v in s.items() if k.endswith("exp_avg_sq")]


def _huge_update(rank, rule: str, fmt: str):
    """Two clean steps, then one whose update is HUGE_UPDATE (every rank sends it; ``fmt`` "inner": the local
    steps' own rule, ``sync_every=2``, fed this rank's gradient scaled to it), then one clean step."""
    from hf_demo.wire import codec

    kw = {"sync_every": 2, "inner_rule": rule} if fmt == "inner" else {"update_rule": rule, "value_format": fmt}
    model = tiny_mlp()
    opt = small_demo(model, comm_timeout=10.0, **kw)
    for step in range(2):
        loss_and_backward(model, rank, step)
        opt.step()
    loss_and_backward(model, rank, 2)
    if fmt == "inner":
        for p in model.parameters():
            p.grad.mul_(HUGE_UPDATE / p.grad.abs().max())
    else:
        values = codec.value_format(fmt)
        real_encode = values.encode_rows
        values.encode_rows = lambda v, bucket: real_encode(torch.where(v < 0, -HUGE_UPDATE, HUGE_UPDATE), bucket)
    try:
        opt.step()
    finally:
        if fmt != "inner":
            values.encode_rows = real_encode
    loss_and_backward(model, rank, 3)
    opt.step()
    opt.flush()
    return [p.detach().clone() for p in model.parameters()], _moments(opt), opt.steps


def _huge_updates(rank, world, cases):
    return {case: _huge_update(rank, *case) for case in cases}


@pytest.mark.parametrize(
    "cases",
    [FAST_CASES, pytest.param([c for c in RULE_CASES if c not in FAST_CASES], marks=pytest.mark.slow)],
    ids=["adam_fp32-adamw_inner", "every_other_rule_and_format"],
)
def test_an_update_whose_square_overflows_leaves_adams_second_moment_finite_on_every_rank(gloo, cases):
    """An averaged update above about 1.8e19 (every rank's, or a local step's own under sync_every) squared past
    fp32's range: the second moment became Inf and stayed so (that element frozen, Inf saved in checkpoints),
    silently. It now saturates at fp32's maximum, in every rule that keeps one (adam, adamw; outer and inner) and
    every value format: every rank's moments and parameters are finite, and the replicas identical."""
    ranks = expect_ok(gloo(_huge_updates, 2, [tuple(c) for c in cases], timeout=180))
    for case in cases:
        (params0, _, steps0), (params1, _, steps1) = (r[case] for r in ranks)
        assert steps0 == steps1 == 4, (case, steps0, steps1)
        assert all(torch.equal(a, b) for a, b in zip(params0, params1)), f"{case}: the replicas differ"
        for rank, (params, moments, _) in enumerate(r[case] for r in ranks):
            assert moments, case
            assert all(torch.isfinite(v).all() for v in moments), f"{case}, rank {rank}: an Inf second moment"
            assert all(torch.isfinite(p).all() for p in params), f"{case}, rank {rank}: non-finite parameters"
