"""What a JSON-schema grammar costs per decode step (issue 29, item 5: at most 5% of decode on the GPU).

    python benchmarks/grammar_cost.py MODEL.gguf [--streams 1,16] [--tokens 64] [--repeat 2]
                                      [--set ENV=VALUE ...]

The daemon's scheduler in this process (its serving loop: on a GPU the device sampler, with the
grammar's mask uploaded into each constrained sequence's slot and its steps not overlapped). For
each stream count N, rounds alternate between N free streams and N constrained ones (the schema
below: an object holding a list of 400 integers, longer than --tokens),
the same raw prompts and seeded sampling (temperature 1), --tokens tokens at most. Reported per
mode: decode ms per token (each Done's eval_duration / eval_count, the mean over streams, best of
--repeat), tokens per stream, and the constrained mode's cost over the free one in percent. A
constrained stream that ends sooner (its value is complete) still counts its own tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SCHEMA = {"type": "object", "properties": {"values": {"type": "array", "minItems": 400, "maxItems": 400,
                                                      "items": {"type": "integer", "minimum": 0, "maximum": 99999}}},
          "required": ["values"], "additionalProperties": False}


async def burst(s, model: str, n: int, tokens: int, constrained: bool, base: int) -> tuple[float, list[int]]:
    from ipc.protocol import Done, Generate, SamplingOptions

    async def one(i: int):
        replies = []
        req = Generate(base + i, model, prompt=f"Data set {i}:", raw=True, max_tokens=tokens,
                       options=SamplingOptions(temperature=1.0, seed=i),
                       format=json.dumps(SCHEMA) if constrained else None)
        await s.generate(req, replies.append, time.perf_counter_ns())
        done = replies[-1]
        assert isinstance(done, Done), done
        return done.eval_duration / max(1, done.eval_count) / 1e6, done.eval_count

    results = await asyncio.gather(*(one(i) for i in range(n)))
    return statistics.mean(r[0] for r in results), [r[1] for r in results]


async def main_async(args) -> None:
    from daemon.config import Settings
    from daemon.engine import Engine
    from daemon.scheduler import Scheduler

    s = Scheduler(Settings.load(max_batch=16), factory=lambda p, **kw: Engine.load(p, **kw))
    try:
        await burst(s, args.model, 1, 4, True, 10)  # load, compile, the tokenizer's grammar table
        base = 1000
        for n in (int(x) for x in args.streams.split(",")):
            best = {}
            counts = {}
            for _ in range(args.repeat):
                for constrained in (False, True):
                    ms, c = await burst(s, args.model, n, args.tokens, constrained, base)
                    base += 100
                    best[constrained] = min(best.get(constrained, ms), ms)
                    counts[constrained] = c
            cost = (best[True] / best[False] - 1) * 100
            print(f"{n:>3} streams  free {best[False]:.3f} ms/token   json schema {best[True]:.3f} ms/token   "
                  f"cost {cost:+.1f}%   tokens per stream free {sorted(counts[False])} "
                  f"constrained {sorted(counts[True])}", flush=True)
    finally:
        await s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="ENV=VALUE")
    args = ap.parse_args()
    for kv in args.set:
        k, _, v = kv.partition("=")
        os.environ[k] = v
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
