#!/usr/bin/env bash
# A/B of two builds on the device machine, for changes that no environment control can revert
# (code layout, compiler options): the same benchmarks.trace and benchmarks.run commands on a
# baseline tree and on this one, in alternating rounds (base, head, base, head, ...), fresh
# processes each, under one MPS daemon when the ranks share a GPU. Usage, from the repository
# root on the device machine (`run` with carry=[".carry"]):
#   git archive <base commit> | (mkdir -p .carry/base && tar -x -C .carry/base)   # here, first
#   BASE=.carry/base BASE_COMMIT=<hash> AFDEP_COMMIT=<hash> bash scripts/gpu_ab_builds.sh
# Env: BASE (the baseline tree), BASE_COMMIT / AFDEP_COMMIT (recorded in the result files),
#      ALT / ALT_COMMIT (optional: a third tree, measured between base and head each round),
#      ROUNDS (default 2), TRACE_ARGS (default: token layout, T = 1 and 32, 2 fresh worlds;
#      empty string: no trace),
#      BENCH_ARGS (default: 1A1F H4096 BF16 random, both layouts, T = 1 32 512, afdep and
#      symmetric; empty string: no benchmark), OUT (default ./gpu_out);
#      TRACE_ARGS_HEAD, BENCH_ARGS_HEAD (and _BASE, _ALT): one side's own arguments, e.g. an
#      afdep_alt arm whose --alt-env names a control only the head has;
#      TESTS_K / SAN_K (optional): after the rounds, the head's GPU tests that this -k selects
#      and compute-sanitizer memcheck of those SAN_K selects (scripts/gpu_suite.sh custom on
#      the head's in-place build, its own MPS daemon; files under $OUT/tests), within
#      TEST_TIMEOUT and SAN_TIMEOUT seconds (default 240 and 120): a kernel change's A/B and
#      its tests in one device call.
# Every tree is built in place first, all at once (scripts/build_inplace.py). Everything under
# $OUT is packed into one bundle.tgz at the end (the device returns at most 8 files), also when
# an outer `timeout` stops the script (SIGTERM): a cut-off call still brings its rounds back.
set -u -o pipefail
OUT="${OUT:-$PWD/gpu_out}"
BASE="${BASE:?BASE: the baseline tree (see the header)}"
BASE=$(cd "$BASE" && pwd)
HEAD_DIR=$PWD
SIDES="base head"
if [ -n "${ALT:-}" ]; then ALT=$(cd "$ALT" && pwd); SIDES="base alt head"; fi
# side_dir / side_commit NAME: the tree and commit of one side
side_dir() { case $1 in base) echo "$BASE" ;; alt) echo "$ALT" ;; *) echo "$HEAD_DIR" ;; esac; }
# side_args KIND SIDE: KIND_ARGS_SIDE (e.g. BENCH_ARGS_HEAD) where set, else KIND_ARGS
side_args() {
  local v="$1_ARGS_$(echo "$2" | tr a-z A-Z)" d="$1_ARGS"
  if [ -n "${!v+x}" ]; then echo "${!v}"; else echo "${!d}"; fi
}
side_commit() {
  case $1 in base) echo "${BASE_COMMIT:-?}" ;; alt) echo "${ALT_COMMIT:-?}" ;;
    *) echo "${AFDEP_COMMIT:-?}" ;; esac
}
ROUNDS="${ROUNDS:-2}"
TRACE_ARGS="${TRACE_ARGS---tokens 1 32 --arms afdep --receive-layout tokens --repeats 2}"
BENCH_ARGS="${BENCH_ARGS---gpus 1 --hidden 4096 --dtype bf16 --routing random --tokens 1 32 512 --repeats 3 --arms afdep symmetric --receive-layouts tokens experts --queue-ahead-us 200}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
# test-only packages the device lacks travel in this tree's .carry/py (gpu_suite.sh's note)
[ -d "$HEAD_DIR/.carry/py" ] && export PYTHONPATH="$HEAD_DIR/.carry/py:${PYTHONPATH:-}"
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
MPS_UP=0
# packed first: after SIGTERM, `timeout -k` leaves seconds, and stopping the daemon may take 10
finish() {
  bash "$HEAD_DIR/scripts/pack_out.sh"
  if [ "$MPS_UP" = 1 ]; then mps_quit; fi
}
trap finish EXIT
trap 'stamp "stopped (SIGTERM)"; exit 143' TERM

