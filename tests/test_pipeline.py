"""The step's architecture as documented: the pipeline's parts in order, the registries a new part plugs into,
and no hook installed on other optimizers by importing hf_demo."""

import re
import subprocess
import sys
from pathlib import Path

import torch

import hf_demo
from hf_demo.compression import transforms
from hf_demo.exchange import exchanges
from hf_demo.optim import optimizer, signals, update_rules
from hf_demo.topology import TOPOLOGIES

DESIGN = (Path(__file__).parent.parent / "docs" / "DESIGN.md").read_text()


def test_the_design_page_lists_the_pipelines_parts_in_order():
    listed = re.search(r"```text\n(.*?)\n```", DESIGN, re.S).group(1)
    assert re.findall(r"[a-z]+", listed) == optimizer.PIPELINE.names()


def test_every_registry_the_design_page_names_holds_what_it_documents():
    for name, cls in transforms.TRANSFORMS.items():
        assert callable(cls.encode) and callable(cls.decode) and f"`{name}`" in DESIGN
    for name, cls in exchanges.EXCHANGES_BY_NAME.items():
        assert all(callable(getattr(cls, m)) for m in ("prepare", "start", "finish")) and f"`{name}`" in DESIGN
        assert hasattr(cls, "collectives") and "`collectives`" in DESIGN, name
    for name, cls in TOPOLOGIES.items():
        documented = ("build", "select", "identity", "mean_over_ranks", "agree_step", "agree", "agree_refusal")
        assert all(callable(getattr(cls, m)) and f"`{m}(" in DESIGN for m in documented), name
        assert f"`{name}`" in DESIGN
    for name, cls in signals.SIGNALS.items():
        assert all(callable(getattr(cls, m)) for m in ("select", "decay_and_scale", "entering", "update")), name
    for name, rule in update_rules.RULES.items():
        assert callable(rule.direction) and callable(rule.signal) and f"`{name}`" in DESIGN
    for part in optimizer.PIPELINE.parts:
        assert callable(part.run) and f"`{part.name}`" in DESIGN


def test_importing_hf_demo_hooks_no_other_optimizer():
    code = "import torch.optim.optimizer as o, hf_demo, hf_demo.trl; print(len(o._global_optimizer_pre_hooks))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0"


def test_a_failed_step_commits_nothing():
    """A step that raises after its collectives and checks (here: in the update rule) leaves every parameter,
    momentum and counter as it was: the writes are staged until the one commit."""
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = hf_demo.DeMo([p], lr=1e-2, compression_topk=4, compression_chunk=8, update_rule="adam")
    p.grad = torch.randn(8, 8)
    opt.step()
    before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}, opt.steps, opt.comm_stats.steps)
    opt.param_groups[0]["update_rule"] = "gone"  # the rule's lookup fails late in the step, before the commit
    p.grad = torch.randn(8, 8)
    try:
        opt.step()
    except ValueError:
        pass
    opt.param_groups[0]["update_rule"] = "adam"
    assert torch.equal(p.detach(), before[0]) and (opt.steps, opt.comm_stats.steps) == before[2:]
    assert all(torch.equal(opt.state[p][k], v) for k, v in before[1].items())
