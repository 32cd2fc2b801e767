"""The user docs name only things that exist: settings, modules, make targets, script flags and files.

Every check reads the real thing: ``DeMoSettings.names()`` for settings, ``importlib`` for ``hf_demo.*``
names, the Makefile's targets, the ``add_argument`` flags and dataclass fields of the scripts' sources (and
Trainer's own arguments for the recipes), ``Path.exists`` for files. It looks at README.md and docs/**/*.md:
inline code, fenced code blocks and link targets. No process is started.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import shlex
import textwrap
from functools import cache
from pathlib import Path

import pytest

from hf_demo.settings import DeMoSettings

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# the top-level entries of the repository a path in the docs may start with (not what .gitignore leaves out,
# such as outputs/: the docs name the files a clean clone has)
IGNORED = {line.strip("/") for line in (ROOT / ".gitignore").read_text().split() if "*" not in line}
TOP_LEVEL = tuple(sorted(p.name for p in ROOT.iterdir() if not p.name.startswith(".") and p.name not in IGNORED))
SOURCE_DIRS = ("hf_demo", "recipes", "benchmarks", "examples", "scripts", "tests")
# keyword arguments of hf_demo.DeMo and its factories besides the settings
OPTIMIZER_KWARGS = {"params", "lr", "weight_decay", "process_group", "device_mesh", "preset", "sign_update"}
OPTIMIZER_CALLS = {"DeMo", "create_optimizer", "optimizer_cls_and_kwargs"}

FENCE = re.compile(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
DEMO_FLAG = re.compile(r"(?<![\w./-])-{0,2}demo_([a-z0-9_]+)")
NOT_SETTINGS = {
    "ops",
    "compute",
    "compute_s",
    "lr",
    "args",
    "elastic",
}  # demo_ops and demo_elastic (DeMoTrainer's arguments for hf_demo.ops and hf_demo.elastic), the ops log's
# demo_compute_s, compare.py's --demo_lr/--demo_args
MODULE = re.compile(r"(?<![\w.])hf_demo(?:\.[A-Za-z_]\w*)+")
MAKE = re.compile(r"\bmake ([a-z][\w-]*)")
SCRIPT = re.compile(r"^((?:recipes|benchmarks|examples|scripts)/[\w/]+\.py)$")
KWARG = re.compile(r"^([a-z_][a-z0-9_]*)=(?!=)")
IDENT = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)+$")


# ------------------------------------------------------------------ the real things
def setting_names() -> set[str]:
    return set(DeMoSettings.names())


@cache
def source_words() -> frozenset[str]:
    """Every identifier written in the repository's Python sources: the names that exist somewhere."""
    words = set()
    for folder in SOURCE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            if path == Path(__file__).resolve():
                continue  # this file plants bad names on purpose
            words.update(re.findall(r"[A-Za-z_]\w*", path.read_text()))
    return frozenset(words)


@cache
def trainer_fields() -> frozenset[str]:
    """Fields of DeMoTrainingArguments (Trainer's own plus demo_*) and, where TRL is installed, SFTConfig's."""
    from hf_demo import DeMoTrainingArguments

    names = {f.name for f in dataclasses.fields(DeMoTrainingArguments)}
    try:
        from trl import SFTConfig

        names |= {f.name for f in dataclasses.fields(SFTConfig)}
    except ImportError:  # pragma: no cover - TRL is a dev dependency
        pass
    return frozenset(names)


@cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([A-Za-z][\w-]*):", text, re.M))


def declared_flags(source: str) -> set[str]:
    """``--flags`` of argparse calls, and dataclass fields (HfArgumentParser's flags), in ``source``."""
    flags = set()
    for call in re.finditer(r"add_argument\(((?:\s*\"[^\"]*\"\s*,?)+)", source):
        flags.update(f.lstrip("-").replace("-", "_") for f in re.findall(r"\"(--?[\w-]+)\"", call.group(1)))
    flags.update(re.findall(r"^\s+(\w+): [^=\n]+= field\(", source, re.M))
    return flags


