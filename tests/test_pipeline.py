"""The step's architecture as documented: the step's phases in order, the registries a new part plugs into,
and no hook installed on other optimizers by importing hf_demo."""

import dataclasses
import inspect
import re
import subprocess
import sys
from pathlib import Path

import torch

import hf_demo
from hf_demo import compression
from hf_demo.exchange import transport as exchanges
from hf_demo.optim import phases, records, signals, update_rules, view
from hf_demo.topology import TOPOLOGIES
from hf_demo.wire import agreement

DESIGN = (Path(__file__).parent.parent / "docs" / "DESIGN.md").read_text()


def test_the_design_page_lists_the_steps_phases_in_order():
    listed = re.search(r"```text\n(.*?)\n```", DESIGN, re.S).group(1)
    assert re.findall(r"[a-z]+", listed) == list(phases.PHASES)


def test_every_registry_the_design_page_names_holds_what_it_documents():
    for name, cls in compression.TRANSFORMS.items():
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
    for name in phases.PHASES:
        assert callable(getattr(phases, name)) and f"`{name}`" in DESIGN


def test_an_exchange_is_built_once_per_spec_and_a_refused_one_every_time():
    """A steady step reuses the exchange its plan made (``build`` is cached per spec); a refusal is not cached."""
    import pytest

    layouts = [compression.plan((16, 16), 8, 4), compression.plan((33,), 8, 4)]
    spec = exchanges.ExchangeSpec(layouts, "fp32", "uint16", world=2)
    built = exchanges.build("all_gather", spec)
    assert exchanges.build("all_gather", exchanges.ExchangeSpec(list(layouts), "fp32", "uint16", world=2)) is built
    other = exchanges.build("all_gather", dataclasses.replace(spec, layouts=layouts[:1]))
    assert other is not built and other.payload_nbytes < built.payload_nbytes
    assert exchanges.build("all_gather", dataclasses.replace(spec, value_format="bf16")) is not built
    for _ in range(2):
        with pytest.raises(ValueError, match="averages over every rank"):
            exchanges.build("all_reduce", dataclasses.replace(spec, average="pickers"))


def test_a_step_transport_is_its_transport_bound_to_a_step():
    transport = exchanges.Transport.alone()
    stepping, traffic = transport.at(5), exchanges.Traffic()
    assert (stepping.step, stepping.world, stepping.rank, stepping.backend) == (5, 1, 0, None)
    assert stepping.traffic is not transport.at(5).traffic  # a new Traffic where none is given
    assert transport.at(6, traffic).traffic is traffic


def test_importing_hf_demo_hooks_no_other_optimizer():
    code = "import torch.optim.optimizer as o, hf_demo, hf_demo.trl; print(len(o._global_optimizer_pre_hooks))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0"


def test_importing_hf_demo_leaves_the_hugging_face_stack_to_first_use():
    """The optimizer alone needs torch only: transformers, accelerate and datasets come with the first use of the
    integration's names (``hf_demo.DeMoTrainer`` and the rest), in the same process."""
    code = (
        "import sys, hf_demo; "
        "print(sorted(m for m in ('transformers', 'accelerate', 'datasets') if m in sys.modules)); "
        "hf_demo.DeMoTrainingArguments; print('transformers' in sys.modules, hf_demo.with_demo.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "True hf_demo.hf.trainer"], out


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


def _reads(phase) -> list[str]:
    """The records a phase takes: its parameters after the step."""
    return list(inspect.signature(phase).parameters)[1:]


def test_every_phase_says_what_it_reads_and_what_it_makes():
    """A phase takes the step and the records it reads (each made by a phase before it, annotated with its type),
    and returns the record it makes: its signature is the whole of what it uses of the step. Every record is made
    by one phase, is frozen, and the design page names the phase that makes it."""
    by_type = {}  # record type -> the phase that makes it, in the order of the phases
    for name in phases.PHASES:
        phase = getattr(phases, name)
        for arg in _reads(phase):  # each made by a phase before this one
            assert phase.__annotations__[arg].removesuffix(" | None") in by_type, (name, arg)
        returned = phase.__annotations__["return"]
        if returned != "None":
            record = returned.removesuffix(" | None")
            assert record not in by_type, (name, record)  # every record made once
            by_type[record] = name
    records_made = {
        cls.__name__
        for cls in vars(records).values()
        if dataclasses.is_dataclass(cls) and cls.__module__ == records.__name__ and cls.__name__ != "Step"
    }
    assert sorted(by_type) == sorted(records_made)
    for record, maker in by_type.items():
        cls = getattr(records, record)
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
        assert re.search(rf"\| `[a-z]+` \| `{record}` \| `{maker}` \|", DESIGN), (record, maker)


def test_run_step_calls_every_phase_in_order_each_in_its_range(monkeypatch):
    """The ranges one steady step opens, in order: ``DeMo.step``, then each phase of :data:`PHASES` (``compress``:
    top-k and coding), ``DeMo.exchange`` opened just before ``agreement`` (it holds ``communicate`` too); a local
    step runs plan, topology, signal and commit only (on the CPU every range is a plain ``record_function``)."""
    opened = []
    real = torch.profiler.record_function
    monkeypatch.setattr(torch.profiler, "record_function", lambda name: (opened.append(name), real(name))[1])

    def ranges(**settings) -> list[str]:
        p = torch.nn.Parameter(torch.randn(8, 8))
        opt = hf_demo.DeMo([p], lr=1e-2, compression_topk=4, compression_chunk=8, **settings)
        p.grad = torch.randn(8, 8)
        opt.step()
        p.grad = torch.randn(8, 8)
        opened.clear()
        opt.step()
        return [name.removeprefix("DeMo.") for name in opened]

    steady = ranges()
    assert steady[0] == "step" and [n for n in steady[1:] if n != "exchange"] == list(phases.PHASES), steady
    assert steady.index("exchange") == steady.index("agreement") - 1
    assert ranges(sync_every=4) == ["step", *phases.LOCAL_STEP]


def test_a_step_on_cuda_opens_an_nvtx_range_with_each_range(monkeypatch):
    """On CUDA each range of the step is an NVTX range of the same name too (traced), pushed and popped in order."""
    nvtx = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: nvtx.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: nvtx.append(("pop", None)))
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = hf_demo.DeMo([p], lr=1e-2, compression_topk=4, compression_chunk=8)
    p.grad = torch.randn(8, 8)
    phases.run_step(opt.step_view(), opt.transport.at(opt.steps), cuda=True)  # (nothing committed)
    pushed = [name.removeprefix("DeMo.") for what, name in nvtx if what == "push"]
    assert pushed[0] == "step" and [n for n in pushed[1:] if n != "exchange"] == list(phases.PHASES), pushed
    assert [what for what, _ in nvtx].count("pop") == len(pushed) and nvtx[-1] == ("pop", None)


def test_phases_get_a_view_of_the_optimizer_and_not_the_optimizer():
    """What a phase is given holds no optimizer: the step's fields, and the view's, are settings, state and
    callables, and no phase names the optimizer."""
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = hf_demo.DeMo([p], lr=1e-2, compression_topk=4, compression_chunk=8)
    seen = opt.step_view()
    assert isinstance(seen, view.OptimizerView)
    fields = {f.name: getattr(seen, f.name) for f in dataclasses.fields(seen)}
    assert not any(isinstance(v, torch.optim.Optimizer) for v in fields.values())
    assert {f.name for f in dataclasses.fields(records.Step)} == {"view", "transport", "tx", "decided", "settings"}
    for name in phases.PHASES:
        assert not {"opt", "ctx", "optimizer"} & set(_reads(getattr(phases, name))), name


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
