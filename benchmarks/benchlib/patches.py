"""Benchmark-only patches of hf_demo's internals, for prototypes a benchmark measures before any becomes a setting.

Each patch holds in the process that makes it only (a forked run's), from then on: nothing here is a setting, and
nothing restores the function patched over.
"""

from __future__ import annotations

from collections.abc import Callable


def wrap_commit_sync(transform: Callable[..., tuple]) -> None:
    """Patch ``hf_demo.optim.local_steps.commit_sync`` (where a synchronisation's agreed change lands):
    ``transform(param, state, update, outer_lr, m_in, rule_state)`` returns those six arguments, any of them
    changed, and the ``commit_sync`` in place before the patch receives them."""
    from hf_demo.optim import local_steps

    original = local_steps.commit_sync

    def commit_sync(param, state, update, outer_lr, m_in, rule_state):
        original(*transform(param, state, update, outer_lr, m_in, rule_state))

    local_steps.commit_sync = commit_sync
