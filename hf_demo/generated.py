"""Where the classes made by :func:`hf_demo.with_demo` live, so pickle can find them by name.

Trainer pickles its arguments into every checkpoint (``training_args.bin``); a class made at run time
must be reachable as ``module.name`` for that. Loading such a file needs the class made again in the
loading process (``with_demo`` with the same pair), except for ``hf_demo.trl``'s, which load on demand.
"""

from __future__ import annotations

import importlib
import sys


def publish(cls: type) -> type:
    """Give ``cls`` (made at run time) a unique name in this module and return it."""
    module = sys.modules[__name__]
    name, n = cls.__name__, 2
    while getattr(module, name, cls) is not cls:
        name, n = f"{cls.__name__}_{n}", n + 1
    cls.__name__ = cls.__qualname__ = name
    cls.__module__ = __name__
    setattr(module, name, cls)
    return cls


def __getattr__(name: str):
    if name.startswith("DeMo") and "SFT" in name:  # made by hf_demo.trl on import
        importlib.import_module("hf_demo.trl")
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (made by hf_demo.with_demo at run time)")
