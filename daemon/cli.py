"""The moed command line.

    moed generate [MODEL] PROMPT [--chat]   stream a completion (the demo MoE when no MODEL)
    moed demo-model [--experts E --used K]  build the demo MoE from SmolLM2-135M-Instruct
    moed settings                           list every setting and its environment variable
    moed trace replay TRACE --cache-experts N  simulate expert-cache policies on a routing trace
    moed trace record MODEL PROMPT --out PATH  generate greedily and record the routing per token
    moed pack [MODEL] [--level N] [--force]  write the expert pack beside the model (the demo MoE by default)
"""

from __future__ import annotations

import argparse
import os
import sys

from .config import Settings
from .errors import MoedError


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--numerics", choices=("ggml", "float32"), default=None)
    p.add_argument("--threads", type=int, default=None)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moed", description="Run Mixture-of-Experts GGUF models locally.")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("args", nargs="+", metavar="[MODEL] PROMPT")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    _add_sampling(g)
    d = sub.add_parser("demo-model", help="build (once) the demo MoE and print its path")
    d.add_argument("--experts", type=int, default=16)
    d.add_argument("--used", type=int, default=12)
    d.add_argument("--force", action="store_true", help="rebuild even if cached")
    sub.add_parser("settings", help="list settings and their environment variables")
    _add_trace(sub)
    _add_pack(sub)
    return ap


def _add_pack(sub) -> None:
    pk = sub.add_parser("pack", help="write the expert pack (one read per expert, zstd where it pays)")
    pk.add_argument("model", nargs="?", default=None, metavar="MODEL", help="GGUF file (default: the demo MoE)")
    pk.add_argument("--level", type=int, default=3, help="zstd level 1..22 (default 3)")
    pk.add_argument("--min-saving", type=float, default=0.10,
                    help="compress an expert only if zstd saves at least this fraction (default 0.10)")
    pk.add_argument("--out", default=None, help="pack path (default: MODEL.moepack)")
    pk.add_argument("--force", action="store_true", help="rewrite an up-to-date pack")


def _add_trace(sub) -> None:
    t = sub.add_parser("trace", help="record or replay expert-routing traces")
    tsub = t.add_subparsers(dest="trace_command", required=True)
    r = tsub.add_parser("replay", help="simulate expert-cache policies on a trace; print hit rates")
    r.add_argument("trace", metavar="TRACE", help="jsonl trace (.jsonl or .jsonl.zst)")
    cap = r.add_mutually_exclusive_group(required=True)
    cap.add_argument("--cache-experts", type=int, help="cache capacity in experts per MoE layer")
    cap.add_argument("--cache-mb", type=float, help="total cache budget in MiB, split over the MoE layers")
    size = r.add_mutually_exclusive_group()
    size.add_argument("--expert-mb", type=float, help="size of one expert in MiB (with --cache-mb)")
    size.add_argument("--model", help="GGUF file giving the expert size per layer (with --cache-mb)")
    r.add_argument("--policy", default="lru,belady,lfu-decay",
                   help="comma-separated policies: lru, belady, lfu-decay, lru2 (default lru,belady,lfu-decay)")
    r.add_argument("--json", action="store_true", help="print the results as JSON")
    rec = tsub.add_parser("record", help="generate greedily and record each token's routing")
    rec.add_argument("model", metavar="MODEL")
    rec.add_argument("prompt", metavar="PROMPT")
    rec.add_argument("--out", required=True, help="output path (.jsonl, or .jsonl.zst to compress)")
    rec.add_argument("--max-tokens", type=int, default=64)
    rec.add_argument("--threads", type=int, default=None)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # Positionals may come after options ("generate MODEL --chat PROMPT"): collect them.
    unknown = [a for a in extra if a.startswith("-")]
    if unknown or (extra and args.command != "generate"):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if extra:
        args.args += extra
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "demo-model":
            from .demo import demo_model_path
            print(demo_model_path(args.experts, args.used, force=args.force))
            return 0
        if args.command == "trace":
            return _trace(args, parser)
        if args.command == "pack":
            return _pack(args)
        if args.command == "settings":
            for name, env, default, doc in Settings.describe():
                print(f"{env:<24} {name:<22} default {default!r:<10} {doc}")
            return 0
    except MoedError as e:
        print(f"moed: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 2


def _generate(args) -> int:
    from .engine import Engine
    from .progress import Progress

    if len(args.args) > 2:
        raise MoedError("generate takes [MODEL] PROMPT (quote the prompt)")
    if len(args.args) == 2:
        model_path, prompt = args.args
    else:
        from .demo import demo_model_path
        model_path, prompt = demo_model_path(), args.args[0]
    steps = ["reading", "building", "tokenizer", "warming kernels"]
    bar = Progress("loading", len(steps))
    engine = Engine.load(model_path, progress=lambda msg: bar.advance(note=msg),
                         numerics=args.numerics, n_threads=args.threads)
    engine.forward(engine.tokenize("warm", add_special=False) or [0])  # compiles the kernels once
    bar.close()
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                    repeat_penalty=args.repeat_penalty, seed=args.seed)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": prompt})
        pieces = engine.chat(messages, max_tokens=args.max_tokens, stop=args.stop, **sampling)
    else:
        pieces = engine.generate(prompt, max_tokens=args.max_tokens, stop=args.stop, **sampling)
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = engine.last_stats
    if s.eval_count:
        print(f"[{s.prompt_eval_count} prompt tokens in {s.prompt_eval_duration / 1e9:.2f}s, "
              f"{s.eval_count} tokens at {s.eval_count / max(s.eval_duration, 1) * 1e9:.1f} tok/s, "
              f"stop: {s.done_reason}]", file=sys.stderr)
    return 0


