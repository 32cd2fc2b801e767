"""The optimizer and its step: :class:`DeMo`, the staged step's parts, update rules, local steps, the policy."""
