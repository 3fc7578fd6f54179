"""What the daemon costs and what continuous batching buys.

    python benchmarks/daemon_overhead.py [--model M.gguf] [--threads 2] [--tokens 64]
                                         [--cache-mb MB] [--concurrency 1,4,16] [--repeat 3]

1. Per-token overhead of the socket: the same greedy generation (same prompt tokens, same
   settings) in process through Engine.generate, and through a daemon (`moed serve` started as a
   subprocess on a temporary socket) with the blocking Client. Reported in ms/token:
     in-process     Engine: eval_duration / eval_count
     daemon compute the daemon's own Done: eval_duration / eval_count
     client         wall time between the first and the last chunk the client reads, per token
   client - in-process is the whole cost of going through the daemon; client - daemon compute is
   the socket + framing + event-loop hand-over part alone. Runs alternate between the two, best of
   --repeat (the unlimited expert cache keeps this compute-bound). Since the compute thread goes on
   with the next step while the event loop sends a token, that cost is hidden in the rate; the
   latency it adds to each token is measured apart: a daemon in this process stamps each token
   when it is sampled, a client process stamps it when it arrives.
2. Aggregate decode throughput with 1, 4 and 16 concurrent streams (one AsyncClient connection
   each, distinct prompts, greedy, all sent at once), two ways: steady = tokens/s while every
   stream decodes (from the last stream's first token, i.e. after every prefill, to the first
   stream's last token; token arrival times taken in the client), and wall = all generated
   tokens / wall time, prompt evaluation included (the 16 prefills run one after another before
   the first decode step). Also the daemon's mean batch (sequences per forward_batch step).
3. Expert bytes read per generated token at each concurrency, from the daemon's stats (the
   expert cache's bytes_read and loads deltas over the run). With an unlimited cache every expert
   is read once and then hits, so the tables are repeated for each --cache-mb limit (default:
   unlimited, and a quarter of the model's expert bytes).

Default model: the demo MoE (daemon.demo.demo_model_path(), built on first use). Prints
measurements only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _bench.daemon import start_daemon  # noqa: E402  (benchmarks/ is sys.path[0] for a script)

PROMPTS = [
    "The history of the printing press begins",
    "In the middle of the ocean there is",
    "A recipe for bread starts with",
    "The theory of evolution explains",
    "Once upon a time in a small village",
    "The best way to learn a language is",
    "Mountains are formed when",
    "The first computers were",
    "Rivers carry water from",
    "A good night's sleep helps",
    "The moon orbits the earth",
    "Music has been part of human life",
    "Bees make honey by",
    "The city at night looks",
    "Trains changed travel because",
    "Old libraries keep books that",
]


def expert_bytes(path: str) -> int:
    from daemon.storage.gguf import GGUFFile

    with GGUFFile(path) as g:
        return sum(t.nbytes for n, t in g.tensors.items() if "_exps." in n)


def in_process_run(engine, ids: list[int], tokens: int) -> float:
    """ms per decode step of Engine.generate (it runs one forward per generated token)."""
    list(engine.generate(ids, tokens, temperature=0))
    s = engine.last_stats
    return s.eval_duration / max(s.eval_count, 1) / 1e6


def daemon_run(client, path: str, ids: list[int], tokens: int) -> tuple[float, float, int]:
    """(client ms per token between chunks, daemon ms per decode step from its Done, tokens)."""
    stamps = []
    gen = client.generate(ids, model=path, max_tokens=tokens, options={"temperature": 0})
    for chunk in gen:
        if chunk.tokens:
            stamps.append(time.perf_counter_ns())
    d = gen.done
    # the first token comes from the prefill's logits: eval_count tokens take eval_count - 1 steps
    daemon_ms = d.eval_duration / max(d.eval_count - 1, 1) / 1e6
    client_ms = (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1) / 1e6
    return client_ms, daemon_ms, d.eval_count


LATENCY_CLIENT = r"""
import json, sys, time
sys.path.insert(0, sys.argv[4])
from ipc import Client
sock, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
ids = json.loads(sys.stdin.read())
with Client(sock, timeout=600) as c:
    list(c.generate(ids, model=path, max_tokens=4, options={"temperature": 0}))
    gen = c.generate(ids, model=path, max_tokens=n, options={"temperature": 0})
    stamps = [time.perf_counter_ns() for chunk in gen if chunk.tokens]
