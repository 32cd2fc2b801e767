# The two commands of the README:  make demo  (set up + main job)   make test  (set up + test suite)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test test-slow test-fast lint demo quickstart bench compare gpu-check gpu-quality
setup:
	VENV=$(VENV) bash scripts/setup.sh

test: setup
	$(PY) -m pytest -q -m "not slow" --durations=25

# The slow tier: 20 two-process launches under load, exits with starved gloo workers, torchrun kill-and-recover,
# compare.py end to end, the 4-rank cases of the bitwise families and the longest cases whose checks the default run
# makes elsewhere (tests/conftest.py: SLOW_CASES, FOUR_RANK_FAMILIES).
test-slow: setup
	$(PY) -m pytest -q -m slow

# The fast tier: everything but accelerate launches and the long fault/mode suites on gloo ranks.
test-fast: setup
	$(PY) -m pytest -q -m "not launch and not ranks"

# On a machine with an NVIDIA GPU: the CUDA tests, DeMo over NCCL ranks, the step benchmark on CUDA (exit 77: no GPU).
gpu-check: setup
	bash scripts/gpu_check.sh

# On a machine with an NVIDIA GPU: DDP-Muon, the from_scratch presets and DDP-AdamW at ~100M parameters on 4 ranks
# sharing the GPU (exit 77: no GPU). No setup: a GPU machine without the package index uses its own python3 and
# the tokenizer files that `bash scripts/gpu_quality.sh prepare` wrote here (.gpuq/tokenizer, carried along).
gpu-quality:
	bash scripts/gpu_quality.sh

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

quickstart: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc_per_node 2 examples/quickstart.py

# The main job: a 2-process DeMo fine-tune of SmolLM2-135M on the Python stdlib sources (a few minutes).
# Every step is logged (run_clm.py's default) and evaluated every 5 steps, for training.png.
DEMO_OUT ?= outputs/smollm2-demo
DEMO_ARGS ?= --max_steps 20 --per_device_train_batch_size 2 --block_size 128 --learning_rate 1e-4 \
	--max_eval_samples 16 --eval_strategy steps --eval_steps 5 --save_strategy no --report_to tensorboard
demo: setup
	ACCELERATE_USE_CPU=$${ACCELERATE_USE_CPU-$$(nvidia-smi -L >/dev/null 2>&1 && echo 0 || echo 1)} \
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE-1} OMP_NUM_THREADS=1 \
	$(VENV)/bin/accelerate launch --config_file accelerate_configs/cpu_multiprocess.yaml \
	recipes/run_clm.py --output_dir $(DEMO_OUT) --use_cpu $$(nvidia-smi -L >/dev/null 2>&1 && echo false || echo true) $(DEMO_ARGS)

compare: setup
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE-1} $(PY) recipes/compare.py --output_dir outputs/compare --steps 20 --eval_steps 5 -- \
	--per_device_train_batch_size 2 --block_size 128 --max_eval_samples 16

bench: setup
	$(PY) -m pip install -q pytorch-optimizer einops
	$(PY) benchmarks/optimizer_step.py
