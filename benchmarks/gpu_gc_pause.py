"""The cyclic garbage collector's pauses in decode steps through the VRAM expert cache, with the
loaded model's objects walked by it (as before daemon/heap.py) and frozen out of its walks.

    python benchmarks/gpu_gc_pause.py MODEL.gguf [--set KEY=VALUE ...]

Loads the model with device=cuda, gpu_cache_mb=8000, offload_min_batch=0 (MOE_GPU_CACHE_MB = 8000,
hybrid compute off; --set overrides any setting, e.g. --set device=cpu), gives the frozen heap back
(gc.unfreeze(): the state before daemon/heap.py), prefills 16 tokens, decodes 16 warm-up steps,
then three rounds of 16 steps; after the second round it freezes the heap as Engine.load does
(daemon.heap: a full collection, then gc.freeze(); the collection keeps garbage out of the frozen
heap, issue 25). Prints per round ms/step, time in collections (gc.callbacks) per step, the
collections per generation and the objects the collector tracks.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from daemon.engine import Engine  # noqa: E402

ROUND = 16


class Collections:
    """Seconds spent in collections and their count per generation (gc.callbacks)."""

    def __init__(self):
        self.reset()
        gc.callbacks.append(self)

    def reset(self):
        self.seconds, self.count, self._t0 = 0.0, [0, 0, 0], 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.count[info["generation"]] += 1


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--set", action="append", default=[], type=lambda kv: tuple(kv.split("=", 1)),
                    help="a setting of daemon.config for Engine.load, e.g. --set gpu_cache_mb=24000")
    args = ap.parse_args(argv)
    settings = {"device": "cuda", "gpu_cache_mb": "8000", "offload_min_batch": "0"} | dict(args.set)
    col = Collections()
    with Engine.load(args.model, **settings) as eng:
        gc.unfreeze()
        model = eng.model
        cache = model.new_cache(256)
        tok = int(np.argmax(model.forward(list(range(100, 100 + ROUND)), cache)[-1]))

        def steps(n: int) -> float:
            nonlocal tok
            t = time.perf_counter()
            for _ in range(n):
                tok = int(np.argmax(model.forward([tok], cache)[-1]))
            return (time.perf_counter() - t) / n * 1e3

        print(f"warm-up: {steps(ROUND):.1f} ms/step")
        for rnd in range(3):
            col.reset()
            ms = steps(ROUND)
            print(f"round {rnd} ({'frozen' if rnd == 2 else 'walked'}): {ms:.1f} ms/step; collections "
                  f"{col.seconds * 1e3 / ROUND:.2f} ms/step, gen0/1/2 {'/'.join(map(str, col.count))}; "
                  f"tracked objects {len(gc.get_objects()):,}", flush=True)
            if rnd == 1:
                gc.collect()  # what heap.hold() does, without counting a second engine
                gc.freeze()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
