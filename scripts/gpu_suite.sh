#!/usr/bin/env bash
# The whole GPU suite in one call on the device machine: build, GPU tests (shared-GPU layouts
# under CUDA MPS), compute-sanitizer memcheck on small exchanges, and the benchmarks.
# Logs and JSON go under $OUT (default ./gpu_out). Usage:
#   scripts/gpu_suite.sh [full|smoke|custom]   (full: every GPU test; smoke: a quick subset;
#                                               custom: PYTEST_K selects)
# Env: BUILD=pip|cuda-only|skip, PYTEST_K (-k filter), PYTEST_X (extra pytest args, e.g.
#      --timeout=120), TEST_TIMEOUT (s: the whole test run's budget, not a per-test limit;
#      tests it leaves unstarted are listed as NOT RUN), SKIP_TESTS=1 (no GPU tests: a call
#      for the build, memcheck or a benchmark alone), MPS=0 (no MPS daemon), SKIP_SAN=1,
#      SAN_TIMEOUT, SAN_K (the memcheck run's -k filter, default sanitizer: every test named so),
#      SKIP_BENCH=1, BENCH_ARGS (args for python -m benchmarks.run), SOAK=<replays>,
#      OVERLAP=1, TRACE=1, TRACE_ARGS (args for python -m benchmarks.trace), TRACE_TIMEOUT,
#      TRACE_ALT_ENV (NAME=VALUE ...: the trace once more with these controls, trace-alt.json),
#      AFDEP_COMMIT (the commit a copied tree records in results),
#      SHARDS=<n> (n concurrent pytest shards under MPS, each with 1/n of the SMs; the tests
#      SERIAL_K selects, and failures, run alone afterwards: scripts/shard_pytest.py;
#      RESUME="<summary.txt or shard log of an earlier call at the same commit> ..." skips
#      what passed there),
#      PACK=1 (pack $OUT into one bundle.tgz at the end), MARKED=1 (also the gpu-marked tests
#      outside tests/gpu and tests/contract, e.g. the doctor's; always in full mode).
#      Test-only packages the device lacks (expecttest) can travel in .carry/py (git-ignored;
#      `run` carry=[".carry"]): it goes on PYTHONPATH when present.
#      Experimental controls for the whole suite: export them (every rank sees the caller's
#      environment; a test's own settings go on top), e.g. AFDEP_RAW_META=1.
# Tests: tests/gpu (GPU-only) and the CUDA cases of tests/contract (-m gpu). Rank r runs on
# GPU r % n_gpus, so one GPU runs everything (ranks share it under the MPS daemon started
# below; 2-GPU-only tests, NCCL one rank per GPU, skip with their reason).
set -u -o pipefail
MODE="${1:-full}"
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
export MAX_JOBS="${MAX_JOBS:-32}"
PY=python3
if [ -d "$PWD/.carry/py" ]; then export PYTHONPATH="$PWD/.carry/py:${PYTHONPATH:-}"; fi
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

{
  stamp "mode=$MODE commit=${AFDEP_COMMIT:-?}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  nvidia-smi topo -m 2>&1 | head -5
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
} 2>&1 | tee "$OUT/env.log"

# ---- build -----------------------------------------------------------------------------
# BUILD=cuda-only builds torch_afdep._cuda in place, plus the c10d backend (torch_afdep._C)
# when the gpu-marked tests outside tests/gpu run (they need it)
if [ "$MODE" = "full" ] || [ "${MARKED:-0}" = "1" ]; then export WITH_BACKEND=1; fi
stamp "build: pip install --no-build-isolation --no-deps -e . (BUILD=${BUILD:-pip})" | tee "$OUT/build.log"
if [ "${BUILD:-pip}" = "skip" ]; then
  stamp "build skipped (BUILD=skip)" | tee -a "$OUT/build.log"
elif [ "${BUILD:-pip}" = "cuda-only" ] || ! $PY -m pip install --no-build-isolation --no-deps -e . >>"$OUT/build.log" 2>&1; then
  stamp "BUILD=cuda-only or pip install failed: building the extensions in place" | tee -a "$OUT/build.log"
  $PY "$(dirname "$0")/build_inplace.py" >>"$OUT/build.log" 2>&1
  export PYTHONPATH="$PWD:${PYTHONPATH:-}"
fi
stamp "build done" | tee -a "$OUT/build.log"
$PY -c 'import torch_afdep._cuda as c; print("extension ok, cudart", c.runtime_version())' 2>&1 | tee -a "$OUT/build.log"

# ---- tests ---------------------------------------------------------------------------
# Layouts with several ranks on one GPU need kernels of several processes to run at once:
# start a CUDA MPS daemon for the tests (MPS=0 skips; those tests then skip themselves).
# Its stop waits until the daemon is gone (scripts/mps.sh), else a next call's start would
# fail and the shared-GPU tests would skip.
. "$(dirname "$0")/mps.sh"
if [ "${MPS:-1}" = "1" ] && command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  if mps_start /tmp/afdep-mps; then
    export AFDEP_TEST_SHARED_GPU=1
    trap mps_quit EXIT
    stamp "MPS daemon started: shared-GPU layouts enabled" | tee -a "$OUT/env.log"
  fi
