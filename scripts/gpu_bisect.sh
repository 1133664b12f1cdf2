#!/usr/bin/env bash
# Run one GPU test selection under the default protocol and then with each named control
# reverted, to find which protocol change a failure needs. Logs under $OUT (default ./gpu_out).
#   scripts/gpu_bisect.sh '<pytest -k expr>' [AFDEP_X ...]   (default: every AFDEP_* control)
# Assumes the extension is built (scripts/gpu_suite.sh builds it).
set -u -o pipefail
K="$1"; shift
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
if [ $# -eq 0 ]; then
  set -- $(python3 -c 'from torch_afdep import controls; print(" ".join(controls.CONTROLS))')
fi
for v in default "$@"; do
  if [ "$v" = default ]; then envs=(); else envs=("$v=0"); fi
  log="$OUT/bisect-$v.log"
  env "${envs[@]}" timeout -s INT "${BISECT_TIMEOUT:-120}" python3 -m pytest tests/gpu -q -x \
    -p no:cacheprovider -k "$K" >"$log" 2>&1
  echo "$v: rc=$? $(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$log" | tail -1)"
  grep -E "relative error|tokens wrong|Error" "$log" | head -3 | cut -c1-1500
done
