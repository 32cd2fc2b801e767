"""State owned by the optimizer: no module of hf_demo but ``optim/optimizer.py`` writes an attribute of a ``DeMo``.

What changes the optimizer's state is a named transition of :class:`hf_demo.DeMo` (``loaded``, ``settled``,
``unsettle``, ``run_by``, ...), or a value that a ``DeMo`` method assigns. Two checks:

* an AST scan of every module of hf_demo: an assignment, augmented assignment, ``setattr``, ``delattr`` or
  ``__dict__``/``vars()`` write whose target is a DeMo (or an attribute of one: ``opt.policy.tier = ...``) fails;
* at run time, ``DeMo.__setattr__`` records the nearest hf_demo module on the stack of every write while 1- and
  2-rank runs step, save, load, confirm and flush: it must be ``optim/optimizer.py`` (torch's ``Optimizer`` base
  class, which DeMo's own methods call, is not an hf_demo module). After its constructor, DeMo changes what it
  keeps only by replacing its one frozen record (``run_state``, :class:`hf_demo.optim.state.RunState`) whole: each
  replacement is recorded with the fields it changed (``run_state.unsettled``).
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import hf_demo
from hf_demo.optim.optimizer import DeMo

PACKAGE = Path(hf_demo.__file__).parent
TORCH = Path(torch.__file__).parent
OWNER = PACKAGE / "optim" / "optimizer.py"

# No module is allowed: the elastic wrapper changes DeMo through ``DeMo.reset_peers()``.
ALLOWED: set[str] = set()

# What a DeMo is called in hf_demo: a local name, an attribute of ``self``, or what ``unwrap_optimizer`` returns.
NAMES = {"opt", "optimizer", "demo", "demo_opt"}
SELF_ATTRIBUTES = {"opt", "_opt", "optimizer", "_optimizer", "demo", "_demo"}
UNWRAPS = {"unwrap_optimizer"}


def _is_demo(node: ast.AST) -> bool:
    """Whether ``node`` names a DeMo (``opt``, ``self._opt``, ``unwrap_optimizer(...)``)."""
    if isinstance(node, ast.Name):
        return node.id in NAMES
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr in SELF_ATTRIBUTES
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        return name in UNWRAPS
    return False


def _rooted_in_demo(node: ast.AST) -> bool:
    """Whether ``node`` is a DeMo or an attribute chain starting at one (``opt.counters``, ``opt.policy``)."""
    while True:
        if _is_demo(node):
            return True
        if not isinstance(node, ast.Attribute):
            return False
        node = node.value


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    elif isinstance(node, ast.Delete):
        found = list(node.targets)
    else:
        return []
    flat = []
    while found:
        t = found.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            found.extend(t.elts)
        else:
            flat.append(t.value if isinstance(t, ast.Starred) else t)
    return flat


def _writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, source) of every write of a DeMo's attribute in ``tree``."""
    found = []
    for node in ast.walk(tree):
        for t in _targets(node):
            if isinstance(t, ast.Attribute) and _rooted_in_demo(t.value):
                found.append((node.lineno, ast.unparse(t)))
            if isinstance(t, ast.Subscript) and _is_dict_of_demo(t.value):  # opt.__dict__["x"] = ...
                found.append((node.lineno, ast.unparse(t)))
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else None
            if name in {"setattr", "delattr"} and node.args and _rooted_in_demo(node.args[0]):
                found.append((node.lineno, ast.unparse(node)))
            if isinstance(func, ast.Attribute) and func.attr in {"update", "__setitem__", "setdefault", "pop"}:
                if _is_dict_of_demo(func.value):  # opt.__dict__.update(...), vars(opt).update(...)
                    found.append((node.lineno, ast.unparse(node)))
            if isinstance(func, ast.Attribute) and func.attr in {"__setattr__", "__delattr__"}:
                if node.args and _rooted_in_demo(node.args[0]) or _rooted_in_demo(func.value):
                    found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def _is_dict_of_demo(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return _rooted_in_demo(node.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars" and node.args:
        return _rooted_in_demo(node.args[0])
    return False


def outside_writers() -> dict[str, list[tuple[int, str]]]:
    """{module path: its writes of a DeMo's attributes} for every module of hf_demo but ``optim/optimizer.py``."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == OWNER:
            continue
        writes = _writes(ast.parse(path.read_text(), str(path)))
        if writes:
            found[path.relative_to(PACKAGE).as_posix()] = writes
    return found


def test_no_module_but_the_optimizer_writes_an_attribute_of_demo():
    found = outside_writers()
    assert set(found) - ALLOWED == set(), {k: v for k, v in found.items() if k not in ALLOWED}


def test_the_scan_finds_each_kind_of_write():
    """The scan itself: each form of a write is found, and a read or a write of something else is not."""
    source = """
opt.x = 1
opt.counters.unsynced = False
a, opt.y = 1, 2
optimizer.z += 1
self._opt.pending = None
unwrap_optimizer(self.optimizer).context = "trainer"
setattr(opt, "w", 1)
opt.__dict__["v"] = 1
vars(demo).update(u=1)
del opt.t
"""
    assert [line for line, _ in _writes(ast.parse(source))] == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    clean = "x = opt.x\nopts.reduceOp = 1\nself.optimizer_state = 1\nopt.state[p]['m'] = 1\nopt.step()\n"
    assert _writes(ast.parse(clean)) == []


# ---------------------------------------------------------------------------------------------- at run time
def _writer() -> tuple[str, str]:
    """The nearest module of hf_demo on the stack of the write (torch's and Python's own frames skipped), and the
    function there that writes."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if PACKAGE in path.parents:
            return path.relative_to(PACKAGE).as_posix(), frame.f_code.co_name
        frame = frame.f_back
    return "<outside hf_demo>", ""


def _recorder(seen: dict[str, set[str]]):
    """A ``DeMo.__setattr__`` that records each write in ``seen``: {writer: names}. A replacement of the record
    adds each field it changed (``run_state.<field>``); a write after the constructor of anything but the record
    adds ``"<after construction> <name>"`` to its writer's names."""
    original = torch.optim.Optimizer.__setattr__

    def record(self, name, value):
        writer, function = _writer()
        names = seen.setdefault(writer, set())
        names.add(name)
        old = vars(self).get("run_state")
        if name == "run_state" and old is not None:
            assert dataclasses.is_dataclass(value) and type(value).__dataclass_params__.frozen, value
            names.update(
                f"run_state.{f.name}"
                for f in dataclasses.fields(value)
                if getattr(old, f.name) is not getattr(value, f.name)
            )
        elif function != "__init__" and TORCH not in Path(sys._getframe(1).f_code.co_filename).parents:
            names.add(f"<after construction> {name}")  # (torch's own bookkeeping, __setstate__'s, is not DeMo's)
        original(self, name, value)

    return record


@pytest.fixture
def writers(monkeypatch):
    seen: dict[str, set[str]] = {}
    monkeypatch.setattr(DeMo, "__setattr__", _recorder(seen), raising=False)
    return seen


def _run(tmp_path, **settings):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = DeMo(model.parameters(), lr=1e-2, compression_topk=4, compression_chunk=8, **settings)
    for _ in range(3):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        staged = opt.prepare_step()
        staged.discard()
        opt.zero_grad()
    opt.confirm()
    opt.flush()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    again = DeMo(model.parameters(), lr=1e-2, compression_topk=4, compression_chunk=8, **settings)
    again.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=False))
    model(torch.randn(4, 8)).square().mean().backward()
    again.step()
    again.flush()


