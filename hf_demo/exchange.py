"""How coefficients move between ranks (placeholder: filled in by the core refactor)."""
EXCHANGES = ("all_gather", "all_reduce")
