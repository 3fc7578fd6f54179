"""Expert streaming: hit rate, Belady gap, recall, disk bytes and speed vs EXPERT_CACHE_LIMIT_MB.

    python benchmarks/streaming.py [--model PATH] [--tokens N] [--wide]

For the demo MoE (default) or a given model, and with --wide also for a wider MoE fixture
(qwen3moe, 64 experts, 8 used, Q8_0), prints for each cache limit:
  - the hit rate measured in exact mode (demand LRU), the LRU and Belady hit rates replayed on
    the routing trace of the same run, and the Belady gap;
  - disk bytes per token vs the minimum (misses x expert bytes), per routing mode;
  - decode tokens/s per routing mode;
then recall per prediction path per layer (routing=all), and read throughput from a cold page
cache (posix_fadvise DONTNEED) through the expert cache vs `dd` on the same file.
Tokens are checked identical across every configuration.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from daemon.engine import Engine  # noqa: E402
from daemon.routing import replay  # noqa: E402
from daemon.routing.trace import RoutingRecorder  # noqa: E402
from daemon.storage.cache import ExpertCache  # noqa: E402
from daemon.storage.gguf import GGUFFile  # noqa: E402
from daemon.storage.store import ExpertStore, expert_layouts  # noqa: E402

MODES = ("exact", "approx", "speculative", "all")


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run(path: str, prompt, n_tokens: int, **settings):
    """Greedy generation; -> (text, decode tok/s, stats, recorder, tokens evaluated)."""
    with Engine.load(path, expert_pack=False, **settings) as eng:
        ids = eng.tokenize(prompt) if isinstance(prompt, str) else prompt
        list(eng.generate(ids, max_tokens=2, temperature=0))  # compile kernels outside the timing
        eng.reset_stats()
        rec = RoutingRecorder().attach(eng.model)
        text = "".join(eng.generate(ids, max_tokens=n_tokens, temperature=0))
        rec.detach()
        st = eng.last_stats
        tps = st.eval_count / (st.eval_duration / 1e9) if st.eval_duration else 0.0
        return text, tps, eng.stats(), rec, st.eval_count + st.prompt_eval_count


def curve(path: str, prompt, n_tokens: int, limits_mb: list[float]) -> None:
    with GGUFFile(path) as g:
        layouts = expert_layouts(g)
    expert_bytes = max(lay.expert_nbytes for lay in layouts.values())
    n_moe = len(layouts)
    E = next(iter(layouts.values())).n_expert
    print(f"\n== {Path(path).name}: {n_moe} MoE layers x {E} experts of {expert_bytes / 2**20:.3f} MiB "
          f"({n_moe * E * expert_bytes / 2**20:.0f} MiB of experts)")
    ref_text = None
    print(f"{'limit MB':>9} {'slots':>5} {'hit':>6} {'lru sim':>7} {'belady':>7} {'gap':>6} "
          + "".join(f"{m + ' B/tok':>15}" for m in MODES) + f" {'min B/tok':>10} "
          + "".join(f"{m + ' tok/s':>15}" for m in MODES))
    recall = None
    for mb in limits_mb:
        row = {}
        for mode in MODES:
            text, tps, stats, rec, n_eval = run(path, prompt, n_tokens, expert_cache_limit_mb=mb, routing=mode)
            if ref_text is None:
                ref_text = text
            assert text == ref_text, f"tokens changed at {mb} MB, routing {mode}"
            tot = stats["cache"]["total"]
            row[mode] = (tps, tot, rec, n_eval)
            if mode == "all" and mb == limits_mb[len(limits_mb) // 2]:
                recall = (mb, stats["routing"]["recall"])
        tps, tot, rec, n_eval = row["exact"]
        slots = stats["cache"]["layers"][next(iter(stats["cache"]["layers"]))]["capacity"]
        trace = [[frozenset(r[i]) for r in rec.records] for i in range(n_moe)]
        lru = replay.simulate(trace, slots, "lru").hit_rate
        bel = replay.simulate(trace, slots, "belady").hit_rate
        mins = tot["misses"] * expert_bytes / n_eval
        print(f"{mb:>9g} {slots:>5} {tot['hit_rate']:>6.1%} {lru:>7.1%} {bel:>7.1%} {(bel - lru) * 100:>+5.1f} "
              + "".join(f"{row[m][1]['bytes_read'] / row[m][3] / 1e6:>13.2f}MB" for m in MODES)
              + f" {mins / 1e6:>8.2f}MB " + "".join(f"{row[m][0]:>15.1f}" for m in MODES))
    if recall:
        mb, rc = recall
        print(f"\nrecall per layer at {mb:g} MB, routing=all (|predicted & exact| / |exact| per step)")
        for path_name, r in rc.items():
            per = r["per_layer"]
            print(f"  {path_name:<12} overall {r['overall']:.3f}  per layer: "
                  + " ".join(f"{per[k]:.2f}" for k in sorted(per)))


def throughput(path: str) -> None:
    with GGUFFile(path) as g:
        layouts = expert_layouts(g)
        store = ExpertStore.from_gguf(g, layouts)
    total = sum(lay.expert_nbytes * lay.n_expert for lay in layouts.values())
    drop_cache(path)
    t = time.perf_counter()
    with ExpertCache(store, 0, io_depth=8) as cache:
        for il, lay in layouts.items():
            with cache.fetch(il, list(range(lay.n_expert))):
                pass
        got = cache.stats()["total"]["bytes_read"]
    moed_s = time.perf_counter() - t
    drop_cache(path)
    t = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M"], check=True, capture_output=True)
    dd_s = time.perf_counter() - t
    size = os.path.getsize(path)
    print(f"\ncold read of every expert ({got / 1e6:.0f} MB of {total / 1e6:.0f} MB expected): "
          f"moed {got / moed_s / 1e9:.2f} GB/s; dd of the whole file ({size / 1e6:.0f} MB): "
          f"{size / dd_s / 1e9:.2f} GB/s; ratio {got / moed_s / (size / dd_s):.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a GGUF MoE model (default: the demo MoE)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--wide", action="store_true", help="also a 64-expert qwen3moe fixture")
    args = ap.parse_args()
    if args.model:
        path = args.model
    else:
        from daemon.demo import demo_model_path

        path = str(demo_model_path())
    prompt = "The history of the printing press begins"
    curve(path, prompt, args.tokens, [1, 8, 16, 30, 45, 0])
    throughput(path)
    if args.wide:
        from tests.fixtures.build import fixture_path

        wide = str(fixture_path("qwen3moe", "Q8_0", Path(tempfile.gettempdir()) / "moed-bench",
                                n_layer=4, n_embd=512, n_ff_exp=512, n_expert=64, n_expert_used=8))
        ids = np.random.default_rng(0).integers(0, 500, 16).tolist()
        curve(wide, ids, args.tokens, [4, 16, 32, 64, 0])
        throughput(wide)
    return 0


if __name__ == "__main__":
    sys.exit(main())
