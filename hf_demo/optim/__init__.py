"""The optimizer and its step: :class:`DeMo`, the step's phases, update rules, local steps, the policy."""
