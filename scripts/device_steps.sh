#!/usr/bin/env bash
# One device call as a list of steps, each bounded by what is left of the call's own time
# limit, everything under $OUT packed into one bundle.tgz at the end (the device tool returns
# at most 8 files). For a session's short calls on a lent GPU; scripts/gpu_suite.sh is the
# whole suite in one go. E.g. (a fresh machine builds in about 90 s):
#   STEPS="build trace suite" LIMIT=560 AFDEP_COMMIT=<hash> bash scripts/device_steps.sh
# Steps (in the order given; one that would have under MIN_STEP_S (45) seconds is skipped):
#   build  pip install --no-build-isolation --no-deps -e . (build_inplace.py if pip fails)
#   trace  benchmarks.trace --arms afdep --replays 60 per layout of TRACE_LAYOUTS (default
#          "tokens experts") at TRACE_T (default 1), TRACE_EXTRA appended (e.g. --afdep-env X=1);
#          trace2, trace3, ...: more traces in the same call from TRACE2_LAYOUTS, TRACE2_T,
#          TRACE2_EXTRA, ... (files under $OUT/trace2-<layout>, ...)
#   suite  the GPU suite's tests (gpu_suite.sh custom, SHARDS=1, BUILD=skip): PYTEST_K selects,
#          RESUME="<summary.txt or shard logs> ..." skips what passed there, SUITE_BUDGET (s;
#          default: what is left less 60, the suite's own set-up and the pack)
#   san    compute-sanitizer memcheck of the tests/gpu cases SAN_K selects (default sanitizer)
#   ab     benchmarks.run, arms afdep and afdep_alt with AB_ENV (NAME=VALUE ...), layouts
#          AB_LAYOUTS (default "tokens experts"), T = AB_T, 3 repeats, within AB_LIMIT s
#          (default 150; less when less is left). ab2, ab3, ...: more A/Bs in the same call,
#          each from its own AB2_ENV, AB2_T, AB2_LAYOUTS, AB2_LIMIT (files under $OUT/ab2, ...)
#   bench  benchmarks.run, arms afdep and symmetric, both layouts, T = BENCH_T (default
#          "1 32 128 512 2048"), BENCH_REPEATS (default 3), within what is left
#   profile  scripts/gpu_profile.sh (ncu per kernel in lockstep; its CELLS, EXCHANGES, SAMPLED)
#   probe  scripts/poll_probe.cu built with nvcc and run once per mode of PROBE_MODES (default
#          "queue fresh"; "main" runs it without a mode; "ipc" and "ipcq" as its two processes),
#          each within PROBE_TIMEOUT s (default 40), into $OUT/probe/<mode>.json (stderr beside
#          it as <mode>.err); PROBE_MPS=1 runs them under an MPS daemon of their own, into
#          <mode>-mps.json; always from this checkout, whatever TREE says. probe2, probe3, ...:
#          more runs in the same call from PROBE2_MODES, PROBE2_MPS, ... (built once)
# TREE=<folder>: the library steps build and run the checkout in that folder instead (e.g. an
# older commit's `git archive` under .carry/, carried with `run`), to measure a control that a
# later commit removed; the call's own .carry/py still goes on PYTHONPATH.
# Every step but profile is one scripts/gpu_suite.sh call with the parts it needs turned on
# (files under $OUT/<step>, its log in $OUT/<step>.log); both ranks share the one GPU under
# the CUDA MPS daemon that gpu_suite.sh starts and stops.
set -u
ROOT=${OUT:?set OUT to the folder the results go to}
T0=$(date +%s)
LIMIT=${LIMIT:-560}
MIN_STEP_S=${MIN_STEP_S:-45}  # so that every inner limit below stays above 0
left() { echo $(( LIMIT - ( $(date +%s) - T0 ) )); }
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$ROOT/call.log"; }
# secs R [CAP]: seconds a step may take, keeping R in reserve (at most CAP); prints nothing,
# and says so, when fewer than MIN_STEP_S are left (timeout 0 would mean no limit at all)
secs() {
  local t=$(( $(left) - $1 ))
  if [ -n "${2:-}" ] && [ "$t" -gt "$2" ]; then t=$2; fi
  if [ "$t" -ge "$MIN_STEP_S" ]; then echo "$t"; else stamp "skipped: ${t}s left" >&2; fi
}
# test-only packages the device lacks (expecttest) travel in .carry/py (run's carry);
# gpu_suite.sh puts the folder on PYTHONPATH
export MAX_JOBS="${MAX_JOBS:-32}"
stamp "commit=${AFDEP_COMMIT:-?} steps=${STEPS:-} limit=${LIMIT}s"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$ROOT/call.log" 2>&1
# run_suite NAME SECONDS [VAR=VALUE ...]: one scripts/gpu_suite.sh call within SECONDS, its files
# under $ROOT/NAME; by default it builds nothing and runs nothing (the VARs turn parts on).
# gpu_suite.sh starts the MPS daemon and stops it, waiting, as it exits.
SELF=$PWD
. "$SELF/scripts/mps.sh"
LIB=${TREE:-$SELF}
if [ ! -d "$LIB/scripts" ]; then stamp "TREE=$LIB: no checkout there"; STEPS=""; fi
if [ -d "$SELF/.carry/py" ]; then export PYTHONPATH="$SELF/.carry/py:${PYTHONPATH:-}"; fi
run_suite() {
  local name=$1 t=$2
  shift 2
  (cd "$LIB" && env OUT="$ROOT/$name" BUILD=skip SKIP_TESTS=1 SKIP_SAN=1 SKIP_BENCH=1 "$@" \
    timeout -k 10 "$t" bash scripts/gpu_suite.sh custom) > "$ROOT/$name.log" 2>&1
  stamp "$name rc=$?"
}
for s in ${STEPS:-}; do
  case $s in
  build)
    t=$(secs 15); [ -n "$t" ] || continue
    stamp "build"
    run_suite build "$t" BUILD=pip
    grep -h "extension ok" "$ROOT/build/build.log" | tee -a "$ROOT/call.log";;
  trace|trace[0-9]*)
    # trace reads TRACE_LAYOUTS, TRACE_T, TRACE_EXTRA; traceN reads TRACEN_* (files under
    # $OUT/traceN-<layout>)
    v=TRACE${s#trace}; lv="${v}_LAYOUTS" tv="${v}_T" xv="${v}_EXTRA"
    for lay in ${!lv:-tokens experts}; do
      t=$(secs 15 130); [ -n "$t" ] || break
      stamp "$s $lay T=${!tv:-1} ${!xv:-}"
      run_suite "$s-$lay" "$t" TRACE=1 TRACE_TIMEOUT=$(( t - 20 )) TRACE_ARGS="--tokens ${!tv:-1} \
--arms afdep --receive-layout $lay --replays 60 ${!xv:-}"
    done;;
  suite)
    t=$(secs 15); [ -n "$t" ] || continue
    budget=${SUITE_BUDGET:-$(( t - 45 ))}  # 45: gpu_suite.sh's set-up before the tests
    if [ "$budget" -lt "$MIN_STEP_S" ]; then stamp "suite skipped: ${budget}s for tests"; continue; fi
    stamp "suite -k '${PYTEST_K:-not sanitizer}' budget=${budget}s resume=${RESUME:-none}"
    # forked worlds (they worked on every lent H100 and H200 so far) unless AFDEP_WORLD_START
    # says otherwise; set it empty for gpu_suite.sh's probe of them (about 20 s, at most 90)
    run_suite suite "$t" SKIP_TESTS=0 RESUME="${RESUME:-}" SHARDS=1 TEST_TIMEOUT="$budget" \
      AFDEP_WORLD_START="${AFDEP_WORLD_START-forkserver}"
    stamp "suite: $(head -1 "$ROOT/suite/shards/summary.txt" 2>/dev/null || echo 'no summary')";;
  san)
    t=$(secs 15); [ -n "$t" ] || continue
    stamp "memcheck -k ${SAN_K:-sanitizer}"
    run_suite san "$t" SKIP_SAN=0 SAN_TIMEOUT=$(( t - 20 )) SAN_K="${SAN_K:-sanitizer}"
    grep -E "ERROR SUMMARY|passed|failed" "$ROOT/san/sanitizer.log" | tail -4 | tee -a "$ROOT/call.log";;
  ab|ab[0-9]*)
    # ab reads AB_ENV, AB_T, ...; abN reads ABN_ENV, ABN_T, ... (indirect expansion)
    v=AB${s#ab}; e="${v}_ENV" tv="${v}_T" lv="${v}_LAYOUTS" mv="${v}_LIMIT"
    if [ -z "${!e:-}" ] || [ -z "${!tv:-}" ]; then stamp "$s: set ${e} and ${tv}"; continue; fi
    t=$(secs 15 "${!mv:-150}"); [ -n "$t" ] || continue
    stamp "$s ${!e} T=${!tv} layouts=${!lv:-tokens experts}"
    run_suite "$s" "$t" SKIP_BENCH=0 BENCH_TIMEOUT=$(( t - 20 )) BENCH_ARGS="--gpus 1 --arms afdep \
afdep_alt --receive-layouts ${!lv:-tokens experts} --tokens ${!tv} --hidden 4096 --dtype bf16 \
--routing random --repeats 3 --alt-env ${!e} --time-budget $(( t - 30 )) --no-plot";;
  bench)
    t=$(secs 15); [ -n "$t" ] || continue
    stamp "bench T=${BENCH_T:-1 32 128 512 2048}"
    run_suite bench "$t" SKIP_BENCH=0 BENCH_TIMEOUT=$(( t - 20 )) BENCH_ARGS="--gpus 1 --arms afdep \
symmetric --receive-layouts tokens experts --tokens ${BENCH_T:-1 32 128 512 2048} --hidden 4096 \
--dtype bf16 --routing random --repeats ${BENCH_REPEATS:-3} --time-budget $(( t - 30 ))";;
  profile)
    t=$(secs 15); [ -n "$t" ] || continue
    stamp "profile CELLS=${CELLS:-default}"
    (cd "$LIB" && OUT="$ROOT/profile" timeout -k 10 "$t" bash scripts/gpu_profile.sh) \
      > "$ROOT/profile.log" 2>&1
    stamp "profile rc=$?";;
  probe|probe[0-9]*)
    # probe reads PROBE_MODES, PROBE_MPS; probeN reads PROBEN_* (the same files' folder)
    v=PROBE${s#probe}; mv="${v}_MODES" pv="${v}_MPS"
    modes=${!mv:-queue fresh} want_mps=${!pv:-0}
    t=$(secs 15); [ -n "$t" ] || continue
    mkdir -p "$ROOT/probe"
    stamp "$s $modes"
    if [ ! -x "$ROOT/probe/poll_probe" ] && ! timeout -k 5 "$t" nvcc -O3 -arch=sm_90a \
        -o "$ROOT/probe/poll_probe" "$SELF/scripts/poll_probe.cu" > "$ROOT/probe/build.log" 2>&1
    then
      stamp "probe: nvcc failed (probe/build.log)"; continue
    fi
    mps=""  # PROBE_MPS=1: the modes run under an MPS daemon of their own (files <mode>-mps.*)
    if [ "$want_mps" = 1 ]; then
      if mps_start /tmp/afdep-probe-mps; then mps=-mps; stamp "probe: MPS daemon started"
      else stamp "probe: no MPS daemon"; fi
    fi
    for m in $modes; do
      t=$(( $(left) - 15 )); [ "$t" -gt "${PROBE_TIMEOUT:-40}" ] && t=${PROBE_TIMEOUT:-40}
      if [ "$t" -lt 5 ]; then stamp "probe $m skipped: ${t}s left"; break; fi
      f="$ROOT/probe/$m$mps"
      case $m in
        ipc|ipcq)  # two processes: rank 1 in the background, rank 0 prints
          d=$(mktemp -d)
          timeout -k 5 "$t" "$ROOT/probe/poll_probe" "$m" 1 "$d" 2> "$f.err1" &
          timeout -k 5 "$t" "$ROOT/probe/poll_probe" "$m" 0 "$d" > "$f.json" 2> "$f.err"
          rc=$?; wait; rm -rf "$d";;
        *)
          arg=$m; [ "$m" = main ] && arg=""
          timeout -k 5 "$t" "$ROOT/probe/poll_probe" $arg > "$f.json" 2> "$f.err"
          rc=$?;;
      esac
      stamp "probe $m$mps rc=$rc"
    done
    if [ -n "$mps" ]; then mps_quit >> "$ROOT/call.log"; fi
    # (set only for the probe's daemon: the later steps' gpu_suite.sh starts its own)
    [ "$want_mps" = 1 ] && unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY;;
  *) stamp "unknown step $s";;
  esac
done
rm -f "$ROOT/probe/poll_probe"  # (built once by the first probe step; not worth packing)
stamp "call done"
OUT=$ROOT bash "$(dirname "$0")/pack_out.sh"
