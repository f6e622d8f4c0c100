#!/usr/bin/env bash
# Wheels the lent GPU image lacks (it has torch, triton, transformers, pluggy, pyyaml, safetensors;
# no pydantic and no network), for Python 3.12 on x86_64, into benchmarks/gpu/wheels/ (git-ignored;
# pass it in the device tool's `carry`).
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p wheels
pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --no-deps -d wheels pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.7.0 typing-inspection typing_extensions \
    click==8.5.1 rich==15.0.0 markdown-it-py mdurl pygments tqdm==4.70.1 setuptools pytest==9.2.0 iniconfig packaging
ls -la wheels
