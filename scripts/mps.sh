# CUDA MPS daemon helpers, sourced by scripts/gpu_suite.sh and scripts/device_steps.sh.
# mps_start PREFIX: the daemon with its pipe and log folders at PREFIX-pipe and PREFIX-log
# (exported for the clients started after it); its status is the daemon start's.
mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY="$1-pipe" CUDA_MPS_LOG_DIRECTORY="$1-log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d
}
# mps_quit: stops the daemon and waits until it is gone, so that a next start does not find
# it stopping (that start would fail). By the full command line: pgrep -x never matches a
# name over 15 characters.
mps_quit() {
  echo quit | nvidia-cuda-mps-control
  for _ in $(seq 50); do pgrep -f nvidia-cuda-mps-control >/dev/null || return 0; sleep 0.2; done
  echo "the MPS daemon did not stop in 10 s"
}