print(json.dumps({"id": gen.id, "stamps": stamps}))
"""


def handover_latency(path: str, settings: dict, ids: list[int], tokens: int) -> list[float]:
    """ms from each token's creation on the compute thread (Sequence.feed) to its arrival in a
    client process: the socket + framing + event-loop part of a token's latency. The daemon runs
    in this process (to stamp creation); perf_counter_ns is CLOCK_MONOTONIC, shared by processes."""
    import json

    from daemon import service
    from daemon.config import Settings
    from daemon.scheduler import sequence

    created: dict[int, list[int]] = {}
    feed = sequence.Sequence.feed

    def stamped(self, logits):
        n = self.eval_count
        out = feed(self, logits)
        if self.eval_count > n:
            created.setdefault(self.id, []).append(time.perf_counter_ns())
        return out

    async def run() -> list[float]:
        with tempfile.TemporaryDirectory(prefix="moed-lat-") as tmp:
            sock = os.path.join(tmp, "moed.sock")
            async with service.make_server(Settings.load(env={}), sock) as server:
                await server.handler.load(path, settings, keep_alive=-1)
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", LATENCY_CLIENT, sock, path, str(tokens), ROOT,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                out, _ = await proc.communicate(json.dumps(ids).encode())
        r = json.loads(out)
        return [(b - a) / 1e6 for a, b in zip(created[r["id"]], r["stamps"])]

    sequence.Sequence.feed = stamped
    try:
        return asyncio.run(run())
    finally:
        sequence.Sequence.feed = feed


async def concurrent(sock: str, path: str, prompts: list[list[int]], tokens: int) -> dict:
    from ipc import AsyncClient

    arrivals: list[list[float]] = []  # per stream: perf_counter when each token's chunk arrived

    async def one(ids):
        stamps: list[float] = []
        arrivals.append(stamps)
        async with AsyncClient(sock, timeout=600) as c:
            gen = c.generate(ids, model=path, max_tokens=tokens, options={"temperature": 0})
            async for chunk in gen:
                if chunk.tokens:
                    stamps.append(time.perf_counter())
            return gen.done

    async with AsyncClient(sock, timeout=600) as admin:
        before = (await admin.stats(path))[path]
        t0 = time.perf_counter()
        dones = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
        after = (await admin.stats(path))[path]
    gen_tokens = sum(d.eval_count for d in dones)
    cache_b, cache_a = (before.get("cache") or {}).get("total", {}), (after.get("cache") or {}).get("total", {})
    sb, sa = before["scheduler"], after["scheduler"]
    steps = sa["steps"] - sb["steps"]
    # Steady state: from the moment every stream has its first token (all prefills done, all
    # decoding) to the moment the first stream ends; tokens that arrived in between / its length.
    start = max(a[0] for a in arrivals)
    end = min(a[-1] for a in arrivals)
    in_window = sum(1 for a in arrivals for t in a if start < t <= end)
    return {
        "streams": len(prompts),
        "tokens": gen_tokens,
        "wall_s": wall,
        "aggregate_tps": gen_tokens / wall,
        "steady_tps": in_window / (end - start) if end > start else float("nan"),
        "steady_s": end - start,
        "mean_batch": (sa["step_tokens"] - sb["step_tokens"]) / steps if steps else 0.0,
        "bytes_per_token": (cache_a.get("bytes_read", 0) - cache_b.get("bytes_read", 0)) / max(gen_tokens, 1),
        "loads_per_token": (cache_a.get("loads", 0) - cache_b.get("loads", 0)) / max(gen_tokens, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the demo MoE)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="tokens per stream")
    ap.add_argument("--cache-mb", default=None,
                    help="expert cache limits in MiB for the throughput tables, comma-separated; 0 = unlimited "
                         "(default: 0 and a quarter of the expert bytes)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--repeat", type=int, default=5, help="alternating solo runs for the overhead (best kept)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of the concurrency sweep per cache limit (the machine's speed drifts; each round "
                         "runs every level once)")
    args = ap.parse_args()
    if args.model is None:
        from daemon.demo import demo_model_path

        args.model = str(demo_model_path())
    path = os.path.realpath(args.model)
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    ex = expert_bytes(path)
    limits = ([float(x) for x in args.cache_mb.split(",")] if args.cache_mb
              else [0.0, round(ex / 4 / 2**20, 1)])
    print(f"model {path}\n  {ex / 2**20:.1f} MiB of experts, {args.threads} threads, {args.tokens} tokens per "
          f"stream, python {sys.version.split()[0]}, {os.cpu_count()} CPUs")

    from daemon.engine import Engine
    from ipc import Client

    settings = {"n_threads": args.threads, "expert_cache_limit_mb": 0.0}
    engine = Engine.load(path, **settings)
    prompts = [engine.tokenize(p) for p in PROMPTS]
    prompts = [prompts[i % len(prompts)] for i in range(max(levels))]
    with tempfile.TemporaryDirectory(prefix="moed-bench-") as tmp:
        sock = os.path.join(tmp, "moed.sock")
        n = max(levels)
        proc = start_daemon(sock, "--max-batch", str(n), "--queue-size", str(max(64, n)))
        try:
            with Client(sock, timeout=600) as c:
                c.load(path, keep_alive=-1, **settings)
                list(engine.generate(prompts[0], 4, temperature=0))  # warm-up both
                list(c.generate(prompts[0], model=path, max_tokens=4, options={"temperature": 0}))
                inproc, client_ms, daemon_ms = [], [], []
                for _ in range(args.repeat):  # alternate, so both see the same machine load
                    inproc.append(in_process_run(engine, prompts[0], args.tokens))
                    cm, dm, n = daemon_run(c, path, prompts[0], args.tokens)
                    client_ms.append(cm)
                    daemon_ms.append(dm)
            engine.close()
            best_in, best_client, best_daemon = min(inproc), min(client_ms), min(daemon_ms)
            print(f"\nper-token overhead, unlimited expert cache ({n} tokens, best of {args.repeat} alternating runs;"
                  f" medians in brackets)")
            print(f"  in-process Engine.generate  {best_in:8.3f} ms/token  [{statistics.median(inproc):.3f}]")
            print(f"  daemon compute (its Done)   {best_daemon:8.3f} ms/token  [{statistics.median(daemon_ms):.3f}]")
            print(f"  client through the socket   {best_client:8.3f} ms/token  [{statistics.median(client_ms):.3f}]")
            print(f"  overhead vs in-process      {best_client - best_in:+8.3f} ms/token")
            print(f"  overhead of socket + loop   {best_client - best_daemon:+8.3f} ms/token  "
                  f"[median of per-run differences "
                  f"{statistics.median(c - d for c, d in zip(client_ms, daemon_ms)):+.3f}]")

            lat = handover_latency(path, settings, prompts[0], args.tokens)
            print(f"  token hand-over latency     median {statistics.median(lat):.3f} ms, max {max(lat):.3f} ms "
                  f"(compute thread -> client process, {len(lat)} tokens)")

            for limit in limits:
                with Client(sock, timeout=600) as c:  # other settings: the idle model is reloaded
                    c.load(path, keep_alive=-1, n_threads=args.threads, expert_cache_limit_mb=limit)
                    list(c.generate(prompts[0], model=path, max_tokens=4, options={"temperature": 0}))
                print(f"\naggregate decode throughput, expert cache {f'{limit:g} MiB' if limit else 'unlimited'}")
                print("  steady = tokens/s while every stream decodes (after the last prefill, until the first "
                      "stream ends);\n  wall = all generated tokens / wall time, prompt evaluation included")
                runs: dict[int, list[dict]] = {level: [] for level in levels}
                for rnd in range(args.rounds):  # levels in turn, rotated, so each round sees one machine state
                    for level in levels[rnd % len(levels):] + levels[:rnd % len(levels)]:
                        runs[level].append(asyncio.run(concurrent(sock, path, prompts[:level], args.tokens)))
                print(f"  {args.rounds} rounds; medians, and in brackets the range of each round's speed-up over "
                      f"its own {levels[0]}-stream run")
                print(f"  {'streams':>7} {'tokens':>7} {'steady tok/s':>12} {'speed-up':>19} {'wall tok/s':>10} "
                      f"{'speed-up':>19} {'mean batch':>10} {'expert B/token':>15} {'loads/token':>12}")
                base = runs[levels[0]]
                for level in levels:
                    rs = runs[level]
                    med = {key: statistics.median(r[key] for r in rs) for key in
                           ("tokens", "steady_tps", "aggregate_tps", "mean_batch", "bytes_per_token", "loads_per_token")}
                    cols = []
                    for key in ("steady_tps", "aggregate_tps"):
                        ups = [r[key] / b[key] for r, b in zip(rs, base)]
                        cols.append(f"{med[key]:>10.1f} {statistics.median(ups):>6.2f}x "
                                    f"[{min(ups):.2f}-{max(ups):.2f}]")
                    print(f"  {level:>7} {med['tokens']:>7.0f} {cols[0]:>32} {cols[1]:>30} {med['mean_batch']:>10.2f} "
                          f"{med['bytes_per_token']:>15,.0f} {med['loads_per_token']:>12.2f}")
            with Client(sock) as c:
                c.shutdown()
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    main()
