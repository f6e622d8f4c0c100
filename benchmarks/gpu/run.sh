#!/usr/bin/env bash
# The one prepared script for a lent GPU machine (one H200, no network): installs this checkout,
# then answers, most important first: do CUDA graphs replay correctly; do the Triton kernels pass
# conformance compiled for real; does the KV budget's step-memory profile hold; how fast is it.
#
#   bash benchmarks/gpu/run.sh                    # on the GPU machine; carry benchmarks/gpu/wheels
#   bash benchmarks/gpu/run.sh --dry-run          # anywhere: no CUDA, no installs, every part rehearsed
#   bash benchmarks/gpu/run.sh --only kv-profile,bench-e2e   # a rerun of some parts (after install)
#
# TIME PLAN. A lent device gives 15 minutes in all, the machine's start (minutes) included, so this
# script must end within 8 minutes: no part starts after BUDGET_S (450 s) and each runs under
# `timeout` with the limit below (SIGTERM, then SIGKILL 5 s later). The limits sum to 410 s, so even
# if every part ran to its limit the run ends by 7 min (+ 5 s per killed part).
#
#   part                limit  what it answers
#   preflight             15   can it run at all: packages or carried wheels, pip, setuptools >= 77,
#                              torch + triton + a CUDA device; if not, ONE line saying what to carry
#                              or install, and the script stops (exit status 3) within seconds
#   install               40   the carried wheels the image lacks, corerun and 4 plugins editable
#   bench-graphs          45   CUDA-graph replay == eager for every bucket (torch, triton); step times
#   conformance-graph     35   graph:cuda conformance, with torch and with triton attention
#   conformance-triton    70   attention:triton conformance on CUDA (compiled kernels), + num_splits=4
#   kv-profile            65   step-memory profile vs capture and serving: torch, then triton, each
#                              engine in its own process (28 s each) on a clean device
#   conformance-rest      30   attention:torch, sampler:full, sampler:basic, attention:flash if installed
#   bench-attention       30   decode bandwidth, prefill TFLOP/s against SDPA
#   bench-e2e             80   corerun bench: triton+cuda (vs transformers: 25 s), then triton+eager,
#                              torch+cuda, torch+eager (17 s each), each in its own process
#                        ---
#                        410
#
# Compiles are shared: one TRITON_CACHE_DIR for the whole run, and the graph, KV-profile and e2e parts
# use the same head shape (64-dim heads, 4 query heads per KV head); the KV-profile and e2e parts use
# one random model folder, written once ($CORERUN_GPU_SCRATCH).
# Every part writes its JSON under $OUT (default ./gpu-results) before and after each check, so a part
# cut short keeps what it measured and names the check it was in; summary.txt has one line per part.
# Exit status: 0 when every part passed, 1 when one failed or timed out, 3 when preflight stopped it,
# 4 when the install failed (nothing after it could run).
set -u
cd "$(dirname "$0")/../.."

DRY=0
ONLY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --only) ONLY="${2:?--only needs a comma-separated list of parts}"; shift ;;
        --only=*) ONLY="${1#--only=}" ;;
        -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "run.sh: unknown argument $1 (use --dry-run, --only PART,PART or --help)" >&2; exit 2 ;;
    esac
    shift
done

OUT="${OUT:-$PWD/gpu-results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
summary="$OUT/summary.txt"
: > "$summary"
export PYTHONUNBUFFERED=1                # a part killed by its limit keeps every line it printed
export PIP_BREAK_SYSTEM_PACKAGES=1       # the image's Python may be marked externally managed (PEP 668)
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export CORERUN_GPU_SCRATCH="${CORERUN_GPU_SCRATCH:-${TMPDIR:-/tmp}/corerun-gpu}"  # the random models, once per run
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$CORERUN_GPU_SCRATCH/triton-cache}"  # one Triton cache for every part
mkdir -p "$CORERUN_GPU_SCRATCH" "$TRITON_CACHE_DIR"
DEADLINE=$((SECONDS + ${BUDGET_S:-450}))
DRYARG=""
[ "$DRY" = 1 ] && DRYARG="--dry-run"
failed=0

say() { echo "$*" | tee -a "$summary"; }

