"""One benchmark command: moed on a model for every combination of settings, next to llama.cpp.

    python benchmarks/run.py MODEL.gguf --threads 2,16 --cache-mb 0,4000 --routing exact,speculative \
        --replay off,benchmarks/data/traces/olmoe-1b-7b_top8of64_299tok.jsonl --concurrency 1 \
        --prompt-tokens 128 --decode-tokens 32 [--cold] [--json out.json] [--no-llama | --llama]
    python benchmarks/run.py --quick [--json out.json]     # a 2-layer synthetic model, under a minute

Each combination runs in a fresh child process (threads are fixed when numba starts), and times a
prefill of the same prompt (--prompt-tokens ids of the model's own tokenizer) and greedy decode.
One table: prefill and decode tok/s, time to first token (the prefill of every sequence and its
first greedy token), expert-cache hit rate, bytes per token
read by the expert cache and from disk (/proc/self/io read_bytes), the disk bandwidth achieved in
the timed passes and that as a fraction of an O_DIRECT sequential read of the same file measured
in the same run (`dd iflag=direct bs=4M`, up to 1 GiB), peak RSS (the child's ru_maxrss). Then
llama.cpp (llama-cpp-python) on the same file and prompt ids at each thread count and concurrency:
its routing is its own model's and ignores --replay, which the routing column says; each moed row
has its prefill and decode ratio to the llama.cpp row of the same threads and concurrency. Concurrency N prefills N
sequences (the prompt's body rotated by 0..N-1 tokens) in one pass and decodes them as one batch,
in both engines (llama.cpp: one llama_decode with N sequence ids); tok/s are totals.

Warm runs time a second pass of the same prompts in one process (the experts it routes to are
cached). --cold drops the model's pages (posix_fadvise DONTNEED, and drop_caches where permitted)
after an untimed pass that compiles the kernels, then loads the model again: load and both timed
passes start cold. llama.cpp maps and reads the whole file at load, so its cold reads are in load s.
Results also go to --json. Needs llama-cpp-python for the llama.cpp rows (they say "not installed"
otherwise; --llama makes that an error).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

from _bench import table  # noqa: E402
from _bench.disk import direct_read_rate, drop_file_pages  # noqa: E402
from daemon.errors import MoedError  # noqa: E402

PROMPT = ("The history of the printing press begins in the workshops of medieval Europe, where "
          "goldsmiths, papermakers and scribes shared a trade in books that few could afford. ")
QUICK_TRACE = ROOT / "benchmarks/data/traces/olmoe-1b-7b_top8of64_299tok.jsonl"
QUICK_SYNTH = {"n_layer": 2, "n_embd": 256, "n_ff_exp": 256, "n_head": 2}  # qwen3-30b-a3b, shrunk
QUICK_CACHE_MB = 4.0  # about 16 of the 128 experts of each of the 2 layers


def _list(kind, check, what: str):
    """An argparse type: comma-separated values, each of `kind` and passing `check`."""
    def parse(text: str):
        values = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            try:
                value = kind(part)
            except ValueError:
                value = None
            if value is None or not check(value):
                raise argparse.ArgumentTypeError(f"{part!r} is not {what}")
            values.append(value)
        if not values:
            raise argparse.ArgumentTypeError("give at least one value")
        return values
    return parse


def _count(least: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {least}")
        return value
    return parse


def _replay(text: str) -> str:
    if text != "off" and not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no routing trace at {text} (give 'off' or a trace file)")
    return text


def _setting(text: str) -> tuple[str, list[str]]:
    """ENV=V1,V2 -> (ENV, [V1, V2]), each value checked by the settings registry."""
    from daemon.config import Settings
    from daemon.errors import ConfigError

    env, _, values = text.partition("=")
    if env not in {e for _, e, _, _ in Settings.describe()}:
        raise argparse.ArgumentTypeError(f"{env!r} is not a moed setting (see `moed --help` or daemon/config.py)")
    parts = [v.strip() for v in values.split(",") if v.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"give at least one value for {env}")
    for v in parts:
        try:
            Settings.load({env: v})
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return env, parts


def parser() -> argparse.ArgumentParser:
    from daemon.config import ROUTING

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="a GGUF model (not with --quick)")
    ap.add_argument("--threads", type=_list(int, lambda v: v > 0, "a positive integer"), default=[2])
    ap.add_argument("--cache-mb", type=_list(float, lambda v: v >= 0, "a size in MB >= 0 (0 = unlimited)"),
                    default=[0.0], help="EXPERT_CACHE_LIMIT_MB values")
    ap.add_argument("--routing", type=_list(str, lambda v: v in ROUTING, "one of " + ", ".join(ROUTING)),
                    default=["auto"], help="MOE_ROUTING values")
    ap.add_argument("--replay", type=lambda t: [_replay(v.strip()) for v in t.split(",") if v.strip()],
                    default=["off"], help="off and/or MOE_ROUTING_REPLAY trace files")
    ap.add_argument("--concurrency", type=_list(int, lambda v: v > 0, "a positive integer"), default=[1])
    ap.add_argument("--set", type=_setting, action="append", default=[], metavar="ENV=V1,V2",
                    help="another moed setting to vary, by its environment variable (daemon/config.py), "
                         "e.g. MOE_DEMAND_READS=compute,io; repeatable")
    ap.add_argument("--prompt-tokens", type=_count(1), default=128)
    ap.add_argument("--decode-tokens", type=_count(0), default=32)
    ap.add_argument("--cold", action="store_true", help="drop the model's pages before each timed run")
    ap.add_argument("--json", help="also write the results here")
    llama = ap.add_mutually_exclusive_group()
    llama.add_argument("--no-llama", action="store_true", help="moed rows only")
    llama.add_argument("--llama", action="store_true", help="fail if llama-cpp-python is not installed")
    ap.add_argument("--quick", action="store_true",
                    help="a 2-layer small-width qwen3-30b-a3b synth model and a minimal matrix (a smoke test)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    return ap


def prompt_ids(model: str, n: int) -> list[int]:
    """n ids of the model's own tokenizer (BOS if it adds one, then a repeated English passage)."""
    from daemon.storage.gguf import GGUFFile
    from daemon.text.tokenizer import Tokenizer

    with GGUFFile(model) as g:
        tok = Tokenizer.from_metadata(g.metadata)
    text = PROMPT
    while len(ids := tok.encode(text)) < n:
        text += PROMPT
    return ids[:n]


