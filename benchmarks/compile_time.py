"""Cold and warm compile time of the CPU matmul kernels (daemon/kernels/matmul.py).

    python benchmarks/compile_time.py [--repeats 2] [--types Q8_0,Q4_K,...]

Each repeat gives numba an empty cache directory (NUMBA_CACHE_DIR) and runs two fresh child
processes on it: "cold" compiles every kernel, "warm" loads them from the cache the first one
wrote. A child imports the kernels, then for each weight type makes one call per path the model
takes: linear (ggml numerics), linear (float32 numerics), linear_selected and linear_grouped on a
read-only stack of 3 experts, as mmapped weights are, and for quantized types the one-token
experts' fused call (kernels/moe_decode.py, gate, up and down of that type). Prints the wall seconds spent in the import
and in each path's calls (the first call of a path compiles it), the child's total wall and CPU
seconds (CPU: user + system of all its threads; compiling runs on one thread, so on an idle
machine the two agree, and on a busy one CPU time is the steadier figure), and the minimum of
each column over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ALL_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K")
PATHS = ("linear", "linear_f32", "selected", "grouped", "fused")
K = 512  # two K-quant super-blocks
N = 8
T = 9  # activation rows: 8 + 1 in the block kernels, >= 8 rows (tiled) for K-quants


def child(types: list[str]) -> dict:
    """Time the import and each path's calls in this process."""
    t0, c0 = time.perf_counter(), time.process_time()
    import numpy as np

    from types import SimpleNamespace

    from daemon.kernels import matmul as M
    from daemon.kernels import moe_decode
    from daemon.kernels import quants as Q
    from daemon.storage.experts import ExpertLayout
    times = {"import": time.perf_counter() - t0, **{p: 0.0 for p in PATHS}}

    def timed(path, fn, *args, **kw):
        t = time.perf_counter()
        fn(*args, **kw)
        times[path] += time.perf_counter() - t

    x = np.zeros((T, K), np.float32)
    for name in types:
        qt = int(getattr(Q, name))
        stack = np.zeros((3, N, Q.row_bytes(qt, K)), np.uint8)
        stack.flags.writeable = False
        timed("linear", M.linear, x, stack[0], qt, K)
        timed("linear_f32", M.linear, x, stack[0], qt, K, numerics="float32")
        xp = M.prepare(x, qt)
        timed("selected", M.linear_selected, xp, stack, np.array([2, 0]), np.array([0, 1]), qt, K)
        timed("grouped", M.linear_grouped, xp, stack, np.array([1, 2]), np.array([0, 1, T]), qt, K)
        if moe_decode.supports(qt, qt, qt):
            square = np.zeros((3, K, Q.row_bytes(qt, K)), np.uint8)  # D = F = K
            square.flags.writeable = False
            batch = SimpleNamespace(gate=square, up=square, down=square, gate_bias=None)
            one = np.array([2, 0])
            timed("fused", moe_decode.expert_ffn, M.prepare(x[:1], qt), batch, ExpertLayout(3, K, K, qt, qt, qt),
                  one, one, np.zeros(2, np.int64), "silu", 0.0, 0.0)
    times["total"] = time.perf_counter() - t0
    times["cpu"] = time.process_time() - c0
    return times


def run_child(cache_dir: str, types: list[str]) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, __file__, "--child", ",".join(types)], env=env, cwd=root,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--types", default=",".join(ALL_TYPES), help="comma-separated weight types")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child.split(","))))
        return
    types = args.types.split(",")
    cols = ("import", *PATHS, "total", "cpu")
    print(f"types: {','.join(types)}  K={K} N={N} T={T}  cpu={os.cpu_count()}")
    print(f"{'run':<8}" + "".join(f"{c:>12}" for c in cols) + "   (seconds; total and cpu: the whole child)")
    best: dict[str, dict] = {}
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="numba-cache-") as cache:
            for kind in ("cold", "warm"):
                t = run_child(cache, types)
                print(f"{kind + str(r + 1):<8}" + "".join(f"{t[c]:12.2f}" for c in cols), flush=True)
                best[kind] = {c: min(best.get(kind, t)[c], t[c]) for c in cols}
    for kind in ("cold", "warm"):
        print(f"{kind + ' min':<8}" + "".join(f"{best[kind][c]:12.2f}" for c in cols))


if __name__ == "__main__":
    main()