@pytest.mark.parametrize("settings", [{}, {"sync_every": 2}, {"comm_budget": 0.2}, {"overlap": True}])
def test_only_the_optimizer_writes_its_attributes_while_one_rank_runs(tmp_path, writers, settings):
    _run(tmp_path, **settings)
    assert "optim/optimizer.py" in writers
    assert set(writers) == {"optim/optimizer.py"}, writers
    assert not [n for n in writers["optim/optimizer.py"] if n.startswith("<after")], writers  # only the record
    assert {"run_state.counters", "run_state.policy"} <= writers["optim/optimizer.py"], writers  # by the commit


def test_the_record_is_frozen_and_a_write_elsewhere_is_seen(writers):
    """The runtime check itself: a field of the record cannot be assigned, and a module of hf_demo other than the
    optimizer that replaced the record (as ``optim/settle.py`` would) is recorded as a writer."""
    opt = DeMo([torch.nn.Parameter(torch.zeros(4, 4))])
    with pytest.raises(dataclasses.FrozenInstanceError):
        opt.run_state.pending = None
    namespace = {"opt": opt, "dataclasses": dataclasses}
    exec(
        compile("opt.run_state = dataclasses.replace(opt.run_state)", str(PACKAGE / "optim" / "settle.py"), "exec"),
        namespace,
    )
    assert "optim/settle.py" in writers, writers


