#!/usr/bin/env bash
# Set up (or bring up to date) a development environment in ./.venv, doing only what is not
# done yet: create the virtual environment if absent, install requirements.txt when it is not
# satisfied, and build the C++ and (where nvcc exists) CUDA extensions only when their sources,
# setup.py, torch's version or an AFDEP_BUILD_* variable changed (scripts/setup_check.py keeps
# the stamp). A second run takes seconds.
#   bash scripts/setup.sh           set up
#   bash scripts/setup.sh --check   say what a run would do; exit 1 when it would do anything
# Env: VENV (default .venv), PYTHON (the interpreter that creates it, default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
CHECK=0
[ "${1:-}" = "--check" ] && CHECK=1
say() { echo "[setup] $*"; }

if [ ! -x "$VENV/bin/python" ]; then
  if [ "$CHECK" = 1 ]; then say "would create $VENV, install requirements and build"; exit 1; fi
  say "creating the virtual environment $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"
STAMP_FILE="$VENV/.torch_afdep-build-stamp"
TODO=0

if "$PY" scripts/setup_check.py requirements requirements.txt; then
  say "requirements satisfied"
else
  TODO=1
  if [ "$CHECK" = 1 ]; then
    say "would install requirements.txt"
  else
    say "installing requirements.txt (first time: torch and the test tools)"
    "$PY" -m pip install --progress-bar on -r requirements.txt
  fi
fi

if [ "$CHECK" = 0 ] || [ "$TODO" = 0 ]; then
  if "$PY" scripts/setup_check.py build-needed "$STAMP_FILE"; then
    TODO=1
    if [ "$CHECK" = 1 ]; then
      say "would build the extensions (sources, setup.py, torch or build variables changed)"
    else
      STAMP=$("$PY" scripts/setup_check.py stamp)  # of the sources this build compiles
      LOG="$VENV/torch_afdep-build.log"
      if command -v nvcc >/dev/null 2>&1 && [ "${AFDEP_BUILD_CUDA:-auto}" != "0" ]; then
        say "building torch_afdep._C (c10d backend) and torch_afdep._cuda (nvcc found; 1-3 min)"
      else
        say "building torch_afdep._C (c10d backend; no nvcc, so no CUDA extension)"
      fi
      say "full log: $LOG"
      # pip -v streams the build; show ninja's steps ([i/n] ... -c <source>) as they happen.
      : >"$LOG"  # exists before tail follows it (else tail may start first and give up)
      "$PY" -m pip install -v --no-build-isolation --no-deps -e . >"$LOG" 2>&1 </dev/null &
      PIP_PID=$!
      tail -n +1 -f "$LOG" --pid="$PIP_PID" 2>/dev/null | awk '
        /^ *\[[0-9]+\/[0-9]+\]/ {
          src = ""
          for (i = 2; i <= NF; i++) if ($i == "-c") { src = $(i + 1) }
          sub(".*/csrc/", "csrc/", src)
          print "[setup]   " $1 " " (src != "" ? "compile " src : "link"); fflush() }' \
        || true  # the progress lines are cosmetic: only pip's own status (below) decides
      if ! wait "$PIP_PID"; then
        say "build FAILED; the end of $LOG:"
        tail -40 "$LOG"
        exit 1
      fi
      echo "$STAMP" >"$STAMP_FILE"
      say "build done"
    fi
  else
    say "extensions up to date (stamp matches)"
  fi
fi

if [ "$CHECK" = 1 ]; then exit "$TODO"; fi
say "ready: $PY"
