"""Single-process behaviour of hf_demo.DeMo: invariants, formats, dtypes, state, validation."""

import io
import warnings

import pytest
import torch

import hf_demo
from codec_helpers import encode_values
from hf_demo import compression as F
from hf_demo.compression import encode, plan
from hf_demo.wire import codec
from models import loss_and_backward, small_demo, tiny_mlp


@pytest.mark.parametrize("fmt", codec.VALUE_FORMATS)
def test_momentum_equals_residual_plus_sent(fmt):
    torch.manual_seed(0)
    layout = plan((128, 96), 64, 32)
    momentum = torch.randn(layout.nblocks, layout.bsize)
    before = momentum.clone()
    idx, values = F.select(momentum, layout.k)
    assert torch.equal(
        values.abs().min(1).values >= momentum.abs().kthvalue(layout.bsize - layout.k, 1).values,
        torch.ones(layout.nblocks, dtype=torch.bool),
    )
    sent, _ = encode_values(fmt, values)
    F.feedback(momentum, idx, sent)
    dense_sent = torch.zeros_like(momentum).scatter_(1, idx, sent)
    if fmt in ("sign", "2bit"):  # scale*sign is not exactly subtractable in fp32: within one rounding
        torch.testing.assert_close(momentum + dense_sent, before, atol=1e-6, rtol=0)
    else:  # v - round(v) is exact in fp32
        assert torch.equal(momentum + dense_sent, before)
    if fmt == "fp32":
        assert torch.equal(momentum.gather(1, idx), torch.zeros_like(values))


def test_average_is_the_mean_over_ranks_that_selected():
    layout = plan((4,), 64, 2)
    idx = torch.tensor([[[0, 1]], [[1, 2]]])  # 2 ranks, 1 block, k=2
    values = torch.tensor([[[1.0, 2.0]], [[4.0, 8.0]]])
    dense = F.densify(*F.mean_weights(idx, values, layout), layout)
    assert torch.equal(dense, torch.tensor([[1.0, 3.0, 8.0, 0.0]]))


def test_optimizer_momentum_is_dct_of_decayed_gradients(device):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 64).to(device))
    opt = hf_demo.DeMo([p], lr=0.1, compression_decay=0.5, value_format="fp32")
    g = torch.randn(64, 64).to(device)
    p.grad = g.clone()
    opt.step()
    assert opt.state[p]["momentum"].device == device
    layout = plan((64, 64), 64, 32)
    expected = 0.1 * encode(g, layout)
    idx, _ = F.select(expected.clone(), 32)
    expected.scatter_(1, idx, 0.0)  # what was sent left the momentum
    torch.testing.assert_close(opt.state[p]["momentum"], expected, atol=1e-6, rtol=0)


def test_bf16_parameters_keep_fp32_momentum_and_real_decay(device):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 64).to(device, torch.bfloat16))
    opt = hf_demo.DeMo([p], lr=1e-3, compression_decay=0.999, value_format="fp32")
    p.grad = torch.randn(64, 64).to(device, torch.bfloat16)
    opt.step()
    m1 = opt.state[p]["momentum"].clone()
    assert m1.dtype == torch.float32
    p.grad = torch.zeros_like(p)
    opt.step()
    m2 = opt.state[p]["momentum"]
    untouched = m2 != 0
    assert untouched.sum() > 3000
    # the decay really happened in fp32 (in bf16, 0.999*x rounds back to x for most x)
    assert torch.equal(m2[untouched], (m1 * 0.999)[untouched])


def _train(fmt, steps=80, lr=1e-2, device="cpu"):
    model = tiny_mlp(hidden=64).to(device)
    opt = hf_demo.DeMo(model.parameters(), lr=lr, compression_topk=8, compression_chunk=16, value_format=fmt)
    losses = []
    for step in range(steps):
        losses.append(loss_and_backward(model, 0, step % 4))
        opt.step()
    return losses


@pytest.mark.parametrize("fmt", codec.VALUE_FORMATS)
def test_every_value_format_trains(fmt, device):
    losses = _train(fmt, device=device)
    assert sum(losses[-4:]) / 4 < 0.6 * sum(losses[:4]) / 4


