# The two commands of the README:  make demo  (set up + main job)   make test  (set up + test suite)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test demo quickstart bench
setup:
	VENV=$(VENV) bash scripts/setup.sh

test: setup
	$(PY) -m pytest -q

quickstart: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc_per_node 2 examples/quickstart.py

demo: quickstart

bench: setup
	$(PY) -m pip install -q pytorch-optimizer
	$(PY) benchmarks/optimizer_step.py
