#!/usr/bin/env bash
# The one prepared script for a lent GPU machine (one H200, no network): installs this checkout,
# then answers, most important first: do CUDA graphs replay correctly; do the Triton kernels pass
# conformance compiled for real; does the KV budget's step-memory profile hold; how fast is it.
#
#   bash benchmarks/gpu/run.sh                    # on the GPU machine; carry benchmarks/gpu/wheels
#   bash benchmarks/gpu/run.sh --dry-run          # anywhere: no CUDA, no installs, every part rehearsed
#   bash benchmarks/gpu/run.sh --only kv-profile,bench-e2e   # a rerun of some parts (after install)
#
# TIME PLAN. One call of the device tool runs at most 600 s (timeout_s 600; the machine's start
# comes before it). Every part compiles its Triton kernels on first use (nothing is cached on a
# fresh machine), so the limits below are sized for a cold cache and sum to BUDGET_S (540 s): no
# part starts after it, each runs under `timeout` with its limit cut to what is left of the budget
# (SIGTERM, then SIGKILL 5 s later), so even if every part ran to its limit the run ends by 545 s,
# then packs $OUT. A part cut by its limit is named in the summary's last line.
#
#   part                limit  what it answers
#   preflight             15   can it run at all: packages or carried wheels, pip, setuptools >= 77,
#                              torch + triton + a CUDA device; if not, ONE line saying what to carry
#                              or install, and the script stops (exit status 3) within seconds
#   install               40   the carried wheels the image lacks, corerun and 4 plugins editable
#   bench-graphs          45   CUDA-graph replay == eager for every bucket (torch, triton); step times
#   conformance-graph     40   graph:cuda conformance, with torch and with triton attention
#   conformance-triton   100   attention:triton conformance on CUDA (30-50 compiles), + num_splits=4,
#                              then lora:triton (about 10 compiles; its CUDA-graph replay check),
#                              then the MoE experts kernel's test (12 compiles, 0.1-0.2 s each
#                              for sm_90 by scripts/compile_check.py: about 5 s with its runs),
#                              then the W4A16 / W8A16 GEMM's tests (about 24 compiles, 0.5-0.7 s each there)
#   kv-profile           100   step-memory profile vs capture and serving: torch, then triton, each
#                              engine in its own process (40 s each, + 5 s to die) on a clean device
#   conformance-rest      45   attention:torch, sampler:full, sampler:basic, lora:torch, lora:grouped,
#                              attention:flash if installed
#   bench-attention       45   decode bandwidth, prefill TFLOP/s against SDPA
#   bench-e2e            110   corerun bench: triton+cuda (vs transformers: 30 s), then triton+eager,
#                              torch+cuda, torch+eager (22 s each), each in its own process
#                        ---
#                        540
#
# Compiles are shared: one TRITON_CACHE_DIR for the whole run, and the graph, KV-profile and e2e parts
# use the same head shape (64-dim heads, 4 query heads per KV head); the KV-profile and e2e parts use
# one random model folder, written once ($CORERUN_GPU_SCRATCH).
#
# RESULTS. A lent machine's tool brings back at most 8 files from $OUT, so every part writes into a
# working folder ($CORERUN_GPU_SCRATCH/gpu-results): its JSON before and after each check (a part cut
# short keeps what it measured and names the check it was in) and its log. $OUT receives exactly two
# files, rewritten as each part starts and ends and once more on every exit (the end, a stop, SIGTERM
# or SIGINT from `timeout` or a user, which also stops the running part first): summary.txt, one line
# per part, and gpu-results.tgz, the whole working folder. The summary is printed last on stdout.
# Exit status: 0 when every part passed, 1 when one failed or timed out, 3 when preflight stopped it,
# 4 when the install failed (nothing after it could run), 128 + the signal's number when one stopped it.
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

