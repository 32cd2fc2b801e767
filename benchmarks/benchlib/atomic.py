"""Files the benchmarks write whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, write) -> None:
    """``write(tmp)`` to a temporary file of this process's own beside ``path``, then rename it to ``path``: a run
    killed while writing leaves the previous file whole, and two processes writing the same file at once (two runs
    tokenising one batch of the corpus) each put a whole file there, never each other's half."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)
