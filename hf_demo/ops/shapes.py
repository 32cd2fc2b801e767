"""A model's trainable parameter shapes, from a Hub-style ``config.json``, a shape list, or a count and a shape.

- ``from_config(path)``: the model transformers builds from the config (``AutoModelForCausalLM``, else
  ``AutoModel``), instantiated on the meta device (no memory, no weights), tied weights counted once;
- ``parse_shapes("4096x4096*32,4096")``: shapes, each ``AxB[xC...]`` with an optional ``*count``;
- ``from_count(1.2e9, (2048, 8192))``: as many matrices of that shape as the count holds, the rest a vector.
"""

from __future__ import annotations

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
    size = math.prod(layer_shape)
    whole, rest = divmod(int(params), size)
    return [tuple(layer_shape)] * whole + ([(rest,)] if rest else [])


def from_config(path: str | Path) -> list[Shape]:
    """The trainable parameter shapes of the model a ``config.json`` (or a folder holding one) describes."""
    from hf_demo.ops.optional import require

    transformers = require("transformers", "reading a model's config.json")
    import torch

    path = Path(path)
    folder = path if path.is_dir() else path.parent
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no config.json at {path}: give the file or the folder holding it")
    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal LM: the bare model of its family
            model = transformers.AutoModel.from_config(config)
    return [tuple(p.shape) for p in model.parameters() if p.requires_grad]


def count(shapes: list[Shape]) -> int:
    return sum(math.prod(s) for s in shapes)
