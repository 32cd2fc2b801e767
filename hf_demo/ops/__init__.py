"""The operator's view of a DeMo run: plan it (``hf-demo plan``), watch it (metrics, exporters, alerts), read it
afterwards (``hf-demo report``). See docs/guides/operations.md."""
