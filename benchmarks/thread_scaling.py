"""CPU prefill and decode speed as threads are added, per numba threading layer (issue 11, item 4).

Each configuration runs in a child process of its own (the threading layer and the thread count are
fixed when numba starts its pool). By default every expert is resident after a warm-up pass, so no
I/O thread competes with the kernels; `--cache-mb` bounds the expert cache so experts stream through
the I/O threads during the timed passes (from the page cache once warm). Prints one row per configuration and the machine's CPU
topology (logical CPUs, affinity, cgroup quota, threads per core), which decides what "all cores" is.

    python benchmarks/thread_scaling.py --build MODEL.gguf          # a qwen3moe-shaped Q8_0 model
    python benchmarks/thread_scaling.py --model MODEL.gguf --threads 1,4,8,16 --layers omp,workqueue

`--env KEY=VALUE` (repeatable) adds environment to the children, e.g. OMP_WAIT_POLICY=passive.
`--busy N` runs N processes that burn a CPU each beside every configuration (a loaded machine: how
much a spin-waiting thread pool loses to a competitor).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(path: str, layers: int, experts: int) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.fixtures.build import build_fixture

    t0 = time.perf_counter()
    build_fixture("qwen3moe", "Q8_0", path, seed=0, n_layer=layers, n_embd=2048, n_head=32, n_head_kv=4,
                  head_dim=128, n_ff_exp=768, n_expert=experts, n_expert_used=8)
    print(f"built {path}: {os.path.getsize(path) / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", flush=True)


def topology() -> dict:
    info = {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0))}
    for f in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        if os.path.exists(f):
            info[f] = Path(f).read_text().strip()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        info["lscpu"] = {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in out.splitlines() if ":" in ln)
                         if k.strip() in ("Model name", "Thread(s) per core", "Core(s) per socket", "Socket(s)",
                                          "NUMA node(s)", "L3 cache")}
    except OSError:
        pass
    return info


def child(model: str, threads: int, prefill: int, decode: int, repeat: int, cache_mb: float) -> None:
    """One configuration: prints a JSON line with the medians."""
    import numba

    from daemon import Engine

    engine = Engine.load(model, n_threads=threads, routing="exact", expert_cache_limit_mb=cache_mb)
    ids = [(i * 37) % 400 + 10 for i in range(prefill)]
    t0 = time.perf_counter()
    engine.forward(ids)  # compiles (or loads the cache) and reads every expert it routes to
    engine.forward(ids[::-1])
    warm_s = time.perf_counter() - t0
    pre, dec = [], []
    for r in range(repeat):
        cache = engine.model.new_cache(prefill + decode + 1)
        t0 = time.perf_counter()
        logits = engine.model.forward([(t + r) % 400 + 10 for t in ids], cache)
        pre.append(prefill / (time.perf_counter() - t0))
        tok = int(logits[-1].argmax())
        t0 = time.perf_counter()
        for _ in range(decode):
            tok = int(engine.model.forward([tok], cache)[-1].argmax())
        dec.append(decode / (time.perf_counter() - t0))
    pre.sort()
    dec.sort()
    try:
        layer = numba.threading_layer()
    except ValueError:  # seen on the GPU machine's numba after a governed run (its steps had run)
        layer = os.environ.get("NUMBA_THREADING_LAYER", "?")
    print(json.dumps({"threads": threads, "layer": layer,
                      "numba_threads": numba.get_num_threads(), "warm_s": round(warm_s, 1),
                      "prefill": round(pre[len(pre) // 2], 1), "prefill_min": round(pre[0], 1),
                      "prefill_max": round(pre[-1], 1), "decode": round(dec[len(dec) // 2], 2),
                      "decode_min": round(dec[0], 2), "decode_max": round(dec[-1], 2)}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--build", metavar="PATH", help="write a qwen3moe-shaped Q8_0 model here first")
    ap.add_argument("--build-layers", type=int, default=4)
    ap.add_argument("--build-experts", type=int, default=64)
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--layers", default="omp", help="numba threading layers to try (omp, workqueue, tbb)")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the children (repeatable)")
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cache-mb", type=float, default=0.0,
                    help="EXPERT_CACHE_LIMIT_MB for the children; 0 = every expert resident after warm-up")
    ap.add_argument("--busy", type=int, default=0, help="CPU-burning processes beside each configuration")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.model, args.child, args.prefill, args.decode, args.repeat, args.cache_mb)
        return 0
    if args.build:
        build(args.build, args.build_layers, args.build_experts)
        args.model = args.model or args.build
    if not args.model:
        ap.error("--model or --build is needed")
    print(json.dumps(topology()), flush=True)
    extra = dict(kv.split("=", 1) for kv in args.env)
    rows = []
    print(f"{'layer':<10} {'env':<24} {'threads':>7} {'prefill tok/s (min-max)':>26} {'decode tok/s (min-max)':>24}")
    for layer in args.layers.split(","):
        for threads in (int(t) for t in args.threads.split(",")):
            env = {**os.environ, **extra, "NUMBA_THREADING_LAYER": layer,
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
            cmd = [sys.executable, __file__, "--child", str(threads), "--model", args.model,
                   "--prefill", str(args.prefill), "--decode", str(args.decode), "--repeat", str(args.repeat),
                   "--cache-mb", str(args.cache_mb)]
            burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
            try:
                p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            finally:
                for b in burners:
                    b.kill()
                    b.wait()
            if p.returncode:
                print(f"{layer:<10} {threads:>7} failed: {p.stderr.strip().splitlines()[-1:]}", flush=True)
                continue
            row = json.loads(p.stdout.strip().splitlines()[-1]) | {"env": extra, "asked_layer": layer,
                                                                   "busy": args.busy}
            rows.append(row)
            envs = ",".join([f"{k}={v}" for k, v in extra.items()] + [f"busy={args.busy}"] * bool(args.busy)) or "-"
            print(f"{row['layer']:<10} {envs:<24} {threads:>7} "
                  f"{row['prefill']:>9.1f} ({row['prefill_min']:.1f}-{row['prefill_max']:.1f})".ljust(60)
                  + f"{row['decode']:>9.2f} ({row['decode_min']:.2f}-{row['decode_max']:.2f})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
