#!/usr/bin/env bash
# One lease of the GPU machine, used in few, full calls: old code against new and llama.cpp's
# CUDA build, on full-size synth files, all on the same machine.
#
#   here (with the registries):  bash benchmarks/gpu_lease.sh pack OLD_COMMIT
#       .device/ gets ../shared/device's bootstrap and wheels, old.tgz (OLD_COMMIT's daemon/ and
#       benchmarks/) and lcp.tgz (llama-cpp-python's vendored llama.cpp, LLAMA_CPP_PYTHON version).
#   device call 1:  eval "$(bash .device/bootstrap.sh)"; bash benchmarks/gpu_lease.sh prepare [q8 oss];
#                   MOED_COMMIT=<sha> bash benchmarks/gpu_tests.sh all -k "not smollm2 and not demo"
#       prepare starts, in sessions of their own (they outlive the call, not the machine), the
#       synth files (/tmp/oss.gguf, /tmp/q8.gguf; in the order given) and the llama.cpp build
#       (/tmp/lcp/build/bin).
#   device call 2, 3 (at once after the last, while the machine is warm):
#                   eval "$(bash .device/bootstrap.sh)"; bash benchmarks/gpu_lease.sh ab /tmp/q8.gguf q8
#       gpu_decode.py at this checkout ("new") and at old.tgz ("old"), then llama-bench -fa 0,1 and
#       llama-batched-bench B=1,16; logs and JSON to $OUT (6 files).
# A machine goes back 30 s after a call: a later call starts a bare one (minutes of device time).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
dev=.device

wait_for() {  # file, seconds
  local i
  for ((i = 0; i < $2; i += 5)); do [ -e "$1" ] && return 0; sleep 5; done
  echo "gave up waiting for $1 after $2 s" >&2; return 1
}

case ${1:-} in
  pack)
    old=${2:?usage: $0 pack OLD_COMMIT}
    mkdir -p $dev
    [ -f $dev/bootstrap.sh ] || cp -r ../shared/device/. $dev/ || echo "no ../shared/device: copy its bootstrap and wheels into $dev/" >&2
    git archive "$old" daemon benchmarks | gzip > $dev/old.tgz || exit 1
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --no-binary=:all: "llama-cpp-python==${LLAMA_CPP_PYTHON:-0.3.36}" -d "$tmp" || exit 1
    tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
    (cd "$tmp"/llama_cpp_python-*/vendor/llama.cpp &&
      tar czf - --exclude=tools/ui CMakeLists.txt cmake common ggml include src tools vendor licenses LICENSE scripts) > $dev/lcp.tgz
    rm -rf "$tmp"
    ls -la $dev/old.tgz $dev/lcp.tgz ;;
  prepare)
    touch /tmp/prepare.started  # ab: files are on their way
    # the files in the order asked (default oss q8); each TAG.done marks one, synth.done them all
    setsid bash -c 'for tag in '"${2:-oss q8}"'; do
        case $tag in
          oss) python3 -m daemon.cli synth /tmp/oss.gguf --like gpt-oss-20b > /tmp/synth-oss.log 2>&1 ;;
          q8) python3 -m daemon.cli synth /tmp/q8.gguf --like qwen3-30b-a3b --type Q8_0 > /tmp/synth-q8.log 2>&1 ;;
        esac
        touch /tmp/$tag.done
      done
      touch /tmp/synth.done' < /dev/null > /dev/null 2>&1 &
    if [ -f $dev/lcp.tgz ]; then
      # niced: the tests beside it compile kernels on the same cores
      setsid bash -c "mkdir -p /tmp/lcp && tar xzf $dev/lcp.tgz -C /tmp/lcp && cd /tmp/lcp &&
        cmake -S . -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release \
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
          -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_HTML=OFF > /tmp/lcp-build.log 2>&1 &&
        nice -n 15 cmake --build build -j 12 --target llama-bench llama-batched-bench >> /tmp/lcp-build.log 2>&1
        echo \"build rc=\$?\" >> /tmp/lcp-build.log; touch /tmp/lcp.done" < /dev/null > /dev/null 2>&1 &
    else
      echo "no $dev/lcp.tgz: no llama.cpp build (bash $0 pack OLD_COMMIT makes one)"
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader ;;
  ab)
    model=${2:?usage: $0 ab MODEL TAG [versions]}
    tag=${3:?usage: $0 ab MODEL TAG [versions]}
    versions=${4:-new old}
    # a machine given back meanwhile comes bare: nothing to wait for (prepare makes the files)
    if [ ! -e /tmp/$tag.done ] && [ ! -e /tmp/prepare.started ]; then
      echo "no /tmp/$tag.gguf and no synth making it: a fresh machine? run '$0 prepare' first" >&2; exit 1
    fi
    wait_for /tmp/$tag.done 540 || exit 1
    [ -d /tmp/old/daemon ] || { mkdir -p /tmp/old && tar xzf $dev/old.tgz -C /tmp/old; }
    for v in $versions; do
      if [ "$v" = old ]; then d=/tmp/old; else d=$PWD; fi
      (cd $d && PYTHONPATH=$d:${PYTHONPATH:-} timeout 240 python3 benchmarks/gpu_decode.py "$model" --prompt 512 \
        --steps 64 --batch 16 --profile 0 --graphs 1 --kernels 4 --json "$out/decode-$tag-$v.json" \
        > "$out/decode-$tag-$v.log" 2>&1)
      echo "== $v rc=$?"
      grep -E "GPU busy" "$out/decode-$tag-$v.log"
      python3 -c "import json, sys; d = json.load(open(sys.argv[1]))[0]
print({k: round(v, 2) for k, v in d.items() if k.endswith(('_tps', '_ms'))})" "$out/decode-$tag-$v.json"
    done
    if wait_for /tmp/lcp.done 300 && [ -x /tmp/lcp/build/bin/llama-bench ]; then
      b=/tmp/lcp/build/bin
      timeout 180 $b/llama-bench -m "$model" -ngl 99 -fa 0,1 -p 512 -n 128 -r 3 -t 16 > "$out/llama-bench-$tag.log" 2>&1
      grep -E "^\|" "$out/llama-bench-$tag.log"
      timeout 120 $b/llama-batched-bench -m "$model" -ngl 99 -c 8192 -b 2048 -ub 512 -npp 64 -ntg 128 -npl 1,16 \
        -t 16 -fa on > "$out/batched-$tag.log" 2>&1
      grep -E "^\|" "$out/batched-$tag.log"
    else
      tail -n 3 /tmp/lcp-build.log 2>/dev/null
    fi ;;
  *) echo "usage: $0 pack OLD_COMMIT | prepare [oss q8] | ab MODEL TAG [versions]" >&2; exit 2 ;;
esac
