"""Sampling on the device (daemon/kernels/cuda/sample.py) at a real vocabulary, on a GPU.

    python benchmarks/gpu_sample.py [--vocab 151936] [--n 50]

Prints, per option set, rows S and threads per block: the GPU time of one sample_rows launch (CUDA
events, median of --n) and, for comparison, the CPU Sampler's time for one row. Then checks, at
this vocabulary: greedy tokens (with the repeat penalty) equal the CPU's, and a CUDA graph of the
launch replays to the same tokens as eager launches from the same seeds.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--n", type=int, default=50)
    args = ap.parse_args()
    from numba import cuda

    from daemon.backend.cuda_graphs import GraphCache, HostClock, nonblocking_stream
    from daemon.kernels.cuda.sample import SamplerSlots, sample_rows
    from daemon.sampling import Sampler, SamplingOptions

    V = args.vocab
    rng = np.random.default_rng(0)
    stream = nonblocking_stream()

    def to_host(a) -> list[int]:
        x = a.copy_to_host(stream=stream)
        stream.synchronize()
        return x.tolist()
    history = rng.integers(0, V, size=200).tolist()
    print(f"V={V}; GPU us per launch (median of {args.n}); CPU ms per row")
    print(f"{'options':30s} {'S':>3s} {'threads':>7s} {'GPU us':>9s} {'CPU ms/row':>10s}")
    for name, fields in OPTION_SETS.items():
        o = SamplingOptions(seed=1, **fields)
        host = (rng.standard_normal((32, V)) * 3).astype(np.float32)
        cpu = Sampler(o)
        t0 = time.perf_counter()
        for r in range(8):
            cpu.sample(host[r], history)
        cpu_ms = (time.perf_counter() - t0) / 8 * 1e3
        for S in (1, 8, 32):
            pool = SamplerSlots(S, 64)
            slots = cuda.to_device(np.array([pool.assign(o, history, 4096) for _ in range(S)], np.int32))
            logits = cuda.to_device(host[:S])
            tokens = cuda.device_array(S, np.int32)
            flags = cuda.device_array(S, np.int32)
            for threads in (256, 1024):
                sample_rows(logits, slots, pool, tokens, flags, stream, threads)  # compile, warm
                times = []
                for _ in range(args.n):
                    a, b = cuda.event(), cuda.event()
                    a.record(stream)
                    sample_rows(logits, slots, pool, tokens, flags, stream, threads)
                    b.record(stream)
                    b.synchronize()
                    times.append(cuda.event_elapsed_time(a, b) * 1e3)
                print(f"{name:30s} {S:3d} {threads:7d} {statistics.median(times):9.1f} {cpu_ms:10.2f}")

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
