#!/usr/bin/env bash
# Run one GPU test selection under the default protocol and then with each named control
# reverted, to find which protocol change a failure needs. Logs under $OUT (default ./gpu_out).
#   scripts/gpu_bisect.sh '<pytest -k expr>' [ARM ...]   (default: every AFDEP_* control)
# An ARM is a control name (run with it set to 0) or comma-separated NAME=VALUE settings
# (e.g. AFDEP_WIDE_LOCAL=0,AFDEP_TEST_COMBINE_DELAY_MS=5).
# Assumes the extension is built (scripts/gpu_suite.sh builds it). BISECT_DEFAULT=0 skips
# the default arm. Selects from tests/gpu and the contract's CUDA cases (-m gpu); layouts whose
# ranks share a GPU (every multi-rank layout on one GPU) need a running MPS daemon and
# AFDEP_TEST_SHARED_GPU=1 (scripts/gpu_suite.sh shows how), else they skip.
set -u -o pipefail
K="$1"; shift
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
if [ $# -eq 0 ]; then
  set -- $(python3 -c 'from torch_afdep import controls; print(" ".join(controls.CONTROLS))')
fi
arms=("$@"); [ "${BISECT_DEFAULT:-1}" = 1 ] && arms=(default "$@")
TESTS="tests/gpu tests/contract"
python3 -c 'import torch_afdep._C' >/dev/null 2>&1 || \
  TESTS="$TESTS --ignore=tests/contract/test_backend.py --ignore=tests/contract/test_mesh.py"
for v in "${arms[@]}"; do
  if [ "$v" = default ]; then envs=()
  elif [[ "$v" == *=* ]]; then IFS=, read -r -a envs <<<"$v"
  else envs=("$v=0"); fi
  log="$OUT/bisect-$(echo "$v" | tr -c 'A-Za-z0-9_.\n-' '_').log"
  env "${envs[@]}" timeout -s INT "${BISECT_TIMEOUT:-120}" python3 -m pytest $TESTS -m gpu -q -x \
    -p no:cacheprovider -k "$K" >"$log" 2>&1
  echo "$v: rc=$? $(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$log" | tail -1)"
  grep -E "relative error|tokens wrong|Error" "$log" | head -3 | cut -c1-1500
done
