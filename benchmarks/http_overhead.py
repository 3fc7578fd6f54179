"""What HTTP costs per token over moed's own socket (issue 29: at most 0.2 ms, at 1 and 16 streams).

    python benchmarks/http_overhead.py MODEL.gguf [--threads 2] [--streams 1,16] [--tokens 64]
                                       [--repeat 3] [--set ENV=VALUE ...] [--json out.json]

One `moed serve` (a temporary socket; MOED_MODELS a temporary directory where MODEL is `bench`;
HTTP on a free loopback port). For each stream count N, --repeat rounds, each running three ways
one after another, with N concurrent greedy streams of the same raw prompt and --tokens tokens:
    msgspec   ipc.AsyncClient, one connection per stream (moed's own protocol)
    ollama    POST /api/generate, NDJSON (aiohttp, one connection per stream)
    openai    POST /v1/completions, SSE
Per stream: (arrival of its final message - arrival of its first token) / (tokens - 1), in the
client; a mode's figure is the mean over its streams, best of the rounds. Printed: ms per token
for each mode, and each HTTP mode minus msgspec. The streams' token counts are printed too (greedy
text ends early at an end-of-generation token: the same in every mode).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._bench.daemon import start_daemon  # noqa: E402

PROMPT = "The history of the mixture of experts begins"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def msgspec_stream(sock: str, tokens: int) -> tuple[float, int]:
    from ipc import AsyncClient
    from ipc.protocol import SamplingOptions

    async with AsyncClient(sock) as c:
        gen = c.generate(PROMPT, model="bench", max_tokens=tokens, raw=True, options=SamplingOptions(temperature=0))
        first = None
        async for _chunk in gen:
            first = first or time.perf_counter()
        end = time.perf_counter()
        return (end - first) / max(1, gen.done.eval_count - 1), gen.done.eval_count


async def http_stream(session, url: str, api: str, tokens: int) -> tuple[float, int]:
    if api == "ollama":
        body = {"model": "bench", "prompt": PROMPT, "raw": True,
                "options": {"num_predict": tokens, "temperature": 0}}
        path = "/api/generate"
    else:
        body = {"model": "bench", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        path = "/v1/completions"
    first = end = None
    count = 0
    async with session.post(url + path, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.strip() or line.strip() == b"data: [DONE]":
                continue
            obj = json.loads(line.removeprefix(b"data: "))
            if api == "ollama" and obj.get("done"):
                end, count = time.perf_counter(), obj["eval_count"]
            elif api == "openai" and obj.get("usage"):
                end, count = time.perf_counter(), obj["usage"]["completion_tokens"]
            elif first is None:
                first = time.perf_counter()
    return (end - first) / max(1, count - 1), count


async def burst(mode: str, n: int, sock: str, url: str, tokens: int) -> tuple[float, list[int]]:
    import aiohttp

    if mode == "msgspec":
        results = await asyncio.gather(*(msgspec_stream(sock, tokens) for _ in range(n)))
    else:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            results = await asyncio.gather(*(http_stream(session, url, mode, tokens) for _ in range(n)))
    return statistics.mean(r[0] for r in results) * 1e3, [r[1] for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="ENV=VALUE")
    ap.add_argument("--json")
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="moed-http-bench-")
    os.mkdir(os.path.join(work, "models"))
    os.symlink(os.path.abspath(args.model), os.path.join(work, "models", "bench.gguf"))
    port = free_port()
    os.environ.update({"MOED_MODELS": os.path.join(work, "models"), "MOED_HTTP_HOST": f"127.0.0.1:{port}",
                       "MOE_N_THREADS": str(args.threads), "MOED_MAX_BATCH": "16"})
    for kv in args.set:
        k, _, v = kv.partition("=")
        os.environ[k] = v
    sock = os.path.join(work, "moed.sock")
    url = f"http://127.0.0.1:{port}"
    proc = start_daemon(sock)
    out = {"model": args.model, "threads": args.threads, "tokens": args.tokens, "streams": {}}
    try:
        asyncio.run(burst("msgspec", 1, sock, url, 4))  # load and compile
        for n in (int(x) for x in args.streams.split(",")):
            best: dict[str, float] = {}
            counts: dict[str, list[int]] = {}
            for _ in range(args.repeat):
                for mode in ("msgspec", "ollama", "openai"):
                    ms, c = asyncio.run(burst(mode, n, sock, url, args.tokens))
                    best[mode] = min(best.get(mode, ms), ms)
                    counts[mode] = c
            out["streams"][n] = {"ms_per_token": best, "tokens": counts}
            print(f"{n:>3} streams  msgspec {best['msgspec']:.3f} ms/token   "
                  f"ollama {best['ollama']:.3f} (+{best['ollama'] - best['msgspec']:.3f})   "
                  f"openai {best['openai']:.3f} (+{best['openai'] - best['msgspec']:.3f})   "
                  f"tokens per stream {sorted(set(counts['msgspec']))}/{sorted(set(counts['ollama']))}/"
                  f"{sorted(set(counts['openai']))}", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
