"""Where the classes made by :func:`hf_demo.with_demo` live, and how pickle finds them in a fresh process.

Trainer pickles its arguments into every checkpoint (``training_args.bin``). A class made at run time is named
``hf_demo.hf.runtime_classes.<name>``, and pickled as *how to make it again* (its kind and the module and name of
the class it was made from, :func:`remake`): a process that never called ``with_demo`` unpickles it, the class
made again on the way. The metaclass :class:`Remade` carries this (``copyreg``); a user's subclass of such a class
pickles by its own name, as any class.
"""

from __future__ import annotations

import copyreg
import importlib
import sys


class Remade(type):
    """The metaclass of the classes ``with_demo`` makes: pickled as :func:`remake` of what they were made from."""


class Made(metaclass=Remade):
    """A base of the classes ``with_demo`` makes; it adds nothing but its metaclass."""

    __slots__ = ()


def publish(cls: type, kind: str, base: type) -> type:
    """Give ``cls`` (made at run time from ``base``; ``kind`` is "trainer" or "config") a unique name in this
    module, record what it was made from, and return it."""
    module = sys.modules[__name__]
    name, n = cls.__name__, 2
    while getattr(module, name, cls) is not cls:
        name, n = f"{cls.__name__}_{n}", n + 1
    cls.__name__ = cls.__qualname__ = name
    cls.__module__ = __name__
    cls._hf_demo_made = (kind, base.__module__, base.__qualname__)
    setattr(module, name, cls)
    return cls


MAKERS: dict = {}  # kind ("trainer", "config"): the function that makes such a class of a base; hf_demo.hf.trainer
# fills it when imported (remake imports it in a fresh process that has not)


def remake(kind: str, module: str, qualname: str) -> type:
    """The class ``with_demo`` makes of ``module.qualname`` (the same one, made on first use in this process)."""
    if kind not in MAKERS:
        importlib.import_module("hf_demo.hf.trainer")
    if kind not in MAKERS:
        raise ValueError(f"hf_demo: cannot remake a class of kind {kind!r} (a pickle from another hf_demo version?)")
    base = importlib.import_module(module)
    for part in qualname.split("."):
        base = getattr(base, part)
    return MAKERS[kind](base)


def _reduce(cls: type):
    made = cls.__dict__.get("_hf_demo_made")
    return cls.__qualname__ if made is None else (remake, made)


copyreg.pickle(Remade, _reduce)

# checkpoints written before this module moved pickled their classes as hf_demo.generated.<name>
sys.modules.setdefault("hf_demo.generated", sys.modules[__name__])

MADE_ON_IMPORT = {"DeMoSFTTrainer": "hf_demo.trl", "DeMoSFTConfig": "hf_demo.trl"}


def __getattr__(name: str):
    if name in MADE_ON_IMPORT:  # pickles by name (older hf_demo) in a process that has not imported hf_demo.trl
        importlib.import_module(MADE_ON_IMPORT[name])
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (made by hf_demo.with_demo at run time)")