def _recorded() -> dict[str, set[str]]:
    """In a forked rank: record every write of a DeMo's attribute from now on (the process ends with the run)."""
    seen: dict[str, set[str]] = {}
    DeMo.__setattr__ = _recorder(seen)
    return seen


def _two_ranks(rank, world, path):
    """A steady step refused by rank 1 (rank 0 undoes it, both raise, the retry commits: settle's transitions),
    a save and a load, a local phase ended by flush() (``end_local_phase="average"``)."""
    from test_settle import _refused_at_the_next_step

    seen = _recorded()
    _refused_at_the_next_step(rank, world, {})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    kw = dict(lr=1e-2, compression_topk=4, compression_chunk=8, sync_every=2)
    opt = DeMo(model.parameters(), **kw)
    for step in range(3):
        torch.manual_seed(rank * 10 + step)
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.save(opt.state_dict(), f"{path}/opt{rank}.pt")
    again = DeMo(model.parameters(), **kw)
    again.load_state_dict(torch.load(f"{path}/opt{rank}.pt", weights_only=False))
    again.flush()
    return {k: sorted(v) for k, v in seen.items()}


@pytest.mark.ranks
def test_only_the_optimizer_writes_its_attributes_while_two_ranks_run(tmp_path):
    from dist_utils import expect_ok, run_ranks

    for seen in expect_ok(run_ranks(_two_ranks, 2, str(tmp_path), timeout=180)):
        assert "run_state.unsettled" in seen.get("optim/optimizer.py", ()), seen  # the refused step kept, settled
        assert set(seen) == {"optim/optimizer.py"}, seen
        assert not [n for n in seen["optim/optimizer.py"] if n.startswith("<after")], seen


# ---------------------------------------------------------------------------------------------- device_mesh
class _Mesh:
    """Stands for Accelerate's (replicate, shard) mesh: DeMo keeps it at construction and reads it at its first step."""

    ndim = 2


@pytest.mark.parametrize("given", [False, True], ids=["optim_demo", "optimizer_cls_and_kwargs"])
def test_the_trainer_gives_demo_the_hsdp_mesh_when_it_builds_it(tmp_path, monkeypatch, given):
    """Under HSDP (the model sharded by the Trainer on a 2-D mesh) DeMo is built with ``device_mesh``: the Trainer
    writes nothing into it after (``--optim demo``, or a DeMo class given to the Trainer), and puts its own
    ``optimizer_cls_and_kwargs`` back."""
    built = []
    monkeypatch.setattr(DeMo, "__init__", _recording(DeMo.__init__, built))
    chosen = (DeMo, {"lr": 1e-3, "compression_topk": 4}) if given else None
    optim = {} if given else {"optim": "demo"}
    args = hf_demo.DeMoTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **optim)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    trainer = hf_demo.DeMoTrainer(model=model, args=args, optimizer_cls_and_kwargs=chosen)
    trainer._demo_mesh = mesh = _Mesh()
    opt = hf_demo.hf.data_parallel.unwrap_optimizer(trainer.create_optimizer())
    assert built == [mesh] and opt.device_mesh is mesh
    assert trainer.optimizer_cls_and_kwargs is chosen


def test_the_trainer_gives_no_mesh_without_hsdp(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(DeMo, "__init__", _recording(DeMo.__init__, built))
    args = hf_demo.DeMoTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", optim="demo")
    trainer = hf_demo.DeMoTrainer(model=torch.nn.Sequential(torch.nn.Linear(8, 8)), args=args)
    trainer._demo_mesh = type("FSDP", (), {"ndim": 1})()  # pure FSDP: nothing to exchange across replicas
    trainer.create_optimizer()
    assert built == [None]


def _recording(init, built: list):
    def recorded(self, *args, device_mesh=None, **kwargs):
        built.append(device_mesh)
        init(self, *args, device_mesh=device_mesh, **kwargs)

    return recorded
