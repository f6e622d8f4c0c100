#!/usr/bin/env bash
# Wheels the lent GPU image lacks, into benchmarks/gpu/wheels/ (git-ignored: name it in the device
# tool's `carry` list, or run.sh stops at once saying so). The image has torch, triton, transformers,
# pluggy, pyyaml, safetensors (and numpy), no pydantic, no network; the wheels are for CPython
# ${PYVER:-3.12} on x86_64. setuptools >= 77 builds the editable installs (`license = "Apache-2.0"`).
# The folder stays under 10 MiB (the carry limit is 64 MiB per call).
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p wheels
PYVER="${PYVER:-3.12}"
pip download --only-binary=:all: --python-version "$PYVER" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --no-deps -d wheels pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.7.0 typing-inspection typing_extensions \
    click==8.5.1 rich==15.0.0 markdown-it-py mdurl pygments tqdm==4.70.1 "setuptools>=77" pytest==9.2.0 iniconfig packaging
ls -la wheels
du -sh wheels
