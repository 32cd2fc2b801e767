"""A step prepared and not applied yet: what :meth:`hf_demo.DeMo.prepare_step` hands back (``opt``: that DeMo)."""

from __future__ import annotations


class StagedStep:
    """A step that :meth:`DeMo.prepare_step` ran to its end, with its writes staged (its transaction) and nothing
    applied. ``commit()`` applies it (as :meth:`DeMo.step` does), ``discard()`` drops it: the parameters, the
    optimizer state and the counters stay bitwise as they were (what happened on the wire stays counted). One of
    the two, once, on every rank alike. A step this rank refused to keep (its verdict settles later) has
    nothing staged: both do nothing then (:attr:`empty`)."""

    def __init__(self, opt, transport, tx=None, settled=None, outcome=None):
        self._opt, self.transport, self._tx = opt, transport, tx
        self.settled, self.outcome = settled, outcome
        self.closed: str | None = None  # "committed" or "discarded", once

    @property
    def empty(self) -> bool:
        """Nothing staged to apply: this rank keeps nothing of the step (refused here, settled later)."""
        return self._tx is None

    def commit(self) -> None:
        """Apply the step (its transaction, then its outcome: counters, policy, traffic)."""
        self._opt._commit(self)

    def discard(self) -> None:
        """Drop the step: nothing of it is applied."""
        self._opt._discard(self)

    def close(self, how: str):
        """Mark the step ``how`` (committed, discarded) and hand over its transaction (None: nothing staged)."""
        if self.closed is not None:
            raise RuntimeError(f"DeMo: this prepared step was already {self.closed}: commit() or discard() it once")
        self.closed = how
        return self._tx
