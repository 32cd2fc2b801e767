"""Devices: DeMo makes every tensor on the parameters' device (or, for host work, on the CPU by name).

Without a GPU the default-device tests catch the mistakes a GPU would: every step runs with the default device
set to ``meta`` while the parameters are on the CPU, so a tensor created without ``device=`` lands on ``meta``
(recorded, and the step breaks on it). With a GPU, the ``device`` fixture adds the CUDA runs (``-m cuda``).
"""

import io
import os
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import hf_demo
from dist_utils import expect_ok
from hf_demo import compression as F
from hf_demo.compression import plan
from hf_demo.exchange.transport import wire_device
from hf_demo.wire import codec
from models import awkward_mlp, loss_and_backward

MODES = {
    "default": dict(),
    "fp32-raw": dict(value_format="fp32", update_rule="raw"),
    "sign": dict(value_format="sign"),
    "2bit": dict(value_format="2bit"),
    "all_reduce": dict(exchange="all_reduce"),
    "overlap": dict(overlap=True),
    "sync_every-adamw": dict(sync_every=2, inner_rule="adamw"),
    "bf16-stochastic": dict(param_rounding="stochastic"),
}


class MetaTensors(TorchFunctionMode):
    """Records every torch call that returns a tensor on ``meta`` (where the caller named no device)."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                where = traceback.extract_stack(limit=3)[0]
                self.made.append(f"{getattr(func, '__name__', func)} at {where.filename}:{where.lineno}")
        return out


def _model(mode):
    model = awkward_mlp()
    return model.to(torch.bfloat16) if mode == "bf16-stochastic" else model


def _grads(model, rank, step):
    if model[0].weight.dtype == torch.float32:
        loss_and_backward(model, rank, step)
        return
    g = torch.Generator().manual_seed(100 * rank + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _run(mode, rank=0, default_device=None, steps=6):
    """Steps (one with a NaN gradient), a state_dict round trip and a flush, the default device set to
    ``default_device`` around every optimizer call: (parameters and state, what landed on the default device)."""
    model = _model(mode)
    opt = hf_demo.DeMo(model.parameters(), lr=1e-2, compression_topk=6, compression_chunk=8, **MODES[mode])
    record = MetaTensors()
    for step in range(steps):
        _grads(model, rank, step)
        if step == 3:
            next(model.parameters()).grad[0] = float("nan")  # a skipped step on every rank
        with torch.device(default_device or "cpu"), record:
            opt.step()
            if step == 4:
                saved = opt.state_dict()
                buf = io.BytesIO()
                torch.save(saved, buf)
                opt.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    with torch.device(default_device or "cpu"), record:
        opt.flush()
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return [p.detach().clone() for p in model.parameters()] + state, record.made


@pytest.mark.parametrize("mode", list(MODES))
def test_no_tensor_lands_on_the_default_device(mode, monkeypatch):
    monkeypatch.setenv("HF_DEMO_SECRET", "device-test")  # HMAC: every payload is copied to the host
    plain, _ = _run(mode)
    under_meta, made = _run(mode, default_device="meta")
    assert made == [], f"tensors created without device= (they landed on the default device): {made}"
    assert all(a.dtype == b.dtype and a.device == b.device and torch.equal(a, b) for a, b in zip(plain, under_meta))
    assert all(t.device.type == "cpu" for t in under_meta)


def _two_ranks(rank, world, mode):
    """A 2-rank gloo run: headers from the other rank, fingerprints, a resync, the exchanges' collectives."""
    os.environ["HF_DEMO_SECRET"] = "device-test"
    model = _model(mode)
    opt = hf_demo.DeMo(
        model.parameters(), lr=1e-2, compression_topk=6, compression_chunk=8, check_every=2, full_sync_every=3,
        **MODES[mode],
    )  # fmt: skip
    _grads(model, rank, 0)
    opt.step()  # the process groups are made outside: torch's own new_group is not under test
    record = MetaTensors()
    for step in range(1, 5):
        _grads(model, rank, step)
        with torch.device("meta"), record:
            opt.step()
    with torch.device("meta"), record:
        opt.flush()
    return record.made, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["default", "all_reduce", "overlap"])
def test_no_tensor_lands_on_the_default_device_two_ranks(mode, gloo):
    (made0, params0), (made1, params1) = expect_ok(gloo(_two_ranks, 2, mode))
    assert made0 == made1 == []
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))


def test_wire_device_puts_each_backend_where_it_works():
    cpu, cuda1 = torch.device("cpu"), torch.device("cuda", 1)
    assert wire_device("gloo", cpu) == cpu and wire_device("gloo", cuda1) == cpu  # gloo: through the host
    assert wire_device("nccl", cuda1) == cuda1  # NCCL: the tensor's own GPU
    assert wire_device("cpu:gloo,cuda:nccl", cuda1) == cuda1 and wire_device("cpu:gloo,cuda:nccl", cpu) == cpu
    assert wire_device("mpi", cuda1) == cuda1 and wire_device(None, cpu) == cpu  # others: as given
    if torch.cuda.is_available():
        assert wire_device("nccl", cpu) == torch.device("cuda", torch.cuda.current_device())


