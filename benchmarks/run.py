"""One benchmark command: moed on a model for every combination of settings, next to llama.cpp.

    python benchmarks/run.py MODEL.gguf --threads 2,16 --cache-mb 0,4000 --routing exact,speculative \
        --replay off,benchmarks/data/traces/olmoe-1b-7b_top8of64_299tok.jsonl --concurrency 1 \
        --prompt-tokens 128 --decode-tokens 32 [--cold] [--json out.json] [--no-llama | --llama]
    python benchmarks/run.py --quick [--json out.json]     # a 2-layer synthetic model, under a minute
    python benchmarks/run.py MODEL.gguf --device cuda --gpu-cache-mb 7400,14800 --replay off,TRACE.jsonl \
        --min-batch 0,auto --decode-tokens 32 [--warmup 24] [--threads 16] [--prompt-tokens 128] \
        [--set ENV=V1,V2] (--llama-bench PATH [--llama-ncmoe 0,48] | --no-llama) [--json out.json]

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

--device cuda: moed decodes on the GPU with a VRAM expert cache of each --gpu-cache-mb
(MOE_GPU_CACHE_MB; the host expert cache unlimited, in pinned memory), for every replay, min-batch
(MOE_OFFLOAD_MIN_BATCH), threads and --set value, each in a child process running
benchmarks/gpu_offload.py's measure(): the prompt prefilled (cold), --warmup decode steps, the prompt
prefilled again into a fresh sequence (warm), then --decode-tokens timed steps. The routing column
says "uniform" for a synthesized file's own router (random weights: close to uniform), "own
router" for another file's, "replay NAME" for a trace.
Then llama.cpp's CUDA build, `llama-bench -ngl 99 -ncmoe N -p PROMPT -n DECODE -r 3 -t THREADS -o json`,
once per VRAM budget and thread count: N is the smallest --n-cpu-moe whose expert tensors left on
the GPU (those of blocks N.., sizes as in the file) take at most the budget (E expert layers of B
bytes: N = E - floor(budget / B)); --llama-ncmoe adds rows at other N. Each moed row has its decode
and prefill ratios to the llama.cpp row of its budget and threads: moed's prefill cold (its first
prompt, experts read from the file) and warm (the prompt again, experts in host memory), llama.cpp's
from its mapping, warm after load. The CPU mode's host-cache options (--cache-mb, --routing,
--concurrency, --cold, --llama) are refused with --device cuda, the GPU options without it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

from _bench import gpu, table  # noqa: E402
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


def _executable(text: str) -> str:
    found = shutil.which(text)  # a path to an executable file, or a command on PATH
    if found is None:
        raise argparse.ArgumentTypeError(f"no llama-bench executable at {text} (llama.cpp built with CUDA: "
                                         "cmake -B build -DGGML_CUDA=ON && cmake --build build; build/bin/llama-bench)")
    return str(Path(found).resolve())


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
    cuda = ap.add_argument_group("--device cuda (the VRAM expert cache next to llama.cpp's CUDA build)")
    cuda.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    cuda.add_argument("--gpu-cache-mb", type=_list(float, lambda v: v > 0, "a size in MB > 0"),
                     help="MOE_GPU_CACHE_MB values: VRAM for experts, MiB (needed with --device cuda)")
    cuda.add_argument("--min-batch", type=_list(str, lambda v: v == "auto" or (v.isascii() and v.isdigit()),
                                               "auto or a whole number"),
                     help="MOE_OFFLOAD_MIN_BATCH values (default 0,auto)")
    cuda.add_argument("--warmup", type=_count(0), help="decode steps before the timed ones (default 24)")
    cuda.add_argument("--llama-bench", type=_executable, metavar="PATH",
                     help="llama.cpp's llama-bench, built with CUDA (or give --no-llama)")
    cuda.add_argument("--llama-ncmoe", type=_list(int, lambda v: v >= 0, "an integer >= 0"), default=[],
                     metavar="N1,N2", help="more llama-bench rows at these --n-cpu-moe (0: every expert in VRAM)")
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


GPU_OPTIONS = ("gpu_cache_mb", "min_batch", "warmup", "llama_bench")
GPU_DEFAULTS = {"min_batch": ["0", "auto"], "warmup": 24}


def check_device(ap: argparse.ArgumentParser, args) -> None:
    """Options of one device only are errors with the other (parser.error: exit status 2)."""
    if args.device == "cpu":
        given = [o for o in GPU_OPTIONS if getattr(args, o) is not None] + ["llama_ncmoe"] * bool(args.llama_ncmoe)
        if given:
            ap.error(f"--{given[0].replace('_', '-')} is for --device cuda")
        return
    cpu_only = {"--quick": args.quick, "--cache-mb": args.cache_mb != [0.0], "--routing": args.routing != ["auto"],
                "--concurrency": args.concurrency != [1], "--cold": args.cold, "--llama": args.llama}
    for option, given in cpu_only.items():
        if given:
            ap.error(f"{option} is for the CPU mode, not --device cuda (which runs one warm sequence with the host "
                     "expert cache unlimited, and llama.cpp as --llama-bench)")
    if not args.gpu_cache_mb:
        ap.error("--device cuda needs --gpu-cache-mb MB[,MB...] (VRAM for experts)")
    if args.no_llama and (args.llama_bench or args.llama_ncmoe):
        ap.error("--no-llama and --llama-bench/--llama-ncmoe contradict each other")
    if not args.no_llama and not args.llama_bench:
        ap.error("--device cuda needs --llama-bench PATH (llama.cpp built with CUDA) or --no-llama")
    for option, value in GPU_DEFAULTS.items():
        if getattr(args, option) is None:
            setattr(args, option, value)


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
    if row.get("device") == "cuda" or "n_cpu_moe" in row:
        what = (f"vram={row['gpu_cache_mb']} routing={row['routing_label']} min_batch={row['min_batch']}"
                if row["engine"] == "moed" else f"ncmoe={row['n_cpu_moe']}")
    else:
        what = (f"cache={row['cache_mb']:g} routing={row['routing']} replay={bool(row['replay'])} "
                if row["engine"] == "moed" else "") + f"conc={row['concurrency']}"
    print(f"  done: {row['engine']} threads={row['threads']} {what}" + (f" {row['error']}" if "error" in row else ""),
          file=sys.stderr, flush=True)


def gpu_moed_rows(args, base: dict, synthesized: bool) -> list[dict]:
    rows = []
    names = [env for env, _ in args.set]
    for threads, mb, replay, min_batch, *values in itertools.product(
            args.threads, args.gpu_cache_mb, args.replay, args.min_batch, *(v for _, v in args.set)):
        spec = base | {"engine": "moed", "device": "cuda", "threads": threads, "gpu_cache_mb": mb,
                       "replay": "" if replay == "off" else str(Path(replay).resolve()), "min_batch": min_batch,
                       "warmup": args.warmup, "env": dict(zip(names, values))}
        row = spec | run_child(spec)
        source = f"replay {Path(replay).stem}" if spec["replay"] else ("uniform" if synthesized else "own router")
        row["routing_label"] = source + "".join(f"; {k}={v}" for k, v in spec["env"].items())
        rows.append(row)
        _progress(row)
    return rows


def gpu_llama_rows(args, model: str, blocks: dict[int, int]) -> list[dict]:
    """One llama-bench row per VRAM budget and thread count (--n-cpu-moe sized to the budget), then the
    --llama-ncmoe rows; each distinct (N, threads) runs once."""
    done: dict[tuple[int, int], dict] = {}
    rows = []
    budgets = [(mb, gpu.n_cpu_moe(blocks, int(mb * 2**20))) for mb in args.gpu_cache_mb]
    for threads, (mb, n) in itertools.product(args.threads, budgets + [(None, n) for n in args.llama_ncmoe]):
        if (n, threads) not in done:
            done[n, threads] = gpu.llama_bench(args.llama_bench, model, n, args.decode_tokens, threads,
                                               args.prompt_tokens)
        layers, nbytes = gpu.on_gpu(blocks, n)
        row = {"engine": "llama.cpp", "threads": threads, "gpu_cache_mb": mb, "n_cpu_moe": n, "replay": "",
               "expert_layers_gpu": layers, "expert_bytes_gpu": nbytes,
               "routing_label": f"own router; {layers}/{len(blocks)} expert layers in VRAM ({gpu.mib(nbytes)} MiB)"}
        rows.append(row | done[n, threads])
        _progress(rows[-1])
    return rows


def add_gpu_derived(rows: list[dict]) -> None:
    """Each moed row's decode and prefill tok/s (cold and warm) over llama.cpp's at the same VRAM budget
    and threads."""
    llama = {(r["threads"], r["gpu_cache_mb"]): r for r in rows
             if r["engine"] == "llama.cpp" and r["gpu_cache_mb"] is not None and "error" not in r}
    for r in rows:
        ref = llama.get((r["threads"], r["gpu_cache_mb"]))
        if r["engine"] != "moed" or "error" in r or not ref:
            continue
        for ratio, ours, theirs in (("ratio_decode", "decode_tok_s", "decode_tok_s"),
                                    ("ratio_prefill", "prefill_tok_s", "prefill_tok_s"),
                                    ("ratio_prefill_warm", "prefill_warm_tok_s", "prefill_tok_s")):
            if r.get(ours) and ref.get(theirs):
                r[ratio] = r[ours] / ref[theirs]


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


def gpu_bench(args, model: str) -> int:
    try:
        ids = prompt_ids(model, args.prompt_tokens)
        info = gpu.model_info(model)
    except MoedError as e:
        print(f"error: cannot read {model}: {e}", file=sys.stderr)
        return 2
    size, blocks = os.path.getsize(model), info["blocks"]
    sizes = sorted(set(blocks.values())) or [0]
    per = gpu.mib(sizes[0]) + (f"-{gpu.mib(sizes[-1])}" if len(sizes) > 1 else "")
    print(f"{Path(model).name}: {size / 2**30:.2f} GiB, experts {sum(blocks.values()) / 2**30:.2f} GiB in "
          f"{len(blocks)} layers ({per} MiB a layer); {len(ids)} prompt tokens, {args.warmup} warm-up and "
          f"{args.decode_tokens} timed decode steps (greedy); {os.cpu_count()} CPUs; device cuda"
          + (f"; llama.cpp: {args.llama_bench}" if args.llama_bench else ""), flush=True)
    rows = gpu_moed_rows(args, {"model": model, "ids": ids, "decode": args.decode_tokens}, info["synthesized"])
    if not args.no_llama:
        rows += gpu_llama_rows(args, model, blocks)
    add_gpu_derived(rows)
    print(table.render(rows, table.GPU_COLUMNS, table.GPU_TEXT_COLUMNS))
    if args.json:
        out = {"model": model, "file_bytes": size, "device": "cuda", "cpus": os.cpu_count(),
               "expert_bytes_per_block": blocks, "synthesized": info["synthesized"], "prompt_tokens": len(ids),
               "warmup_tokens": args.warmup, "decode_tokens": args.decode_tokens, "llama_bench": args.llama_bench,
               "rows": [{k: v for k, v in r.items() if k != "ids"} for r in rows]}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if any("error" in r and r["engine"] == "moed" for r in rows) else 0


def bench(args, model: str) -> int:
    if not Path(model).is_file():
        print(f"error: no model file at {model}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        return gpu_bench(args, model)
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
    check_device(ap, args)
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
