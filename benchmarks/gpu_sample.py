"""Sampling on the device (daemon/kernels/cuda/sample.py) at a real vocabulary, on a GPU.

    python benchmarks/gpu_sample.py [--vocab 151936] [--n 50] [--chunk 2048]

Prints, per option set, rows S (1, 4, 16, 64) and kernel: the GPU time of one launch (CUDA events,
median of --n) for the two-phase sampler (sample_rows: phase 1 over chunks of the vocabulary, phase
2 a block a row; "two-phase A/B": A threads a phase-1 block, B a phase-2 block; sample_rows's
defaults are 256/1024) and the one-block kernel it replaced (sample_rows_single), at 256 and 1024
threads a block, and the CPU Sampler's time for one row; a configuration the kernel refuses prints
"refused: why". Then checks, at this vocabulary: the two kernels draw the same tokens from the same
seeds, greedy tokens (with the repeat penalty) equal the CPU's, and a CUDA graph of the launch
replays to the same tokens as eager launches from the same seeds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPTION_SETS = {
    "greedy+penalty": dict(temperature=0.0, repeat_penalty=1.1),
    "default": dict(),  # top_k 40, top_p 0.95, min_p 0.05, temperature 0.8, penalty 1.1
    "top_k=0 top_p=0.95": dict(top_k=0, min_p=0.0, repeat_penalty=1.0),
    "top_k=0 top_p=1 min_p=0.05": dict(top_k=0, top_p=1.0, repeat_penalty=1.0),
    "top_k=2000 (radix path)": dict(top_k=2000, repeat_penalty=1.0),
}
ROWS = (1, 4, 16, 64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--chunk", type=int, default=2048, help="logits a phase-1 block reads")
    args = ap.parse_args()
    from numba import cuda

    from daemon.backend.cuda_graphs import GraphCache, HostClock, nonblocking_stream
    from daemon.kernels.cuda.sample import SamplerSlots, sample_rows, sample_rows_single
    from daemon.sampling import Sampler, SamplingOptions

    V = args.vocab
    rng = np.random.default_rng(0)
    stream = nonblocking_stream()
    kernels = {
        "two-phase 256/1024": lambda *a: sample_rows(*a, stream=stream, threads=1024, chunk=args.chunk,
                                                     chunk_threads=256),
        "two-phase 1024/1024": lambda *a: sample_rows(*a, stream=stream, threads=1024, chunk=args.chunk,
                                                      chunk_threads=1024),
        "two-phase 256/256": lambda *a: sample_rows(*a, stream=stream, threads=256, chunk=args.chunk,
                                                    chunk_threads=256),
        "one-block T=256": lambda *a: sample_rows_single(*a, stream=stream, threads=256),
        "one-block T=1024": lambda *a: sample_rows_single(*a, stream=stream, threads=1024),
    }

    def to_host(a) -> list[int]:
        x = a.copy_to_host(stream=stream)
        stream.synchronize()
        return x.tolist()
    history = rng.integers(0, V, size=200).tolist()
    print(f"V={V}, chunk={args.chunk}; GPU us per launch (median of {args.n}); CPU ms per row")
    print(f"{'options':28s} {'S':>3s} {'kernel':20s} {'GPU us':>9s} {'CPU ms/row':>10s}")
    same = {}
    for name, fields in OPTION_SETS.items():
        o = SamplingOptions(seed=1, **fields)
        host = (rng.standard_normal((max(ROWS), V)) * 3).astype(np.float32)
        cpu = Sampler(o)
        t0 = time.perf_counter()
        for r in range(8):
            cpu.sample(host[r], history)
        cpu_ms = (time.perf_counter() - t0) / 8 * 1e3
        for S in ROWS:
            for kname, run in kernels.items():
                pool = SamplerSlots(S, 64)
                slots = cuda.to_device(np.array([pool.assign(o, history, 4096) for _ in range(S)], np.int32))
                logits = cuda.to_device(host[:S])
                tokens = cuda.device_array(S, np.int32)
                flags = cuda.device_array(S, np.int32)
                try:
                    run(logits, slots, pool, tokens, flags)  # compile, warm
                    stream.synchronize()
                except Exception as e:  # noqa: BLE001  (a refused configuration is a result here)
                    print(f"{name:28s} {S:3d} {kname:20s} refused: {type(e).__name__}: {e}"[:200])
                    continue
                if S == 16:  # first draws from the same seeds and logits: the kernels must agree
                    same.setdefault(name, {})[kname] = to_host(tokens)
                times = []
                for _ in range(args.n):
                    a, b = cuda.event(), cuda.event()
                    a.record(stream)
                    run(logits, slots, pool, tokens, flags)
                    b.record(stream)
                    b.synchronize()
                    times.append(cuda.event_elapsed_time(a, b) * 1e3)
                print(f"{name:28s} {S:3d} {kname:20s} {statistics.median(times):9.1f} {cpu_ms:10.2f}")
    for name, got in same.items():  # float64 sums follow the threads of the drawing block: compare like with like
        for t in ("256", "1024"):
            group = {tuple(v) for k, v in got.items() if k.endswith(("/" + t, "=" + t))}
            print(f"same first tokens, kernels drawing with {t} threads ({name}):", len(group) == 1)

    # greedy with the penalty equals the CPU's at this vocabulary
    host = (rng.standard_normal((16, V)) * 3).astype(np.float32)
    host[:, ::5] = np.round(host[:, ::5])  # ties
    o = SamplingOptions(temperature=0.0, repeat_penalty=1.3, repeat_last_n=64)
    pool = SamplerSlots(16, 64)
    slots = np.array([pool.assign(o, history, 4096) for _ in range(16)], np.int32)
    tokens = cuda.device_array(16, np.int32)
    flags = cuda.device_array(16, np.int32)
    sample_rows(cuda.to_device(host, stream=stream), cuda.to_device(slots, stream=stream), pool, tokens, flags, stream)
    want = [Sampler(o).sample(host[r], history) for r in range(16)]
    print("greedy + penalty == CPU:", to_host(tokens) == want)

    # a captured graph replays to the eager tokens
    o = SamplingOptions(seed=5)

    def run(graph: bool) -> list[list[int]]:
        pool = SamplerSlots(8, 64)
        slots = cuda.to_device(np.array([pool.assign(o, history, 4096) for _ in range(8)], np.int32))
        logits = cuda.device_array((8, V), np.float32)
        tokens = cuda.device_array(8, np.int32)
        flags = cuda.device_array(8, np.int32)
        out = []

        def step():
            sample_rows(logits, slots, pool, tokens, flags, stream)
            return tokens

        g = GraphCache().capture("sample", stream, step) if graph else None
        for i in range(4):
            logits.copy_to_device(host[i % 2:i % 2 + 8], stream=stream)
            if g is None:
                step()
            else:
                g.launch(stream, HostClock())
            out.append(to_host(tokens))
        return out

    eager, replayed = run(False), run(True)
    print("graph replay == eager:", eager == replayed, eager[-1])


if __name__ == "__main__":
    main()
