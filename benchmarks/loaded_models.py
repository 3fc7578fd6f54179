"""Issue 25, item 13's probe: N Loads of different copies of a model at once, in process.

    python benchmarks/loaded_models.py [--model MODEL.gguf] [-n 40] [--set KEY=VALUE ...]

Copies the model (default: the qwen3moe Q8_0 test fixture, built on the fly) N times, sends N
Scheduler.load calls together, then prints the wall time, the models listed at the end, the
evictions (MOED_MAX_LOADED_MODELS), threads and RSS before and after. Before the cap, 40 loads
left 40 models listed and 123 threads (with --set warm=0 here); with it, 3 and 18.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from daemon.config import Settings  # noqa: E402
from daemon.engine import Engine  # noqa: E402
from daemon.scheduler import Scheduler  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def probe(model: str, n: int, settings: dict, warm: bool) -> None:
    with tempfile.TemporaryDirectory() as d:
        paths = [os.path.join(d, f"m{i}.gguf") for i in range(n)]
        for p in paths:
            shutil.copyfile(model, p)
        sched = Scheduler(Settings.load(**settings), warm=warm,
                          factory=lambda p, **kw: Engine.load(p, **{"n_threads": 1, **kw}))
        threads, rss, t0 = threading.active_count(), rss_mib(), time.perf_counter()
        results = await asyncio.gather(*(sched.load(p) for p in paths), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        print(f"{n} loads in {time.perf_counter() - t0:.1f} s: {len(errors)} errors, "
              f"{len(sched.registry.models)} models listed (cap {sched.registry.max_loaded}), "
              f"{sched.registry.evictions} evictions, threads {threads} -> {threading.active_count()}, "
              f"RSS {rss:.0f} -> {rss_mib():.0f} MiB")
        for e in errors[:3]:
            print(f"  {type(e).__name__}: {e}")
        await sched.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a GGUF model (default: the qwen3moe Q8_0 test fixture)")
    ap.add_argument("-n", type=int, default=40, help="loads of different copies (default 40)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting (e.g. max_loaded_models=5); warm=0 skips the warm-up token")
    args = ap.parse_args()
    settings = dict(kv.split("=", 1) for kv in args.set)
    warm = settings.pop("warm", "1") not in ("0", "false")
    with tempfile.TemporaryDirectory() as d:
        model = args.model
        if model is None:
            from tests.fixtures.build import fixture_path

            model = str(fixture_path("qwen3moe", "Q8_0", Path(d)))
        asyncio.run(probe(model, args.n, settings, warm))


if __name__ == "__main__":
    main()
