#!/usr/bin/env bash
# ncu on each kernel of an exchange, in lockstep (benchmarks/lockstep.py: no kernel waits for
# a peer, so kernel replay is safe and no MPS daemon is needed). Run on the device machine
# from the repository root after a build (scripts/gpu_suite.sh BUILD=cuda-only leaves the
# extension in place). For each cell CELLS names ("layout:T", default tokens:1 experts:1
# tokens:32; H4096 BF16 1A1F):
#   1. durations: one-pass metrics (kernel time, cycles, warp instructions) of every kernel of
#      EXCHANGES exchanges, with ncu's cache control "all" (caches flushed before each
#      kernel) and "none" (as the previous kernels left them);
#   2. where the time goes: warp-state sampling (every 32 cycles) and the source counters
#      of a few kernels of each kind, exported per SASS instruction (--page source).
# Writes under $OUT (default ./gpu_out): ncu reports, their CSV exports, lockstep JSON, logs.
# Env: CELLS, EXCHANGES (default 40), SAMPLED (kernels sampled per cell, default 8),
#      NCU (default ncu), PACK=1 (pack $OUT into bundle.tgz at the end).
set -u -o pipefail
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 AFDEP_WORLD_START=spawn
export PYTHONPATH="$PWD:$PWD/.carry/py:${PYTHONPATH:-}"
NCU="${NCU:-ncu}"
CELLS="${CELLS:-tokens:1 experts:1 tokens:32}"
EXCHANGES="${EXCHANGES:-40}"
SAMPLED="${SAMPLED:-8}"
KERNELS='regex:dispatch_kernel|combine_kernel'
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
{
  $NCU --version 2>&1 | tail -2
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1
} | tee "$OUT/profile-env.log"

for cell in $CELLS; do
  rl=${cell%%:*}; T=${cell##*:}; name="$rl-T$T"
  args="--receive-layout $rl --tokens $T --hidden 4096 --dtype bf16"
  # the lockstep run alone: event times and output checks, no profiler
  timeout 180 python3 -m benchmarks.lockstep $args --exchanges 20 \
    --out "$OUT/lockstep-$name.json" > "$OUT/lockstep-$name.log" 2>&1
  stamp "lockstep $name: rc=$? $(grep -c median "$OUT/lockstep-$name.log") steps"
  for cc in all none; do
    timeout 240 $NCU --clock-control none --cache-control $cc --target-processes all \
      --kernel-name "$KERNELS" --metrics gpu__time_duration.sum,sm__cycles_elapsed.max,smsp__inst_executed.sum,sm__warps_launched.sum,launch__grid_size \
      -o "$OUT/dur-$name-cc$cc" -f \
      python3 -m benchmarks.lockstep $args --exchanges "$EXCHANGES" --out "$OUT/dur-$name-cc$cc.json" \
      > "$OUT/dur-$name-cc$cc.log" 2>&1
    stamp "durations $name cache-control $cc: rc=$?"
    $NCU -i "$OUT/dur-$name-cc$cc.ncu-rep" --page raw --csv > "$OUT/dur-$name-cc$cc.csv" 2>&1
  done
  # skip the first exchanges (module load, first touches) in either counting (per process or
  # overall): 4 kernels per exchange
  timeout 300 $NCU --clock-control none --cache-control none --target-processes all \
    --kernel-name "$KERNELS" --launch-skip 16 --launch-count "$SAMPLED" \
    --section LaunchStats --section WarpStateStats --section SourceCounters \
    --section SchedulerStats --section InstructionStats --warp-sampling-interval 0 \
    --import-source no -o "$OUT/samp-$name" -f \
    python3 -m benchmarks.lockstep $args --exchanges 14 --out "$OUT/samp-$name.json" \
    > "$OUT/samp-$name.log" 2>&1
  stamp "sampling $name: rc=$?"
  $NCU -i "$OUT/samp-$name.ncu-rep" --page details --csv > "$OUT/samp-$name-details.csv" 2>&1
  $NCU -i "$OUT/samp-$name.ncu-rep" --page raw --csv > "$OUT/samp-$name-raw.csv" 2>&1
  $NCU -i "$OUT/samp-$name.ncu-rep" --page source --csv --print-source sass \
    > "$OUT/samp-$name-source.csv" 2>&1
  stamp "exports $name: $(wc -c < "$OUT/samp-$name-source.csv") bytes of source page"
  python3 scripts/ncu_summary.py --dir "$OUT" --cell "$name" \
    --commit "${AFDEP_COMMIT:-?}" --out "$OUT/ncu-summary-$name.json" > "$OUT/ncu-summary-$name.log" 2>&1
done
stamp "profile done"
if [ "${PACK:-0}" = "1" ]; then bash "$(dirname "$0")/pack_out.sh"; fi