fi
# SKIP_TESTS=1: none of the GPU tests (nor the probe of forked worlds they use)
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  # GPU worlds fork from a server that imported torch once (seconds saved per test) when a
  # probe world gets working CUDA that way; else (or with AFDEP_WORLD_START set) as given
  if [ -z "${AFDEP_WORLD_START:-}" ]; then
    if AFDEP_WORLD_START=forkserver timeout 90 $PY -c 'from torch_afdep.testing import spawn_world, cuda_probe_body
assert spawn_world(cuda_probe_body, 2, device_ids=[0, 0], timeout=80) == [2.0, 2.0]' >>"$OUT/env.log" 2>&1; then
      export AFDEP_WORLD_START=forkserver
      stamp "forked GPU worlds work: AFDEP_WORLD_START=forkserver" | tee -a "$OUT/env.log"
    else
      stamp "forked GPU worlds failed the probe (env.log): GPU worlds spawn" | tee -a "$OUT/env.log"
    fi
  fi
  if [ "$MODE" = "smoke" ]; then
    # about 5 minutes on 2 x H200: every kernel path of 1A1F, the contract's 1A1F exchanges
    K="(eager_role_aware and 1A1F-128-7168) or (eager_symmetric and 1A1F-128-2048) or (control and 1A1F and (WIDE or ROLE_WARPS or ONE_WAY)) or timeout_raises or (graph_replays and 1A1F-bfloat16) or (hostile_graph and 1A1F) or (duplicate and 1A1F) or previous_exchange or zero_copy or (fp64_reference and 1A1F)"
  elif [ "$MODE" = "custom" ]; then
    K="${PYTEST_K:-not sanitizer}"
    PYTEST_K=""
  else
    K="not sanitizer"
  fi
  [ -n "${PYTEST_K:-}" ] && K="($K) and ($PYTEST_K)"
  # The contract's CUDA cases (marked gpu) run with tests/gpu; its backend and mesh files need
  # the c10d extension (torch_afdep._C): left out, and said so, when it was not built.
  TESTS="tests/gpu tests/contract"
  if ! $PY -c 'import torch_afdep._C' >/dev/null 2>&1; then
    TESTS="$TESTS --ignore=tests/contract/test_backend.py --ignore=tests/contract/test_mesh.py"
    stamp "torch_afdep._C not built: tests/contract/test_backend.py and test_mesh.py left out" | tee -a "$OUT/env.log"
  fi
  stamp "pytest $TESTS -m gpu -k '$K' (shards: ${SHARDS:-1})" | tee "$OUT/tests.log"
  if [ -n "${SHARDS:-}" ] || [ -n "${RESUME:-}" ]; then
    # shard_pytest.py: a per-test summary.txt that RESUME can take; SHARDS=1 is one serial
    # pytest (the fastest with forked worlds: about 3 s a test on one H200); SHARDS>1 runs
    # concurrent shards under MPS, each with 1/SHARDS of the SMs, failures rerun alone, and
    # tests whose worlds wait at barriers or hold many ranks run alone after the shards
    SERIAL_K="${SERIAL_K:-symmetric or control or 2A2F or 3A1F or 1A3F or 4A2F or 1A2F or previous_exchange or zero_copy or connector or fault or killed or timeout or skipped}"
    RESUME_ARGS=(); for r in ${RESUME:-}; do RESUME_ARGS+=(--resume "$r"); done
    $PY scripts/shard_pytest.py --shards "${SHARDS:-1}" --budget "${TEST_TIMEOUT:-420}" \
      --out "$OUT/shards" --serial-k "$SERIAL_K" ${RESUME_ARGS[@]+"${RESUME_ARGS[@]}"} \
      -- $TESTS -m gpu -k "$K" >>"$OUT/tests.log" 2>&1
  else
    timeout -s INT -k 30 "${TEST_TIMEOUT:-420}" $PY -m pytest $TESTS -m gpu -v ${PYTEST_X:-} -rA -s -p no:cacheprovider -k "$K" \
      --durations=15 >>"$OUT/tests.log" 2>&1
  fi
  echo "pytest rc=$?" | tee -a "$OUT/tests.log"
  # Other gpu-marked tests (tests/tools, tests/perf: the doctor's CUDA self-test); full mode, or MARKED=1
  if [ "$MODE" = "full" ] || [ "${MARKED:-0}" = "1" ]; then
    stamp "pytest -m gpu (outside tests/gpu and tests/contract)" | tee "$OUT/tests-marked.log"
    # only the files that hold gpu-marked tests (others may need test-only packages)
    MARKED_FILES=$(grep -rl "mark.gpu" tests --include='test_*.py' | grep -v -e '^tests/gpu/' -e '^tests/contract/')
    if [ -n "$MARKED_FILES" ]; then
      timeout -s INT -k 30 "${MARKED_TIMEOUT:-240}" $PY -m pytest $MARKED_FILES -m gpu -v \
        -rA -p no:cacheprovider ${PYTEST_X:-} >>"$OUT/tests-marked.log" 2>&1
      echo "pytest (marked) rc=$?" | tee -a "$OUT/tests-marked.log"
    else
      echo "no gpu-marked files outside tests/gpu and tests/contract" | tee -a "$OUT/tests-marked.log"
    fi
    tail -8 "$OUT/tests-marked.log"
  fi
  tail -25 "$OUT/tests.log"
