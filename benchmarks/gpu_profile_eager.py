"""Where an eager step's host time goes: cProfile of eager decode steps and one prefill, by
cumulative and own time, on the CUDA backend.

    python benchmarks/gpu_profile_eager.py MODEL.gguf [--prompt 128] [--steps 4] [--lines 45]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from daemon.backend.cuda import CUDABackend  # noqa: E402
from daemon.model.transformer import Transformer  # noqa: E402
from daemon.storage.gguf import GGUFFile  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lines", type=int, default=45)
    args = ap.parse_args()
    from numba import cuda

    g = GGUFFile(args.model)
    backend = CUDABackend(0, graphs=False)
    model = Transformer(g, experts=backend.resident_experts(g), backend=backend)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.hp.n_vocab, args.prompt).tolist()
    seq = model.new_cache(args.prompt + 4 * args.steps + 8)
    model.forward(prompt, model.new_cache(args.prompt + 8))  # compile
    model.forward(prompt, seq)
    for _ in range(2):
        model.forward([1], seq)
    cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        model.forward([1], seq)
    cuda.synchronize()
    print(f"eager decode step: {(time.perf_counter() - t0) / args.steps * 1e3:.2f} ms "
          f"({model.hp.n_layer} layers), unprofiled")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        model.forward([1], seq)
    cuda.synchronize()
    prof.disable()
    for order in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(order).print_stats(args.lines)
        print(f"--- {args.steps} eager decode steps by {order}\n{s.getvalue()}")


if __name__ == "__main__":
    main()
