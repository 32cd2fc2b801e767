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


# checkpoints written before this module moved pickled their classes as hf_demo.generated.<name>
sys.modules.setdefault("hf_demo.generated", sys.modules[__name__])

MADE_ON_IMPORT = {"DeMoSFTTrainer": "hf_demo.trl", "DeMoSFTConfig": "hf_demo.trl"}


def __getattr__(name: str):
    if name in MADE_ON_IMPORT:  # unpickling in a process that has not imported hf_demo.trl yet
        importlib.import_module(MADE_ON_IMPORT[name])
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (made by hf_demo.with_demo at run time)")
