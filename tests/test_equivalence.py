"""hf_demo.DeMo against the slow, plain reference written from the algorithm (1, 2 and 4 gloo ranks)."""
import pytest
import torch

import hf_demo
from dist_utils import expect_ok, run_ranks
from models import loss_and_backward, tiny_mlp
from reference_demo import ReferenceDeMo

SETTINGS = dict(lr=3e-3, decay=0.9, topk=6, chunk=8, weight_decay=0.01)


def _train_both(rank, world, sign_update):
    fast_model, ref_model = tiny_mlp(), tiny_mlp()
    fast = hf_demo.DeMo(fast_model.parameters(), lr=SETTINGS["lr"], compression_decay=SETTINGS["decay"],
                        compression_topk=SETTINGS["topk"], compression_chunk=SETTINGS["chunk"],
                        weight_decay=SETTINGS["weight_decay"], value_format="fp32", sign_update=sign_update)
    ref = ReferenceDeMo(ref_model.parameters(), sign_update=sign_update, **SETTINGS)
    for step in range(20):
        loss_and_backward(fast_model, rank, step)
        loss_and_backward(ref_model, rank, step)
        fast.step()
        ref.step()
    return [p.detach().clone() for p in fast_model.parameters()], [p.detach().clone() for p in ref_model.parameters()]


def _max_diff(fast, ref):
    return max((a - b).abs().max().item() for a, b in zip(fast, ref))


@pytest.mark.parametrize("sign_update", [True, False])
def test_matches_reference_single_process(sign_update):
    fast, ref = _train_both(0, 1, sign_update)
    assert _max_diff(fast, ref) <= 1e-5


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sign_update", [True, False])
def test_matches_reference_distributed(world, sign_update):
    results = expect_ok(run_ranks(_train_both, world, sign_update))
    for fast, ref in results:
        assert _max_diff(fast, ref) <= 1e-5
    # and the training really moved the parameters
    assert _max_diff(results[0][0], [p.detach() for p in tiny_mlp().parameters()]) > 1e-4  # ten times the tolerance
