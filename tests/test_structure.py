"""The package's shape: no import cycles, and one module (``hf_demo.topology.dtensor``) that looks inside DTensors."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_demo"
BOUNDARY = PACKAGE / "topology" / "dtensor.py"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """{module: the hf_demo modules it imports}, function-local imports included (a lazy import is a dependency
    still), and each imported module's parent packages below ``hf_demo`` (importing ``a.b.c`` runs ``a.b``'s
    ``__init__``). The root package, the public facade that imports the rest, is nobody's dependency here."""
    mods = _modules()

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {resolve(a.name) for a in node.names if a.name.startswith("hf_demo.")}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "hf_demo":
                found |= {f"hf_demo.{a.name}" for a in node.names if f"hf_demo.{a.name}" in mods}  # a module
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("hf_demo."):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in mods else resolve(node.module))
        for target in list(found):
            parts = target.split(".")
            found |= {".".join(parts[:i]) for i in range(2, len(parts))}
        graph[name] = {t for t in found if t and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_cycle_finder_finds_a_cycle_through_a_package_init():
    graph = {"p.a": {"q.b"}, "q": {"q.c"}, "q.b": set(), "q.c": {"p.a"}, "p": set()}
    graph["p.a"] |= {"q"}  # importing q.b runs q's __init__
    assert cycles(graph) == [["p.a", "q", "q.c"]]


def test_hf_demo_has_no_import_cycle():
    graph = import_graph()
    assert "hf_demo.topology.dtensor" in graph["hf_demo.optim.sharded_checkpoint"]
    assert cycles(graph) == []


# reading or building a DTensor by hand: its local shard, its layout, a new one from pieces
UNWRAPS = re.compile(
    r"\.to_local\(|from_local\(|\.placements\b|(?<!opt)(?<!self)(?<!distributed)\.device_mesh\b|torch\.distributed\.tensor\b"
)


def unwraps(source: str) -> list[str]:
    return [line.strip() for line in source.splitlines() if UNWRAPS.search(line.split("#")[0])]


@pytest.mark.parametrize(
    "line, found",
    [
        ("mine = value.to_local()", True),
        ("DTensor.from_local(v, p.device_mesh, p.placements)", True),
        ("from torch.distributed.tensor import Shard", True),
        ("mesh = opt.device_mesh", False),
        ("from torch.distributed.device_mesh import init_device_mesh", False),
        ("self.process_group, self.device_mesh = group, mesh", False),
        ("views = [local(p) for p in params]", False),
    ],
)
def test_the_unwrap_pattern_tells_dtensor_work_from_the_optimizers_mesh_setting(line, found):
    assert bool(unwraps(line)) == found


def test_only_the_dtensor_boundary_looks_inside_a_dtensor():
    """Every other module computes on local tensors and asks ``hf_demo.topology.dtensor`` for the rest."""
    found = {
        str(path.relative_to(ROOT)): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != BOUNDARY and (hits := unwraps(path.read_text()))
    }
    assert found == {}
    assert unwraps(BOUNDARY.read_text())  # the pattern still matches what the boundary does