def run_child(spec: dict) -> dict:
    env = {**os.environ, **spec.get("env", {}), "NUMBA_NUM_THREADS": str(spec["threads"]),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True,
                       text=True)
    if p.returncode:
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        return {"error": "failed: " + (lines[-1] if lines else f"exit status {p.returncode}")}
    return json.loads(p.stdout.strip().splitlines()[-1])


def moed_rows(args, base: dict) -> list[dict]:
    rows = []
    names = [env for env, _ in args.set]
    for threads, mb, routing, replay, conc, *values in itertools.product(
            args.threads, args.cache_mb, args.routing, args.replay, args.concurrency, *(v for _, v in args.set)):
        spec = base | {"engine": "moed", "threads": threads, "cache_mb": mb, "routing": routing,
                       "replay": "" if replay == "off" else str(Path(replay).resolve()), "concurrency": conc,
                       "env": dict(zip(names, values))}
        row = spec | run_child(spec)
        source = f"replay {Path(replay).stem}" if spec["replay"] else "own router"
        row["routing_label"] = f"{row.get('routing_used', routing)}, {source}" + "".join(
            f"; {k}={v}" for k, v in spec["env"].items())
        rows.append(row)
        _progress(row)
    return rows


def llama_rows(args, base: dict, installed: bool) -> list[dict]:
    rows = []
    for threads, conc in itertools.product(args.threads, args.concurrency):
        spec = base | {"engine": "llama.cpp", "threads": threads, "concurrency": conc}
        result = run_child(spec) if installed else {"error": "not installed (pip install llama-cpp-python)"}
        row = spec | result | {"routing_label": "its own router (replay n/a)"}
        rows.append(row)
        _progress(row)
    return rows


def _progress(row: dict) -> None:
    print(f"  done: {row['engine']} threads={row['threads']} "
          + (f"cache={row['cache_mb']:g} routing={row['routing']} replay={bool(row['replay'])} "
             if row["engine"] == "moed" else "")
          + f"conc={row['concurrency']}" + (f" {row['error']}" if "error" in row else ""), file=sys.stderr, flush=True)