fi

# ---- compute-sanitizer -------------------------------------------------------------
# With fewer than two GPUs the small sanitizer layouts share a GPU: they run under the MPS
# daemon still up; with two or more GPUs they run one rank per GPU.
if [ "${SKIP_SAN:-0}" != "1" ]; then
  stamp "compute-sanitizer memcheck (small 1A1F, 1A2F; shared GPU: ${AFDEP_TEST_SHARED_GPU:-0})" | tee "$OUT/sanitizer.log"
  AFDEP_WORLD_START=spawn timeout "${SAN_TIMEOUT:-240}" compute-sanitizer --tool memcheck --target-processes all \
    --error-exitcode 9 $PY -m pytest tests/gpu -q -x -rs -p no:cacheprovider -k "${SAN_K:-sanitizer}" \
    >>"$OUT/sanitizer.log" 2>&1
  echo "sanitizer rc=$?" | tee -a "$OUT/sanitizer.log"
  grep -E "ERROR SUMMARY|passed|failed|error|SKIPPED" "$OUT/sanitizer.log" | tail -8
fi
# The benchmarks run one rank per GPU where there are enough GPUs, without MPS; on one GPU
# their ranks share it, which needs the daemon (the benchmarks skip such arms without it): it
# stays up until the script exits.
NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "${AFDEP_TEST_SHARED_GPU:-0}" = "1" ] && [ "$NGPU" -ge 2 ]; then
  mps_quit; trap - EXIT
  unset AFDEP_TEST_SHARED_GPU CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi

# ---- benchmarks (each optional; all write JSON/MD under $OUT) ----------------------------
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  stamp "benchmarks.run ${BENCH_ARGS:-}" | tee "$OUT/bench.log"
  timeout -s INT "${BENCH_TIMEOUT:-300}" $PY -m benchmarks.run --out-dir "$OUT" \
    --queue-ahead-us 200 ${BENCH_ARGS:-} >>"$OUT/bench.log" 2>&1
  echo "bench rc=$?" | tee -a "$OUT/bench.log"
  tail -24 "$OUT/bench.log"
fi
if [ -n "${SOAK:-}" ]; then  # SOAK=<replays>, e.g. 100000
  stamp "benchmarks.soak --replays $SOAK" | tee "$OUT/soak.log"
  timeout "${SOAK_TIMEOUT:-240}" $PY -m benchmarks.soak --replays "$SOAK" --check-every \
    "${SOAK_CHECK_EVERY:-100}" --out-dir "$OUT" >>"$OUT/soak.log" 2>&1
  echo "soak rc=$?" | tee -a "$OUT/soak.log"; tail -3 "$OUT/soak.log"
fi
if [ "${OVERLAP:-0}" = "1" ]; then
  stamp "benchmarks.overlap" | tee "$OUT/overlap.log"
  timeout 150 $PY -m benchmarks.overlap --out-dir "$OUT" ${OVERLAP_ARGS:-} >>"$OUT/overlap.log" 2>&1
  echo "overlap rc=$?" | tee -a "$OUT/overlap.log"; tail -14 "$OUT/overlap.log"
fi
if [ "${TRACE:-0}" = "1" ]; then
  stamp "benchmarks.trace" | tee "$OUT/trace.log"
  timeout "${TRACE_TIMEOUT:-150}" $PY -m benchmarks.trace --out "$OUT/trace.json" ${TRACE_ARGS:-} \
    >>"$OUT/trace.log" 2>&1
  echo "trace rc=$?" | tee -a "$OUT/trace.log"; tail -34 "$OUT/trace.log"
fi
if [ "${TRACE:-0}" = "1" ] && [ -n "${TRACE_ALT_ENV:-}" ]; then  # the same trace, controls on top
  stamp "benchmarks.trace --afdep-env $TRACE_ALT_ENV" | tee "$OUT/trace-alt.log"
  timeout "${TRACE_TIMEOUT:-150}" $PY -m benchmarks.trace --out "$OUT/trace-alt.json" ${TRACE_ARGS:-} \
    --afdep-env $TRACE_ALT_ENV >>"$OUT/trace-alt.log" 2>&1
  echo "trace (alt) rc=$?" | tee -a "$OUT/trace-alt.log"; tail -34 "$OUT/trace-alt.log"
fi
stamp "suite done"
# PACK=1: one $OUT/bundle.tgz instead of many files (the device returns at most 8)
if [ "${PACK:-0}" = "1" ]; then bash "$(dirname "$0")/pack_out.sh"; fi
