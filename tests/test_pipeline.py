"""The step's architecture as documented: the pipeline's parts in order, the registries a new part plugs into,
and no hook installed on other optimizers by importing hf_demo."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_demo
from hf_demo.compression import transforms
from hf_demo.exchange import exchanges
from hf_demo.optim import optimizer, pipeline, records, signals, update_rules, view
from hf_demo.topology import TOPOLOGIES
from hf_demo.wire import agreement

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
        documented += ("agree_figures",)
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


def test_every_part_says_what_it_reads_and_what_it_makes():
    """A part's ``run`` takes the step and, by name, the records it reads (each made by a part before it), and
    returns the record it makes: its signature is the whole of what it uses of the step."""
    made = []
    for part in optimizer.PIPELINE.parts:
        names = pipeline.reads(part)
        assert all(name in made for name in names), (part.name, names, made)
        returned = part.run.__annotations__["return"]
        if part.makes is None:
            assert returned == "None", part.name
        else:
            record, maker = records.MADE_BY[part.makes]
            assert maker == part.name and record.__name__ in returned, (part.name, returned)
            made.append(part.makes)
        for name in names:  # each record it reads, annotated with its type
            assert records.MADE_BY[name][0].__name__ in part.run.__annotations__[name], (part.name, name)
    assert sorted(made) == sorted(records.MADE_BY)  # every record made, once
    for name, (record, maker) in records.MADE_BY.items():
        assert f"| `{name}` | `{record.__name__}` | `{maker}` |" in DESIGN
        assert dataclasses.is_dataclass(record) and record.__dataclass_params__.frozen


def test_a_part_that_reads_a_record_no_part_before_it_makes_is_refused():
    class Early:
        name, makes = "early", None

        def run(self, step, verdict): ...

    with pytest.raises(ValueError, match="'early' reads \\['verdict'\\]"):
        pipeline.Pipeline([Early()])


def test_parts_get_a_view_of_the_optimizer_and_not_the_optimizer():
    """What a part is given holds no optimizer: the step's fields, and the view's, are settings, state and
    callables, and no part's ``run`` names the optimizer."""
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = hf_demo.DeMo([p], lr=1e-2, compression_topk=4, compression_chunk=8)
    seen = opt.step_view()
    assert isinstance(seen, view.OptimizerView)
    fields = {f.name: getattr(seen, f.name) for f in dataclasses.fields(seen)}
    assert not any(isinstance(v, torch.optim.Optimizer) for v in fields.values())
    assert {f.name for f in dataclasses.fields(records.Step)} == {"view", "transport", "tx", "decided"}
    for part in optimizer.PIPELINE.parts:
        assert not {"opt", "ctx", "optimizer"} & set(pipeline.reads(part)), part.name


def test_the_vote_words_are_packed_and_read_by_one_pair():
    rows = torch.cat([agreement.pack_words([3, -1 << 40]), agreement.pack_words([0, 7])])
    assert rows.dtype == torch.uint8 and rows.numel() == 32
    assert agreement.unpack_words(rows, 2) == [[3, -1 << 40], [0, 7]]
    assert agreement.unpack_words(rows.reshape(4, 8), 1) == [[3], [-1 << 40], [0], [7]]
    packed = [
        path
        for path in (Path(__file__).parent.parent / "hf_demo").rglob("*.py")
        if "view(torch.int64)" in path.read_text() or "torch.int64).view(torch.uint8)" in path.read_text()
    ]
    assert [path.name for path in packed] == ["agreement.py"]