part() {  # part NAME LIMIT_S RESULTS_JSON COMMAND... : one part under its time limit; a failure never stops the run
    local name=$1 limit=$2 json=$3; shift 3
    if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then return 0; fi
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 15 ]; then say "== $name: skipped (the time budget is spent)"; failed=1; return 0; fi
    [ "$limit" -gt "$left" ] && limit=$left
    if [ -n "${PART_LIMIT_S:-}" ] && [ "$limit" -gt "$PART_LIMIT_S" ]; then limit=$PART_LIMIT_S; fi
    say "== $name (limit $limit s)"
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local verdict="ok"
    case $rc in
        0) ;;
        124|137) verdict="TIMED OUT after $limit s"; failed=1 ;;
        *) verdict="FAILED (exit status $rc)"; failed=1 ;;
    esac
    local detail=""
    [ -n "$json" ] && detail="; $("$PY" benchmarks/gpu/part_report.py summary "$json" 2>&1)"
    say "   $verdict in $((SECONDS - start)) s$detail (log: $name.log)"
    tail -n 8 "$OUT/$name.log"
}

install_checkout() {  # the carried wheels preflight found missing here, then corerun and the plugins, editable
    local -a wheels=()
    mapfile -t wheels < "$OUT/install-wheels.txt"
    step() { if [ "$DRY" = 1 ]; then echo "dry run, would run: $*"; else echo "+ $*"; "$@"; fi; }
    if [ ${#wheels[@]} -gt 0 ]; then
        step "$PY" -m pip install --no-index --no-deps "${wheels[@]}" || return
    fi
    step "$PY" -m pip install --no-index --no-deps --no-build-isolation -e . -e plugins/attention_triton \
        -e plugins/attention_flash -e plugins/sampler_basic || return
    if [ "$DRY" = 1 ]; then echo "dry run, would run: $PY -m corerun plugins --json"; return; fi
    "$PY" -m corerun plugins --json > "$OUT/plugins.json"
}
export -f install_checkout
export OUT PY DRY

# ---------------------------------------------------------------- preflight: seconds, one line
if [ -z "$ONLY" ] || [[ ",$ONLY," == *",preflight,"* ]] || [[ ",$ONLY," == *",install,"* ]]; then
    line=$(timeout -k 5 "${PART_LIMIT_S:-15}" "$PY" benchmarks/gpu/preflight.py --out "$OUT" $DRYARG 2>&1)
    rc=$?
    say "${line:-run.sh: cannot start: the preflight check printed nothing (exit status $rc)}"
    if [ $rc -ne 0 ]; then
        [[ $line == "run.sh: cannot start"* ]] || say "run.sh: cannot start: preflight exit status $rc (see above)"
        exit 3
    fi
    [ -f "$OUT/machine.txt" ] && cat "$OUT/machine.txt"
    part install 40 "" bash -c install_checkout
    if [ $failed != 0 ]; then  # every later part would only fail to import corerun
        say "run.sh: stopped: the install failed (install.log above); nothing after it can run"
        exit 4
    fi
fi

# ---------------------------------------------------------------- the parts, most important first
part bench-graphs 45 "$OUT/bench_graphs.json" "$PY" benchmarks/gpu/bench_graphs.py --out "$OUT" $DRYARG \
    --backends torch,triton --max-model-len 2048 --hidden 1024 --heads 16 --kv-heads 4 --layers 4 --iters 30
part conformance-graph 35 "$OUT/conformance-graph.json" \
    "$PY" benchmarks/gpu/conformance_part.py --group graph --out "$OUT/conformance-graph.json" $DRYARG
part conformance-triton 70 "$OUT/conformance-triton.json" \
    "$PY" benchmarks/gpu/conformance_part.py --group triton --out "$OUT/conformance-triton.json" $DRYARG
part kv-profile 65 "$OUT/kv_profile.json" "$PY" benchmarks/gpu/check_kv_profile.py --out "$OUT" --engine-timeout 28 $DRYARG
part conformance-rest 30 "$OUT/conformance-rest.json" \
    "$PY" benchmarks/gpu/conformance_part.py --group rest --out "$OUT/conformance-rest.json" $DRYARG
part bench-attention 30 "$OUT/bench_attention.json" "$PY" benchmarks/gpu/bench_attention.py --out "$OUT" $DRYARG \
    --iters 20 --decode-batches 1,32,128 --decode-contexts 1024,8192 --prefill-lens 512,2048
part bench-e2e 80 "$OUT/bench_e2e.json" "$PY" benchmarks/gpu/bench_e2e.py --out "$OUT" --timeout 17 --hf-extra 8 $DRYARG

say "== done in $SECONDS s; $([ $failed = 0 ] && echo 'every part passed' || echo 'some part failed or timed out'); results in $OUT"
echo; echo "== summary (also $summary)"; cat "$summary"  # last, so a tool that keeps only the output's tail keeps it
exit $failed
