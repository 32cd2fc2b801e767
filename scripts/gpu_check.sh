#!/usr/bin/env bash
# GPU checks of hf-demo, for a machine with an NVIDIA GPU (run from anywhere: bash scripts/gpu_check.sh).
#   1. the CUDA tests:           pytest -m cuda (the device-parametrised tests, their CUDA runs)
#   2. DeMo over real ranks:     2 processes over NCCL with >= 2 GPUs; with one GPU, 1 process over NCCL and
#                                2 processes sharing the GPU over gloo (scripts/gpu_dist_check.py: replicas
#                                must stay bitwise identical in every mode)
#   3. the step benchmark:       benchmarks/optimizer_step.py --device cuda (2 layers, DeMo and AdamW)
#   4. the step cost:            benchmarks/step_cost.py --devices cuda (ops and host reads per step, wall times)
#   4b. host syncs:             scripts/gpu_sync_check.py: a steady-state step under set_sync_debug_mode, the
#                                count the same at 128 and 512 tensors; a CUDA-graph capture of a step, tried
#   5. HSDP-DeMo (FSDP2):        scripts/gpu_fsdp_check.py: a custom loop (hf_demo.fsdp, NCCL, a DCP resume that
#                                must end bit for bit), the same with the from_scratch preset (local Muon steps,
#                                each sharded matrix orthogonalised whole) and DeMoTrainer through
#                                accelerate_configs/fsdp2_hsdp.yaml:
#                                2 x 2 HSDP with >= 4 GPUs, pure FSDP over 2 with 2 or 3, one process otherwise
# Then a summary, one line per check.
# Exit status: 0 every check passed; 1 a check failed; 77 no CUDA GPU visible to torch (nothing was checked:
# the automake convention for "skipped"; a CPU-only torch build on a GPU machine also ends here).
# Environment: VENV (default .venv; `make setup` installs the CUDA torch where nvidia-smi works),
# GPU_CHECK_LAYERS (benchmark layers, default 2), GPU_CHECK_STEPS (steps per mode, default 12),
# GPU_CHECK_TIMEOUT (seconds per check, default 240: a hung check fails alone instead of stalling the rest).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  echo "gpu_check: no $PY: run 'make setup' first" >&2
  exit 1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! gpus=$("$PY" -c "import torch, sys; n = torch.cuda.device_count() if torch.cuda.is_available() else 0; print(n); sys.exit(0 if n else 1)" 2>/dev/null); then
  why=$("$PY" -c "import torch; print('torch', torch.__version__, '(CUDA build' if torch.version.cuda else '(CPU-only build', end=')')" 2>/dev/null || echo "torch does not import")
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: SKIPPED: nvidia-smi sees a GPU but torch does not ($why): reinstall torch with CUDA" >&2
  else
    echo "gpu_check: SKIPPED: no CUDA GPU on this machine ($why); nothing was checked (exit 77)" >&2
  fi
  exit 77
fi
name=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0))")
echo "gpu_check: $gpus GPU(s), $name"

declare -a summary
failed=0
check() {  # check "label" command...
  local label=$1
  shift
  local t0=$SECONDS
  echo
  echo "=== $label: $*"
  if timeout --kill-after 10 "${GPU_CHECK_TIMEOUT:-240}" "$@"; then
    summary+=("PASS  $label ($((SECONDS - t0)) s)")
  else
    summary+=("FAIL  $label ($((SECONDS - t0)) s, exit $?)")
    failed=1
  fi
}

check "CUDA tests (pytest -m cuda)" "$PY" -m pytest -q -m cuda -p no:cacheprovider tests
STEPS=${GPU_CHECK_STEPS:-12}
if [ "$gpus" -ge 2 ]; then
  check "2 processes, NCCL, a GPU each" "$VENV/bin/torchrun" --standalone --nproc_per_node 2 \
    scripts/gpu_dist_check.py --backend nccl --steps "$STEPS"
else
  check "1 process, NCCL" "$PY" scripts/gpu_dist_check.py --backend nccl --steps "$STEPS"
  check "2 processes on one GPU, gloo" "$VENV/bin/torchrun" --standalone --nproc_per_node 2 \
    scripts/gpu_dist_check.py --backend gloo --steps "$STEPS"
fi
WORLD=$([ "$gpus" -ge 2 ] && echo 2 || echo 1)
check "optimizer step benchmark on CUDA ($WORLD rank(s))" "$PY" benchmarks/optimizer_step.py --device cuda \
  --world-size "$WORLD" --layers "${GPU_CHECK_LAYERS:-2}" --only demo-bf16,demo-sign,adamw --steps 5
check "step cost on CUDA (aten ops, host reads, wall times)" "$PY" benchmarks/step_cost.py --devices cuda \
  --out "${GPU_CHECK_OUT:-/tmp}/step_cost_cuda.md"
check "host syncs of a steady-state step ($WORLD rank(s))" "$VENV/bin/torchrun" --standalone \
  --nproc_per_node "$WORLD" scripts/gpu_sync_check.py
LOOP_PROCS=$([ "$gpus" -ge 4 ] && echo 4 || echo "$WORLD")
LOOP_SHARD=$([ "$gpus" -ge 4 ] && echo 2 || echo 1)
check "HSDP-DeMo custom loop ($LOOP_PROCS rank(s), shard $LOOP_SHARD, NCCL, DCP resume)" "$VENV/bin/torchrun" \
  --standalone --nproc_per_node "$LOOP_PROCS" scripts/gpu_fsdp_check.py loop --shard "$LOOP_SHARD"
check "HSDP-DeMo custom loop, the from_scratch preset ($LOOP_PROCS rank(s), shard $LOOP_SHARD: local Muon steps)" \
  "$VENV/bin/torchrun" --standalone --nproc_per_node "$LOOP_PROCS" scripts/gpu_fsdp_check.py loop \
  --shard "$LOOP_SHARD" --preset from_scratch
if [ "$gpus" -ge 4 ]; then TRAINER=(4 2 2); elif [ "$gpus" -ge 2 ]; then TRAINER=(2 1 2); else TRAINER=(1 1 1); fi
check "HSDP-DeMo DeMoTrainer (${TRAINER[0]} process(es): replicate ${TRAINER[1]} x shard ${TRAINER[2]})" \
  "$VENV/bin/accelerate" launch --config_file accelerate_configs/fsdp2_hsdp.yaml --num_machines 1 --machine_rank 0 \
  --main_process_ip 127.0.0.1 --main_process_port 29517 --num_processes "${TRAINER[0]}" \
  --parallelism_config_dp_replicate_size "${TRAINER[1]}" --parallelism_config_dp_shard_size "${TRAINER[2]}" \
  scripts/gpu_fsdp_check.py trainer

echo
echo "gpu_check summary ($name):"
printf '  %s\n' "${summary[@]}"
exit $failed
