"""What the benchmarks share: the gloo-world launcher and the stdlib corpus, and how DeMo settings are written
on a command line.

The launcher and the corpus live in ``tests/`` (``dist_utils.py``, ``models.py``), where every CI run exercises
them; this module puts that folder on the import path, so a benchmark writes
``from common import run_ranks, stdlib_bytes``. :func:`parse_overrides` reads ``key=value,...`` DeMo keywords
(``convergence.py --demo-configs``, ``wan_worker.py --demo-settings``).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from dist_utils import RankError, expect_ok, free_port, run_ranks  # noqa: E402
from models import stdlib_bytes, stdlib_files  # noqa: E402

__all__ = ["RankError", "expect_ok", "free_port", "run_ranks", "stdlib_bytes", "stdlib_files", "parse_overrides"]

ALIASES = {  # short keys of the command lines
    "topk": "compression_topk",
    "chunk": "compression_chunk",
    "decay": "compression_decay",
    "format": "value_format",
}


def _value(text: str):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text.strip()


def parse_overrides(spec: str) -> dict:
    """``key=value,...`` -> DeMo keywords: short keys expanded (:data:`ALIASES`), values int, float, true/false
    or text (DeMo validates them)."""
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if "=" not in item:
            raise SystemExit(f"DeMo override {item!r} is not key=value")
        k, v = item.split("=", 1)
        out[ALIASES.get(k.strip(), k.strip())] = _value(v)
    return out
