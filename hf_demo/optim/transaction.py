"""A step's writes, staged: nothing the step computes reaches the optimizer, the parameters or the counters
until :meth:`Transaction.commit`, so a step that raises anywhere before it changes nothing and needs no undo.

Each staged write is a plain assignment or an in-place tensor update that cannot fail on purpose (the
checks, collectives and decisions all ran before); writes run in the order they were staged."""

from __future__ import annotations

from collections.abc import Callable

import torch


class Transaction:
    def __init__(self):
        self._writes: list[Callable[[], None]] = []
        self.committed = False

    def stage(self, write: Callable[[], None]) -> None:
        """Run ``write`` at commit, after the writes staged before it."""
        self._writes.append(write)

    def set(self, mapping: dict, key, value) -> None:
        """``mapping[key] = value`` at commit (a state entry)."""
        self._writes.append(lambda: mapping.__setitem__(key, value))

    def update(self, mapping: dict, values: dict) -> None:
        self._writes.append(lambda: mapping.update(values))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` at commit (a parameter's new value)."""
        self._writes.append(lambda: dst.copy_(src))

    def commit(self) -> None:
        if self.committed:
            raise RuntimeError("a step's transaction commits once")
        self.committed = True
        with torch.no_grad():
            for write in self._writes:
                write()
        self._writes.clear()