# every tree built at once, in place (scripts/build_inplace.py; each tree's own csrc), the
# cores split among them: the build is most of an A/B call's set-up
JOBS=$(( $(nproc) / $(echo $SIDES | wc -w) )); [ "$JOBS" -ge 1 ] || JOBS=1
for side in $SIDES; do
  dir=$(side_dir $side)
  (cd "$dir" && MAX_JOBS=$JOBS python3 "$HEAD_DIR/scripts/build_inplace.py" \
    > "$OUT/build-$side.log" 2>&1; echo $? > "$OUT/build-$side.rc") &
done
wait
for side in $SIDES; do
  dir=$(side_dir $side); commit=$(side_commit $side)
  ok=$(cd "$dir" && PYTHONPATH="$dir" python3 -c 'import torch_afdep._cuda as c; print("extension ok, cudart", c.runtime_version())' 2>&1 | tail -1)
  stamp "$side ($commit) built: rc=$(cat "$OUT/build-$side.rc"), $ok"
done

NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "$NGPU" -lt 2 ] && command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  . "$HEAD_DIR/scripts/mps.sh"
  mps_start /tmp/afdep-mps && MPS_UP=1
  stamp "MPS daemon started (one GPU)"
fi

for ((i = 0; i < ROUNDS; ++i)); do
  for side in $SIDES; do
    dir=$(side_dir $side); commit=$(side_commit $side)
    # the tree's own package and extension: its in-place build, first on the path
    export PYTHONPATH="$dir:$HEAD_DIR/.carry/py"
    targs=$(side_args TRACE $side); bargs=$(side_args BENCH $side)
    if [ -n "$targs" ]; then
      (cd "$dir" && AFDEP_COMMIT="$commit" timeout 150 python3 -m benchmarks.trace \
        --out "$OUT/trace-$side-$i.json" $targs > "$OUT/trace-$side-$i.log" 2>&1)
      stamp "trace $side round $i: rc=$?"
    fi
    if [ -n "$bargs" ]; then
      (cd "$dir" && AFDEP_COMMIT="$commit" timeout 300 python3 -m benchmarks.run \
        --out-dir "$OUT/bench-$side-$i" $bargs > "$OUT/bench-$side-$i.log" 2>&1)
      stamp "bench $side round $i: rc=$?"
    fi
  done
done
for i in $(seq 0 $((ROUNDS - 1))); do
  for side in $SIDES; do
    echo "== $side round $i"
    [ -n "$(side_args TRACE $side)" ] &&
      grep -E "A CTA0|kernel \(|kernels total|F reply|collect|offsets|expansion" \
        "$OUT/trace-$side-$i.log" | cut -c1-100 | head -14
    [ -n "$(side_args BENCH $side)" ] &&
      grep -E "^## 1A1F|^\| (afdep|afdep_alt|symmetric), " "$OUT/bench-$side-$i.log"
  done
done
# the head's tests (TESTS_K / SAN_K): gpu_suite.sh starts its own MPS daemon, so this one stops
if [ -n "${TESTS_K:-}${SAN_K:-}" ]; then
  if [ "$MPS_UP" = 1 ]; then mps_quit; MPS_UP=0; fi
  (cd "$HEAD_DIR" && PYTHONPATH="$HEAD_DIR:$HEAD_DIR/.carry/py" OUT="$OUT/tests" BUILD=skip \
    SKIP_BENCH=1 SKIP_TESTS=$([ -n "${TESTS_K:-}" ] && echo 0 || echo 1) PYTEST_K="${TESTS_K:-}" \
    SKIP_SAN=$([ -n "${SAN_K:-}" ] && echo 0 || echo 1) SAN_K="${SAN_K:-sanitizer}" \
    TEST_TIMEOUT="${TEST_TIMEOUT:-240}" SAN_TIMEOUT="${SAN_TIMEOUT:-120}" \
    AFDEP_COMMIT="$(side_commit head)" bash scripts/gpu_suite.sh custom > "$OUT/tests.log" 2>&1)
  stamp "head's tests: rc=$?"
  grep -E "passed|failed|ERROR SUMMARY|sanitizer rc|pytest rc" "$OUT/tests.log" | tail -6
fi
