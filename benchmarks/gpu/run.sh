#!/usr/bin/env bash
# The one prepared script for a lent GPU machine (one H200 here): in under 8 minutes it
#   1. installs corerun and its plugins from this checkout (no network: extra wheels come from
#      benchmarks/gpu/wheels/, carried along; make them with benchmarks/gpu/fetch_wheels.sh),
#   2. captures CUDA graphs and checks replay against eager for every bucket, timing decode steps,
#      and compares the KV budget's step-memory profile with what capture and serving then take,
#   3. compiles the Triton kernels for real by running the conformance suite on CUDA
#      (attention: torch, triton, flash when importable; graph: cuda with torch and with triton
#      attention; sampler: full, basic),
#   4. measures attention bandwidth / prefill throughput and end-to-end throughput (tensor_parallel_size 1:
#      the machine has one GPU).
# Every result lands under $OUT (default ./gpu-results); a failed part is recorded and the rest still run.
set -u
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu-results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
summary="$OUT/summary.txt"
: > "$summary"

DEADLINE=$((SECONDS + ${BUDGET_S:-450}))  # the whole run stays under 8 minutes

part() {  # part NAME TIMEOUT_S COMMAND... : run one part, keep its log and status; skip past the deadline
    local name=$1 limit=$2; shift 2
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 15 ]; then echo "== $name: skipped (time budget spent)" | tee -a "$summary"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    local start=$SECONDS
    echo "== $name" | tee -a "$summary"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc in $((SECONDS - start)) s (log: $name.log)" | tee -a "$summary"
    tail -n 25 "$OUT/$name.log"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

if compgen -G "benchmarks/gpu/wheels/*.whl" > /dev/null; then
    part install-wheels 60 "$PY" -m pip install --no-index --no-deps benchmarks/gpu/wheels/*.whl
fi
part install 60 "$PY" -m pip install --no-index --no-deps --no-build-isolation -e . \
    -e plugins/attention_triton -e plugins/attention_flash -e plugins/sampler_basic -e plugins/sampler_full

part plugins 20 "$PY" -m corerun plugins --json
# CUDA graphs first: the one part nothing else measures, so a short budget never skips it
# (a max_model_len past the split-KV threshold, so captured decodes take the split path too)
part bench-graphs 60 "$PY" benchmarks/gpu/bench_graphs.py --out "$OUT" --backends torch,triton --max-model-len 2048
# the KV budget's step-memory profile against what capture and serving then take
part kv-profile 60 "$PY" benchmarks/gpu/check_kv_profile.py --out "$OUT"
# conformance on CUDA (compiles the Triton kernels for real); flash only reports its reasons when not importable
part conformance-attention-triton 120 "$PY" -m corerun conformance attention:triton --device cuda --json
part conformance-attention-triton-split 45 "$PY" -m corerun conformance attention:triton --option num_splits=4 -k "decode or mixed" --device cuda --json
part conformance-attention-torch 45 "$PY" -m corerun conformance attention:torch --device cuda --json
part conformance-graph-cuda 45 "$PY" -m corerun conformance graph:cuda --device cuda --json
part conformance-graph-cuda-triton 45 "$PY" -m corerun conformance graph:cuda --attention triton --device cuda --json
part conformance-sampler-full 30 "$PY" -m corerun conformance sampler:full --device cuda --json
part conformance-sampler-basic 30 "$PY" -m corerun conformance sampler:basic --device cuda --json
part conformance-attention-flash 20 "$PY" -m corerun conformance attention:flash --device cuda --json
part bench-attention 60 "$PY" benchmarks/gpu/bench_attention.py --out "$OUT" --iters 20 --decode-contexts 1024,8192 --prefill-lens 512,2048
part bench-e2e 110 "$PY" benchmarks/gpu/bench_e2e.py --out "$OUT"
echo "== done; results in $OUT" | tee -a "$summary"
