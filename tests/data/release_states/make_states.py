"""Run with the release before the staged step (commit eff6f7a, from the repository root): states saved mid-run
and what 3 more steps give, for tests/test_release_states.py."""

import copy
import sys

import torch

sys.path.insert(0, "tests")
import hf_demo
from models import loss_and_backward, tiny_mlp

MODES = {
    "default": {},
    "adam_fp32": {"update_rule": "adam", "value_format": "fp32"},
    "all_reduce": {"exchange": "all_reduce"},
    "overlap_in_flight": {"overlap": True},
    "sync_every_mid_phase": {"sync_every": 4},
    "budget_tier": {"comm_budget": 0.2, "policy_sync_every": 8},
}
out = sys.argv[1]
for name, kw in MODES.items():
    kw = {"lr": 3e-3, "compression_topk": 4, "compression_chunk": 8, **kw}
    model = tiny_mlp()
    opt = hf_demo.DeMo(model.parameters(), **kw)
    for step in range(6):
        loss_and_backward(model, 0, step)
        opt.step()
    if name == "budget_tier":
        opt.policy.tier = 2
    saved = copy.deepcopy({"kw": kw, "model": model.state_dict(), "opt": opt.state_dict()})
    for step in range(6, 9):
        loss_and_backward(model, 0, step)
        opt.step()
    opt.flush()
    saved["after"] = [p.detach().clone() for p in model.parameters()]
    torch.save(saved, f"{out}/{name}.pt")
    print(name, "ok")
