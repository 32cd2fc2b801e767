"""A step's writes, staged: nothing the step computes reaches the optimizer, the parameters or the counters
until :meth:`Transaction.commit`, so a step that raises anywhere before it changes nothing and needs no undo.

Each staged write is a plain assignment or an in-place tensor update that cannot fail on purpose (the
checks, collectives and decisions all ran before); writes run in the order they were staged.

A step committed *tentatively* (its verdict travels with the next exchange: :mod:`hf_demo.optim.settle`) commits
with an undo log, :meth:`Transaction.commit` ``(undo=True)``: just before each write the pre-image of what it
changes is kept (the old value of a state entry, a clone of a tensor written in place, the optimizer's record), and
:meth:`Undo.__call__` puts every pre-image back, in reverse order, bitwise. A staged write says how its pre-image
is taken: :meth:`Transaction.set`, :meth:`~Transaction.update` and :meth:`~Transaction.copy` know it;
:meth:`~Transaction.stage` takes ``touches`` (tensors written in place), ``before`` (a callable that keeps the
pre-image and returns what restores it) or ``keeps_nothing`` (a write that changes no state: a warning)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

Restore = Callable[[], None]
_MISSING = object()


@dataclass(eq=False)
class Undo:
    """The pre-images of one committed transaction (kept by :meth:`Transaction.commit`); calling it restores them
    (once). Its tensor copies can go to the next transaction's log once it is no longer needed (:meth:`spare`):
    the copy then reuses their memory."""

    _restores: list[Restore] = field(default_factory=list)
    _copies: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0  # bytes held by the tensors copied for it

    def spare(self) -> dict:
        """Drop the log and hand over its tensor copies, by (shape, dtype, device), for the next log to fill."""
        spare: dict = {}
        for c in self._copies:
            spare.setdefault((c.shape, c.dtype, c.device), []).append(c)
        self._restores.clear()
        self._copies.clear()
        self.nbytes = 0
        return spare

    def __call__(self) -> None:
        with torch.no_grad():
            for restore in reversed(self._restores):
                restore()
        self._restores.clear()
        self._copies.clear()
        self.nbytes = 0


def _put_back(mapping: dict, old: list) -> None:
    """Put ``mapping``'s entries back as ``old`` holds them: (key, value), absent ones (``_MISSING``) removed again."""
    for k, v in old:
        if v is _MISSING:
            mapping.pop(k, None)
        else:
            mapping[k] = v


def keep_mapping(mapping: dict) -> Callable[[], Restore]:
    """A ``before`` for a write that may change any entry of ``mapping`` (the old values are kept by reference)."""

    def before() -> Restore:
        old = dict(mapping)

        def restore() -> None:
            mapping.clear()
            mapping.update(old)

        return restore

    return before


def keep_fields(obj) -> Callable[[], Restore]:
    """A ``before`` for a write that changes ``obj``'s fields in place (plain values: kept as they are)."""

    def before() -> Restore:
        old = dict(vars(obj))
        return lambda: vars(obj).update(old)

    return before


@dataclass(eq=False)
class Transaction:
    """A step's staged writes (the module's docstring)."""

    _writes: list[tuple[Callable[[], None], Callable[[], Restore] | None, Sequence[torch.Tensor]]] = field(
        default_factory=list
    )
    committed: bool = False
    undoable: bool = True  # every staged write says how its pre-image is kept

    def stage(
        self,
        write: Callable[[], None],
        *,
        touches: Sequence[torch.Tensor] = (),
        before: Callable[[], Restore] | None = None,
        keeps_nothing: bool = False,
    ) -> None:
        """Run ``write`` at commit, after the writes staged before it. For an undo log: ``touches``, the tensors
        it writes in place; ``before``, what keeps the pre-image of anything else it changes; ``keeps_nothing``,
        it changes no state. A write with none of them makes the transaction not undoable."""
        if not touches and before is None and not keeps_nothing:
            self.undoable = False
        self._writes.append((write, before, tuple(touches)))

    def set(self, mapping: dict, key, value) -> None:
        """``mapping[key] = value`` at commit (a state entry)."""
        self.update(mapping, {key: value})

    def update(self, mapping: dict, values: dict) -> None:
        """``mapping.update(values)`` at commit (state entries); its pre-image: those entries as they are then
        (absent ones removed again by the undo)."""
        keys = list(values)
        before = lambda: partial(_put_back, mapping, [(k, mapping.get(k, _MISSING)) for k in keys])  # noqa: E731
        self._writes.append((lambda: mapping.update(values), before, ()))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` at commit (a parameter's new value)."""
        self._writes.append((lambda: dst.copy_(src), None, (dst,)))

    def commit(self, undo: bool = False, spare: dict | None = None) -> Undo | None:
        """Run every write; with ``undo``, keep each one's pre-image first and return the :class:`Undo` (its
        tensor copies made into ``spare``'s tensors where they fit: :meth:`Undo.spare` of a log no longer needed)."""
        if self.committed:
            raise RuntimeError("a step's transaction commits once")
        if undo and not self.undoable:
            raise RuntimeError("a write of this transaction keeps no pre-image: it cannot commit with an undo log")
        self.committed = True
        log, spare = (Undo() if undo else None), (spare if spare is not None else {})
        with torch.no_grad():
            for write, before, touches in self._writes:
                for t in touches if log is not None else ():  # a clone of each tensor written in place
                    free = spare.get((t.shape, t.dtype, t.device))
                    saved = free.pop().copy_(t.detach()) if free else t.detach().clone()
                    log._restores.append(lambda t=t, saved=saved: t.copy_(saved))
                    log._copies.append(saved)
                    log.nbytes += saved.numel() * saved.element_size()
                if log is not None and before is not None:
                    log._restores.append(before())
                write()
        self._writes.clear()
        return log
