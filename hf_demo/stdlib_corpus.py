"""An offline corpus that every Python install has: the standard library's own sources.

The recipes, the examples, the tests and the benchmarks all read it through these two functions.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test"}


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted, without site-packages and test suites (~740, 12 MB)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not SKIP & set(p.relative_to(root).parts))


def stdlib_bytes(limit: int | None = None) -> torch.Tensor:
    """Those files concatenated in order, each followed by a newline, as uint8 (the first ``limit`` bytes)."""
    data = bytearray()
    for f in stdlib_files():
        data += f.read_bytes() + b"\n"
        if limit is not None and len(data) >= limit:
            break
    return torch.frombuffer(data[:limit] if limit else data, dtype=torch.uint8)
