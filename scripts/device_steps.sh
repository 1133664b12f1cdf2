#!/usr/bin/env bash
# One device call as a list of steps, each bounded by what is left of the call's own time
# limit, everything under $OUT packed into one bundle.tgz at the end (the device tool returns
# at most 8 files). For a session's short calls on a lent GPU; scripts/gpu_suite.sh is the
# whole suite in one go. E.g. (a fresh machine builds in about 90 s):
#   STEPS="build trace suite" LIMIT=560 AFDEP_COMMIT=<hash> bash scripts/device_steps.sh
# Steps (in the order given; one that would have under MIN_STEP_S (20) seconds is skipped):
#   build  pip install --no-build-isolation --no-deps -e . (build_inplace.py if pip fails)
#   trace  benchmarks.trace --arms afdep --replays 60 per layout of TRACE_LAYOUTS (default
#          "tokens experts") at TRACE_T (default 1), TRACE_EXTRA appended (e.g. --afdep-env X=1)
#   suite  the GPU suite's tests (gpu_suite.sh custom, SHARDS=1, BUILD=skip): PYTEST_K selects,
#          RESUME="<summary.txt or shard logs> ..." skips what passed there, SUITE_BUDGET (s;
#          default: what is left less 60, the suite's own set-up and the pack)
#   san    compute-sanitizer memcheck of the tests/gpu cases SAN_K selects (default sanitizer)
#   ab     benchmarks.run, arms afdep and afdep_alt with AB_ENV (NAME=VALUE ...), layouts
#          AB_LAYOUTS (default "tokens experts"), T = AB_T, 3 repeats, within AB_LIMIT s
#          (default 150; less when less is left)
#   bench  benchmarks.run, arms afdep and symmetric, both layouts, T = BENCH_T (default
#          "1 32 128 512 2048"), BENCH_REPEATS (default 3), within what is left
#   profile  scripts/gpu_profile.sh (ncu per kernel in lockstep; its CELLS, EXCHANGES, SAMPLED)
# Both ranks share the one GPU under a CUDA MPS daemon that each GPU step starts and stops.
set -u
ROOT=${OUT:?set OUT to the folder the results go to}
T0=$(date +%s)
LIMIT=${LIMIT:-560}
MIN_STEP_S=${MIN_STEP_S:-20}
left() { echo $(( LIMIT - ( $(date +%s) - T0 ) )); }
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$ROOT/call.log"; }
# secs R [CAP]: seconds a step may take, keeping R in reserve (at most CAP); prints nothing,
# and says so, when fewer than MIN_STEP_S are left (timeout 0 would mean no limit at all)
secs() {
  local t=$(( $(left) - $1 ))
  if [ -n "${2:-}" ] && [ "$t" -gt "$2" ]; then t=$2; fi
  if [ "$t" -ge "$MIN_STEP_S" ]; then echo "$t"; else stamp "skipped: ${t}s left" >&2; fi
}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# test-only packages the device lacks (expecttest) travel in .carry/py (run's carry)
export PYTHONPATH="$PWD/.carry/py:$PWD" MAX_JOBS="${MAX_JOBS:-32}"
stamp "commit=${AFDEP_COMMIT:-?} steps=${STEPS:-} limit=${LIMIT}s"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$ROOT/call.log" 2>&1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/afdep-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/afdep-mps-log
mps_on() {
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d 2>/dev/null || true
}
# quit, and wait until the daemon is gone: the next step's start must not find it stopping
# (gpu_suite.sh's start would fail, and its shared-GPU tests would skip)
mps_off() {
  echo quit | nvidia-cuda-mps-control 2>/dev/null
  for _ in $(seq 50); do pgrep -x nvidia-cuda-mps-control >/dev/null || return 0; sleep 0.2; done
  stamp "the MPS daemon did not stop in 10 s"
}
for s in ${STEPS:-}; do
  case $s in
  build)
    t=$(secs 30); [ -n "$t" ] || continue
    stamp "build"
    timeout -k 10 "$t" python3 -m pip install --no-build-isolation --no-deps -e . > "$ROOT/build.log" 2>&1 || {
      stamp "pip failed: build_inplace.py"
      t=$(secs 30); [ -n "$t" ] && WITH_BACKEND=1 timeout -k 10 "$t" python3 scripts/build_inplace.py >> "$ROOT/build.log" 2>&1; }
    python3 -c 'import torch_afdep._cuda as c, torch_afdep._C; print("extensions ok, cudart", c.runtime_version())' \
      2>&1 | tee -a "$ROOT/call.log"
    stamp "build done";;
  trace)
    mps_on
    for lay in ${TRACE_LAYOUTS:-tokens experts}; do
      t=$(secs 15 120); [ -n "$t" ] || break
      stamp "trace $lay T=${TRACE_T:-1} ${TRACE_EXTRA:-}"
      timeout -k 10 "$t" python3 -m benchmarks.trace --tokens ${TRACE_T:-1} --arms afdep \
        --receive-layout "$lay" --replays 60 --out "$ROOT/trace-$lay.json" ${TRACE_EXTRA:-} \
        > "$ROOT/trace-$lay.log" 2>&1
      stamp "trace $lay rc=$?"
    done
    mps_off;;
  suite)
    t=$(secs 15); [ -n "$t" ] || continue
    budget=${SUITE_BUDGET:-$(( t - 45 ))}  # 45: gpu_suite.sh's set-up before the tests
    if [ "$budget" -lt "$MIN_STEP_S" ]; then stamp "suite skipped: ${budget}s for tests"; continue; fi
    stamp "suite -k '${PYTEST_K:-not sanitizer}' budget=${budget}s resume=${RESUME:-none}"
    # forked worlds (they worked on every lent H100 and H200 so far) unless AFDEP_WORLD_START
    # says otherwise; set it empty for gpu_suite.sh's probe of them (about 20 s, at most 90)
    env RESUME="${RESUME:-}" OUT="$ROOT/suite" BUILD=skip SKIP_SAN=1 SKIP_BENCH=1 SHARDS=1 \
      AFDEP_WORLD_START="${AFDEP_WORLD_START-forkserver}" TEST_TIMEOUT="$budget" \
      timeout -k 10 "$t" bash scripts/gpu_suite.sh custom > "$ROOT/suite.log" 2>&1
    stamp "suite: $(head -1 "$ROOT/suite/shards/summary.txt" 2>/dev/null || echo 'no summary')";;
  san)
    t=$(secs 15); [ -n "$t" ] || continue
    mps_on
    stamp "memcheck -k ${SAN_K:-sanitizer}"
    AFDEP_TEST_SHARED_GPU=1 AFDEP_WORLD_START=spawn timeout -k 10 "$t" compute-sanitizer \
      --tool memcheck --target-processes all --error-exitcode 9 python3 -m pytest tests/gpu -q -rs \
      -p no:cacheprovider -k "${SAN_K:-sanitizer}" > "$ROOT/san.log" 2>&1
    stamp "memcheck rc=$?"
    grep -E "ERROR SUMMARY|passed|failed" "$ROOT/san.log" | tail -4 | tee -a "$ROOT/call.log"
    mps_off;;
  ab)
    if [ -z "${AB_ENV:-}" ] || [ -z "${AB_T:-}" ]; then stamp "ab: set AB_ENV and AB_T"; continue; fi
    t=$(secs 15 "${AB_LIMIT:-150}"); [ -n "$t" ] || continue
    mps_on
    stamp "ab $AB_ENV T=$AB_T"
    timeout -k 10 "$t" python3 -m benchmarks.run --gpus 1 --arms afdep afdep_alt \
      --receive-layouts ${AB_LAYOUTS:-tokens experts} --tokens $AB_T --hidden 4096 --dtype bf16 \
      --routing random --repeats 3 --alt-env $AB_ENV --time-budget $(( t - 15 )) --no-plot \
      --out-dir "$ROOT/ab" > "$ROOT/ab.log" 2>&1
    stamp "ab rc=$?"
    mps_off;;
  bench)
    t=$(secs 15); [ -n "$t" ] || continue
    mps_on
    stamp "bench T=${BENCH_T:-1 32 128 512 2048}"
    timeout -k 10 "$t" python3 -m benchmarks.run --gpus 1 --arms afdep symmetric \
      --receive-layouts tokens experts --tokens ${BENCH_T:-1 32 128 512 2048} --hidden 4096 \
      --dtype bf16 --routing random --repeats "${BENCH_REPEATS:-3}" --time-budget $(( t - 15 )) \
      --out-dir "$ROOT/bench" > "$ROOT/bench.log" 2>&1
    stamp "bench rc=$?"
    mps_off;;
  profile)
    t=$(secs 15); [ -n "$t" ] || continue
    stamp "profile CELLS=${CELLS:-default}"
    OUT="$ROOT/profile" timeout -k 10 "$t" bash scripts/gpu_profile.sh > "$ROOT/profile.log" 2>&1
    stamp "profile rc=$?";;
  *) stamp "unknown step $s";;
  esac
done
stamp "call done"
OUT=$ROOT bash "$(dirname "$0")/pack_out.sh"