def add_derived(rows: list[dict], dd_rate: float) -> None:
    """Disk bandwidth of the timed passes, its fraction of dd, the moed/llama.cpp ratios, and
    (JSON only) whether moed with its own router produced llama.cpp's greedy tokens."""
    llama = {(r["threads"], r["concurrency"]): r for r in rows if r["engine"] == "llama.cpp" and "error" not in r}
    for r in rows:
        if "error" in r:
            continue
        rate = r["disk_bytes"] / r["timed_s"]
        r["disk_mb_s"] = rate / 1e6
        r["of_dd"] = rate / dd_rate if dd_rate else None
        ref = llama.get((r["threads"], r["concurrency"]))
        if r["engine"] == "moed" and ref:
            r["ratio_prefill"] = r["prefill_tps"] / ref["prefill_tps"]
            r["ratio_decode"] = r["decode_tps"] / ref["decode_tps"] if r["decode_tps"] and ref["decode_tps"] else None
            if not r["replay"]:  # the same greedy tokens, or how far they agree (llama.cpp's repacked
                r["same_tokens_as_llama"] = r["generated"] == ref["generated"]  # weights sum in another order)


def llama_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def quick_model(directory: str) -> str:
    from daemon.synth import synth

    path = str(Path(directory) / "qwen3-30b-a3b-2layers.gguf")
    synth(path, "qwen3-30b-a3b", report=lambda *_: None, **QUICK_SYNTH)
    return path


def bench(args, model: str) -> int:
    if not Path(model).is_file():
        print(f"error: no model file at {model}", file=sys.stderr)
        return 2
    installed = llama_installed()
    if args.llama and not installed:
        print("error: --llama: llama-cpp-python is not installed (pip install llama-cpp-python)", file=sys.stderr)
        return 2
    try:
        ids = prompt_ids(model, args.prompt_tokens)
    except MoedError as e:
        print(f"error: cannot read {model}: {e}", file=sys.stderr)
        return 2
    size = os.path.getsize(model)
    dd = direct_read_rate(model)
    drop = drop_file_pages(model) if args.cold else "none (warm: a second pass in the same process)"
    base = {"model": model, "ids": ids, "decode": args.decode_tokens,
            "cold": args.cold}
    print(f"{Path(model).name}: {size / 2**30:.2f} GiB; {len(base['ids'])} prompt tokens, {args.decode_tokens} "
          f"decoded (greedy); {os.cpu_count()} CPUs; page cache: {drop}\n"
          f"dd-style sequential read ({dd['mode']}, {dd['bytes'] / 2**20:.0f} MiB): "
          f"{dd['bytes_per_s'] / 1e6:.0f} MB/s", flush=True)
    rows = moed_rows(args, base)
    if not args.no_llama:
        rows += llama_rows(args, base, installed)
    add_derived(rows, dd["bytes_per_s"])
    print(table.render(rows))
    if args.json:
        out = {"model": model, "file_bytes": size, "cpus": os.cpu_count(), "cold": args.cold, "page_cache": drop,
               "dd": dd, "prompt_tokens": len(base["ids"]), "decode_tokens": args.decode_tokens,
               "rows": [{k: v for k, v in r.items() if k != "ids"} for r in rows]}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if any("error" in r and r["engine"] == "moed" for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.child:
        from _bench import children

        print(json.dumps(children.run(json.loads(args.child))))
        return 0
    if args.quick:
        if args.model:
            ap.error("--quick writes its own model: give no MODEL")
        args.threads, args.cache_mb, args.routing, args.concurrency = [2], [0.0, QUICK_CACHE_MB], ["auto"], [1]
        args.replay = ["off", str(QUICK_TRACE)]
        args.prompt_tokens, args.decode_tokens = 32, 8
        with tempfile.TemporaryDirectory(prefix="moed-bench-quick-") as td:
            try:
                model = quick_model(td)
            except MoedError as e:  # SynthError: no space in the temp dir, ...
                print(f"error: --quick could not write its model: {e}", file=sys.stderr)
                return 2
            return bench(args, model)
    if not args.model:
        ap.error("a MODEL.gguf is needed (or --quick)")
    return bench(args, args.model)


if __name__ == "__main__":
    sys.exit(main())
