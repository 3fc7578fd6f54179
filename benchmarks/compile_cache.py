"""The kernel cache on disk (daemon/kernels/cuda/kernel_cache.py): a second process loads the
GPU kernels a load and a first request need instead of compiling them (issue 26 item 3).

    python benchmarks/compile_cache.py [MODEL] [--processes 2] [--off] [--daemon-warm]
                                       [--prompt 64] [--decode 4] [--cache-dir DIR] [--json PATH]

MODEL: a GGUF file; default a small qwen3moe Q8_0 fixture (tests/fixtures/build.py), built once
under $TMPDIR/moed-bench-fixtures. Each row is a fresh `python compile_cache.py --child` run one
after another on the same kernel cache directory (a new empty one, unless --cache-dir): the first
compiles and writes the entries, the later ones should load them. --off first adds a row with
MOED_KERNEL_CACHE=off (compiles everything, writes nothing).

A child loads the model with Engine.load(device="cuda") (--daemon-warm: through the daemon's
scheduler.models.load_engine, with its one-token and prefill warm-ups), then generates --decode
tokens, greedy, from a --prompt-token prompt (ids 0..n-1 mod the vocabulary): one prefill and
decode steps, as a first request. Columns: seconds of the load, of the first request, of both
(wall, in the child, after its imports); launch.COUNTS: fast-path kernel overloads compiled in the
child vs loaded from the cache, in all and (in load) by the end of the load; the entries in the
cache directory after the child; numba: overloads numba's dispatchers hold at the end (compiled
in the child, by a fast-path miss or a dispatcher launch on stream 0, or from numba's own cache):
with a warm cache, what is left of it is what the kernel cache does not cover.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def numba_overloads() -> int:
    """Kernel overloads numba's dispatchers hold in this process: compiled here (a fast-path miss, or
    a dispatcher launch: stream 0) or taken from numba's own cache (cache=True kernels)."""
    import gc

    from numba.cuda.dispatcher import CUDADispatcher

    return sum(len(o.overloads) for o in gc.get_objects()
               if isinstance(o, CUDADispatcher) and not o.targetoptions.get("device"))


def child(model: str, prompt: int, decode: int, daemon_warm: bool) -> dict:
    from daemon.engine import Engine
    from daemon.kernels.cuda import launch

    t0 = time.perf_counter()
    if daemon_warm:
        from daemon.scheduler.models import load_engine

        engine = load_engine(Engine.load, model, {"device": "cuda"}, lambda *_r: None)
    else:
        engine = Engine.load(model, device="cuda")
    t1 = time.perf_counter()
    loaded = dict(launch.COUNTS)
    try:
        ids = [i % engine.model.hp.n_vocab for i in range(prompt)]
        n = sum(1 for _ in engine.generate(ids, max_tokens=decode, temperature=0.0))
    finally:
        t2 = time.perf_counter()
        engine.close()
    return {"load_s": t1 - t0, "request_s": t2 - t1, "total_s": t2 - t0, "pieces": n,
            "compiled": launch.COUNTS["compiled"], "cached": launch.COUNTS["cached"],
            "compiled_in_load": loaded["compiled"], "cached_in_load": loaded["cached"],
            "numba_overloads": numba_overloads()}


def run_child(args, setting: str) -> dict:
    env = dict(os.environ, MOED_KERNEL_CACHE=setting)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, __file__, args.model, "--child", "--prompt", str(args.prompt), "--decode", str(args.decode)]
    if args.daemon_warm:
        cmd.append("--daemon-warm")
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"child failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def default_model() -> str:
    from tests.fixtures.build import fixture_path

    return str(fixture_path("qwen3moe", "Q8_0", Path(tempfile.gettempdir()) / "moed-bench-fixtures"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="GGUF file (default: a small qwen3moe Q8_0 fixture)")
    ap.add_argument("--processes", type=int, default=2, help="fresh processes on the same cache, one after another")
    ap.add_argument("--off", action="store_true", help="first a process with MOED_KERNEL_CACHE=off")
    ap.add_argument("--daemon-warm", action="store_true", help="load through scheduler.models.load_engine")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens of the first request")
    ap.add_argument("--decode", type=int, default=4, help="tokens generated (decode steps + 1)")
    ap.add_argument("--cache-dir", help="kernel cache directory to use (default: a new empty one)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.prompt, args.decode, args.daemon_warm)))
        return
    args.model = args.model or default_model()
    rows = []
    with tempfile.TemporaryDirectory(prefix="moed-kernels-") as tmp:
        cache = Path(args.cache_dir or tmp)
        print(f"model: {args.model}  prompt={args.prompt} decode={args.decode}  cache: {cache}"
              f"{'  (daemon warm-up)' if args.daemon_warm else ''}")
        print(f"{'run':<10}{'load s':>9}{'request s':>11}{'total s':>9}{'compiled':>10}{'cached':>8}"
              f"{'(in load)':>12}{'entries':>9}{'numba':>7}")
        runs = [("off", "off")] if args.off else []
        runs += [(f"process {i + 1}", str(cache)) for i in range(args.processes)]
        for label, setting in runs:
            r = run_child(args, setting)
            r["run"] = label
            r["entries"] = len(list(cache.glob("*.cubin"))) if cache.exists() else 0
            rows.append(r)
            print(f"{label:<10}{r['load_s']:9.2f}{r['request_s']:11.2f}{r['total_s']:9.2f}{r['compiled']:10d}"
                  f"{r['cached']:8d}{r['compiled_in_load']:>6d}/{r['cached_in_load']:<5d}{r['entries']:9d}"
                  f"{r['numba_overloads']:7d}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "prompt": args.prompt, "decode": args.decode,
                                               "daemon_warm": args.daemon_warm, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
