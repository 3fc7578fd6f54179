"""Decode and prefill on the CUDA backend, with where a decode step's time goes.

    python benchmarks/gpu_decode.py MODEL.gguf [--prompt 64] [--steps 32] [--batch 8] [--profile 4] [--graphs 0,1]

Loads MODEL on cuda:0 as the engine does (weights and every expert in VRAM), then times:
prefill of --prompt tokens; greedy-free decode steps of one sequence (median ms, tok/s); one step of
--batch sequences; and a cProfile of --profile decode steps, whose top entries by own time show
what the host spends a step on (kernel launches are numba's dispatcher `__call__` / `launch`).
With --graphs 0,1 the same in one process with decode steps launched kernel by kernel and replayed
as CUDA graphs: a graph's step is the GPU's time (kernels, ~1 us each between them), the eager
step minus that is the host's (Python, launches).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from daemon.backend.cuda import CUDABackend  # noqa: E402
from daemon.model.transformer import Transformer  # noqa: E402
from daemon.storage.gguf import GGUFFile  # noqa: E402


def timed(fn, sync) -> float:
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--profile", type=int, default=4)
    ap.add_argument("--graphs", default="1", help="1: decode steps replayed as CUDA graphs, 0: eager, 0,1: both")
    ap.add_argument("--json")
    args = ap.parse_args()
    from numba import cuda

    t0 = time.perf_counter()
    g = GGUFFile(args.model)
    backend = CUDABackend(0, max_slots=args.batch + 2)
    model = Transformer(g, experts=backend.resident_experts(g), backend=backend)
    load_s = time.perf_counter() - t0
    print(f"load {load_s:.1f} s, VRAM {backend.vram_bytes() / 2**20:,.0f} MiB ({backend.memory_note()})", flush=True)
    rows = []
    for graphs in [v.strip() == "1" for v in args.graphs.split(",")]:
        backend.use_graphs = graphs
        res, prof = measure(args, model, cuda)
        res.update(graphs=graphs, load_s=load_s, captures=backend.graphs.captures, replays=backend.graphs.replays)
        rows.append(res)
        print(json.dumps(res, indent=1))
        print(prof, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def measure(args, model, cuda) -> tuple[dict, str]:
    rng = np.random.default_rng(0)
    V = model.hp.n_vocab
    n_ctx = args.prompt + args.steps + args.profile + 16
    sync = cuda.synchronize
    prompt = rng.integers(0, V, args.prompt).tolist()

    warm = model.new_cache(n_ctx)  # compiles every kernel the timed passes take
    t_compile = timed(lambda: model.forward(prompt, warm), sync)
    for _ in range(2):
        model.forward([1], warm)
    del warm
    seq = model.new_cache(n_ctx)
    t_prefill = timed(lambda: model.forward(prompt, seq), sync)
    tok = rng.integers(0, V, args.batch)

    steps = [timed(lambda: model.forward(tok[:1], seq), sync) for _ in range(args.steps)]
    caches = [model.new_cache(n_ctx) for _ in range(args.batch)]
    model.forward_many([prompt] * args.batch, caches)
    for _ in range(2):
        model.forward_batch(tok, caches)
    batch = [timed(lambda: model.forward_batch(tok, caches), sync) for _ in range(max(4, args.steps // 4))]

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.profile):
        model.forward(tok[:1], seq)
    sync()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
    step_ms = statistics.median(steps) * 1e3
    res = {"model": Path(args.model).name, "first_prefill_s": t_compile, "prefill_tps": args.prompt / t_prefill,
           "decode_ms": step_ms, "decode_tps": 1e3 / step_ms,
           f"batch{args.batch}_ms": statistics.median(batch) * 1e3,
           f"batch{args.batch}_tps": args.batch / statistics.median(batch)}
    return res, s.getvalue()


if __name__ == "__main__":
    main()
