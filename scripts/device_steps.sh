#!/usr/bin/env bash
# One device call as a list of steps, each within the call's own time limit, everything under
# $OUT packed into one bundle.tgz at the end (the device tool returns at most 8 files). For a
# session's short calls on a lent GPU; scripts/gpu_suite.sh is the whole suite in one go.
#   STEPS="build trace suite san ab bench" LIMIT=560 AFDEP_COMMIT=<hash> bash scripts/device_steps.sh
# Steps (in the order given):
#   build  pip install --no-build-isolation --no-deps -e . (build_inplace.py if pip fails)
#   trace  benchmarks.trace --arms afdep --replays 60 per layout of TRACE_LAYOUTS (default
#          "tokens experts") at TRACE_T (default 1), TRACE_EXTRA appended (e.g. --afdep-env X=1)
#   suite  the GPU suite's tests (gpu_suite.sh custom, SHARDS=1, BUILD=skip): PYTEST_K selects,
#          RESUME="<summary.txt or shard logs> ..." skips what passed there, SUITE_BUDGET (s;
#          default: what is left of LIMIT less 60)
#   san    compute-sanitizer memcheck of the tests/gpu cases SAN_K selects (default sanitizer)
#   ab     benchmarks.run, arms afdep and afdep_alt with AB_ENV (NAME=VALUE ...), layouts
#          AB_LAYOUTS (default "tokens experts"), T = AB_T, 3 repeats, within AB_LIMIT s
#   bench  benchmarks.run, arms afdep and symmetric, both layouts, T = BENCH_T (default
#          "1 32 128 512 2048"), BENCH_REPEATS (default 3), within what is left of LIMIT
# Both ranks share the one GPU under a CUDA MPS daemon that each GPU step starts and stops.
set -u
ROOT=$OUT
T0=$(date +%s)
LIMIT=${LIMIT:-560}
left() { echo $(( LIMIT - ( $(date +%s) - T0 ) )); }
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$ROOT/call.log"; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# test-only packages the device lacks (expecttest) travel in .carry/py (run's carry)
export PYTHONPATH="$PWD/.carry/py:$PWD" MAX_JOBS="${MAX_JOBS:-32}"
stamp "commit=${AFDEP_COMMIT:-?} steps=${STEPS:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$ROOT/call.log" 2>&1
mps_on() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/afdep-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/afdep-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d 2>/dev/null || true
}
mps_off() { echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 1; }
for s in ${STEPS:-}; do
  case $s in
  build)
    stamp "build"
    python3 -m pip install --no-build-isolation --no-deps -e . > "$ROOT/build.log" 2>&1 || {
      stamp "pip failed: build_inplace.py"
      WITH_BACKEND=1 python3 scripts/build_inplace.py >> "$ROOT/build.log" 2>&1; }
    python3 -c 'import torch_afdep._cuda as c, torch_afdep._C; print("extensions ok, cudart", c.runtime_version())' \
      2>&1 | tee -a "$ROOT/call.log"
    stamp "build done";;
  trace)
    mps_on
    for lay in ${TRACE_LAYOUTS:-tokens experts}; do
      stamp "trace $lay T=${TRACE_T:-1} ${TRACE_EXTRA:-}"
      timeout $(( $(left) > 130 ? 120 : $(left) - 10 )) python3 -m benchmarks.trace --tokens ${TRACE_T:-1} \
        --arms afdep --receive-layout "$lay" --replays 60 --out "$ROOT/trace-$lay.json" ${TRACE_EXTRA:-} \
        > "$ROOT/trace-$lay.log" 2>&1
      stamp "trace $lay rc=$?"
    done
    mps_off;;
  suite)
    stamp "suite -k '${PYTEST_K:-not sanitizer}' resume=${RESUME:-none}"
    env RESUME="${RESUME:-}" OUT="$ROOT/suite" BUILD=skip SKIP_SAN=1 SKIP_BENCH=1 SHARDS=1 \
      TEST_TIMEOUT="${SUITE_BUDGET:-$(( $(left) - 60 ))}" bash scripts/gpu_suite.sh custom \
      > "$ROOT/suite.log" 2>&1
    stamp "suite: $(head -1 "$ROOT/suite/shards/summary.txt" 2>/dev/null || echo 'no summary')";;
  san)
    mps_on
    stamp "memcheck -k ${SAN_K:-sanitizer}"
    AFDEP_TEST_SHARED_GPU=1 AFDEP_WORLD_START=spawn timeout $(( $(left) - 20 )) compute-sanitizer \
      --tool memcheck --target-processes all --error-exitcode 9 python3 -m pytest tests/gpu -q -rs \
      -p no:cacheprovider -k "${SAN_K:-sanitizer}" > "$ROOT/san.log" 2>&1
    stamp "memcheck rc=$?"
    grep -E "ERROR SUMMARY|passed|failed" "$ROOT/san.log" | tail -4 | tee -a "$ROOT/call.log"
    mps_off;;
  ab)
    mps_on
    stamp "ab ${AB_ENV:?AB_ENV} T=${AB_T:?AB_T}"
    timeout "${AB_LIMIT:-150}" python3 -m benchmarks.run --gpus 1 --arms afdep afdep_alt \
      --receive-layouts ${AB_LAYOUTS:-tokens experts} --tokens $AB_T --hidden 4096 --dtype bf16 \
      --routing random --repeats 3 --alt-env $AB_ENV --no-plot --out-dir "$ROOT/ab" > "$ROOT/ab.log" 2>&1
    stamp "ab rc=$?"
    mps_off;;
  bench)
    mps_on
    stamp "bench T=${BENCH_T:-1 32 128 512 2048}"
    timeout $(( $(left) - 15 )) python3 -m benchmarks.run --gpus 1 --arms afdep symmetric \
      --receive-layouts tokens experts --tokens ${BENCH_T:-1 32 128 512 2048} --hidden 4096 \
      --dtype bf16 --routing random --repeats "${BENCH_REPEATS:-3}" --time-budget $(( $(left) - 30 )) \
      --out-dir "$ROOT/bench" > "$ROOT/bench.log" 2>&1
    stamp "bench rc=$?"
    mps_off;;
  *) stamp "unknown step $s";;
  esac
done
stamp "call done"
OUT=$ROOT bash "$(dirname "$0")/pack_out.sh"