def _snapshot(model, opt):
    return [p.detach().clone() for p in model.parameters()], [s["momentum"].clone() for s in opt.state.values()]


def test_resume_is_bitwise_exact_through_weights_only_load(device):
    model = tiny_mlp().to(device)
    opt = hf_demo.DeMo(model.parameters(), lr=3e-3, compression_topk=4, compression_chunk=8)
    for step in range(5):
        loss_and_backward(model, 0, step)
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    for step in range(5, 10):
        loss_and_backward(model, 0, step)
        opt.step()
    straight = _snapshot(model, opt)

    ckpt = torch.load(io.BytesIO(buf.getvalue()), map_location="cpu", weights_only=True)  # as DeMoTrainer loads
    model2 = tiny_mlp(seed=123).to(device)
    model2.load_state_dict(ckpt["model"])
    opt2 = hf_demo.DeMo(model2.parameters(), lr=3e-3, compression_topk=4, compression_chunk=8)
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.steps == 5
    assert all(s["momentum"].device == device for s in opt2.state.values())
    for step in range(5, 10):
        loss_and_backward(model2, 0, step)
        opt2.step()
    resumed = _snapshot(model2, opt2)
    for a, b in zip(straight[0] + straight[1], resumed[0] + resumed[1]):
        assert torch.equal(a, b)
    assert opt2.steps == opt.steps == 10


def test_momentum_stays_fp32_after_loading_into_bf16_parameters():
    p = torch.nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16))
    opt = hf_demo.DeMo([p], lr=1e-3)
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    opt2 = hf_demo.DeMo([p], lr=1e-3)
    opt2.load_state_dict(sd)
    assert opt2.state[p]["momentum"].dtype == torch.float32
    assert torch.equal(opt2.state[p]["momentum"], opt.state[p]["momentum"])


def test_loading_a_state_for_another_layout_fails_clearly():
    p = torch.nn.Parameter(torch.randn(64, 64))
    opt = hf_demo.DeMo([p], lr=1e-3)
    p.grad = torch.randn_like(p)
    opt.step()
    other = hf_demo.DeMo([torch.nn.Parameter(torch.randn(32, 128))], lr=1e-3)  # same size, other shape
    with pytest.raises(hf_demo.DeMoStateError, match="saved momentum of parameter 0"):
        other.load_state_dict(opt.state_dict())
    with pytest.raises(hf_demo.DeMoStateError, match="not saved by hf_demo"):
        other.load_state_dict(torch.optim.SGD([p], lr=1).state_dict())


def test_missing_grad_counts_as_zero_and_scalar_parameters_work():
    a = torch.nn.Parameter(torch.tensor(1.5))
    b = torch.nn.Parameter(torch.randn(3))
    opt = hf_demo.DeMo([a, b], lr=0.1)
    a.grad = torch.tensor(2.0)
    opt.step()
    assert a.item() == pytest.approx(1.4)  # sign update of the whole (sent) scalar
    assert torch.equal(opt.state[b]["momentum"], torch.zeros(1, 3))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(lr=-1.0), "lr"),
        (dict(lr=float("nan")), "lr"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(compression_decay=1.5), "compression_decay"),
        (dict(compression_chunk=0), "compression_chunk"),
        (dict(compression_chunk=300), "compression_chunk"),
        (dict(compression_chunk=2.5), "compression_chunk"),
        (dict(compression_topk=0), "compression_topk"),
        (dict(compression_topk=65, compression_chunk=8), "compression_topk"),
        (dict(value_format="int4"), "value_format"),
        (dict(nonfinite="ignore"), "nonfinite"),
        (dict(sign_update="yes"), "sign_update"),
    ],
)
def test_invalid_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hf_demo.DeMo([torch.nn.Parameter(torch.ones(3))], **{"lr": 1e-3, **kwargs})


def test_nonfinite_gradient_single_process(device):
    p = torch.nn.Parameter(torch.randn(8, 8).to(device))
    before = p.detach().clone()
    opt = hf_demo.DeMo([p], lr=1e-2)
    p.grad = torch.full_like(p, float("nan"))
    opt.step()
    assert torch.equal(p.detach(), before) and opt.skipped_steps == 1 and opt.steps == 1
    assert "momentum" not in opt.state[p]
    strict = hf_demo.DeMo([p], lr=1e-2, nonfinite="raise")
    p.grad = torch.full_like(p, float("inf"))
    with pytest.raises(hf_demo.DeMoNonFiniteError, match="rank"):
        strict.step()


