"""The GPU mode of benchmarks/run.py (--device cuda): moed's VRAM expert cache next to llama.cpp's
CUDA build (llama-bench) given the same VRAM for experts.

    expert_blocks(model) -> {block: bytes}   the expert tensors llama.cpp's --n-cpu-moe moves, per block
    n_cpu_moe(blocks, budget) -> N           the --n-cpu-moe that keeps at most `budget` bytes of them in VRAM
    llama_bench(...) -> a row                one llama-bench run (-o json), parsed; a failure is {"error": ...}
    moed(spec) -> a row                      one moed run in a child process (gpu_offload.measure)

llama.cpp's `--n-cpu-moe N` keeps the expert tensors of blocks 0..N-1 in host memory (the tensors
whose names match `blk\\.<i>\\.ffn_(up|down|gate|gate_up)_(ch|)exps`, biases included: common.h's
llm_ffn_block_regex) and every other tensor on the GPU (-ngl 99). So the N that gives llama.cpp at
most the VRAM moed's cache gets is the smallest N whose blocks N.. hold at most that many expert
bytes (as stored in the file): with E expert layers of B bytes each, N = E - floor(budget / B).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(?:up|down|gate|gate_up)_(?:ch|)exps")
LLAMA_REPS = 3  # llama-bench -r
LLAMA_TIMEOUT_S = 3600


def model_info(model: str) -> dict:
    """{"blocks": {block: expert bytes}, "synthesized": written by `moed synth`} of a GGUF file."""
    from daemon.storage.gguf import GGUFFile

    with GGUFFile(model) as g:
        blocks: dict[int, int] = {}
        for name, t in g.tensors.items():
            if m := EXPERT_TENSOR.match(name):
                blocks[int(m[1])] = blocks.get(int(m[1]), 0) + t.nbytes
        name = g.metadata.get("general.name", "")
    return {"blocks": blocks, "synthesized": isinstance(name, str) and name.startswith("moed-synth-")}


def n_cpu_moe(blocks: dict[int, int], budget_bytes: int) -> int:
    """The smallest N such that the expert bytes of blocks >= N are at most budget_bytes."""
    n, kept = max(blocks, default=-1) + 1, 0
    for b in range(n - 1, -1, -1):
        kept += blocks.get(b, 0)
        if kept > budget_bytes:
            break
        n = b
    return n


def on_gpu(blocks: dict[int, int], ncmoe: int) -> tuple[int, int]:
    """(expert layers, expert bytes) llama.cpp keeps in VRAM with --n-cpu-moe ncmoe."""
    kept = [nbytes for b, nbytes in blocks.items() if b >= ncmoe]
    return len(kept), sum(kept)


def mib(nbytes: int) -> str:
    x = nbytes / 2**20
    return f"{x:,.0f}" if x >= 10 else f"{x:.2f}"


def llama_bench(binary: str, model: str, ncmoe: int, decode: int, threads: int, prompt: int = 0) -> dict:
    """One `llama-bench -o json` run: decode tok/s (avg_ts, stddev_ts over LLAMA_REPS repetitions), and with
    prompt > 0 also its prefill test of that many tokens (prefill_tok_s; its experts come from the warm
    mapping)."""
    argv = [binary, "-m", model, "-ngl", "99", "-ncmoe", str(ncmoe), "-p", str(prompt), "-n", str(decode),
            "-r", str(LLAMA_REPS), "-t", str(threads), "-o", "json"]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=LLAMA_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"llama-bench failed: {e}"}
    if p.returncode:
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        return {"error": f"llama-bench failed (exit status {p.returncode})" + (f": {lines[-1]}" if lines else "")}
    try:
        tests = json.loads(p.stdout[p.stdout.index("["):])
        (test,) = [t for t in tests if t.get("n_gen") == decode and not t.get("n_prompt")]
        row = {"decode_tok_s": float(test["avg_ts"]), "decode_tok_s_stddev": float(test["stddev_ts"]),
               "n_gen": test["n_gen"], "n_cpu_moe_run": test.get("n_cpu_moe"), "n_threads": test.get("n_threads"),
               "samples_ts": test.get("samples_ts"), "gpu_info": test.get("gpu_info"),
               "backends": test.get("backends"), "build_commit": test.get("build_commit"), "argv": argv[1:]}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {"error": f"llama-bench printed no decode result (n_gen {decode}) in its JSON: {p.stdout[-200:]!r}"}
    if prompt:
        pre = [t for t in tests if isinstance(t, dict) and t.get("n_prompt") == prompt and not t.get("n_gen")]
        if len(pre) != 1 or not isinstance(pre[0].get("avg_ts"), (int, float)):
            return {"error": f"llama-bench printed no prefill result (n_prompt {prompt}) in its JSON"}
        row |= {"prefill_tok_s": float(pre[0]["avg_ts"]), "prefill_tok_s_stddev": float(pre[0].get("stddev_ts", 0.0))}
    return row


def moed(spec: dict) -> dict:
    """A moed row in this (child) process: gpu_offload.measure on spec's settings; a MoedError (no CUDA,
    the model does not fit, ...) is the row's error."""
    import numba

    import gpu_offload
    from daemon.errors import MoedError

    try:
        row = gpu_offload.measure(spec["model"], f"{spec['gpu_cache_mb']:g}", spec["replay"] or "uniform",
                                  spec["min_batch"], prompt=spec["ids"], warmup=spec["warmup"], steps=spec["decode"],
                                  settings={"n_threads": spec["threads"]},
                                  say=lambda m: print(m, file=sys.stderr, flush=True))
    except MoedError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {k: v for k, v in row.items() if k not in ("model", "cache_mb", "min_batch")} | {
        "numba_threads": numba.get_num_threads()}