@cache
def script_flags(script: str) -> frozenset[str]:
    """The flags ``script`` accepts: its own and its sibling modules' (recipes: Trainer's arguments too)."""
    path = ROOT / script
    flags = declared_flags(path.read_text())
    siblings = {p.stem: p for p in path.parent.glob("*.py")}
    siblings.update({p.name: p for p in path.parent.iterdir() if (p / "__init__.py").exists()})  # recipelib
    for name in re.findall(r"^(?:from|import) (\w+)", path.read_text(), re.M):
        sibling = siblings.get(name)
        if sibling is None or sibling == path:
            continue
        sources = sorted(sibling.glob("*.py")) if sibling.is_dir() else [sibling]
        for source in sources:
            flags |= declared_flags(source.read_text())
    if script.startswith("recipes/"):
        flags |= trainer_fields()
    return frozenset(flags | {"help"})


# ------------------------------------------------------------------ what a doc names
def code_of(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    """``([(language, body) of each fenced block], [each inline code span outside the blocks])``."""
    blocks = [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]
    prose = FENCE.sub("", text)
    return blocks, INLINE.findall(prose)


def commands(body: str) -> list[list[str]]:
    """The shell commands of a code block or span, continuation lines joined, comments dropped."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        try:
            out.append(shlex.split(line))
        except ValueError:
            out.append(line.split())
    return out


def flag_problems(words: list[str]) -> list[str]:
    """The flags after the first repository script of a command that the script does not take."""
    i = next((i for i, word in enumerate(words) if SCRIPT.match(word)), None)
    if i is None:
        return []
    script = words[i]
    if not (ROOT / script).is_file():
        return [f"script {script} does not exist"]
    problems = []
    for arg in words[i + 1 :]:
        if arg in ("--", "|", ";", "&&", ">"):
            break  # what follows goes to another program
        flag = arg[2:].split("=", 1)[0]
        if " " in arg:  # a quoted value (compare.py --demo_args "--demo_sync_every 4 ..."), not a flag
            continue
        if arg.startswith("--") and flag.replace("-", "_") not in script_flags(script):
            problems.append(f"{script} has no flag --{flag}")
    return problems


def optim_args_problems(words: list[str]) -> list[str]:
    problems = []
    for flag, value in zip(words, words[1:]):
        if flag == "--optim_args" and "=" in value:
            for entry in value.split(","):
                key = entry.split("=", 1)[0].strip()
                if key and key not in setting_names() | {"preset"}:
                    problems.append(f"--optim_args names no setting {key!r}")
    return problems


def python_problems(body: str) -> list[str]:
    """Keywords of DeMo's constructors must be settings; a python block must parse."""
    try:
        tree = ast.parse(textwrap.dedent(body))
    except SyntaxError as exc:
        return [f"python block does not parse: {exc.msg} (line {exc.lineno})"]
    problems = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        for kw in node.keywords:
            if kw.arg is None:
                continue
            if func in OPTIMIZER_CALLS and kw.arg not in setting_names() | OPTIMIZER_KWARGS:
                problems.append(f"{func}() has no setting {kw.arg!r}")
            elif kw.arg.startswith("demo_") and kw.arg[5:] not in setting_names() | {"preset", "ops", "elastic"}:
                problems.append(f"no setting demo_{kw.arg[5:]}")
    return problems


def module_problem(name: str) -> str | None:
    """None when ``name`` (``hf_demo.a.b``) imports, or is an attribute of what imports."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return f"{name} does not exist ({'.'.join(parts[:cut])} has no {attr})"
            obj = getattr(obj, attr)
        return None
    return f"{name} does not exist"


def path_problem(target: str, doc: Path) -> str | None:
    """None when a repository path (``tests/x.py::test_y``, ``recipes/x.py:func``, a link) exists."""
    target = target.split("#", 1)[0]
    if not target or re.search(r"[<>*{}$]|://|^mailto:", target):
        return None  # an anchor, a placeholder, a glob or a web address
    path, _, member = target.partition("::")
    if "::" not in target and re.match(r"^[\w/.-]+\.py:\w+$", target):
        path, member = target.rsplit(":", 1)
    base = ROOT if path.split("/", 1)[0] in TOP_LEVEL else doc.parent
    full = (base / path).resolve()
    if not full.exists():
        return f"{target}: no such file"
    if member and not re.search(
        rf"^\s*(?:async )?(?:def|class) {re.escape(member.split('[')[0])}\b", full.read_text(), re.M
    ):
        return f"{target}: {path} defines no {member}"
    return None


def looks_like_path(token: str) -> bool:
    head = token.split("/", 1)[0]
    return (
        " " not in token
        and head in TOP_LEVEL
        and ("/" in token or "." in token)
        and not re.match(r"^hf_demo\.\w", token)  # a module, checked as one
    )


def problems(text: str, doc: Path) -> list[str]:
    """Everything ``text`` (a Markdown file at ``doc``) names that does not exist."""
    found = []
    settings = setting_names()
    for name in DEMO_FLAG.findall(text):
        if name not in settings | {"preset"} | NOT_SETTINGS:
            found.append(f"no setting demo_{name}")
    for name in sorted(set(MODULE.findall(text))):
        problem = module_problem(name)
        if problem:
            found.append(problem)
    blocks, spans = code_of(text)
    shell = [body for lang, body in blocks if lang in ("bash", "sh", "shell", "")] + spans
    for body in shell:
        for words in commands(body):
            found += flag_problems(words) + optim_args_problems(words)
        for target in MAKE.findall(body):
            if target not in make_targets():
                found.append(f"make {target}: no such target")
    for lang, body in blocks:
        if lang == "python":
            found += python_problems(body)
    for span in spans:
        kwarg = KWARG.match(span)
        if kwarg and kwarg.group(1) not in settings | source_words() | trainer_fields():
            found.append(f"`{span}`: {kwarg.group(1)} is no setting or argument")
        first = span.split("_", 1)[0]
        if IDENT.match(span) and first in {s.split("_", 1)[0] for s in settings}:
            if span not in settings and span not in source_words():
                found.append(f"`{span}`: no such setting")
        if looks_like_path(span.split()[0] if span.split() else span):
            problem = path_problem(span.split()[0], doc)
            if problem:
                found.append(problem)
    for target in LINK.findall(FENCE.sub("", text)):
        problem = path_problem(target, doc)
        if problem:
            found.append(problem)
    return found


# ------------------------------------------------------------------ the tests
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_name_only_what_exists(doc):
    assert problems(doc.read_text(), doc) == []


PLANTED = """
Set `--demo_compression_topkk 8` or `compresion_topk=3`, see `hf_demo.optim.nowhere` and
[the guide](guides/no-such-guide.md), run `make nothing-here` and read `tests/test_optimizer.py::test_absent`.

```bash
python recipes/run_clm.py --output_dir out --no_such_flag 1 --optim_args "compression_topk=4,topkk=2"
```

```python
hf_demo.DeMo(params, lr=1e-3, topkk=3)
```
"""

GOOD = """
`--demo_compression_topk 8`, `value_format="sign"`, `hf_demo.trl.DeMoSFTTrainer`, `make test`,
[settings](reference/settings.md), `tests/test_optimizer.py::test_invalid_hyperparameters`.

```bash
python recipes/run_clm.py --output_dir out --max_steps 2 --lora_r 8 --optim_args "compression_topk=4"
```

```python
hf_demo.DeMo(params, lr=1e-3, compression_topk=16, preset="lean")
```
"""


def test_the_checker_finds_every_kind_of_planted_bad_name():
    found = problems(PLANTED, ROOT / "docs" / "index.md")
    expected = [
        "no setting demo_compression_topkk",
        "compresion_topk is no setting or argument",
        "hf_demo.optim.nowhere does not exist",
        "guides/no-such-guide.md: no such file",
        "make nothing-here: no such target",
        "defines no test_absent",
        "recipes/run_clm.py has no flag --no_such_flag",
        "--optim_args names no setting 'topkk'",
        "DeMo() has no setting 'topkk'",
    ]
    for what in expected:
        assert any(what in p for p in found), (what, found)
    assert len(found) == len(expected), found


def test_the_checker_passes_real_names():
    assert problems(GOOD, ROOT / "docs" / "index.md") == []