def _bf16_run(rounding, steps=200, dtype=torch.bfloat16):
    torch.manual_seed(0)
    p = torch.nn.Parameter((torch.rand(64, 64) + 0.5).to(torch.bfloat16).to(dtype))  # weights in [0.5, 1.5)
    start = p.detach().clone()
    opt = hf_demo.DeMo([p], lr=1e-4, param_rounding=rounding)  # sign steps of 1e-4: below bf16's ulp of 2**-7
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        p.grad = (torch.randn(64, 64, generator=g).to(torch.bfloat16) + 0.5).to(dtype)  # a steady push
        opt.step()
    return start, p.detach()


def test_stochastic_rounding_moves_bf16_weights_that_nearest_rounding_freezes():
    start, nearest = _bf16_run("nearest")
    _, stochastic = _bf16_run("stochastic")
    assert (nearest != start).float().mean() < 0.01  # steps below bf16's resolution: the weights never move
    assert (stochastic != start).float().mean() > 0.5
    _, fp32 = _bf16_run("nearest", dtype=torch.float32)
    # on average the bf16 weights go as far as fp32 weights do (fp32 drift ~0.008 here)
    drift, exact = ((start.float() - w.float()).mean().item() for w in (stochastic, fp32))
    assert abs(drift - exact) < 0.1 * exact


def test_stochastic_rounding_is_unbiased(device):
    from hf_demo.compression import stochastic_round

    x = torch.full((200_000,), 1.0 + 2**-10, device=device)  # 1/8 of the way from 1.0 to the next bf16, 1 + 2**-7
    rounded = stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(0))
    assert rounded.device == device
    rounded = rounded.float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(rounded.mean().item() - x[0].item()) < 2e-5


def test_sign_update_is_the_reference_spelling_of_update_rule():
    assert hf_demo.DeMo([torch.nn.Parameter(torch.zeros(2))], sign_update=False).settings.update_rule == "raw"
    assert hf_demo.DeMo([torch.nn.Parameter(torch.zeros(2))], sign_update=True).settings.update_rule == "sign"
    with pytest.raises(ValueError, match="contradicts"):
        hf_demo.DeMo([torch.nn.Parameter(torch.zeros(2))], sign_update=False, update_rule="adam")


def test_the_settings_page_is_generated_from_the_one_source_of_truth():
    from pathlib import Path

    from hf_demo.settings import markdown_table

    page = (Path(__file__).parent.parent / "docs" / "reference" / "settings.md").read_text()
    assert markdown_table() in page, (
        "docs/reference/settings.md is stale: python -m hf_demo.settings > docs/reference/settings.md"
    )


def test_a_pre_release_state_is_refused_naming_its_version_or_its_missing_field():
    """States of format 3 written by this release load; older formats, and format 3 without one of its fields
    (pre-release builds), are refused with what differs, before anything is loaded."""
    p = torch.nn.Parameter(torch.zeros(8, 8))
    opt = hf_demo.DeMo([p], exchange="all_reduce", compression_topk=4, compression_chunk=8)
    p.grad = torch.randn(8, 8)
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_demo.DeMo([p], exchange="all_reduce", compression_topk=4, compression_chunk=8).load_state_dict(
            opt.state_dict()
        )
    old = opt.state_dict()
    old["demo"]["format_version"] = 2
    fresh = hf_demo.DeMo([p], exchange="all_reduce", compression_topk=4, compression_chunk=8)
    with pytest.raises(hf_demo.DeMoStateError, match="format version 2, this hf_demo reads 3"):
        fresh.load_state_dict(old)
    partial = opt.state_dict()
    del partial["demo"]["unsynced"]
    with pytest.raises(hf_demo.DeMoStateError, match="without unsynced in 'demo': written by a pre-release"):
        fresh.load_state_dict(partial)
    assert fresh.steps == 0 and not fresh.state  # nothing was loaded


