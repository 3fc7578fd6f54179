"""Decode and prefill on the CUDA backend, with where a decode step's time goes.

    python benchmarks/gpu_decode.py MODEL.gguf [--prompt 64] [--steps 32] [--batch 8] [--profile 4] [--graphs 0,1]
                                    [--kernels 8] [--launch fast,dispatcher]

Loads MODEL on cuda:0 as the engine does (weights and every expert in VRAM), then times:
prefill of --prompt tokens; greedy-free decode steps of one sequence (median ms, tok/s); one step of
--batch sequences; and a cProfile of --profile decode steps, whose top entries by own time show
what the host spends a step on (kernel launches are numba's dispatcher `__call__` / `launch`).
With --graphs 0,1 the same in one process with decode steps launched kernel by kernel and replayed
as CUDA graphs: a graph's step is the GPU's time (kernels, ~1 us each between them), the eager
step minus that is the host's (Python, launches).
--launch fast,dispatcher: the same with kernels launched through daemon/kernels/cuda/launch.py's
cached cuda.core path and through numba's dispatcher (eager steps differ; graph replays do not).
The cProfile of one prefill is printed too (eager: host time per launch).
--kernels N (needs PyTorch, whose profiler reads CUPTI): the GPU time of each kernel over N
graph-replayed decode steps, by kernel, per step, against the step's wall time (the rest is gaps
between kernels and the graph launch); then the same for N steps of --batch sequences and for one
eager prefill of --prompt tokens.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import re
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
    ap.add_argument("--kernels", type=int, default=0, help="profile N graph-replayed decode steps by kernel")
    ap.add_argument("--launch", default="fast", help="fast: cached cuda.core launches, dispatcher: numba's, or both")
    ap.add_argument("--dp4a", action="store_true", help="prefill's tiled matmuls with dp4a, not the tensor cores")
    ap.add_argument("--mma-shapes", default="", help="WM,WN,TM,TN[;WM,WN,TM,TN]: the tensor-core tiles (wide; narrow)")
    ap.add_argument("--json")
    args = ap.parse_args()
    from numba import cuda

    from daemon.kernels.cuda import mmq
    if args.dp4a:
        mmq.USE_MMA = False
    if args.mma_shapes:
        shapes = [mmq.Shape(*(int(v) for v in part.split(","))) for part in args.mma_shapes.split(";")]
        mmq.MMA_WIDE, mmq.MMA_NARROW = shapes[0], shapes[-1]

    t0 = time.perf_counter()
    g = GGUFFile(args.model)
    backend = CUDABackend(0, max_slots=args.batch + 2)
    model = Transformer(g, experts=backend.resident_experts(g), backend=backend)
    load_s = time.perf_counter() - t0
    print(f"load {load_s:.1f} s, VRAM {backend.vram_bytes() / 2**20:,.0f} MiB ({backend.memory_note()})", flush=True)
    from daemon.kernels.cuda import launch

    rows = []
    for mode in [v.strip() for v in args.launch.split(",")]:
        launch.FAST = mode == "fast"
        for graphs in [v.strip() == "1" for v in args.graphs.split(",")]:
            backend.use_graphs = graphs
            res, prof = measure(args, model, cuda)
            res.update(launch=mode, graphs=graphs, load_s=load_s, captures=backend.graphs.captures,
                       replays=backend.graphs.replays)
            rows.append(res)
            print(json.dumps(res, indent=1))
            print(prof, flush=True)
    launch.FAST = True
    if args.kernels:
        backend.use_graphs = True
        rows.append(kernel_split(args, model, cuda))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def kernel_name(name: str) -> str:
    """A profiler's kernel name (numba's, demangled) -> module::function, e.g. mmvq::_build::kernel."""
    name = re.sub(r"\[abi:[^\]]*\]", "", name).split("(")[0]
    parts = [p for p in name.split("::") if p not in ("daemon", "kernels", "cuda", "backend")]
    return "::".join(parts).replace("_3clocals_3e", "<locals>")


def kernel_split(args, model, cuda) -> dict:
    """GPU time by kernel of graph-replayed decode steps of one sequence, and of one eager
    prefill of --prompt tokens (torch.profiler/CUPTI)."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        print("--kernels needs PyTorch (its profiler reads CUPTI); skipped")
        return {}
    torch.cuda.init()
    rng = np.random.default_rng(1)
    V = model.hp.n_vocab
    prompt = rng.integers(0, V, args.prompt).tolist()
    seq = model.new_cache(args.prompt + args.kernels + 8)
    model.forward(prompt, seq)
    for _ in range(3):  # eager once, captured, replayed
        model.forward([1], seq)
    cuda.synchronize()

    def profiled(fn, reps: int, what: str) -> dict:
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / reps
        by: dict[str, list[float]] = {}
        spans = []
        for ev in prof.events():
            if ev.device_type.name == "CUDA" and ev.device_time > 0:
                by.setdefault(kernel_name(ev.name), []).append(ev.device_time)  # us
                spans.append((ev.time_range.start, ev.time_range.end))
        table = sorted(((k, len(v) / reps, sum(v) / reps, min(v), max(v)) for k, v in by.items()),
                       key=lambda r: -r[2])
        busy = sum(r[2] for r in table) / 1e3  # ms
        print(f"\nkernels of {what}: GPU busy {busy:.2f} ms of {wall_ms:.2f} ms wall "
              f"({100 * busy / wall_ms:.0f}%), {sum(r[1] for r in table):.0f} kernels")
        print(f"{'kernel':56s} {'per step':>9s} {'us/step':>9s} {'us each':>8s} {'min':>7s} {'max':>7s} {'share':>6s}")
        for k, cnt, us, lo, hi in table:
            print(f"{k[:56]:56s} {cnt:9.0f} {us:9.1f} {us / max(cnt, 1):8.2f} {lo:7.2f} {hi:7.2f} "
                  f"{100 * us / 1e3 / busy:5.1f}%")
        idle = idle_split(spans, reps)
        print(f"idle GPU a step: {idle['within_ms']:.3f} ms between its nodes ({idle['gaps']:.0f} gaps, median "
              f"{idle['median_gap_us']:.2f} us), {idle['between_ms']:.3f} ms between steps (gaps over "
              f"{STEP_GAP_US:.0f} us: the host's work)")
        return {"kernels": [{"name": k, "per_step": c, "us_per_step": u, "min_us": lo, "max_us": hi}
                            for k, c, u, lo, hi in table],
                "busy_ms": busy, "wall_ms": wall_ms, **idle}

    decode = profiled(lambda: model.forward([1], seq), args.kernels,
                      f"one decode step ({args.kernels} graph replays)")
    caches = [model.new_cache(args.prompt + args.kernels + 8) for _ in range(args.batch)]
    model.forward_many([prompt] * args.batch, caches)
    tok = rng.integers(0, V, args.batch).tolist()  # distinct rows: each routes to its own experts
    for _ in range(3):
        model.forward_batch(tok, caches)
    cuda.synchronize()
    batch = profiled(lambda: model.forward_batch(tok, caches), args.kernels,
                     f"one step of {args.batch} sequences ({args.kernels} graph replays)")
    del caches
    prefill = profiled(lambda: model.forward(prompt, model.new_cache(args.prompt + 8)), 1,
                       f"one prefill of {args.prompt} tokens (eager)")
    return {**decode, "batch": batch, "prefill": prefill}


