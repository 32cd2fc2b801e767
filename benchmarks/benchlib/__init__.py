"""What the benchmarks share (and the tests import), one module per job.

The benchmarks are scripts (``python benchmarks/convergence.py ...``); Python puts their folder on ``sys.path``,
so they import this package as ``benchlib``; the tests have ``benchmarks/`` on their path for it
(pyproject.toml). Nothing here imports the tests or the recipes.

- :mod:`benchlib.ranks`      the launcher of gloo worlds: a function on N local ranks, results or errors back
- :mod:`benchlib.toy`        the byte-level Llama and its windows of the Python standard library's sources
- :mod:`benchlib.baselines`  DDP-AdamW and DDP + PowerSGD, and PowerSGD's bytes per step from the shapes
- :mod:`benchlib.overrides`  DeMo keywords written ``key=value,...`` on a command line
- :mod:`benchlib.atomic`     files written whole or not at all (``write_atomic``)
- :mod:`benchlib.patches`    benchmark-only patches of hf_demo's internals (prototypes: ``wrap_commit_sync``)
"""
