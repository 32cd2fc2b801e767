"""hf_demo.DeMo against the slow, plain reference written from the algorithm (1, 2 and 4 gloo ranks).

Two models: one whose shapes the chunk divides, one whose shapes it does not (blocks of a smaller divisor, and
zero-padded blocks where there is none).
"""

import pytest

from dist_utils import expect_ok
from hf_demo.compression import plan
from hf_demo.optim.reference import ReferenceDeMo
from models import REFERENCE_SETTINGS, awkward_mlp, demo_as_reference, loss_and_backward, tiny_mlp

SETTINGS = REFERENCE_SETTINGS
MODELS = {"divisible": tiny_mlp, "padded": awkward_mlp}


def _train_both(rank, world, rule, model="divisible", device="cpu", overlap=False, values="fp32"):
    """``values``: the fast optimizer's value_format (``fp32``: the reference's exact values, or ``2bit``)."""
    fast_model, ref_model = MODELS[model]().to(device), MODELS[model]()
    fast = demo_as_reference(fast_model.parameters(), overlap=overlap, update_rule=rule, value_format=values)
    ref_values = "exact" if values == "fp32" else values
    ref = ReferenceDeMo(ref_model.parameters(), rule=rule, delay=int(overlap), value_format=ref_values, **SETTINGS)
    for step in range(20):
        loss_and_backward(fast_model, rank, step)
        loss_and_backward(ref_model, rank, step)
        fast.step()
        ref.step()
    if overlap:
        fast.flush()
        ref.flush()
    return (
        [p.detach().to("cpu", copy=True) for p in fast_model.parameters()],
        [p.detach().clone() for p in ref_model.parameters()],
    )


def _max_diff(fast, ref):
    return max((a - b).abs().max().item() for a, b in zip(fast, ref))


def test_the_models_cover_padding():
    layouts = {
        name: [plan(tuple(p.shape), SETTINGS["chunk"], SETTINGS["topk"]) for p in make().parameters()]
        for name, make in MODELS.items()
    }
    assert not any(layout.padded for layout in layouts["divisible"])
    # (20, 13): 20 in blocks of 5, 13 padded to 16; (20,) and (5, 20): blocks of 5; (5,) is one block
    assert [(lay.b0, lay.b1, lay.padded) for lay in layouts["padded"]] == [
        (5, 8, True),
        (1, 5, False),
        (5, 5, False),
        (1, 5, False),
    ]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("rule", ["sign", "raw", "adam", "adamw"])
def test_matches_reference_single_process(rule, model, device):
    fast, ref = _train_both(0, 1, rule, model, device)  # hf_demo on the device, the reference on the CPU
    assert _max_diff(fast, ref) <= 1e-5


# padding is a per-rank matter: 2 ranks cover it; averaging over 4 ranks is the same code whatever the shapes
@pytest.mark.parametrize("world,model", [(2, "divisible"), (4, "divisible"), (2, "padded")])
@pytest.mark.parametrize("rule", ["sign", "raw", "adam", "adamw"])
def test_matches_reference_distributed(world, rule, model, gloo):
    results = expect_ok(gloo(_train_both, world, rule, model))
    for fast, ref in results:
        assert _max_diff(fast, ref) <= 1e-5
    # and the training really moved the parameters
    start = [p.detach() for p in MODELS[model]().parameters()]
    assert _max_diff(results[0][0], start) > 1e-4  # ten times the tolerance


@pytest.mark.parametrize("rule", ["sign", "adam"])
def test_overlap_matches_the_reference_applied_one_step_late(rule, gloo):
    """overlap=True is DeMo with every update (and its weight decay) applied one step late, nothing else."""
    results = expect_ok(gloo(_train_both, 2, rule, "padded", "cpu", True))
    for fast, ref in results:
        assert _max_diff(fast, ref) <= 1e-5
    # and it is not the plain algorithm: one step late changes where the gradients are taken
    plain = expect_ok(gloo(_train_both, 2, rule, "padded"))
    assert _max_diff(results[0][0], plain[0][0]) > 1e-4


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("rule", ["sign", "raw"])
def test_2bit_values_match_the_reference_single_process(rule, model):
    """value_format='2bit': the reference quantises each block in float64 with Python loops and keeps in its
    momentum what the quantiser lost (error feedback); hf_demo does the same."""
    fast, ref = _train_both(0, 1, rule, model, values="2bit")
    assert _max_diff(fast, ref) <= 1e-5
    exact, _ = _train_both(0, 1, rule, model)
    # and the values really were quantised: 2 bits move the parameters further from exact values than from the
    # reference (raw steps are small: lr times the momentum)
    assert _max_diff(fast, exact) > 10 * _max_diff(fast, ref) + 1e-7


def test_2bit_values_match_the_reference_distributed(gloo):
    results = expect_ok(gloo(_train_both, 2, "sign", "padded", "cpu", False, "2bit"))
    for fast, ref in results:
        assert _max_diff(fast, ref) <= 1e-5
    assert all(all(a.equal(b) for a, b in zip(results[0][0], r[0])) for r in results[1:])  # replicas identical