def _slow_fingerprint(params):
    """The fingerprint spelled out: every bit pattern times its weight, one 64-bit copy per parameter."""
    int_of = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    total = 0
    for p in params:
        bits = p.contiguous().view(int_of[p.element_size()]).reshape(-1).to(torch.int64)
        weights = torch.arange(bits.numel()) % 65521 + 1
        plain, weighted = int(bits.sum()), int((bits * weights).sum())
        total = (total * 1_000_003 + plain * 31 + weighted) & ((1 << 62) - 1)
    return total


def test_parameter_fingerprint_matches_its_slow_spelling():
    """Column sums give the same words as the weighted sum over every element: shorter than one period, an
    exact multiple, a remainder, every element size; a change of one bit or of the order changes the word."""
    from hf_demo.guards import fingerprint as _fingerprint

    torch.manual_seed(0)
    params = [
        torch.randn(7),
        torch.randn(65521),
        torch.randn(3, 65521),
        torch.randn(300, 700),
        torch.randn(513, 257).bfloat16(),
        torch.randn(1000).double(),
        torch.randint(-128, 127, (70000,), dtype=torch.int8),
        torch.randn(129, 1024)[:, ::2],  # not contiguous
        torch.empty(0),
    ]
    assert _fingerprint(params) == _slow_fingerprint(params)
    for p in params:
        assert _fingerprint([p]) == _slow_fingerprint([p])
    changed = [p.clone() for p in params]
    changed[3].view(torch.int32)[17, 5] ^= 1
    assert _fingerprint(changed) != _fingerprint(params)
    assert _fingerprint(params[::-1]) != _fingerprint(params)


def test_a_chunk_changed_during_training_is_refused_clearly():
    """A parameter group's compression_chunk edited between steps failed with a raw tensor-size error."""
    p = torch.nn.Parameter(torch.randn(16, 16))
    opt = hf_demo.DeMo([p], compression_topk=4, compression_chunk=8)
    p.grad = torch.randn(16, 16)
    opt.step()
    before, momentum = p.detach().clone(), opt.state[p]["momentum"].clone()
    opt.param_groups[0]["compression_chunk"] = 4
    with pytest.raises(hf_demo.DeMoStateError, match="compression_chunk was changed during training.*checkpoint"):
        opt.step()
    assert torch.equal(p, before) and torch.equal(opt.state[p]["momentum"], momentum) and opt.steps == 1


def test_a_state_loaded_over_other_weights_is_named_by_check_model():
    """The model file and an optimizer file from different checkpoints: check_model (DeMoTrainer runs it once
    the weights are loaded) names the run, the step and both fingerprints."""
    from hf_demo.optim import checkpointing

    model = tiny_mlp()
    opt = small_demo(model)
    loss_and_backward(model, 0, 0)
    opt.step()
    saved = opt.state_dict()
    assert saved["demo"]["run_id"] == opt.run_id and saved["demo"]["params_print"]
    same = small_demo(model)
    same.load_state_dict(saved)
    checkpointing.check_model(same)  # the weights it was saved with
    other_model = tiny_mlp(seed=1)
    other = small_demo(other_model)
    other.load_state_dict(saved)
    with pytest.raises(hf_demo.DeMoStateError, match=rf"run {opt.run_id}, optimizer step 1; parameter fingerprint"):
        checkpointing.check_model(other)


def test_a_clipped_gradient_spike_that_zeroes_every_gradient_is_named():
    """A spike whose square overflows makes the clipped norm infinite and clipping zeroes every gradient: DeMo then
    steps on its momentum alone, which stalled training without a word; it warns, naming the cause."""
    import warnings

    model = tiny_mlp()
    opt = hf_demo.DeMo(model.parameters(), lr=1e-3, compression_topk=4, compression_chunk=8)
    loss_and_backward(model, 0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        opt.step()  # an ordinary step: no warning
    loss_and_backward(model, 0, 1)
    next(model.parameters()).grad.view(-1)[0] = 1e30
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).isinf()
    with pytest.warns(UserWarning, match="every gradient of this rank was zero at optimizer step 1.*grad_norm inf"):
        opt.step()
