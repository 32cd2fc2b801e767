"""What the benchmarks share with the tests: the gloo-world launcher and the stdlib corpus.

They live in ``tests/`` (``dist_utils.py``, ``models.py``), where every CI run exercises them; this module only
puts that folder on the import path, so a benchmark writes ``from common import run_ranks, stdlib_bytes``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from dist_utils import RankError, expect_ok, free_port, run_ranks  # noqa: E402
from models import stdlib_bytes, stdlib_files  # noqa: E402

__all__ = ["RankError", "expect_ok", "free_port", "run_ranks", "stdlib_bytes", "stdlib_files"]
