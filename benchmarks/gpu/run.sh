#!/usr/bin/env bash
# The one prepared script for a lent GPU machine (one H200 here): in under 8 minutes it
#   1. installs corerun and its plugins from this checkout (no network: extra wheels come from
#      benchmarks/gpu/wheels/, carried along; make them with benchmarks/gpu/fetch_wheels.sh),
#   2. compiles the Triton kernels for real and runs the conformance suite on CUDA
#      (attention: torch, triton, flash when importable; graph: cuda; sampler: full, basic),
#   3. captures CUDA graphs and checks replay against eager for every bucket, timing decode steps,
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

part() {  # part NAME TIMEOUT_S COMMAND... : run one part, keep its log and status
    local name=$1 limit=$2; shift 2
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
    part install-wheels 120 "$PY" -m pip install --no-index --no-deps benchmarks/gpu/wheels/*.whl
fi
part install 180 "$PY" -m pip install --no-index --no-deps --no-build-isolation -e . \
    -e plugins/attention_triton -e plugins/attention_flash -e plugins/sampler_basic -e plugins/sampler_full

part plugins 60 "$PY" -m corerun plugins --json
part compile-check 90 "$PY" plugins/attention_triton/scripts/compile_check.py --dtypes fp16,bf16,fp32 --head-sizes 64,128,256,80
for impl in attention:torch attention:triton attention:flash graph:cuda sampler:full sampler:basic; do
    part "conformance-${impl/:/-}" 150 "$PY" -m corerun conformance "$impl" --device cuda --json
done
part bench-graphs 120 "$PY" benchmarks/gpu/bench_graphs.py --out "$OUT" --backends torch,triton
part bench-attention 150 "$PY" benchmarks/gpu/bench_attention.py --out "$OUT" --iters 20 --decode-contexts 1024,8192 --prefill-lens 512,2048
part bench-e2e 150 "$PY" benchmarks/gpu/bench_e2e.py --out "$OUT"
echo "== done; results in $OUT" | tee -a "$summary"