STEP_GAP_US = 50.0  # an idle GPU longer than this is the host between steps, not a graph's node-to-node gap


def idle_split(spans, steps: int) -> dict:
    """The GPU's idle time in `steps` replayed steps from its kernels' and copies' (start, end) in us:
    gaps up to STEP_GAP_US (node to node inside a graph) apart from longer ones (the host preparing
    the next step, or waiting), each per step. Overlapping spans leave no gap."""
    spans = sorted(spans)
    within: list[float] = []
    between = 0.0
    end = spans[0][1] if spans else 0.0
    for start, stop in spans[1:]:
        gap = start - end
        if gap > STEP_GAP_US:
            between += gap
        elif gap > 0:
            within.append(gap)
        end = max(end, stop)
    within.sort()
    return {"within_ms": sum(within) / 1e3 / steps, "gaps": len(within) / steps,
            "median_gap_us": within[len(within) // 2] if within else 0.0, "between_ms": between / 1e3 / steps}


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

    s = io.StringIO()
    for what, fn in ((f"{args.profile} decode steps", lambda: [model.forward(tok[:1], seq) for _ in range(args.profile)]),
                     ("one prefill", lambda: model.forward(prompt, model.new_cache(n_ctx)))):
        prof = cProfile.Profile()
        prof.enable()
        fn()
        sync()
        prof.disable()
        s.write(f"--- cProfile of {what}, by own time\n")
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
    step_ms = statistics.median(steps) * 1e3
    res = {"model": Path(args.model).name, "first_prefill_s": t_compile, "prefill_tps": args.prompt / t_prefill,
           "decode_ms": step_ms, "decode_tps": 1e3 / step_ms,
           f"batch{args.batch}_ms": statistics.median(batch) * 1e3,
           f"batch{args.batch}_tps": args.batch / statistics.median(batch)}
    return res, s.getvalue()


if __name__ == "__main__":
    main()
