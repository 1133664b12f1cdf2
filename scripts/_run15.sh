#!/usr/bin/env bash
# temporary: session 5, device call 1
set -u
O=$OUT; T0=$(date +%s); left() { echo $(( 570 - ($(date +%s) - T0) )); }
export AFDEP_COMMIT=b90b719 NCCL_NVLS_ENABLE=0
BUILD=cuda-only SKIP_BENCH=1 SKIP_SAN=1 MPS=1 TEST_TIMEOUT=270 PYTEST_X=--timeout=100 \
  PYTEST_K="sized_grid or stream_expansion or flag_round_trip or previous_exchange" \
  bash scripts/gpu_suite.sh custom > $O/suite.log 2>&1
export PYTHONPATH=$PWD
echo "left $(left)" >> $O/suite.log
AFDEP_SYMMETRIC=1 timeout 80 python3 -m pytest tests/gpu -v -rA -p no:cacheprovider --timeout=70 -k two_microbatch > $O/sym_2mb.log 2>&1; echo "rc=$?" >> $O/sym_2mb.log
i=0
for x in "" "AFDEP_SIZED_GRID=1" "AFDEP_SIZED_GRID=1 AFDEP_STREAM_EXPANSION=1"; do
  i=$((i+1)); L=$(left); [ $L -lt 70 ] && { echo "skip $x (left $L)" >> $O/bench_skips.log; continue; }
  mkdir -p $O/ab$i
  if [ -n "$x" ]; then ae="--afdep-env $x"; else ae=""; fi
  timeout $((L-10)) python3 -m benchmarks.run --hidden 4096 --dtype bf16 --routing random --arms afdep symmetric \
    --repeats 2 --time-budget $((L-30)) --queue-ahead-us 50 --out-dir $O/ab$i --no-plot $ae > $O/ab$i/bench.log 2>&1
  echo "rc=$?" >> $O/ab$i/bench.log
done
OUT=$O bash scripts/pack_out.sh