OUT="${OUT:-$PWD/gpu-results}"          # receives summary.txt and gpu-results.tgz, nothing else
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1                # a part killed by its limit keeps every line it printed
export PIP_BREAK_SYSTEM_PACKAGES=1       # the image's Python may be marked externally managed (PEP 668)
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export CORERUN_GPU_SCRATCH="${CORERUN_GPU_SCRATCH:-${TMPDIR:-/tmp}/corerun-gpu}"  # the random models, once per run
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$CORERUN_GPU_SCRATCH/triton-cache}"  # one Triton cache for every part
WORK="$CORERUN_GPU_SCRATCH/gpu-results"  # every part's files; packed into $OUT/gpu-results.tgz
mkdir -p "$OUT" "$CORERUN_GPU_SCRATCH" "$TRITON_CACHE_DIR"
OUT=$(cd "$OUT" && pwd) WORK=$(mkdir -p "$WORK" && cd "$WORK" && pwd)
case "$WORK/" in "$OUT"/*)
    echo "run.sh: CORERUN_GPU_SCRATCH ($CORERUN_GPU_SCRATCH) is inside OUT ($OUT): OUT must receive only the summary and the archive; put the scratch folder elsewhere" >&2
    exit 2 ;;
esac
[ -z "$ONLY" ] && rm -rf "${WORK:?}"/*  # a full run starts clean; --only adds to the earlier run's files
summary="$WORK/summary.txt"
: > "$summary"
DEADLINE=$((SECONDS + ${BUDGET_S:-540}))
DRYARG=""
[ "$DRY" = 1 ] && DRYARG="--dry-run"
failed=0
part_pid="" part_name="" part_start=0 part_json=""  # the part running now, for a signal to stop
print_summary=1 signal="" ended=0
cut="" skipped=""  # parts cut by their limit, parts not started (the budget spent)
LOG_CAP=$((4 << 20))  # a log above this keeps its last 4 MiB in the archive (the tool brings back 16 MiB a file)

say() { echo "$*" | tee -a "$summary"; }

pack() {  # $OUT/summary.txt and $OUT/gpu-results.tgz from the working folder (the archive written aside, then moved)
    local f tmp="$CORERUN_GPU_SCRATCH/gpu-results.tgz.tmp"
    for f in "$WORK"/*.log; do
        if [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt "$LOG_CAP" ]; then tail -c "$LOG_CAP" "$f" > "$f.cut" && mv -f "$f.cut" "$f"; fi
    done
    tar -czf "$tmp" -C "$(dirname "$WORK")" "$(basename "$WORK")" 2>/dev/null
    mv -f "$tmp" "$OUT/gpu-results.tgz"
    cp -f "$summary" "$OUT/summary.txt"
}

stop_part() {  # SIGTERM to the running part (its `timeout` passes it on; the part marks its JSON killed), SIGKILL 5 s later
    kill -TERM "$part_pid" 2>/dev/null
    local i
    for i in $(seq 50); do kill -0 "$part_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$part_pid" 2>/dev/null
    wait "$part_pid" 2>/dev/null
    local detail=""
    [ -n "$part_json" ] && detail="; $("$PY" benchmarks/gpu/part_report.py summary "$part_json" 2>&1)"
    say "   STOPPED by SIG$signal after $((SECONDS - part_start)) s$detail (log: $part_name.log)"
    part_pid=""
}

finish() {  # on every exit: stop the running part, note how the run ended, pack $OUT, print the summary last
    local rc=$?
    # a second signal must not cut the summary short: `timeout` signals the script and then its whole
    # process group, and a user may press Ctrl-C twice. Ignored, not trapped: a trap run while bash
    # parses a command substitution below can break the parse. The stop is bounded (SIGKILL after 5 s)
    trap - EXIT
    trap '' TERM INT HUP
    local cuts="${cut:+; cut by their limit:${cut%,}}${skipped:+; not started, the budget spent:${skipped%,}}"
    if [ -n "$signal" ]; then
        rc=$((128 + $(kill -l "$signal")))
        local during="between parts"
        [ -n "$part_pid" ] && during="in $part_name" && stop_part
        say "== run.sh stopped by SIG$signal after $SECONDS s ($during); no part started after that$cuts"
    elif [ "$ended" = 1 ]; then
        say "== done in $SECONDS s; $([ "$rc" = 0 ] && echo 'every part passed' || echo 'some part failed or timed out')$cuts"
    fi
    pack
    if [ "$print_summary" = 1 ]; then  # last, so a tool that keeps only the output's tail keeps it
        echo; echo "== summary (also summary.txt, and every part's files in gpu-results.tgz, in $OUT)"; cat "$summary"
    fi
    exit "$rc"
}
trap finish EXIT
for s in TERM INT HUP; do trap "[ -n \"\$signal\" ] || { signal=$s; exit; }" "$s"; done  # the first signal counts

part() {  # part NAME LIMIT_S RESULTS_JSON COMMAND... : one part under its time limit; a failure never stops the run
    local name=$1 limit=$2 json=$3; shift 3
    if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then return 0; fi
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 15 ]; then say "== $name: skipped (the time budget is spent)"; failed=1; skipped+=" $name,"; return 0; fi
    [ "$limit" -gt "$left" ] && limit=$left
    if [ -n "${PART_LIMIT_S:-}" ] && [ "$limit" -gt "$PART_LIMIT_S" ]; then limit=$PART_LIMIT_S; fi
    say "== $name (limit $limit s)"
    pack
    # in the background, so that a signal to this script is handled at once, not when the part ends
    timeout -k 5 "$limit" "$@" > "$WORK/$name.log" 2>&1 &
    part_pid=$! part_name=$name part_start=$SECONDS part_json=$json
    wait "$part_pid"
    local rc=$?
    part_pid=""
    local verdict="ok"
    case $rc in
        0) ;;
        124|137) verdict="TIMED OUT after $limit s"; failed=1; cut+=" $name," ;;
        *) verdict="FAILED (exit status $rc)"; failed=1 ;;
    esac
    local detail=""
    [ -n "$json" ] && detail="; $("$PY" benchmarks/gpu/part_report.py summary "$json" 2>&1)"
    say "   $verdict in $((SECONDS - part_start)) s$detail (log: $name.log)"
    tail -n 8 "$WORK/$name.log"
    pack
}

install_checkout() {  # the carried wheels preflight found missing here, then corerun and the plugins, editable
    local -a wheels=()
    mapfile -t wheels < "$WORK/install-wheels.txt"
    step() { if [ "$DRY" = 1 ]; then echo "dry run, would run: $*"; else echo "+ $*"; "$@"; fi; }
    if [ ${#wheels[@]} -gt 0 ]; then
        step "$PY" -m pip install --no-index --no-deps "${wheels[@]}" || return
    fi
    step "$PY" -m pip install --no-index --no-deps --no-build-isolation -e . -e plugins/attention_triton \
        -e plugins/attention_flash -e plugins/sampler_basic || return
    if [ "$DRY" = 1 ]; then echo "dry run, would run: $PY -m corerun plugins --json"; return; fi
    "$PY" -m corerun plugins --json > "$WORK/plugins.json"
}
export -f install_checkout
export WORK PY DRY

# ---------------------------------------------------------------- preflight: seconds, one line
if [ -z "$ONLY" ] || [[ ",$ONLY," == *",preflight,"* ]] || [[ ",$ONLY," == *",install,"* ]]; then
    line=$(timeout -k 5 "${PART_LIMIT_S:-15}" "$PY" benchmarks/gpu/preflight.py --out "$WORK" $DRYARG 2>&1)
    rc=$?
    if [ $rc -ne 0 ]; then  # one line on stdout, and nothing more: the summary is that line
        print_summary=0
        say "${line:-run.sh: cannot start: the preflight check printed nothing (exit status $rc)}"
        [[ $line == "run.sh: cannot start"* ]] || say "run.sh: cannot start: preflight exit status $rc (see above)"
        exit 3
    fi
    say "$line"
    [ -f "$WORK/machine.txt" ] && cat "$WORK/machine.txt"
    part install 40 "" bash -c install_checkout
    if [ $failed != 0 ]; then  # every later part would only fail to import corerun
        say "run.sh: stopped: the install failed (install.log above); nothing after it can run"
        exit 4
    fi
fi

# ---------------------------------------------------------------- the parts, most important first
part bench-graphs 45 "$WORK/bench_graphs.json" "$PY" benchmarks/gpu/bench_graphs.py --out "$WORK" $DRYARG \
    --backends torch,triton --max-model-len 2048 --hidden 1024 --heads 16 --kv-heads 4 --layers 4 --iters 30
part conformance-graph 40 "$WORK/conformance-graph.json" \
    "$PY" benchmarks/gpu/conformance_part.py --group graph --out "$WORK/conformance-graph.json" $DRYARG
part conformance-triton 100 "$WORK/conformance-triton.json" \
    "$PY" benchmarks/gpu/conformance_part.py --group triton --out "$WORK/conformance-triton.json" $DRYARG
part kv-profile 100 "$WORK/kv_profile.json" "$PY" benchmarks/gpu/check_kv_profile.py --out "$WORK" --engine-timeout 40 $DRYARG
part conformance-rest 45 "$WORK/conformance-rest.json" \
    "$PY" benchmarks/gpu/conformance_part.py --group rest --out "$WORK/conformance-rest.json" $DRYARG
part bench-attention 45 "$WORK/bench_attention.json" "$PY" benchmarks/gpu/bench_attention.py --out "$WORK" $DRYARG \
    --iters 20 --decode-batches 1,32,128 --decode-contexts 1024,8192 --prefill-lens 512,2048
part bench-e2e 110 "$WORK/bench_e2e.json" "$PY" benchmarks/gpu/bench_e2e.py --out "$WORK" --timeout 22 --hf-extra 8 $DRYARG

ended=1
exit $failed
