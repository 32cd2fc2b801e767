"""Optional dependencies of the operator's tools: a clear ImportError naming the extra that brings them."""

from __future__ import annotations

import importlib

EXTRA = "ops"


def require(module: str, what: str):
    """``import module``, or an ImportError saying which feature needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{what} needs the Python package {module.split('.')[0]!r}, which the default install of hf-demo does "
            f"not bring: pip install 'hf-demo[{EXTRA}]' (or pip install {module.split('.')[0]})"
        ) from exc