def _pack(args) -> int:
    from .storage import pack
    from .storage.gguf import GGUFFile
    from .storage.store import expert_layouts

    if args.model is None:
        from .demo import demo_model_path
        args.model = demo_model_path()
    out = pack.out_path(args.model, args.out)
    if os.path.exists(out) and not args.force:
        with GGUFFile(args.model) as g:
            try:
                pack.read_pack(out, g, expert_layouts(g))
            except pack.PackError as e:
                print(f"moed: replacing {out}: {e}", file=sys.stderr)
            else:
                raise MoedError(f"{out} is an up-to-date pack of {args.model} (--force rewrites it)")
    r = pack.write_pack(args.model, out, level=args.level, min_saving=args.min_saving, progress=True)
    print(r.table())
    print(f"{out}: {r.file_size / 1e6:.2f} MB, {r.total.raw / 1e6:.2f} MB of experts packed in "
          f"{r.elapsed:.1f}s ({r.throughput / 1e6:.0f} MB/s)")
    return 0


def _trace(args, parser) -> int:
    if args.trace_command == "record":
        return _trace_record(args)
    import json

    from .routing import replay

    tr = replay.load_trace(args.trace)
    if args.cache_experts is not None:
        if args.expert_mb is not None or args.model is not None:
            parser.error("--expert-mb/--model go with --cache-mb, not --cache-experts")
        if args.cache_experts < 0:
            parser.error("--cache-experts must be >= 0")
        capacity = args.cache_experts
    else:
        if args.expert_mb is None and args.model is None:
            parser.error("--cache-mb needs --expert-mb S or --model PATH")
        sizes = ([int(args.expert_mb * 2**20)] if args.expert_mb is not None
                 else replay.expert_bytes_per_layer(args.model))
        if min(sizes) <= 0:
            parser.error("--expert-mb must be > 0")
        capacity = replay.capacity_from_mb(args.cache_mb, sizes, len(tr))
        if len(set(capacity)) == 1:
            capacity = capacity[0]
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    bad = [p for p in policies if p not in replay.POLICIES]
    if bad or not policies:
        parser.error(f"unknown policy {', '.join(bad)} (choose from {', '.join(replay.POLICIES)})")
    results = {p: replay.simulate(tr, capacity, p) for p in policies}
    if args.json:
        print(json.dumps({"capacity": capacity, "tokens": len(tr[0]),
                          "results": [r.to_dict() for r in results.values()]}))
        return 0
    print(f"{args.trace}: {len(tr[0])} tokens, {len(tr)} MoE layers, capacity "
          f"{capacity if isinstance(capacity, int) else '/'.join(map(str, capacity))} experts per layer")
    print(replay.format_table(results, capacity))
    return 0


def _trace_record(args) -> int:
    from .engine import Engine
    from .routing.trace import RoutingRecorder

    engine = Engine.load(args.model, n_threads=args.threads)
    rec = RoutingRecorder().attach(engine.model)
    try:
        for piece in engine.generate(args.prompt, max_tokens=args.max_tokens, temperature=0):
            sys.stdout.write(piece)
            sys.stdout.flush()
    finally:
        rec.detach()
    sys.stdout.write("\n")
    n = rec.write(args.out)
    print(f"[{n} tokens x {len(rec.moe_layers)} MoE layers of routing written to {args.out}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
