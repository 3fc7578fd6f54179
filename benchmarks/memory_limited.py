"""moed vs llama.cpp on one model file when the model does not fit in the memory given to both.

    python benchmarks/memory_limited.py [--model PATH] [--memory-mb 420] [--cache-mb 24] [--tokens 32]
                                        [--plain-llama]

Each engine runs in a child process placed in a cgroup-v1 memory cgroup limited to --memory-mb
(process memory plus the page cache it uses: a memory-mapped model competes with everything
else for it). The model's pages are dropped from the page cache before each run (posix_fadvise
DONTNEED), and both decode the same prompt greedily. llama.cpp maps the whole file (use_mmap),
so under the limit its expert pages are evicted and faulted in again; moed copies only the
non-expert weights into memory at load (it never maps the file) and reads experts into a cache bounded by --cache-mb. Prints decode
tokens/s, bytes read from disk (/proc/self/io read_bytes), major page faults and peak RSS, and
whether both produced the same tokens. Needs root and a writable cgroup-v1 memory hierarchy
(as in the dev VM); says so and stops otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT_IDS_DEFAULT = "The history of the printing press begins"


def _io_read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def child_moed(path: str, ids: list[int], n: int, cache_mb: float) -> dict:
    """Greedy decode through the engine's model with its streaming expert cache."""
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from daemon import Engine

    r0 = _io_read_bytes()
    with Engine.load(path, expert_cache_limit_mb=cache_mb, expert_pack=False) as eng:
        m = eng.model
        warm = m.new_cache(len(ids) + 8)
        m.forward(ids, warm)
        for t in range(4):  # compiles the kernels, like llama.cpp's warm-up below
            m.forward([t], warm)
        cache = m.new_cache(len(ids) + n + 1)
        t0 = time.perf_counter()
        logits = m.forward(ids, cache)
        t1 = time.perf_counter()
        toks = []
        for _ in range(n):
            tok = int(np.argmax(logits[-1]))
            toks.append(tok)
            logits = m.forward([tok], cache)
        t2 = time.perf_counter()
        st = eng.stats()["cache"]["total"]
    return {"prefill_tps": len(ids) / (t1 - t0), "decode_tps": n / (t2 - t1), "disk_read": _io_read_bytes() - r0,
            "expert_bytes_read": st["bytes_read"], "tokens": toks}


def child_llama(path: str, ids: list[int], n: int, plain: bool) -> dict:
    from llama_cpp import Llama

    if plain:  # plain CPU buffers, no repacked weights: the numerics moed reproduces bit for bit
        import llama_cpp.llama as mod

        default = mod.llama_cpp.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p

        mod.llama_cpp.llama_model_default_params = params

    r0 = _io_read_bytes()
    llm = Llama(model_path=path, n_ctx=max(256, len(ids) + n + 8), n_threads=2, n_threads_batch=2,
                use_mmap=True, flash_attn=False, verbose=False, seed=0, logits_all=True)
    llm.eval(ids)
    for t in range(4):  # warm-up, as for moed
        llm.eval([t])
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    toks = []
    for _ in range(n):
        tok = int(llm.scores[llm.n_tokens - 1].argmax())
        toks.append(tok)
        llm.eval([tok])
    t2 = time.perf_counter()
    return {"prefill_tps": len(ids) / (t1 - t0), "decode_tps": n / (t2 - t1), "disk_read": _io_read_bytes() - r0,
            "tokens": toks}


def memory_cgroup() -> Path | None:
    base = Path("/sys/fs/cgroup/memory")
    try:
        rel = next(line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup") if ":memory:" in line)
    except StopIteration:
        return None
    cg = base / rel.lstrip("/") / "moed-bench"
    try:
        cg.mkdir(exist_ok=True)
    except OSError:
        return None
    return cg


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_child(cg: Path, limit_mb: int, args: list[str]) -> dict:
    (cg / "memory.limit_in_bytes").write_text(str(limit_mb * 2**20))

    def enter():
        (cg / "cgroup.procs").write_text(str(os.getpid()))

    p = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, preexec_fn=enter)
    if p.returncode:
        return {"error": (p.stderr.strip() or f"exit {p.returncode} (killed by the memory limit?)")[-400:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--memory-mb", type=int, default=420)
    ap.add_argument("--cache-mb", type=float, default=24)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--plain-llama", action="store_true",
                    help="llama.cpp without repacked weight buffers (its numerics = moed's; slower)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, path, ids, n = args.child[0], args.child[1], json.loads(args.child[2]), int(args.child[3])
        r = child_llama(path, ids, n, args.child[4] == "plain") if kind == "llama" else child_moed(path, ids, n, float(args.child[4]))
        r["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        r["major_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        print(json.dumps(r))
        return 0
    sys.path.insert(0, str(ROOT))
    if args.model:
        path = args.model
    else:
        from daemon.demo import demo_model_path

        path = str(demo_model_path())
    from daemon.engine import Engine

    with Engine.load(path) as eng:
        ids = eng.tokenize(PROMPT_IDS_DEFAULT)
    cg = memory_cgroup()
    if cg is None:
        print("no writable cgroup-v1 memory hierarchy here: cannot limit memory", file=sys.stderr)
        return 1
    size = os.path.getsize(path)
    print(f"{Path(path).name}: {size / 2**20:.0f} MiB file; memory limit {args.memory_mb} MiB per process "
          f"(incl. page cache); moed expert cache {args.cache_mb:g} MB; {args.tokens} greedy tokens")
    results = {}
    plain = "plain" if args.plain_llama else "default"
    for name, child in (("llama.cpp", ["llama", path, json.dumps(ids), str(args.tokens), plain]),
                        ("moed", ["moed", path, json.dumps(ids), str(args.tokens), str(args.cache_mb)])):
        drop_cache(path)
        results[name] = r = run_child(cg, args.memory_mb, child)
        if "error" in r:
            print(f"{name:<10} failed: {r['error']}")
            continue
        extra = f" expert bytes {r['expert_bytes_read'] / 2**20:.0f} MiB" if "expert_bytes_read" in r else ""
        print(f"{name:<10} decode {r['decode_tps']:6.1f} tok/s  prefill {r['prefill_tps']:6.1f} tok/s  "
              f"disk read {r['disk_read'] / 2**20:7.0f} MiB  major faults {r['major_faults']:6d}  "
              f"peak RSS {r['max_rss_mb']:.0f} MiB{extra}")
    a, b = results.get("llama.cpp", {}), results.get("moed", {})
    if "decode_tps" in a and "decode_tps" in b:
        # By default llama.cpp runs with its default CPU buffers (repacked weight layouts where it
        # has them), its fastest path, which sums in another order: tokens may differ.
        print(f"moed/llama.cpp decode {b['decode_tps'] / a['decode_tps']:.2f}x; "
              f"same greedy tokens: {a['tokens'] == b['tokens']}")
        if a["tokens"] != b["tokens"]:
            print(f"  llama.cpp {a['tokens']}\n  moed      {b['tokens']}")
    try:
        cg.rmdir()
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