def test_densify_sums_duplicates_in_rank_order(device):
    """Every position picked by many ranks: the sum is the rank-order sum, bitwise, on every device, every time
    (one scatter_add_ would use atomics on CUDA and sum in a varying order)."""
    layout = plan((16, 16), 16, 8)  # one block of 256, k=8
    world = 64
    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(12, generator=g)[: layout.k] for _ in range(world)])[:, None, :]  # many repeats
    values = torch.randn(world, 1, layout.k, generator=g) * torch.logspace(-6, 6, world)[:, None, None]
    expected = torch.zeros(layout.bsize)
    for r in range(world):  # Python's order: rank after rank
        for j in range(layout.k):
            expected[idx[r, 0, j]] += values[r, 0, j]
    dense = [F.densify(*F.mean_weights(idx.to(device), values.to(device), layout), layout) for _ in range(5)]
    mean_idx, mean_values = F.mean_weights(idx, values, layout)
    cpu = F.densify(mean_idx, mean_values, layout)
    assert all(torch.equal(d.cpu(), cpu) for d in dense)
    plain = torch.zeros(1, layout.bsize).scatter_add_(1, mean_idx, mean_values)  # the CPU's one-call sum
    assert torch.equal(cpu, plain)
    counts = torch.zeros(layout.bsize).scatter_add_(0, idx.reshape(-1), torch.ones(world * layout.k))
    torch.testing.assert_close(cpu[0] * counts.clamp(min=1), expected, rtol=1e-5, atol=1e-3)


def test_rounding_noise_on_the_cpu_is_the_optimizers_generator():
    """CPU parameters get the noise they always did: the optimizer's CPU generator, drawn directly."""
    x = torch.randn(300, 7)
    noise = torch.randint(0, 1 << 16, x.shape, generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    expected = ((x.view(torch.int32) + noise) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert torch.equal(F.stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(5)), expected)


def test_rounding_noise_is_made_on_the_device_the_same_from_the_same_seed(device):
    x = torch.randn(1000, device=device)
    a = F.stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(9))
    b = F.stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(9))
    assert a.device == device and torch.equal(a, b)  # every rank seeds the same: the same bits
    assert F.generator_on(device, torch.Generator()).device.type == device.type


def test_step_on_the_device_matches_the_cpu(device):
    """The same 6 steps with the parameters on the device and on the CPU (fp32 values, the raw rule: no sign to
    flip on a rounding difference): bitwise on the CPU, within fp32 rounding on CUDA."""

    def train(dev):
        model = awkward_mlp().to(dev)
        opt = hf_demo.DeMo(
            model.parameters(), lr=1e-2, compression_topk=6, compression_chunk=8, value_format="fp32", update_rule="raw"
        )
        for step in range(6):
            loss_and_backward(model, 0, step)
            opt.step()
        assert all(s["momentum"].device == model[0].weight.device for s in opt.state.values())
        return [p.detach().cpu() for p in model.parameters()]

    on_device, on_cpu = train(device), train("cpu")
    for a, b in zip(on_device, on_cpu):
        if device.type == "cpu":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_adam_counter_stays_an_int64_host_counter_through_a_resume_into_bf16():
    """torch's load_state_dict casts state to the parameter's dtype: a bf16 rule_step would stop at 256."""
    p = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16))
    opt = hf_demo.DeMo([p], lr=1e-3, update_rule="adam")
    p.grad = torch.randn_like(p)
    opt.step()
    resumed = hf_demo.DeMo([p], lr=1e-3, update_rule="adam")
    resumed.load_state_dict(opt.state_dict())
    step = resumed.state[p]["rule_step"]
    assert step.dtype == torch.int64 and step.device.type == "cpu" and int(step) == 1
    assert resumed.state[p]["exp_avg_sq"].dtype == torch.float32


def test_an_exchange_in_flight_resumes_onto_the_parameters_device(device):
    """overlap=True saves the received rows of the exchange in flight; loaded with map_location="cpu" (as
    DeMoTrainer loads), they go back to the parameters' device and the late update applies there."""

    def make(model):
        return hf_demo.DeMo(model.parameters(), lr=1e-2, compression_topk=4, compression_chunk=8, overlap=True)

    model = awkward_mlp().to(device)
    opt = make(model)
    for step in range(3):
        loss_and_backward(model, 0, step)
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    opt.flush()
    straight = [p.detach().cpu() for p in model.parameters()]

    saved = torch.load(io.BytesIO(buf.getvalue()), map_location="cpu", weights_only=True)
    model2 = awkward_mlp(seed=5).to(device)
    model2.load_state_dict(saved["model"])
    opt2 = make(model2)
    opt2.load_state_dict(saved["opt"])
    assert opt2.pending.in_flight.data.device == device
    opt2.flush()
    assert all(torch.equal(a, p.detach().cpu()) for a, p in zip(straight, model2.parameters()))


def test_header_bytes_do_not_depend_on_the_default_device():
    header = codec.Header(step=3, layout_checksum=1, settings_checksum=2, flags=0, world_size=2, payload_bytes=8)
    with torch.device("meta"):
        raw = header.to_bytes()
    assert raw.device.type == "cpu" and codec.Header.from_bytes(raw) == header
